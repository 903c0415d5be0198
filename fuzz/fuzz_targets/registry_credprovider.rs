//! Fuzzes the kubelet credential provider parsers: the `CredentialProviderConfig` file
//! (YAML subset or JSON) and a plugin's `CredentialProviderResponse`. Nothing may panic;
//! an accepted config names plugins that are plain file names with at least one image
//! pattern and a known exchange apiVersion; the credentials an accepted response gives
//! for an image come from an `auth` key that matches the image, and an image no key
//! matches gets none (credentials never go to another registry).
#![no_main]

use ferry_registry_client::credprovider::{
    parse_config, parse_response, EXCHANGE_API_VERSIONS,
};
use libfuzzer_sys::fuzz_target;

const IMAGES: &[&str] = &[
    "registry.example.com/team/app",
    "a.b.example.com/x",
    "127.0.0.1:5000/private/app",
    "123456789.dkr.ecr.us-east-1.amazonaws.com/app",
    "gcr.io/project/image",
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    if selector % 2 == 0 {
        if let Ok(cfg) = parse_config(rest) {
            for p in &cfg.providers {
                assert!(!p.name.is_empty() && !p.name.contains('/') && p.name != "..");
                assert!(!p.match_images.is_empty());
                assert!(EXCHANGE_API_VERSIONS.contains(&p.api_version.as_str()));
                for image in IMAGES {
                    let _ = p.matches(image);
                }
            }
        }
    } else {
        let api = EXCHANGE_API_VERSIONS[(selector as usize / 2) % EXCHANGE_API_VERSIONS.len()];
        if let Ok(r) = parse_response(rest, api) {
            for image in IMAGES {
                let any = r.auth.iter().any(|(p, _)| p.matches(image));
                match r.credentials_for(image) {
                    Some(c) => assert!(r
                        .auth
                        .iter()
                        .any(|(p, cc)| p.matches(image) && cc == c)),
                    None => assert!(!any),
                }
            }
        }
    }
});
