//! Fuzzes the CRI proxy's reading of a `PullImage` body (a gRPC frame around a protobuf
//! message from the kubelet, or from whoever can reach the socket) and what it keeps:
//! no panic, and credentials kept only for the repository of the image named.
#![no_main]

use ferry_daemon::cri::parse_pull_request;
use ferry_registry_client::pullsecrets::PullSecrets;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((image, secret)) = parse_pull_request(data) else {
        return;
    };
    let Ok(ferry_oci::ImageRef::Registry {
        registry,
        repository,
        ..
    }) = ferry_oci::ImageRef::parse(&image)
    else {
        return;
    };
    let secrets = PullSecrets::new();
    let kept = secrets.remember(&registry, repository.as_str(), &secret);
    assert_eq!(kept, secrets.has(&registry, repository.as_str()));
    assert!(!secrets.has(&registry, &format!("{}x", repository.as_str())));
});
