//! What a request asks for (`Scope`, `Actions`) and how scopes are written in challenges
//! and parsed from token requests (`repository:<name>:<actions>`, `registry:catalog:*`).

use std::fmt;

/// Longest scope string accepted from a token request.
pub const MAX_SCOPE_LEN: usize = 1024;

/// A set of repository actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Actions {
    pub pull: bool,
    pub push: bool,
    pub delete: bool,
}

impl Actions {
    pub const NONE: Actions = Actions {
        pull: false,
        push: false,
        delete: false,
    };
    pub const PULL: Actions = Actions {
        pull: true,
        push: false,
        delete: false,
    };
    pub const PUSH: Actions = Actions {
        pull: false,
        push: true,
        delete: false,
    };
    /// Push as the Docker client asks for it (pull and push together).
    pub const PULL_PUSH: Actions = Actions {
        pull: true,
        push: true,
        delete: false,
    };
    pub const DELETE: Actions = Actions {
        pull: false,
        push: false,
        delete: true,
    };
    pub const ALL: Actions = Actions {
        pull: true,
        push: true,
        delete: true,
    };

    pub fn is_empty(self) -> bool {
        !(self.pull || self.push || self.delete)
    }

    /// Actions present in both sets.
    pub fn intersect(self, other: Actions) -> Actions {
        Actions {
            pull: self.pull && other.pull,
            push: self.push && other.push,
            delete: self.delete && other.delete,
        }
    }

    /// Actions present in either set.
    pub fn union(self, other: Actions) -> Actions {
        Actions {
            pull: self.pull || other.pull,
            push: self.push || other.push,
            delete: self.delete || other.delete,
        }
    }

    /// Whether every action of `wanted` is in `self`.
    pub fn covers(self, wanted: Actions) -> bool {
        (!wanted.pull || self.pull)
            && (!wanted.push || self.push)
            && (!wanted.delete || self.delete)
    }

    /// Parse one action name; `None` for names ferry does not know (ignored, not fatal).
    pub fn from_name(name: &str) -> Option<Actions> {
        match name.trim() {
            "pull" => Some(Actions::PULL),
            "push" => Some(Actions::PUSH),
            "delete" => Some(Actions::DELETE),
            "*" => Some(Actions::ALL),
            _ => None,
        }
    }

    /// Parse a comma-separated action list, ignoring unknown names.
    pub fn parse_list(list: &str) -> Actions {
        list.split(',')
            .filter_map(Actions::from_name)
            .fold(Actions::NONE, Actions::union)
    }

    /// Names of the actions present, in protocol order.
    pub fn names(self) -> Vec<&'static str> {
        let mut out = Vec::with_capacity(3);
        if self.pull {
            out.push("pull");
        }
        if self.push {
            out.push("push");
        }
        if self.delete {
            out.push("delete");
        }
        out
    }
}

impl fmt::Display for Actions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.names().join(","))
    }
}

/// What one request needs.
///
/// - `repository: Some(name)`: the given actions on that repository
///   (`repository:<name>:<actions>`).
/// - `repository: None` with non-empty actions: the catalog (`registry:catalog:*`).
/// - `repository: None` with no actions: the API base (`/v2/`): any valid credentials.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub repository: Option<String>,
    pub actions: Actions,
}

impl Scope {
    /// `repository:<name>:<actions>`.
    pub fn repository(name: impl Into<String>, actions: Actions) -> Scope {
        Scope {
            repository: Some(name.into()),
            actions,
        }
    }

    /// `registry:catalog:*`.
    pub fn catalog() -> Scope {
        Scope {
            repository: None,
            actions: Actions::PULL,
        }
    }

    /// The `/v2/` base check: valid credentials, no particular access.
    pub fn base() -> Scope {
        Scope {
            repository: None,
            actions: Actions::NONE,
        }
    }

    pub fn is_catalog(&self) -> bool {
        self.repository.is_none() && !self.actions.is_empty()
    }

    pub fn is_base(&self) -> bool {
        self.repository.is_none() && self.actions.is_empty()
    }
}

impl fmt::Display for Scope {
    /// The challenge form; the base scope renders as the empty string.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repository {
            Some(name) => write!(f, "repository:{name}:{}", self.actions),
            None if self.actions.is_empty() => Ok(()),
            None => f.write_str("registry:catalog:*"),
        }
    }
}

/// Why a requested scope string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScopeError {
    #[error("scope too long ({0} bytes)")]
    TooLong(usize),
    #[error("malformed scope {0:?} (want type:name:actions)")]
    Malformed(String),
    #[error("invalid repository name in scope {0:?}")]
    InvalidName(String),
}

/// One parsed scope of a token request: a known resource, or one ferry does not serve
/// (kept so the grant can be computed and simply left out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestedScope {
    Repository { name: String, actions: Actions },
    Catalog,
    Other,
}

/// Parse every scope of a token request. Each `scope` value may itself hold several
/// space-separated scopes (OAuth2 form style).
pub fn parse_scopes<'a>(
    values: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<RequestedScope>, ScopeError> {
    let mut out = Vec::new();
    for value in values {
        for one in value.split(' ').filter(|s| !s.is_empty()) {
            out.push(parse_scope(one)?);
        }
    }
    Ok(out)
}

/// Parse one `type[(class)]:name:actions` scope.
pub fn parse_scope(text: &str) -> Result<RequestedScope, ScopeError> {
    if text.len() > MAX_SCOPE_LEN {
        return Err(ScopeError::TooLong(text.len()));
    }
    let (kind, rest) = text
        .split_once(':')
        .ok_or_else(|| ScopeError::Malformed(text.to_string()))?;
    let (name, actions) = rest
        .rsplit_once(':')
        .ok_or_else(|| ScopeError::Malformed(text.to_string()))?;
    if name.is_empty() {
        return Err(ScopeError::Malformed(text.to_string()));
    }
    // `repository(plugin)` and similar carry a resource class we do not distinguish.
    let kind = kind.split_once('(').map_or(kind, |(k, _)| k);
    match kind {
        "repository" => {
            if !valid_repository_name(name) {
                return Err(ScopeError::InvalidName(text.to_string()));
            }
            Ok(RequestedScope::Repository {
                name: name.to_string(),
                actions: Actions::parse_list(actions),
            })
        }
        "registry" if name == "catalog" => Ok(RequestedScope::Catalog),
        "" => Err(ScopeError::Malformed(text.to_string())),
        _ => Ok(RequestedScope::Other),
    }
}

/// Whether `name` is a repository name (ferry-oci's one rule, the distribution grammar).
pub fn valid_repository_name(name: &str) -> bool {
    ferry_oci::RepositoryName::parse(name).is_ok()
}
