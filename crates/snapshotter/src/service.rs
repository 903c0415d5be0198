//! The gRPC face: containerd's `containerd.services.snapshots.v1.Snapshots` service over
//! [`Snapshotter`]. Translates messages, answers every request in one key space
//! ([`KEY_SPACE`]; the request's namespace is only logged), and runs each call on a
//! blocking thread (every call touches the disk).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use containerd_client::services::v1::snapshots::{
    self as pb, CleanupRequest, CommitSnapshotRequest, ListSnapshotsRequest, ListSnapshotsResponse,
    MountsRequest, MountsResponse, PrepareSnapshotRequest, PrepareSnapshotResponse,
    RemoveSnapshotRequest, StatSnapshotRequest, StatSnapshotResponse, UpdateSnapshotRequest,
    UpdateSnapshotResponse, UsageRequest, UsageResponse, ViewSnapshotRequest, ViewSnapshotResponse,
};
use containerd_client::types::Mount as PbMount;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::filter::FilterSet;
use crate::meta::Kind;
use crate::proto::snapshots_server::{Snapshots, SnapshotsServer};
use crate::snapshotter::{Info, Mount, Snapshotter};

/// gRPC metadata key carrying containerd's namespace.
pub const NAMESPACE_HEADER: &str = "containerd-namespace";
/// Namespace logged for a request that carries none (containerd's own default).
pub const DEFAULT_NAMESPACE: &str = "default";
/// The one key space every request is answered in, whatever namespace it carries.
///
/// containerd's metadata store is what keeps namespaces apart: the keys it sends a
/// snapshotter are already unique (`<namespace>/<id>/<name>`), and its own snapshotters
/// ignore namespaces. The header cannot scope anything either, because containerd does
/// not send it consistently: 2.x sends the caller's namespace with the calls made for a
/// client request (Prepare, Commit, Stat…), 1.6 only with its CRI plugin's, and neither
/// sends one with its garbage collector's List and Remove. Scoped by the header, that
/// collector would see none of those snapshots and remove nothing. Records from a ferry
/// that did scope them are merged into this space when the service starts
/// ([`Snapshotter::merge_namespaces`]).
pub const KEY_SPACE: &str = DEFAULT_NAMESPACE;
/// Longest namespace name containerd allows.
const MAX_NAMESPACE_LEN: usize = 76;
/// Snapshots per List response message.
const LIST_BATCH: usize = 100;

/// The Snapshots service over a shared [`Snapshotter`].
#[derive(Debug, Clone)]
pub struct SnapshotService {
    snapshotter: Arc<Snapshotter>,
}

impl SnapshotService {
    /// A service answering from `snapshotter`, after merging records kept under other
    /// namespaces into [`KEY_SPACE`] (a failure there is logged: those records stay out of
    /// reach, the rest is served).
    pub fn new(snapshotter: Arc<Snapshotter>) -> Self {
        match snapshotter.merge_namespaces(KEY_SPACE) {
            Ok(0) => {}
            Ok(moved) => tracing::info!(
                moved,
                "merged snapshots recorded per namespace into the one key space"
            ),
            Err(e) => tracing::error!(error = %e, "cannot merge snapshots recorded per namespace"),
        }
        Self { snapshotter }
    }

    /// The tonic server to add to a router.
    pub fn into_server(self) -> SnapshotsServer<SnapshotService> {
        SnapshotsServer::new(self)
    }

    async fn blocking<T, F>(&self, job: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Snapshotter) -> Result<T, Error> + Send + 'static,
    {
        let snapshotter = Arc::clone(&self.snapshotter);
        let result = tokio::task::spawn_blocking(move || job(&snapshotter))
            .await
            .map_err(|e| Status::internal(format!("snapshot task failed: {e}")))?;
        result.map_err(|e| {
            match e.code() {
                tonic::Code::Internal => tracing::error!(error = %e, "snapshot operation failed"),
                _ => tracing::debug!(error = %e, "snapshot operation refused"),
            }
            Status::from(e)
        })
    }
}

/// The namespace a request carries: containerd's header, else `default`. For logs only:
/// the request is answered in [`KEY_SPACE`].
pub fn namespace<T>(request: &Request<T>) -> Result<String, Status> {
    let Some(value) = request.metadata().get(NAMESPACE_HEADER) else {
        return Ok(DEFAULT_NAMESPACE.to_owned());
    };
    let ns = value
        .to_str()
        .map_err(|_| Status::invalid_argument("namespace header is not ASCII"))?;
    validate_namespace(ns)?;
    Ok(ns.to_owned())
}

/// containerd's namespace rule: alphanumerics separated by single `.`, `_` or `-`.
fn validate_namespace(ns: &str) -> Result<(), Status> {
    let bad = || Status::invalid_argument(format!("invalid namespace {ns:?}"));
    if ns.is_empty() || ns.len() > MAX_NAMESPACE_LEN {
        return Err(bad());
    }
    let mut previous_separator = true;
    for c in ns.chars() {
        let separator = matches!(c, '.' | '_' | '-');
        if !(c.is_ascii_alphanumeric() || separator) || (separator && previous_separator) {
            return Err(bad());
        }
        previous_separator = separator;
    }
    if previous_separator {
        return Err(bad());
    }
    Ok(())
}

fn to_pb_mounts(mounts: Vec<Mount>) -> Vec<PbMount> {
    mounts
        .into_iter()
        .map(|m| PbMount {
            r#type: m.fs_type,
            source: m.source,
            target: String::new(),
            options: m.options,
        })
        .collect()
}

fn to_pb_info(info: Info) -> pb::Info {
    let kind = match info.kind {
        Kind::View => pb::Kind::View,
        Kind::Active => pb::Kind::Active,
        Kind::Committed => pb::Kind::Committed,
    };
    pb::Info {
        name: info.name,
        parent: info.parent,
        kind: kind as i32,
        created_at: Some(prost_types::Timestamp::from(info.created)),
        updated_at: Some(prost_types::Timestamp::from(info.updated)),
        labels: info.labels,
    }
}

type ListStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ListSnapshotsResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Snapshots for SnapshotService {
    async fn prepare(
        &self,
        request: Request<PrepareSnapshotRequest>,
    ) -> Result<Response<PrepareSnapshotResponse>, Status> {
        let ns = namespace(&request)?;
        let r = request.into_inner();
        tracing::debug!(ns, key = r.key, parent = r.parent, labels = ?r.labels, "prepare");
        let mounts = self
            .blocking(move |s| s.prepare(KEY_SPACE, &r.key, &r.parent, r.labels))
            .await?;
        Ok(Response::new(PrepareSnapshotResponse {
            mounts: to_pb_mounts(mounts),
        }))
    }

    async fn view(
        &self,
        request: Request<ViewSnapshotRequest>,
    ) -> Result<Response<ViewSnapshotResponse>, Status> {
        let ns = namespace(&request)?;
        let r = request.into_inner();
        tracing::debug!(ns, key = r.key, parent = r.parent, "view");
        let mounts = self
            .blocking(move |s| s.view(KEY_SPACE, &r.key, &r.parent, r.labels))
            .await?;
        Ok(Response::new(ViewSnapshotResponse {
            mounts: to_pb_mounts(mounts),
        }))
    }

    async fn mounts(
        &self,
        request: Request<MountsRequest>,
    ) -> Result<Response<MountsResponse>, Status> {
        namespace(&request)?;
        let r = request.into_inner();
        let mounts = self.blocking(move |s| s.mounts(KEY_SPACE, &r.key)).await?;
        Ok(Response::new(MountsResponse {
            mounts: to_pb_mounts(mounts),
        }))
    }

    async fn commit(
        &self,
        request: Request<CommitSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let ns = namespace(&request)?;
        let r = request.into_inner();
        tracing::debug!(ns, key = r.key, name = r.name, "commit");
        self.blocking(move |s| s.commit(KEY_SPACE, &r.name, &r.key, r.labels))
            .await?;
        Ok(Response::new(()))
    }

    async fn remove(
        &self,
        request: Request<RemoveSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let ns = namespace(&request)?;
        let r = request.into_inner();
        tracing::debug!(ns, key = r.key, "remove");
        self.blocking(move |s| s.remove(KEY_SPACE, &r.key)).await?;
        Ok(Response::new(()))
    }

    async fn stat(
        &self,
        request: Request<StatSnapshotRequest>,
    ) -> Result<Response<StatSnapshotResponse>, Status> {
        namespace(&request)?;
        let r = request.into_inner();
        let info = self.blocking(move |s| s.stat(KEY_SPACE, &r.key)).await?;
        Ok(Response::new(StatSnapshotResponse {
            info: Some(to_pb_info(info)),
        }))
    }

    async fn update(
        &self,
        request: Request<UpdateSnapshotRequest>,
    ) -> Result<Response<UpdateSnapshotResponse>, Status> {
        namespace(&request)?;
        let r = request.into_inner();
        let info = r
            .info
            .ok_or_else(|| Status::invalid_argument("update needs info"))?;
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let labels: HashMap<String, String> = info.labels;
        let name = info.name;
        let updated = self
            .blocking(move |s| s.update(KEY_SPACE, &name, labels, &paths))
            .await?;
        Ok(Response::new(UpdateSnapshotResponse {
            info: Some(to_pb_info(updated)),
        }))
    }

    type ListStream = ListStream;

    async fn list(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let ns = namespace(&request)?;
        let r = request.into_inner();
        tracing::debug!(ns, filters = ?r.filters, "list");
        let filters = FilterSet::parse(&r.filters).map_err(Status::from)?;
        let infos = self.blocking(move |s| s.walk(KEY_SPACE, &filters)).await?;
        tracing::debug!(found = infos.len(), "list answered");
        let mut batches = Vec::new();
        let mut infos = infos.into_iter().map(to_pb_info).peekable();
        while infos.peek().is_some() {
            let info: Vec<pb::Info> = infos.by_ref().take(LIST_BATCH).collect();
            batches.push(Ok(ListSnapshotsResponse { info }));
        }
        Ok(Response::new(Box::pin(tokio_stream::iter(batches))))
    }

    async fn usage(
        &self,
        request: Request<UsageRequest>,
    ) -> Result<Response<UsageResponse>, Status> {
        namespace(&request)?;
        let r = request.into_inner();
        let usage = self.blocking(move |s| s.usage(KEY_SPACE, &r.key)).await?;
        Ok(Response::new(UsageResponse {
            size: i64::try_from(usage.size).unwrap_or(i64::MAX),
            inodes: i64::try_from(usage.inodes).unwrap_or(i64::MAX),
        }))
    }

    async fn cleanup(&self, _request: Request<CleanupRequest>) -> Result<Response<()>, Status> {
        let report = self.blocking(|s| s.cleanup()).await?;
        tracing::info!(
            removed = report.removed,
            skipped = report.skipped,
            "cleanup"
        );
        Ok(Response::new(()))
    }
}
