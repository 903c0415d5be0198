//! Where a version-2 index's inflate windows come from when a read needs one.
//!
//! A version-2 ferry index keeps each checkpoint's 32 KiB window in a separate windows
//! blob ([`crate::ferryidx::WindowsBlob`]). The reader asks a [`WindowSource`] for
//! checkpoint `k`'s window while it fetches the span, and inflates only after both
//! arrived. [`BlobWindows`] reads windows straight out of the windows blob through a
//! [`RangeSource`] (a layout file, memory in tests); the node's device layer in
//! `ferry-fs` implements the trait with its chunk store, single-flight fetches and
//! accounting.
//!
//! Every implementation must hand out only bytes that hash to the checkpoint's
//! [`WindowRef::sha256`]: a wrong window would inflate to wrong file bytes, which the
//! span digests cannot catch. This module does no I/O beyond its `RangeSource`.

use std::io;
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::ferryidx::WindowRef;
use crate::source::RangeSource;

/// Gives checkpoints' deflated windows, verified.
pub trait WindowSource: Send + Sync {
    /// The deflated window of checkpoint `k`, which lies at `at` in the windows blob,
    /// checked against `at.sha256` (`InvalidData` when it does not match).
    fn window(&self, k: usize, at: &WindowRef) -> io::Result<Vec<u8>>;

    /// True when [`WindowSource::window`] answers without a network round trip (the
    /// reader then asks for it inline instead of alongside the span fetch).
    fn is_local(&self, _k: usize, _at: &WindowRef) -> bool {
        false
    }

    /// True when span `k`'s compressed bytes are local too. A pass over several spans
    /// fetches only its first checkpoint's window, so a later read that starts in one of
    /// those stored spans can begin at an earlier checkpoint instead of fetching the
    /// window (see [`crate::reader::read_indexed`]).
    fn span_is_local(&self, _k: usize) -> bool {
        false
    }
}

/// Checks `bytes` against the window reference; `InvalidData` naming checkpoint `k`.
pub fn verify_window(k: usize, at: &WindowRef, bytes: &[u8]) -> io::Result<()> {
    let actual: [u8; 32] = Sha256::digest(bytes).into();
    if bytes.len() != at.len as usize || actual != at.sha256 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "window of checkpoint {k}: digest mismatch (expected sha256:{}, got sha256:{} \
                 over {} bytes)",
                hex::encode(at.sha256),
                hex::encode(actual),
                bytes.len()
            ),
        ));
    }
    Ok(())
}

/// Windows read from the windows blob through a [`RangeSource`], each verified.
#[derive(Clone)]
pub struct BlobWindows {
    source: Arc<dyn RangeSource>,
    local: bool,
}

impl std::fmt::Debug for BlobWindows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobWindows")
            .field("len", &self.source.len())
            .field("local", &self.local)
            .finish()
    }
}

impl BlobWindows {
    /// Windows from `source`, the windows blob. `local` says whether reading it is
    /// cheap (a file on this machine) or a network round trip.
    pub fn new(source: Arc<dyn RangeSource>, local: bool) -> Self {
        BlobWindows { source, local }
    }
}

impl WindowSource for BlobWindows {
    fn window(&self, k: usize, at: &WindowRef) -> io::Result<Vec<u8>> {
        let bytes = self.source.read_range(at.range())?;
        verify_window(k, at, &bytes)?;
        Ok(bytes)
    }

    fn is_local(&self, _k: usize, _at: &WindowRef) -> bool {
        self.local
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::source::MemSource;

    #[test]
    fn reads_and_verifies_windows() {
        let blob = b"aaaabbbbbb".to_vec();
        let at = WindowRef {
            offset: 4,
            len: 6,
            sha256: Sha256::digest(b"bbbbbb").into(),
        };
        let w = BlobWindows::new(Arc::new(MemSource(blob.clone())), true);
        assert_eq!(w.window(1, &at).unwrap(), b"bbbbbb");
        assert!(w.is_local(1, &at));
        // Wrong bytes in the blob: refused, never handed out.
        let mut bad = blob;
        bad[5] = b'x';
        let w = BlobWindows::new(Arc::new(MemSource(bad)), false);
        let e = w.window(1, &at).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("checkpoint 1"), "{e}");
        // A reference past the end of the blob.
        let far = WindowRef { offset: 8, ..at };
        assert!(w.window(1, &far).is_err());
    }
}
