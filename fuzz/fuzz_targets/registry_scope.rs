//! Fuzzes token-request scope parsing (`scope=repository:a/b:pull,push`, several per value,
//! space separated). Nothing may panic; every repository scope accepted names a valid
//! repository (the same grammar the router enforces, so a token can never be minted for
//! a name the API would refuse), lengths stay bounded, and a `Scope` written the way
//! challenges write it parses back to the same name and actions.
#![no_main]

use ferry_registry::auth::scope::{
    Actions, MAX_SCOPE_LEN, RequestedScope, Scope, parse_scope, parse_scopes,
};
use ferry_registry::server::routes::parse_name;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(scopes) = parse_scopes(text.split('&')) {
        assert!(scopes.len() <= text.len());
        for scope in scopes {
            if let RequestedScope::Repository { name, .. } = &scope {
                assert!(parse_name(name).is_ok(), "scope names {name:?}");
                assert!(!name.contains(".."));
            }
        }
    }
    match parse_scope(text) {
        Ok(RequestedScope::Repository { name, actions }) => {
            assert!(text.len() <= MAX_SCOPE_LEN);
            assert!(parse_name(&name).is_ok(), "scope names {name:?}");
            assert!(text.contains(&name));
            // What a challenge would say for this grant parses back to it.
            let written = Scope::repository(name.clone(), actions).to_string();
            assert_eq!(
                parse_scope(&written),
                Ok(RequestedScope::Repository { name, actions }),
                "{written:?}"
            );
        }
        Ok(RequestedScope::Catalog) => {
            assert_eq!(parse_scope(&Scope::catalog().to_string()), Ok(RequestedScope::Catalog));
        }
        Ok(RequestedScope::Other) | Err(_) => {}
    }
    // Action lists: parsing is a union of known names, and printing round trips.
    let actions = Actions::parse_list(text);
    assert_eq!(Actions::parse_list(&actions.to_string()), actions);
    assert!(Actions::ALL.covers(actions) && actions.covers(Actions::NONE));
});
