//! Parsing a registry's `WWW-Authenticate` challenge, so the load tester authenticates the
//! way the registry asks (Basic on every request, or a bearer token from its realm) rather
//! than the way we assume. Kept apart from the engine because it is pure string handling
//! on untrusted input and is tested on its own.

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

/// Parses the first challenge of a `WWW-Authenticate` value (RFC 7235 `auth-scheme
/// #auth-param`, quoted strings with `\` escapes). `None` when the scheme is neither Basic
/// nor Bearer, a Bearer challenge has no realm, or the value is malformed or too long.
pub fn parse_challenge(value: &str) -> Option<Challenge> {
    if value.len() > MAX_HEADER_LEN {
        return None;
    }
    let value = value.trim_start();
    let scheme_end = value
        .find(|c: char| c.is_ascii_whitespace())
        .unwrap_or(value.len());
    let (scheme, mut rest) = value.split_at(scheme_end);
    let mut realm = None;
    let mut service = None;
    let mut scope = None;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_ascii_whitespace() || c == ',');
        if rest.is_empty() {
            break;
        }
        let Some(eq) = rest.find('=') else { break };
        let key = rest[..eq].trim();
        if key.is_empty() || key.contains(|c: char| c.is_ascii_whitespace() || c == ',') {
            // The start of a second challenge ("…, Basic realm=x"): stop at the first.
            break;
        }
        rest = rest[eq + 1..].trim_start();
        let val;
        if let Some(quoted) = rest.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = quoted.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => out.push(chars.next()?.1),
                    '"' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => out.push(c),
                }
            }
            rest = &quoted[end?..];
            val = out;
        } else {
            let end = rest.find(',').unwrap_or(rest.len());
            val = rest[..end].trim().to_string();
            rest = &rest[end..];
        }
        match key.to_ascii_lowercase().as_str() {
            "realm" => realm = Some(val),
            "service" => service = Some(val),
            "scope" => scope = Some(val),
            _ => {}
        }
    }
    if scheme.eq_ignore_ascii_case("basic") {
        Some(Challenge::Basic)
    } else if scheme.eq_ignore_ascii_case("bearer") {
        Some(Challenge::Bearer {
            realm: realm?,
            service,
            scope,
        })
    } else {
        None
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
        assert_eq!(parse_challenge(r#"Bearer realm="unterminated"#), None);
        assert_eq!(parse_challenge("Negotiate abc"), None);
        assert_eq!(parse_challenge(""), None);
        let long = format!("Bearer realm=\"{}\"", "a".repeat(10_000));
        assert_eq!(parse_challenge(&long), None);
    }
}
