//! Fuzzes what a peer's request carries into the daemon's peer server before any check
//! passes: the `Authorization` value held against the cluster token, and the forwarded
//! registry credential whose JWT `exp` bounds a cached yes. Neither may panic; a token
//! never admits anything but itself.
#![no_main]

use ferry_daemon::p2p::auth::{ClusterToken, credential_expiry};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = credential_expiry(text);
    let token = ClusterToken::new("fuzz-cluster-token-0123456789").expect("a valid token");
    if token.admits(Some(text)) {
        assert_eq!(text, token.header_value());
    }
    if let Ok(theirs) = ClusterToken::new(text) {
        assert!(theirs.admits(Some(&theirs.header_value())));
    }
});
