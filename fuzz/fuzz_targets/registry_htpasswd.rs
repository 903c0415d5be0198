//! Fuzzes htpasswd parsing. Nothing may panic; whatever parses must hold only valid user
//! names with well-formed bcrypt hashes (`$2a$`/`$2b$`/`$2y$`, a two-digit cost in 4..=31,
//! 53 characters of bcrypt base64, so the file cannot load users whose password check
//! can only ever fail), no more users than lines, and re-written as `user:hash` lines it
//! must parse to the same set.
#![no_main]

use std::path::Path;

use ferry_registry::auth::htpasswd::{Htpasswd, valid_user_name};
use libfuzzer_sys::fuzz_target;

fn bcrypt_base64(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'.' || b == b'/'
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(parsed) = Htpasswd::parse(text, Path::new("fuzz.htpasswd")) else {
        return;
    };
    assert!(parsed.len() <= text.lines().count());
    let mut rewritten = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (user, _) = line.split_once(':').expect("a parsed line has a colon");
        assert!(valid_user_name(user), "loaded user {user:?}");
        let hash = parsed.hash_of(user).expect("every line's user is loaded");
        let b = hash.as_bytes();
        assert_eq!(b.len(), 60, "{hash:?}");
        assert!(
            [&b"$2a$"[..], b"$2b$", b"$2y$"].contains(&&b[..4]),
            "{hash:?}"
        );
        assert!(b[4].is_ascii_digit() && b[5].is_ascii_digit() && b[6] == b'$', "{hash:?}");
        let cost = u32::from(b[4] - b'0') * 10 + u32::from(b[5] - b'0');
        assert!((4..=31).contains(&cost), "{hash:?}");
        assert!(b[7..].iter().all(|&c| bcrypt_base64(c)), "{hash:?}");
        rewritten.push_str(&format!("{user}:{hash}\n"));
    }
    let again = Htpasswd::parse(&rewritten, Path::new("fuzz.htpasswd"))
        .expect("rewritten htpasswd parses");
    assert_eq!(again, parsed);
});
