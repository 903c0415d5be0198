//! Signed bearer tokens (JWT) in the shape Docker's token protocol uses: issuer, audience
//! = service, short expiry and an `access` claim listing per-resource actions. HS256 with
//! a shared secret by default; ES256/RS256 with a PEM key pair for other verifiers.

use std::io::Read;
use std::path::Path;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rand::RngCore as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::AuthError;
use super::config::AuthConfig;
use super::scope::{Actions, Scope};

/// Clock skew tolerated on `exp`/`nbf`, in seconds.
pub const LEEWAY_SECS: u64 = 30;
/// Largest key or secret file read.
const MAX_KEY_FILE_BYTES: u64 = 64 << 10;
/// Largest token accepted for verification.
pub const MAX_TOKEN_LEN: usize = 16 << 10;
/// Shortest accepted HS256 secret.
const MIN_SECRET_BYTES: usize = 16;

/// One `access` claim entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceActions {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    pub actions: Vec<String>,
}

/// Token claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub iss: String,
    /// User name; empty for anonymous tokens.
    pub sub: String,
    pub aud: String,
    pub exp: u64,
    pub nbf: u64,
    pub iat: u64,
    pub jti: String,
    #[serde(default)]
    pub access: Vec<ResourceActions>,
    /// Present only on refresh tokens: fingerprint of the user's password hash when issued,
    /// so changing the password revokes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ferry_refresh: Option<String>,
}

/// What a verified access token grants, as the authenticator checks it per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub subject: Option<String>,
    /// `(repository, actions)`; `None` repository = catalog.
    pub access: Vec<(Option<String>, Actions)>,
    pub expires: u64,
}

impl Grant {
    fn from_claims(claims: &Claims) -> Grant {
        let mut access = Vec::with_capacity(claims.access.len());
        for entry in &claims.access {
            let actions = entry
                .actions
                .iter()
                .filter_map(|a| Actions::from_name(a))
                .fold(Actions::NONE, Actions::union);
            match entry.kind.as_str() {
                "repository" => access.push((Some(entry.name.clone()), actions)),
                "registry" if entry.name == "catalog" && !entry.actions.is_empty() => {
                    access.push((None, Actions::ALL))
                }
                _ => {}
            }
        }
        Grant {
            subject: (!claims.sub.is_empty()).then(|| claims.sub.clone()),
            access,
            expires: claims.exp,
        }
    }

    /// Whether this grant allows `scope`.
    pub fn covers(&self, scope: &Scope) -> bool {
        if scope.is_base() {
            return true;
        }
        self.access
            .iter()
            .any(|(name, actions)| match (&scope.repository, name) {
                (Some(wanted), Some(granted)) => wanted == granted && actions.covers(scope.actions),
                (None, None) => true,
                _ => false,
            })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("token too long")]
    TooLong,
    #[error("invalid token: {0}")]
    Invalid(#[from] jsonwebtoken::errors::Error),
    #[error("not an access token")]
    WrongKind,
}

/// Issues and verifies tokens with one key.
pub struct TokenSigner {
    algorithm: Algorithm,
    encoding: EncodingKey,
    decoding: DecodingKey,
    key_id: Option<String>,
    issuer: String,
    audience: String,
    validation: Validation,
}

impl std::fmt::Debug for TokenSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSigner")
            .field("algorithm", &self.algorithm)
            .field("key_id", &self.key_id)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .finish_non_exhaustive()
    }
}

impl TokenSigner {
    /// Keys from the config: PEM pair, inline secret, secret file (created if absent), or
    /// a random per-process secret when nothing is configured.
    pub fn from_config(cfg: &AuthConfig) -> Result<TokenSigner, AuthError> {
        let issuer = cfg.issuer.clone().unwrap_or_else(|| cfg.service.clone());
        let audience = cfg.service.clone();
        let configured = [
            cfg.secret.is_some(),
            cfg.secret_file.is_some(),
            cfg.private_key.is_some(),
        ];
        if configured.iter().filter(|c| **c).count() > 1 {
            return Err(AuthError::Config(
                "set only one of `secret`, `secret_file` or `private_key`/`public_key`".to_string(),
            ));
        }
        match (&cfg.private_key, &cfg.public_key) {
            (Some(private), Some(public)) => {
                return TokenSigner::from_pem(
                    &read_key_file(private)?,
                    &read_key_file(public)?,
                    issuer,
                    audience,
                );
            }
            (None, None) => {}
            _ => {
                return Err(AuthError::Config(
                    "`private_key` and `public_key` go together".to_string(),
                ));
            }
        }
        let secret = if let Some(secret) = &cfg.secret {
            secret.as_bytes().to_vec()
        } else if let Some(path) = &cfg.secret_file {
            load_or_create_secret(path)?
        } else {
            tracing::warn!(
                "auth: no token secret configured; using a random one (tokens die with this process and are not shared by replicas)"
            );
            random_secret_hex().into_bytes()
        };
        if secret.len() < MIN_SECRET_BYTES {
            return Err(AuthError::Config(format!(
                "token secret shorter than {MIN_SECRET_BYTES} bytes"
            )));
        }
        Ok(TokenSigner::hs256(&secret, issuer, audience))
    }

    pub fn hs256(secret: &[u8], issuer: String, audience: String) -> TokenSigner {
        let validation = validation(Algorithm::HS256, &issuer, &audience);
        TokenSigner {
            algorithm: Algorithm::HS256,
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
            key_id: None,
            issuer,
            audience,
            validation,
        }
    }

    /// An ES256 (EC P-256) or RS256 signer from PEM keys; checked by signing and
    /// verifying a probe token so a mismatched pair fails at startup.
    pub fn from_pem(
        private: &[u8],
        public: &[u8],
        issuer: String,
        audience: String,
    ) -> Result<TokenSigner, AuthError> {
        let (algorithm, encoding, decoding) =
            if let Ok(encoding) = EncodingKey::from_ec_pem(private) {
                let decoding = DecodingKey::from_ec_pem(public).map_err(|e| {
                    AuthError::Config(format!(
                        "public_key is not an EC public key matching private_key: {e}"
                    ))
                })?;
                (Algorithm::ES256, encoding, decoding)
            } else if let Ok(encoding) = EncodingKey::from_rsa_pem(private) {
                let decoding = DecodingKey::from_rsa_pem(public).map_err(|e| {
                    AuthError::Config(format!(
                        "public_key is not an RSA public key matching private_key: {e}"
                    ))
                })?;
                (Algorithm::RS256, encoding, decoding)
            } else {
                return Err(AuthError::Config(
                    "private_key is neither an EC P-256 nor an RSA PEM private key".to_string(),
                ));
            };
        let validation = validation(algorithm, &issuer, &audience);
        let signer = TokenSigner {
            algorithm,
            encoding,
            decoding,
            key_id: libtrust_key_id(public),
            issuer,
            audience,
            validation,
        };
        let now = unix_now();
        let probe = signer
            .issue(None, Vec::new(), now, 60, None)
            .map_err(|e| AuthError::Config(format!("cannot sign with private_key: {e}")))?;
        signer
            .verify_claims(&probe)
            .map_err(|_| AuthError::Config("public_key does not match private_key".to_string()))?;
        Ok(signer)
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Sign a token for `subject` (None = anonymous) granting `access`, valid `ttl_secs`
    /// from `now`. `refresh` marks a refresh token (password-hash fingerprint).
    pub fn issue(
        &self,
        subject: Option<&str>,
        access: Vec<ResourceActions>,
        now: u64,
        ttl_secs: u64,
        refresh: Option<String>,
    ) -> Result<String, jsonwebtoken::errors::Error> {
        let mut jti = [0u8; 16];
        rand::rng().fill_bytes(&mut jti);
        let claims = Claims {
            iss: self.issuer.clone(),
            sub: subject.unwrap_or_default().to_string(),
            aud: self.audience.clone(),
            exp: now.saturating_add(ttl_secs),
            nbf: now.saturating_sub(1),
            iat: now,
            jti: hex::encode(jti),
            access,
            ferry_refresh: refresh,
        };
        let mut header = Header::new(self.algorithm);
        header.kid = self.key_id.clone();
        jsonwebtoken::encode(&header, &claims, &self.encoding)
    }

    /// Verify signature, algorithm, `exp`/`nbf` (with leeway), `aud` and `iss`.
    pub fn verify_claims(&self, token: &str) -> Result<Claims, TokenError> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(TokenError::TooLong);
        }
        Ok(jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)?.claims)
    }

    /// Verify an access token (refresh tokens are refused).
    pub fn verify_access(&self, token: &str) -> Result<Grant, TokenError> {
        let claims = self.verify_claims(token)?;
        if claims.ferry_refresh.is_some() {
            return Err(TokenError::WrongKind);
        }
        Ok(Grant::from_claims(&claims))
    }

    /// Verify a refresh token: `(user, password fingerprint)`.
    pub fn verify_refresh(&self, token: &str) -> Result<(String, String), TokenError> {
        let claims = self.verify_claims(token)?;
        match claims.ferry_refresh {
            Some(fingerprint) if !claims.sub.is_empty() => Ok((claims.sub, fingerprint)),
            _ => Err(TokenError::WrongKind),
        }
    }
}

fn validation(algorithm: Algorithm, issuer: &str, audience: &str) -> Validation {
    let mut validation = Validation::new(algorithm);
    validation.leeway = LEEWAY_SECS;
    validation.validate_exp = true;
    validation.validate_nbf = true;
    validation.set_audience(&[audience]);
    validation.set_issuer(&[issuer]);
    validation.set_required_spec_claims(&["exp", "nbf", "aud", "iss", "sub"]);
    validation
}

/// Fingerprint of a password hash, carried by refresh tokens.
pub fn password_fingerprint(bcrypt_hash: &str) -> String {
    hex::encode(&Sha256::digest(bcrypt_hash.as_bytes())[..12])
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn read_key_file(path: &Path) -> Result<Vec<u8>, AuthError> {
    let err = |e: std::io::Error| AuthError::Config(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(err)?;
    let mut bytes = Vec::new();
    file.take(MAX_KEY_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(err)?;
    if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(AuthError::Config(format!(
            "{}: larger than {MAX_KEY_FILE_BYTES} bytes",
            path.display()
        )));
    }
    Ok(bytes)
}

fn random_secret_hex() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// Read the shared secret, or create it: written to a private temp file, synced, then
/// hard-linked into place so concurrent replicas agree on one secret and nobody reads a
/// half-written file.
fn load_or_create_secret(path: &Path) -> Result<Vec<u8>, AuthError> {
    let err = |e: std::io::Error| AuthError::Config(format!("secret_file {}: {e}", path.display()));
    match read_key_file(path) {
        Ok(bytes) => return trimmed_secret(bytes, path),
        Err(_) if !path.exists() => {}
        Err(e) => return Err(e),
    }
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(err)?; // mode 0600
    {
        use std::io::Write;
        tmp.write_all(random_secret_hex().as_bytes()).map_err(err)?;
        tmp.write_all(b"\n").map_err(err)?;
        tmp.as_file().sync_all().map_err(err)?;
    }
    match std::fs::hard_link(tmp.path(), path) {
        Ok(()) => tracing::info!(path = %path.display(), "auth: generated token secret"),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err(e)),
    }
    drop(tmp);
    trimmed_secret(read_key_file(path)?, path)
}

fn trimmed_secret(bytes: Vec<u8>, path: &Path) -> Result<Vec<u8>, AuthError> {
    let text = String::from_utf8_lossy(&bytes);
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(AuthError::Config(format!(
            "secret_file {} is empty",
            path.display()
        )));
    }
    Ok(trimmed.as_bytes().to_vec())
}

/// The key ID docker/distribution derives from a public key (libtrust): SHA-256 of the
/// DER SubjectPublicKeyInfo, first 240 bits, base32, in twelve ':'-separated groups of
/// four. Lets a distribution registry configured with our certificate find our key.
fn libtrust_key_id(public_pem: &[u8]) -> Option<String> {
    let mut reader = std::io::BufReader::new(public_pem);
    let der = rustls_pemfile::read_all(&mut reader).find_map(|item| match item {
        Ok(rustls_pemfile::Item::SubjectPublicKeyInfo(spki)) => Some(spki.as_ref().to_vec()),
        _ => None,
    })?;
    let digest = Sha256::digest(&der);
    let encoded = base32_no_pad(&digest[..30]);
    let groups: Vec<&str> = (0..encoded.len())
        .step_by(4)
        .filter_map(|i| encoded.get(i..i + 4))
        .collect();
    Some(groups.join(":"))
}

fn base32_no_pad(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(bytes.len() * 8 / 5 + 1);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &byte in bytes {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}
