//! Walk (List) filters in containerd's filter syntax, the subset snapshots use:
//! `name==x`, `parent!=y`, `kind==committed`, `labels."containerd.io/gc.root"==v`,
//! `labels.key` (presence), selectors joined by `,` (all must match). Several filter
//! strings in one request are alternatives (any may match), as in containerd.
//! Parsing is bounded and rejects what it does not understand with InvalidArgument,
//! rather than silently matching everything.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// Longest filter string accepted.
pub const MAX_FILTER_LEN: usize = 4096;
/// Most selectors in one filter string.
pub const MAX_SELECTORS: usize = 64;
/// Most filter strings in one request.
pub const MAX_FILTERS: usize = 64;

/// The fields of a snapshot a filter can look at.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    /// Key (active, view) or name (committed).
    pub name: &'a str,
    /// Parent's name, empty for none.
    pub parent: &'a str,
    /// `active`, `view` or `committed`.
    pub kind: &'a str,
    /// Labels.
    pub labels: &'a HashMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Field {
    Name,
    Parent,
    Kind,
    Label(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Present,
    Equal(String),
    NotEqual(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Selector {
    field: Field,
    op: Op,
}

/// One parsed filter string: a conjunction of selectors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    selectors: Vec<Selector>,
}

/// Alternatives: matches when any filter matches; no filters match everything.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FilterSet {
    filters: Vec<Filter>,
}

impl FilterSet {
    /// Parses the `filters` of a List request; empty strings are ignored.
    pub fn parse(filters: &[String]) -> Result<FilterSet> {
        if filters.len() > MAX_FILTERS {
            return Err(Error::InvalidArgument(format!(
                "too many filters: {} (at most {MAX_FILTERS})",
                filters.len()
            )));
        }
        let filters = filters
            .iter()
            .filter(|f| !f.trim().is_empty())
            .map(|f| Filter::parse(f))
            .collect::<Result<Vec<_>>>()?;
        Ok(FilterSet { filters })
    }

    /// Whether a snapshot with these fields is selected.
    pub fn matches(&self, fields: &Fields<'_>) -> bool {
        self.filters.is_empty() || self.filters.iter().any(|f| f.matches(fields))
    }
}

impl Filter {
    /// Parses one filter string.
    pub fn parse(text: &str) -> Result<Filter> {
        if text.len() > MAX_FILTER_LEN {
            return Err(bad(text, 0, &format!("longer than {MAX_FILTER_LEN} bytes")));
        }
        let mut parser = Parser {
            text,
            chars: text.char_indices().peekable(),
        };
        let mut selectors = Vec::new();
        loop {
            if selectors.len() == MAX_SELECTORS {
                return Err(bad(
                    text,
                    0,
                    &format!("more than {MAX_SELECTORS} selectors"),
                ));
            }
            selectors.push(parser.selector()?);
            parser.skip_space();
            match parser.next() {
                None => break,
                Some((_, ',')) => continue,
                Some((at, c)) => return Err(bad(text, at, &format!("unexpected {c:?}"))),
            }
        }
        Ok(Filter { selectors })
    }

    fn matches(&self, fields: &Fields<'_>) -> bool {
        self.selectors.iter().all(|s| s.matches(fields))
    }
}

impl Selector {
    fn matches(&self, fields: &Fields<'_>) -> bool {
        let value = match &self.field {
            Field::Name => Some(fields.name),
            // A base layer's parent is "": containerd looks remote snapshots up with
            // `...,parent==""` for base layers, so equality compares the empty string,
            // while presence (`parent`) means "has a parent".
            Field::Parent => Some(fields.parent),
            Field::Kind => Some(fields.kind),
            Field::Label(key) => fields.labels.get(key).map(String::as_str),
        };
        match (&self.op, value) {
            (Op::Present, v) => v.is_some_and(|v| self.field != Field::Parent || !v.is_empty()),
            (Op::Equal(want), Some(v)) => {
                if self.field == Field::Kind {
                    v.eq_ignore_ascii_case(want)
                } else {
                    v == want
                }
            }
            (Op::Equal(_), None) => false,
            (Op::NotEqual(want), Some(v)) => {
                if self.field == Field::Kind {
                    !v.eq_ignore_ascii_case(want)
                } else {
                    v != want
                }
            }
            (Op::NotEqual(_), None) => true,
        }
    }
}

fn bad(text: &str, at: usize, why: &str) -> Error {
    Error::InvalidArgument(format!("filter {text:?} at byte {at}: {why}"))
}

struct Parser<'a> {
    text: &'a str,
    chars: std::iter::Peekable<std::str::CharIndices<'a>>,
}

impl Parser<'_> {
    fn next(&mut self) -> Option<(usize, char)> {
        self.chars.next()
    }

    fn peek(&mut self) -> Option<char> {
        self.chars.peek().map(|&(_, c)| c)
    }

    fn pos(&mut self) -> usize {
        self.chars.peek().map_or(self.text.len(), |&(i, _)| i)
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.next();
        }
    }

    fn selector(&mut self) -> Result<Selector> {
        self.skip_space();
        let path = self.field_path()?;
        let field = self.field(path)?;
        self.skip_space();
        let at = self.pos();
        let op = match self.peek() {
            None | Some(',') => {
                return Ok(Selector {
                    field,
                    op: Op::Present,
                });
            }
            Some('=') | Some('!') | Some('~') => {
                let first = self.next().map_or(' ', |(_, c)| c);
                if self.next().map(|(_, c)| c) != Some('=') {
                    return Err(bad(self.text, at, "expected ==, != or ~="));
                }
                first
            }
            Some(c) => return Err(bad(self.text, at, &format!("unexpected {c:?}"))),
        };
        if op == '~' {
            return Err(bad(
                self.text,
                at,
                "regular-expression match (~=) is not supported; use == or !=",
            ));
        }
        self.skip_space();
        let value = self.value()?;
        Ok(Selector {
            field,
            op: if op == '=' {
                Op::Equal(value)
            } else {
                Op::NotEqual(value)
            },
        })
    }

    fn field(&self, path: Vec<String>) -> Result<Field> {
        let mut parts = path.into_iter();
        let head = parts.next().unwrap_or_default();
        let rest: Vec<String> = parts.collect();
        let simple = |f: Field| {
            if rest.is_empty() {
                Ok(f)
            } else {
                Err(bad(
                    self.text,
                    0,
                    &format!("field {head:?} has no sub-fields"),
                ))
            }
        };
        match head.as_str() {
            "name" => simple(Field::Name),
            "parent" => simple(Field::Parent),
            "kind" => simple(Field::Kind),
            "labels" if !rest.is_empty() => Ok(Field::Label(rest.join("."))),
            "labels" => Err(bad(self.text, 0, "labels needs a key: labels.\"KEY\"")),
            other => Err(bad(
                self.text,
                0,
                &format!("unknown field {other:?} (name, parent, kind, labels.KEY)"),
            )),
        }
    }

    fn field_path(&mut self) -> Result<Vec<String>> {
        let mut parts = Vec::new();
        loop {
            let at = self.pos();
            let part = match self.peek() {
                Some('"') => self.quoted()?,
                Some(c) if is_field_char(c) => {
                    let mut s = String::new();
                    while let Some(c) = self.peek().filter(|&c| is_field_char(c)) {
                        s.push(c);
                        self.next();
                    }
                    s
                }
                Some(c) => return Err(bad(self.text, at, &format!("expected a field, got {c:?}"))),
                None => return Err(bad(self.text, at, "expected a field")),
            };
            parts.push(part);
            if self.peek() == Some('.') {
                self.next();
            } else {
                return Ok(parts);
            }
        }
    }

    fn value(&mut self) -> Result<String> {
        let at = self.pos();
        if self.peek() == Some('"') {
            return self.quoted();
        }
        let mut s = String::new();
        while let Some(c) = self.peek() {
            if c == ',' {
                break;
            }
            if c == '"' {
                return Err(bad(self.text, self.pos(), "quote inside an unquoted value"));
            }
            s.push(c);
            self.next();
        }
        let s = s.trim_end().to_owned();
        if s.is_empty() {
            return Err(bad(self.text, at, "expected a value"));
        }
        Ok(s)
    }

    fn quoted(&mut self) -> Result<String> {
        let start = self.pos();
        self.next(); // opening quote
        let mut s = String::new();
        loop {
            match self.next() {
                None => return Err(bad(self.text, start, "unterminated quoted string")),
                Some((_, '"')) => return Ok(s),
                Some((at, '\\')) => match self.next() {
                    Some((_, '"')) => s.push('"'),
                    Some((_, '\\')) => s.push('\\'),
                    Some((_, 'n')) => s.push('\n'),
                    Some((_, 't')) => s.push('\t'),
                    Some((_, '/')) => s.push('/'),
                    _ => return Err(bad(self.text, at, "bad escape in quoted string")),
                },
                Some((_, c)) => s.push(c),
            }
        }
    }
}

fn is_field_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn fields<'a>(labels: &'a HashMap<String, String>) -> Fields<'a> {
        Fields {
            name: "sha256:abc",
            parent: "sha256:parent",
            kind: "committed",
            labels,
        }
    }

    fn labels() -> HashMap<String, String> {
        HashMap::from([
            ("containerd.io/gc.root".to_owned(), "x, y".to_owned()),
            ("team".to_owned(), "infra".to_owned()),
        ])
    }

    fn check(filter: &str) -> bool {
        let l = labels();
        FilterSet::parse(&[filter.to_owned()])
            .unwrap()
            .matches(&fields(&l))
    }

    #[test]
    fn selectors_and_conjunction() {
        assert!(check("name==sha256:abc"));
        assert!(!check("name==sha256:abd"));
        assert!(check("name!=other"));
        assert!(check("parent==sha256:parent"));
        assert!(check("kind==committed"));
        assert!(check("kind==Committed"));
        assert!(!check("kind==active"));
        assert!(check(r#"labels."containerd.io/gc.root"=="x, y""#));
        assert!(check("labels.team==infra"));
        assert!(check("labels.team"));
        assert!(!check("labels.missing"));
        assert!(check("labels.missing!=v"));
        assert!(check(" name == sha256:abc , labels.team==infra"));
        assert!(!check("name==sha256:abc,labels.team==other"));
        assert!(check(r#"labels."a\"b"!=1"#));
    }

    #[test]
    fn an_empty_parent_matches_parent_equals_empty() {
        // What containerd's metadata layer asks after a remote Prepare of a base layer.
        let l = labels();
        let base = Fields {
            parent: "",
            ..fields(&l)
        };
        let m = |f: &str| FilterSet::parse(&[f.to_owned()]).unwrap().matches(&base);
        assert!(m(r#"labels.team==infra,parent=="""#));
        assert!(!m("parent==sha256:parent"));
        assert!(!m("parent"), "a base layer has no parent");
        assert!(m("parent!=sha256:parent"));
        assert!(check("parent"));
        assert!(!check(r#"parent=="""#));
    }

    #[test]
    fn several_filters_are_alternatives() {
        let l = labels();
        let set =
            FilterSet::parse(&["name==nope".to_owned(), "kind==committed".to_owned()]).unwrap();
        assert!(set.matches(&fields(&l)));
        let set = FilterSet::parse(&["name==nope".to_owned(), "kind==view".to_owned()]).unwrap();
        assert!(!set.matches(&fields(&l)));
        assert!(FilterSet::parse(&[]).unwrap().matches(&fields(&l)));
    }

    #[test]
    fn bad_filters_are_invalid_argument() {
        for f in [
            "name=x",
            "name==",
            "color==red",
            "labels==x",
            "name.sub==x",
            r#"labels."unterminated==x"#,
            "name~=x.*",
            "name==a\"b",
            "==x",
            "name==x,,",
            &"a".repeat(MAX_FILTER_LEN + 1),
            &vec!["name==x"; MAX_SELECTORS + 1].join(","),
        ] {
            let err = FilterSet::parse(&[f.to_owned()]).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{f}: {err}");
        }
        let many = vec!["name==x".to_owned(); MAX_FILTERS + 1];
        assert!(FilterSet::parse(&many).is_err());
    }
}
