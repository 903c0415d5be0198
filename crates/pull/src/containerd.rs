//! The few containerd calls `ferry pull` makes, over containerd's own gRPC API: leases,
//! content writes and label updates, image records, and snapshot Prepare/Stat/Remove
//! through containerd's Snapshots service (so containerd's metadata knows every layer).
//! Every request carries the namespace (`containerd-namespace` metadata, what containerd
//! 1.6 reads) and, once one exists, the lease (`containerd-lease`). No pull logic here.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::snapshots::{
    PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
    snapshots_client::SnapshotsClient,
};
use containerd_client::services::v1::{
    CreateImageRequest, CreateRequest as CreateLeaseRequest, DeleteRequest as DeleteLeaseRequest,
    Image, Info as ContentInfo, UpdateImageRequest, UpdateRequest as UpdateContentRequest,
    WriteAction, WriteContentRequest, content_client::ContentClient, images_client::ImagesClient,
    leases_client::LeasesClient,
};
use containerd_client::types::Descriptor as PbDescriptor;
use ferry_snapshotter::remote::LABEL_FERRY_REMOTE;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use crate::PullError;

/// Bytes per content write message (containerd's gRPC limit is 16 MiB).
const WRITE_CHUNK: usize = 1 << 20;

/// A connection to containerd in one namespace, optionally under a lease.
#[derive(Debug, Clone)]
pub struct Containerd {
    channel: Channel,
    namespace: String,
    lease: Option<String>,
}

fn rpc(what: &str) -> impl FnOnce(Status) -> PullError + '_ {
    move |status| PullError::Containerd {
        what: what.to_owned(),
        code: status.code(),
        message: status.message().to_owned(),
    }
}

/// RFC 3339 (UTC) of a time, for containerd's `containerd.io/gc.expire` label.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

impl Containerd {
    /// Connects to containerd's socket.
    pub async fn connect(address: &Path, namespace: &str) -> Result<Containerd, PullError> {
        if namespace.is_empty()
            || namespace
                .parse::<tonic::metadata::MetadataValue<_>>()
                .is_err()
        {
            return Err(PullError::Usage(format!("invalid namespace {namespace:?}")));
        }
        let channel =
            containerd_client::connect(address)
                .await
                .map_err(|e| PullError::Connect {
                    address: address.display().to_string(),
                    message: e.to_string(),
                })?;
        Ok(Containerd {
            channel,
            namespace: namespace.to_owned(),
            lease: None,
        })
    }

    fn request<T>(&self, message: T) -> Request<T> {
        let mut req = Request::new(message);
        let md = req.metadata_mut();
        if let Ok(v) = self.namespace.parse() {
            md.insert("containerd-namespace", v);
        }
        if let Some(lease) = &self.lease
            && let Ok(v) = lease.parse()
        {
            md.insert("containerd-lease", v);
        }
        req
    }

    /// Creates a lease that expires after `ttl` (so a killed pull's content is collected)
    /// and makes every later request of this handle hold its resources.
    pub async fn create_lease(&mut self, id: &str, ttl: Duration) -> Result<(), PullError> {
        let mut labels = HashMap::new();
        labels.insert(
            "containerd.io/gc.expire".to_owned(),
            rfc3339(SystemTime::now() + ttl),
        );
        LeasesClient::new(self.channel.clone())
            .create(self.request(CreateLeaseRequest {
                id: id.to_owned(),
                labels,
            }))
            .await
            .map_err(rpc("create lease"))?;
        self.lease = Some(id.to_owned());
        Ok(())
    }

    /// Deletes the lease (what it held is then kept only by the image record's references).
    pub async fn delete_lease(&mut self) -> Result<(), PullError> {
        let Some(id) = self.lease.take() else {
            return Ok(());
        };
        let result = LeasesClient::new(self.channel.clone())
            .delete(self.request(DeleteLeaseRequest { id, sync: false }))
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::NotFound => Ok(()),
            Err(s) => Err(rpc("delete lease")(s)),
        }
    }

    /// Writes `data` as content `digest` (already present is fine), then sets `labels`.
    pub async fn write_content(
        &self,
        digest: &str,
        data: &[u8],
        labels: &HashMap<String, String>,
    ) -> Result<(), PullError> {
        let total = i64::try_from(data.len())
            .map_err(|_| PullError::Image("content larger than i64".into()))?;
        let reference = format!("ferry-pull-{digest}");
        let mut messages = Vec::new();
        let mut offset = 0usize;
        for chunk in data.chunks(WRITE_CHUNK) {
            messages.push(WriteContentRequest {
                action: WriteAction::Write as i32,
                r#ref: reference.clone(),
                total,
                expected: digest.to_owned(),
                offset: offset as i64,
                data: chunk.to_vec(),
                labels: HashMap::new(),
            });
            offset += chunk.len();
        }
        messages.push(WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: reference,
            total,
            expected: digest.to_owned(),
            offset: total,
            data: Vec::new(),
            labels: HashMap::new(),
        });
        let mut content = ContentClient::new(self.channel.clone());
        let what = format!("write content {digest}");
        match content
            .write(self.request(futures_util::stream::iter(messages)))
            .await
        {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(s) if s.code() == Code::AlreadyExists => break,
                        Err(s) => return Err(rpc(&what)(s)),
                    }
                }
            }
            Err(s) if s.code() == Code::AlreadyExists => {}
            Err(s) => return Err(rpc(&what)(s)),
        }
        if labels.is_empty() {
            return Ok(());
        }
        let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
        content
            .update(self.request(UpdateContentRequest {
                info: Some(ContentInfo {
                    digest: digest.to_owned(),
                    labels: labels.clone(),
                    ..Default::default()
                }),
                update_mask: Some(prost_types::FieldMask { paths }),
            }))
            .await
            .map_err(rpc(&format!("label content {digest}")))?;
        Ok(())
    }

    /// Creates the image record `name` pointing at `target`, or repoints an existing one.
    pub async fn put_image(
        &self,
        name: &str,
        media_type: &str,
        digest: &str,
        size: u64,
    ) -> Result<(), PullError> {
        let image = Image {
            name: name.to_owned(),
            labels: HashMap::new(),
            target: Some(PbDescriptor {
                media_type: media_type.to_owned(),
                digest: digest.to_owned(),
                size: i64::try_from(size).unwrap_or(i64::MAX),
                annotations: HashMap::new(),
            }),
            created_at: None,
            updated_at: None,
        };
        let mut images = ImagesClient::new(self.channel.clone());
        let created = images
            .create(self.request(CreateImageRequest {
                image: Some(image.clone()),
                source_date_epoch: None,
            }))
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::AlreadyExists => images
                .update(self.request(UpdateImageRequest {
                    image: Some(image),
                    update_mask: Some(prost_types::FieldMask {
                        paths: vec!["target".to_owned()],
                    }),
                    source_date_epoch: None,
                }))
                .await
                .map(|_| ())
                .map_err(rpc(&format!("update image {name}"))),
            Err(s) => Err(rpc(&format!("create image {name}"))(s)),
        }
    }

    /// Whether snapshot `key` exists in `snapshotter`.
    pub async fn snapshot_exists(&self, snapshotter: &str, key: &str) -> Result<bool, PullError> {
        let result = SnapshotsClient::new(self.channel.clone())
            .stat(self.request(StatSnapshotRequest {
                snapshotter: snapshotter.to_owned(),
                key: key.to_owned(),
            }))
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(s) if s.code() == Code::NotFound => Ok(false),
            Err(s) => Err(rpc(&format!("stat snapshot {key}"))(s)),
        }
    }

    /// Whether snapshot `key` in `snapshotter` was committed from a lazy mount: ferry's
    /// snapshotter labels those [`LABEL_FERRY_REMOTE`], and containerd's Stat passes the
    /// snapshotter's labels on. `false` when there is no such snapshot.
    pub async fn snapshot_is_lazy(&self, snapshotter: &str, key: &str) -> Result<bool, PullError> {
        let result = SnapshotsClient::new(self.channel.clone())
            .stat(self.request(StatSnapshotRequest {
                snapshotter: snapshotter.to_owned(),
                key: key.to_owned(),
            }))
            .await;
        match result {
            Ok(info) => Ok(info
                .into_inner()
                .info
                .is_some_and(|i| i.labels.contains_key(LABEL_FERRY_REMOTE))),
            Err(s) if s.code() == Code::NotFound => Ok(false),
            Err(s) => Err(rpc(&format!("stat snapshot {key}"))(s)),
        }
    }

    /// Prepare through containerd. `Ok(true)`: the snapshot exists now under its target
    /// (AlreadyExists: lazily mounted, adopted from staging, or already there).
    /// `Ok(false)`: an ordinary active snapshot `key` was created.
    pub async fn prepare(
        &self,
        snapshotter: &str,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<bool, PullError> {
        let result = SnapshotsClient::new(self.channel.clone())
            .prepare(self.request(PrepareSnapshotRequest {
                snapshotter: snapshotter.to_owned(),
                key: key.to_owned(),
                parent: parent.to_owned(),
                labels,
            }))
            .await;
        match result {
            Ok(_) => Ok(false),
            Err(s) if s.code() == Code::AlreadyExists => Ok(true),
            Err(s) => Err(rpc(&format!("prepare snapshot {key}"))(s)),
        }
    }

    /// Removes snapshot `key` (missing is fine).
    pub async fn remove_snapshot(&self, snapshotter: &str, key: &str) -> Result<(), PullError> {
        let result = SnapshotsClient::new(self.channel.clone())
            .remove(self.request(RemoveSnapshotRequest {
                snapshotter: snapshotter.to_owned(),
                key: key.to_owned(),
            }))
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::NotFound => Ok(()),
            Err(s) => Err(rpc(&format!("remove snapshot {key}"))(s)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_utc_times() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_827_696); // leap day 2000
        assert_eq!(rfc3339(t), "2000-02-29T12:34:56Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_798_761_599);
        assert_eq!(rfc3339(t), "2026-12-31T23:59:59Z");
    }
}
