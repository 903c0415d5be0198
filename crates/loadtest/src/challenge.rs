//! Reading a registry's `WWW-Authenticate` challenge, so the load tester authenticates the
//! way the registry asks (Basic on every request, or a bearer token from its realm) rather
//! than the way we assume. The parsing is the registry client's
//! ([`ferry_registry_client::auth::parse_challenges`]), so the tester reads a challenge
//! exactly as a node does; this only picks what the tester follows.

/// What a registry asks a client to do before it may pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    /// Send `Authorization: Basic …` with every request.
    Basic,
    /// Get a token from `realm` and send `Authorization: Bearer …`.
    Bearer {
        /// Token endpoint URL.
        realm: String,
        /// `service` parameter to pass to the token endpoint.
        service: Option<String>,
        /// Scope the registry named, if any.
        scope: Option<String>,
    },
}

/// Longest header value looked at; real challenges are a few hundred bytes.
const MAX_HEADER_LEN: usize = 8192;

/// Reads the first challenge of a `WWW-Authenticate` value with the client's parser.
/// `None` when the scheme is neither Basic nor Bearer, a Bearer challenge has no realm,
/// or the value is empty or too long.
pub fn parse_challenge(value: &str) -> Option<Challenge> {
    if value.len() > MAX_HEADER_LEN {
        return None;
    }
    let first = ferry_registry_client::auth::parse_challenges(value)
        .into_iter()
        .next()?;
    match first.scheme.as_str() {
        "basic" => Some(Challenge::Basic),
        "bearer" => {
            let mut params = first.params;
            Some(Challenge::Bearer {
                realm: params.remove("realm")?,
                service: params.remove("service"),
                scope: params.remove("scope"),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_distribution_bearer_challenge() {
        let c = parse_challenge(
            r#"Bearer realm="http://127.0.0.1:5000/token",service="ferry",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "http://127.0.0.1:5000/token".into(),
                service: Some("ferry".into()),
                scope: Some("repository:a/b:pull,push".into()),
            })
        );
    }

    #[test]
    fn parses_basic_and_unquoted_and_escaped_params() {
        assert_eq!(
            parse_challenge(r#"Basic realm="Registry Realm""#),
            Some(Challenge::Basic)
        );
        assert_eq!(
            parse_challenge(r#"bearer realm=http://h/t, service="a\"b""#),
            Some(Challenge::Bearer {
                realm: "http://h/t".into(),
                service: Some("a\"b".into()),
                scope: None,
            })
        );
    }

    #[test]
    fn stops_at_a_second_challenge() {
        assert_eq!(
            parse_challenge(r#"Bearer realm="http://h/t", Basic realm="x""#),
            Some(Challenge::Bearer {
                realm: "http://h/t".into(),
                service: None,
                scope: None,
            })
        );
    }

    #[test]
    fn rejects_what_it_cannot_follow() {
        assert_eq!(parse_challenge("Bearer service=x"), None, "no realm");
        // An unterminated quote runs to the end, as the client reads it.
        assert_eq!(
            parse_challenge(r#"Bearer realm="unterminated"#),
            Some(Challenge::Bearer {
                realm: "unterminated".into(),
                service: None,
                scope: None,
            })
        );
        assert_eq!(parse_challenge("Negotiate abc"), None);
        assert_eq!(parse_challenge(""), None);
        let long = format!("Bearer realm=\"{}\"", "a".repeat(10_000));
        assert_eq!(parse_challenge(&long), None);
    }
}
