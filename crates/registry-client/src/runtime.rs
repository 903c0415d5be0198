//! [`RangeRuntime`]: a tokio runtime on its own thread, for synchronous callers of the
//! [`Client`](crate::Client) (FUSE workers, rayon, plain commands) that must not build or
//! enter a runtime of their own.

use std::sync::Arc;

use crate::ClientError;

/// A tokio runtime running on its own thread, for synchronous callers. Cloning shares it;
/// the thread stops when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct RangeRuntime {
    handle: tokio::runtime::Handle,
    _stop: Arc<StopOnDrop>,
}

#[derive(Debug)]
struct StopOnDrop(Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

impl RangeRuntime {
    /// Starts the runtime thread.
    pub fn new() -> Result<Self, ClientError> {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("ferry-range-io".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("ferry-range-io")
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(rt.handle().clone()));
                rt.block_on(async {
                    let _ = stop_rx.await;
                });
            })
            .map_err(|e| ClientError::Config(format!("cannot start the range I/O thread: {e}")))?;
        let handle = handle_rx
            .recv()
            .map_err(|_| ClientError::Config("range I/O thread died".into()))?
            .map_err(|e| ClientError::Config(format!("cannot build the range runtime: {e}")))?;
        Ok(RangeRuntime {
            handle,
            _stop: Arc::new(StopOnDrop(Some(stop_tx))),
        })
    }

    /// The runtime's handle.
    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}
