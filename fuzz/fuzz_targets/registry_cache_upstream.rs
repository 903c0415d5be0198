//! Fuzzes what the pull-through cache parses: the upstream URL from its config (host and
//! scheme it will dial) and the manifests upstream answers with (which blobs it links to
//! the repository, so later blob requests are served from the cache). The host must be a
//! bare `host[:port]` (no path, credentials or query smuggled in), the scheme exactly
//! http or https, and every blob linked a valid sha256 hex actually named in the document.
#![no_main]

use ferry_oci::units::parse_duration;
use ferry_registry::fuzz_api::{cache_referenced_blobs, cache_upstream_url};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let blobs = cache_referenced_blobs(data);
    for hex in &blobs {
        assert_eq!(hex.len(), 64);
        assert!(hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        let text = String::from_utf8_lossy(data);
        assert!(text.contains(hex.as_str()) || text.contains('\\'), "{hex} not in the document");
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some((host, plain)) = cache_upstream_url(text) {
        assert!(!host.is_empty());
        assert!(!host.contains(['/', '@', '?', '#', ' ']), "host {host:?} from {text:?}");
        // (url strips and skips control characters and spaces; judge only clean input.)
        if text.bytes().all(|b| b > b' ' && b != 0x7f) {
            let scheme = text.split(':').next().unwrap_or("").to_ascii_lowercase();
            assert_eq!(plain, scheme == "http", "{text:?}");
            assert!(scheme == "http" || scheme == "https", "{text:?}");
        }
    }
    if let Ok(d) = parse_duration(text) {
        // The whole-number part counts at least milliseconds (`.5s` has none).
        let digits: String = text.trim().chars().take_while(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse::<u64>() {
            assert!(d.as_millis() >= u128::from(n), "{text:?} -> {d:?}");
        }
    }
});
