//! Fuzzes the client's reading of containerd's `hosts.toml`. Nothing may panic, and what
//! parses is within bounds and well formed: at most `MAX_HOSTS` hosts, each a bare
//! `host[:port]` with an http/https (or no) scheme, an API root that is `/v2` unless
//! `override_path` says otherwise, certificate files inside the host's directory unless
//! given as absolute paths; and parsing the same text twice gives the same result.
#![no_main]

use std::path::Path;

use ferry_registry_client::hosts::{self, HostSettings, Location};
use libfuzzer_sys::fuzz_target;

const DIR: &str = "/etc/containerd/certs.d/reg.example:5000";

fn check_location(l: &Location, settings: &HostSettings) {
    assert!(!l.host.is_empty());
    assert!(!l.host.contains(['/', '?', '#', '@', ' ']), "{:?}", l.host);
    assert!(matches!(l.scheme, None | Some("http") | Some("https")));
    assert!(!l.root.ends_with('/'), "{:?}", l.root);
    assert!(l.root.is_empty() || l.root.starts_with('/'));
    assert!(!l.root.split('/').any(|s| s == ".."), "{:?}", l.root);
    if !settings.override_path {
        assert!(l.root.ends_with("/v2"), "{:?}", l.root);
    }
}

fn check_settings(s: &HostSettings) {
    for f in s
        .tls
        .ca
        .iter()
        .chain(s.tls.client.iter().map(|(c, _)| c))
        .chain(s.tls.client.iter().filter_map(|(_, k)| k.as_ref()))
    {
        assert!(f.is_absolute(), "{f:?}");
    }
    assert!(s.tls.ca.len() <= hosts::MAX_VALUES);
    assert!(s.tls.client.len() <= hosts::MAX_VALUES);
    if let Some(d) = s.dial_timeout {
        assert!(!d.is_zero() && d <= hosts::MAX_DIAL_TIMEOUT);
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (dir, file) = (Path::new(DIR), Path::new(DIR).join("hosts.toml"));
    let first = hosts::parse(text, dir, &file);
    let again = hosts::parse(text, dir, &file);
    match (&first, &again) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string());
            assert!(a.to_string().starts_with(&file.display().to_string()));
        }
        _ => panic!("parsing the same text twice disagreed"),
    }
    let Ok(h) = first else {
        return;
    };
    assert!(h.hosts.len() <= hosts::MAX_HOSTS);
    assert!(h.ignored_keys.len() <= hosts::MAX_VALUES);
    for e in &h.hosts {
        check_location(&e.location, &e.settings);
        check_settings(&e.settings);
    }
    if let Some(s) = &h.server {
        check_location(s, &h.server_settings);
    }
    check_settings(&h.server_settings);
    let _ = hosts::parse_duration(text);
});
