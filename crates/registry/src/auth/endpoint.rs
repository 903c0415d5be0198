//! The token endpoint of the Docker token protocol: `GET /token` (Basic credentials or
//! anonymous, `scope` repeated) and `POST /token` (OAuth2 password and refresh_token
//! grants). It grants the intersection of what was asked and what the rules allow; an
//! empty grant is still a token, as clients expect.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine as _;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use super::challenge::basic_challenge;
use super::scope::parse_scopes;
use super::throttle::{ClientAddr, RETRY_AFTER_SECS};
use super::token::{password_fingerprint, unix_now};
use super::{Authenticator, Credential, Enabled, LoginRefused, parse_authorization};

/// Largest query string or form body accepted.
const MAX_REQUEST_BYTES: usize = 64 << 10;
/// Most scopes one token request may ask for.
const MAX_SCOPES: usize = 64;

/// Router serving the token endpoint at `/token` (GET with Basic credentials or
/// anonymous; POST form for OAuth2 password and refresh_token grants).
pub fn token_router(auth: Arc<Authenticator>) -> Router {
    Router::new()
        .route("/token", get(get_token).post(post_token))
        .with_state(auth)
}

/// A token request after parsing, before authentication.
#[derive(Debug, Default)]
struct TokenRequest {
    service: Option<String>,
    scopes: Vec<String>,
    offline: bool,
    grant_type: Option<String>,
    username: Option<String>,
    password: Option<String>,
    refresh_token: Option<String>,
}

impl TokenRequest {
    fn parse(form: &[u8]) -> TokenRequest {
        let mut request = TokenRequest::default();
        for (key, value) in url::form_urlencoded::parse(form) {
            let value = value.into_owned();
            match key.as_ref() {
                "service" => request.service = Some(value),
                "scope" => request.scopes.push(value),
                "offline_token" => request.offline |= value.eq_ignore_ascii_case("true"),
                "access_type" => request.offline |= value == "offline",
                "grant_type" => request.grant_type = Some(value),
                "username" => request.username = Some(value),
                "password" => request.password = Some(value),
                "refresh_token" => request.refresh_token = Some(value),
                // account, client_id: informational.
                _ => {}
            }
        }
        request
    }
}

async fn get_token(
    State(auth): State<Arc<Authenticator>>,
    client: Option<Extension<ClientAddr>>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    let query = query.unwrap_or_default();
    if query.len() > MAX_REQUEST_BYTES {
        return error(
            StatusCode::BAD_REQUEST,
            "TOO_LARGE",
            "query string too long",
        );
    }
    let request = TokenRequest::parse(query.as_bytes());
    let basic = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(parse_authorization)
        .and_then(|credential| match credential {
            Credential::Basic(encoded) => Some(encoded.to_string()),
            // A bearer token sent to the token endpoint proves nothing here.
            Credential::Bearer(_) => None,
        });
    let credentials = match basic {
        None => None,
        Some(encoded) => match decode_basic(&encoded) {
            Some(pair) => Some(pair),
            None => return unauthorized(&auth, "malformed Basic credentials"),
        },
    };
    issue(auth, client_ip(client), request, credentials, false).await
}

fn client_ip(client: Option<Extension<ClientAddr>>) -> Option<std::net::IpAddr> {
    client.map(|Extension(ClientAddr(ip))| ip)
}

async fn post_token(
    State(auth): State<Arc<Authenticator>>,
    client: Option<Extension<ClientAddr>>,
    body: Bytes,
) -> Response {
    let client = client_ip(client);
    if body.len() > MAX_REQUEST_BYTES {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "TOO_LARGE",
            "form body too large",
        );
    }
    let mut request = TokenRequest::parse(&body);
    match request.grant_type.as_deref() {
        Some("password") => {
            let (Some(user), Some(password)) = (request.username.take(), request.password.take())
            else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "UNSUPPORTED",
                    "password grant needs username and password",
                );
            };
            issue(auth, client, request, Some((user, password)), true).await
        }
        Some("refresh_token") => issue(auth, client, request, None, true).await,
        _ => error(
            StatusCode::BAD_REQUEST,
            "UNSUPPORTED",
            "grant_type must be password or refresh_token",
        ),
    }
}

/// Authenticate (password, refresh token or anonymous) and issue.
async fn issue(
    auth: Arc<Authenticator>,
    client: Option<std::net::IpAddr>,
    request: TokenRequest,
    credentials: Option<(String, String)>,
    oauth: bool,
) -> Response {
    let Some(inner) = auth.enabled_inner() else {
        return error(
            StatusCode::NOT_FOUND,
            "UNSUPPORTED",
            "authentication is disabled on this registry",
        );
    };
    if let Some(service) = &request.service
        && service != &inner.service
    {
        return error(
            StatusCode::BAD_REQUEST,
            "UNSUPPORTED",
            &format!("unknown service {service:?}"),
        );
    }
    let requested = match parse_scopes(request.scopes.iter().map(String::as_str)) {
        Ok(scopes) if scopes.len() <= MAX_SCOPES => scopes,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "UNSUPPORTED", "too many scopes"),
        Err(e) => return error(StatusCode::BAD_REQUEST, "UNSUPPORTED", &e.to_string()),
    };

    let subject: Option<String> = if let Some(refresh) = &request.refresh_token {
        match refresh_subject(inner, refresh) {
            Some(user) => Some(user),
            None => return unauthorized(&auth, "invalid or expired refresh token"),
        }
    } else if let Some((user, password)) = credentials {
        let verifier = auth.clone();
        let verified = tokio::task::spawn_blocking(move || {
            let inner = verifier.enabled_inner().ok_or(LoginRefused::Wrong)?;
            verifier.authenticate_password(inner, client, &user, &password)
        })
        .await;
        match verified {
            Ok(Ok(user)) => Some(user.name.to_string()),
            Ok(Err(LoginRefused::Wrong)) => {
                return unauthorized(&auth, "invalid username or password");
            }
            Ok(Err(LoginRefused::Throttled)) => return throttled(),
            Err(e) => {
                tracing::error!(error = %e, "password verification task failed");
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "UNKNOWN",
                    "password verification failed",
                );
            }
        }
    } else {
        None
    };

    let now = unix_now();
    let access = auth.grant(inner, subject.as_deref(), &requested);
    let scope_text = scope_string(&access);
    let token = match inner
        .signer
        .issue(subject.as_deref(), access, now, inner.token_ttl, None)
    {
        Ok(token) => token,
        Err(e) => {
            tracing::error!(error = %e, "token signing failed");
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "UNKNOWN",
                "token signing failed",
            );
        }
    };
    let mut body = serde_json::json!({
        "token": token,
        "access_token": token,
        "expires_in": inner.token_ttl,
        "issued_at": rfc3339(now),
    });
    if oauth {
        body["scope"] = serde_json::Value::String(scope_text);
    }
    if request.offline
        && request.refresh_token.is_none()
        && let Some(user) = subject.as_deref()
        && let Some(refresh) = new_refresh_token(inner, user, now)
    {
        body["refresh_token"] = serde_json::Value::String(refresh);
    }
    let mut response = (StatusCode::OK, body.to_string()).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn refresh_subject(inner: &Enabled, token: &str) -> Option<String> {
    let (user, fingerprint) = inner.signer.verify_refresh(token).ok()?;
    let (users, _) = inner.users.as_ref()?.current();
    let hash = users.hash_of(&user)?;
    (password_fingerprint(hash) == fingerprint).then_some(user)
}

fn new_refresh_token(inner: &Enabled, user: &str, now: u64) -> Option<String> {
    let (users, _) = inner.users.as_ref()?.current();
    let fingerprint = password_fingerprint(users.hash_of(user)?);
    inner
        .signer
        .issue(
            Some(user),
            Vec::new(),
            now,
            inner.refresh_ttl,
            Some(fingerprint),
        )
        .ok()
}

fn decode_basic(encoded: &str) -> Option<(String, String)> {
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

/// OAuth2 `scope` response value: granted scopes, space-separated.
fn scope_string(access: &[super::token::ResourceActions]) -> String {
    access
        .iter()
        .filter(|entry| !entry.actions.is_empty())
        .map(|entry| format!("{}:{}:{}", entry.kind, entry.name, entry.actions.join(",")))
        .collect::<Vec<_>>()
        .join(" ")
}

fn unauthorized(auth: &Authenticator, message: &str) -> Response {
    let mut response = error(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", message);
    let realm = auth
        .enabled_inner()
        .map_or("ferry-registry", |inner| inner.service.as_str());
    if let Ok(value) = HeaderValue::from_str(&basic_challenge(realm)) {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, value);
    }
    response
}

fn throttled() -> Response {
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        "TOOMANYREQUESTS",
        "too many failed logins; retry later",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
    response
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({"errors": [{"code": code, "message": message}]});
    let mut response = (status, body.to_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a unix time (proleptic Gregorian, days-from-civil inverse).
pub(crate) fn rfc3339(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}
