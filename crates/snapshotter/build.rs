//! Generates the server half of containerd's `containerd.services.snapshots.v1.Snapshots`
//! gRPC service. `containerd-client` ships the message types but only client stubs, so the
//! service is described here by hand (no .proto in this repository) over those types.

fn main() {
    const TYPES: &str = "containerd_client::services::v1::snapshots";
    let method = |name: &str, route: &str, input: &str, output: &str| {
        tonic_build::manual::Method::builder()
            .name(name)
            .route_name(route)
            .input_type(format!("{TYPES}::{input}"))
            .output_type(output.replace("{T}", TYPES))
            .codec_path("tonic_prost::ProstCodec")
    };
    let service = tonic_build::manual::Service::builder()
        .name("Snapshots")
        .package("containerd.services.snapshots.v1")
        .method(
            method(
                "prepare",
                "Prepare",
                "PrepareSnapshotRequest",
                "{T}::PrepareSnapshotResponse",
            )
            .build(),
        )
        .method(
            method(
                "view",
                "View",
                "ViewSnapshotRequest",
                "{T}::ViewSnapshotResponse",
            )
            .build(),
        )
        .method(method("mounts", "Mounts", "MountsRequest", "{T}::MountsResponse").build())
        .method(
            method(
                "commit",
                "Commit",
                "CommitSnapshotRequest",
                "crate::proto::Empty",
            )
            .build(),
        )
        .method(
            method(
                "remove",
                "Remove",
                "RemoveSnapshotRequest",
                "crate::proto::Empty",
            )
            .build(),
        )
        .method(
            method(
                "stat",
                "Stat",
                "StatSnapshotRequest",
                "{T}::StatSnapshotResponse",
            )
            .build(),
        )
        .method(
            method(
                "update",
                "Update",
                "UpdateSnapshotRequest",
                "{T}::UpdateSnapshotResponse",
            )
            .build(),
        )
        .method(
            method(
                "list",
                "List",
                "ListSnapshotsRequest",
                "{T}::ListSnapshotsResponse",
            )
            .server_streaming()
            .build(),
        )
        .method(method("usage", "Usage", "UsageRequest", "{T}::UsageResponse").build())
        .method(
            method(
                "cleanup",
                "Cleanup",
                "CleanupRequest",
                "crate::proto::Empty",
            )
            .build(),
        )
        .build();
    tonic_build::manual::Builder::new()
        .build_client(false)
        .compile(&[service]);
}
