//! Per-repository access rules: repository globs, user lists, first match wins. Compiled
//! once at startup so evaluating them per request is a few comparisons.

use super::AuthError;
use super::config::{AccessRule, AuthConfig};
use super::scope::Actions;

/// User list entry meaning "any authenticated user".
const ANY_USER: &str = "*";
/// User list entry meaning "unauthenticated clients".
pub const ANONYMOUS: &str = "anonymous";

/// The compiled rule list, including the implicit rules (everything for authenticated
/// users when no rules are configured; pull for anonymous with `anonymous_pull`).
#[derive(Debug, Clone)]
pub struct Rules {
    rules: Vec<CompiledRule>,
    catalog_users: UserSet,
}

#[derive(Debug, Clone)]
struct CompiledRule {
    pattern: RepositoryGlob,
    users: UserSet,
    actions: Actions,
}

#[derive(Debug, Clone, Default)]
struct UserSet {
    any_authenticated: bool,
    anonymous: bool,
    names: Vec<String>,
}

impl UserSet {
    fn new(list: &[String]) -> UserSet {
        let mut set = UserSet::default();
        for user in list {
            match user.as_str() {
                ANY_USER => set.any_authenticated = true,
                ANONYMOUS => set.anonymous = true,
                name => set.names.push(name.to_string()),
            }
        }
        set
    }

    fn contains(&self, subject: Option<&str>) -> bool {
        match subject {
            None => self.anonymous,
            Some(user) => self.any_authenticated || self.names.iter().any(|n| n == user),
        }
    }
}

impl Rules {
    pub fn new(cfg: &AuthConfig) -> Result<Rules, AuthError> {
        let mut rules = Vec::with_capacity(cfg.rules.len() + 2);
        for (index, rule) in cfg.rules.iter().enumerate() {
            rules.push(
                compile(rule)
                    .map_err(|e| AuthError::Config(format!("auth.rules[{index}]: {e}")))?,
            );
        }
        if cfg.rules.is_empty() {
            rules.push(CompiledRule {
                pattern: RepositoryGlob::any(),
                users: UserSet {
                    any_authenticated: true,
                    ..UserSet::default()
                },
                actions: Actions::ALL,
            });
        }
        if cfg.anonymous_pull {
            rules.push(CompiledRule {
                pattern: RepositoryGlob::any(),
                users: UserSet {
                    anonymous: true,
                    ..UserSet::default()
                },
                actions: Actions::PULL,
            });
        }
        Ok(Rules {
            rules,
            catalog_users: UserSet::new(&cfg.catalog),
        })
    }

    /// What `subject` (None = anonymous) may do on `repository`: the first matching rule's
    /// actions, or nothing.
    pub fn allowed(&self, subject: Option<&str>, repository: &str) -> Actions {
        self.rules
            .iter()
            .find(|rule| rule.users.contains(subject) && rule.pattern.matches(repository))
            .map_or(Actions::NONE, |rule| rule.actions)
    }

    /// Whether `subject` may list the catalog.
    pub fn catalog_allowed(&self, subject: Option<&str>) -> bool {
        self.catalog_users.contains(subject)
    }
}

fn compile(rule: &AccessRule) -> Result<CompiledRule, String> {
    if rule.users.is_empty() {
        return Err("`users` is empty".to_string());
    }
    let mut actions = Actions::NONE;
    for name in &rule.actions {
        let action = Actions::from_name(name)
            .ok_or_else(|| format!("unknown action {name:?} (pull, push, delete or \"*\")"))?;
        actions = actions.union(action);
    }
    Ok(CompiledRule {
        pattern: RepositoryGlob::new(&rule.repository)?,
        users: UserSet::new(&rule.users),
        actions,
    })
}

/// A repository pattern: `/`-separated segments where `**` (a whole segment) matches any
/// number of segments, including none, and `*`/`?` inside a segment match any run of
/// characters / one character of that segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepositoryGlob {
    segments: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    AnyDepth,
    Glob(Vec<char>),
}

impl RepositoryGlob {
    pub fn new(pattern: &str) -> Result<RepositoryGlob, String> {
        if pattern.is_empty() {
            return Err("empty repository pattern".to_string());
        }
        let mut segments = Vec::new();
        for segment in pattern.split('/') {
            if segment.is_empty() {
                return Err(format!("empty segment in repository pattern {pattern:?}"));
            }
            if segment == "**" {
                // Consecutive `**` mean the same as one.
                if segments.last() != Some(&Segment::AnyDepth) {
                    segments.push(Segment::AnyDepth);
                }
            } else if segment.contains("**") {
                return Err(format!("`**` must be a whole segment in {pattern:?}"));
            } else {
                segments.push(Segment::Glob(segment.chars().collect()));
            }
        }
        Ok(RepositoryGlob { segments })
    }

    fn any() -> RepositoryGlob {
        RepositoryGlob {
            segments: vec![Segment::AnyDepth],
        }
    }

    pub fn matches(&self, repository: &str) -> bool {
        let names: Vec<&str> = repository.split('/').collect();
        // Greedy matching with backtracking to the last `**`: O(pattern × name).
        let (mut p, mut n) = (0, 0);
        let mut resume: Option<(usize, usize)> = None;
        while n < names.len() {
            match self.segments.get(p) {
                Some(Segment::AnyDepth) => {
                    resume = Some((p, n));
                    p += 1;
                }
                Some(Segment::Glob(glob)) if segment_matches(glob, names[n]) => {
                    p += 1;
                    n += 1;
                }
                _ => match resume {
                    Some((star_p, star_n)) => {
                        p = star_p + 1;
                        n = star_n + 1;
                        resume = Some((star_p, star_n + 1));
                    }
                    None => return false,
                },
            }
        }
        while let Some(Segment::AnyDepth) = self.segments.get(p) {
            p += 1;
        }
        p == self.segments.len()
    }
}

/// `*` and `?` wildcard match of one segment (same greedy algorithm, on characters).
fn segment_matches(glob: &[char], text: &str) -> bool {
    let text: Vec<char> = text.chars().collect();
    let (mut g, mut t) = (0, 0);
    let mut resume: Option<(usize, usize)> = None;
    while t < text.len() {
        match glob.get(g) {
            Some('*') => {
                resume = Some((g, t));
                g += 1;
            }
            Some(&c) if c == '?' || c == text[t] => {
                g += 1;
                t += 1;
            }
            _ => match resume {
                Some((star_g, star_t)) => {
                    g = star_g + 1;
                    t = star_t + 1;
                    resume = Some((star_g, star_t + 1));
                }
                None => return false,
            },
        }
    }
    while glob.get(g) == Some(&'*') {
        g += 1;
    }
    g == glob.len()
}
