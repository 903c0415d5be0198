//! The block-style YAML subset kubelet credential provider configs are written in,
//! turned into a JSON value for serde. No YAML crate is in the workspace, and these
//! files use little of YAML: block mappings and sequences, plain and quoted scalars,
//! flow sequences of scalars, comments. Everything else (anchors, aliases, tags, block
//! scalars, flow mappings, several documents) is refused with an error rather than
//! read differently from the kubelet. Every scalar is a string (`null`, `~` and an empty
//! value are null): the config's fields are strings, durations included.

use serde_json::{Map, Value};

/// Deepest nesting accepted (the config needs 4).
const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone)]
struct Line {
    /// 1-based, for errors.
    no: usize,
    indent: usize,
    text: String,
}

/// Parses `src` into a JSON value; the error says what and on which line.
pub(crate) fn parse(src: &str) -> Result<Value, String> {
    let mut lines = Vec::new();
    let mut started = false;
    for (i, raw) in src.lines().enumerate() {
        let no = i + 1;
        let body = raw.trim_end();
        let trimmed = body.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if body.starts_with("---") && trimmed.len() == 3 {
            if started {
                return Err(format!("line {no}: only one YAML document is read"));
            }
            started = true;
            continue;
        }
        if body == "..." {
            break;
        }
        started = true;
        let indent = body.len() - trimmed.len();
        if body[..indent].contains('\t') {
            return Err(format!(
                "line {no}: tabs are not allowed in YAML indentation"
            ));
        }
        lines.push(Line {
            no,
            indent,
            text: trimmed.to_string(),
        });
    }
    if lines.is_empty() {
        return Ok(Value::Null);
    }
    let mut p = Parser { lines, i: 0 };
    let indent = p.lines[0].indent;
    let v = p.block(indent, 0)?;
    if let Some(l) = p.lines.get(p.i) {
        return Err(format!("line {}: unexpected indentation", l.no));
    }
    Ok(v)
}

struct Parser {
    lines: Vec<Line>,
    i: usize,
}

fn is_item(text: &str) -> bool {
    text == "-" || text.starts_with("- ")
}

impl Parser {
    fn block(&mut self, indent: usize, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err("nested too deeply".into());
        }
        let line = &self.lines[self.i];
        if is_item(&line.text) {
            self.seq(indent, depth)
        } else {
            self.map(indent, depth)
        }
    }

    /// The value of an item or key whose text ended at line `self.i - 1` with nothing
    /// after it: a nested block, or null.
    fn nested(&mut self, parent: usize, depth: usize, seq_ok: bool) -> Result<Value, String> {
        match self.lines.get(self.i) {
            Some(l) if l.indent > parent => {
                let indent = l.indent;
                self.block(indent, depth + 1)
            }
            // `key:` followed by `- item` at the key's own indentation is a sequence.
            Some(l) if seq_ok && l.indent == parent && is_item(&l.text) => {
                self.seq(parent, depth + 1)
            }
            _ => Ok(Value::Null),
        }
    }

    fn seq(&mut self, indent: usize, depth: usize) -> Result<Value, String> {
        let mut out = Vec::new();
        while let Some(l) = self.lines.get(self.i) {
            if l.indent < indent {
                break;
            }
            if l.indent > indent || !is_item(&l.text) {
                return Err(format!(
                    "line {}: expected `- ` at column {}",
                    l.no,
                    indent + 1
                ));
            }
            let no = l.no;
            let rest = l.text[1..].trim_start().to_string();
            if rest.is_empty() {
                self.i += 1;
                out.push(self.nested(indent, depth, false)?);
                continue;
            }
            // `- key: value` opens a mapping whose keys sit where `key` starts.
            let col = indent + (l.text.len() - rest.len());
            if is_item(&rest) || split_key(&rest, no)?.is_some() {
                self.lines[self.i] = Line {
                    no,
                    indent: col,
                    text: rest,
                };
                out.push(self.block(col, depth + 1)?);
            } else {
                self.i += 1;
                out.push(scalar_or_flow(&rest, no)?);
            }
        }
        Ok(Value::Array(out))
    }

    fn map(&mut self, indent: usize, depth: usize) -> Result<Value, String> {
        let mut out = Map::new();
        while let Some(l) = self.lines.get(self.i) {
            if l.indent < indent {
                break;
            }
            if l.indent > indent {
                return Err(format!("line {}: unexpected indentation", l.no));
            }
            if is_item(&l.text) {
                // A sequence at the mapping's indentation belongs to the key before.
                return Err(format!(
                    "line {}: a `- ` item where a key was expected",
                    l.no
                ));
            }
            let no = l.no;
            let (key, value) = split_key(&l.text, no)?
                .ok_or_else(|| format!("line {no}: expected `key: value`"))?;
            self.i += 1;
            let v = if value.is_empty() {
                self.nested(indent, depth, true)?
            } else {
                scalar_or_flow(&value, no)?
            };
            if out.insert(key.clone(), v).is_some() {
                return Err(format!("line {no}: key {key:?} appears twice"));
            }
        }
        Ok(Value::Object(out))
    }
}

/// Splits `key: value` (the key may be quoted); `None` when the text is no mapping entry.
fn split_key(text: &str, no: usize) -> Result<Option<(String, String)>, String> {
    let (key, rest) = if text.starts_with('"') || text.starts_with('\'') {
        let (k, used) = quoted(text, no)?;
        let rest = text[used..].trim_start();
        match rest.strip_prefix(':') {
            Some(r) if r.is_empty() || r.starts_with(' ') => (k, r),
            _ => return Ok(None),
        }
    } else {
        let bytes = text.as_bytes();
        let mut found = None;
        for (i, &b) in bytes.iter().enumerate() {
            if b == b'#' && i > 0 && bytes[i - 1] == b' ' {
                break;
            }
            if b == b':' && (i + 1 == bytes.len() || bytes[i + 1] == b' ') {
                found = Some(i);
                break;
            }
        }
        let Some(i) = found else { return Ok(None) };
        let k = text[..i].trim_end();
        if k.is_empty() {
            return Err(format!("line {no}: empty key"));
        }
        (k.to_string(), &text[i + 1..])
    };
    let value = strip_comment(rest.trim());
    Ok(Some((key, value.to_string())))
}

/// Drops a ` # comment` after a plain value (quoted values are left to [`quoted`]).
fn strip_comment(v: &str) -> &str {
    if v.starts_with('"') || v.starts_with('\'') {
        return v;
    }
    if v.starts_with('#') {
        return "";
    }
    match v.find(" #") {
        Some(i) => v[..i].trim_end(),
        None => v,
    }
}

/// A quoted scalar at the start of `text`: its value and the bytes it used.
fn quoted(text: &str, no: usize) -> Result<(String, usize), String> {
    let q = text.as_bytes()[0] as char;
    let mut out = String::new();
    let mut chars = text.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        if c == q {
            if q == '\'' && chars.peek().map(|(_, c)| *c) == Some('\'') {
                chars.next();
                out.push('\'');
                continue;
            }
            return Ok((out, i + 1));
        }
        if q == '"' && c == '\\' {
            let (_, e) = chars
                .next()
                .ok_or_else(|| format!("line {no}: unterminated escape"))?;
            out.push(match e {
                'n' => '\n',
                't' => '\t',
                'r' => '\r',
                '0' => '\0',
                '\\' => '\\',
                '"' => '"',
                '/' => '/',
                ' ' => ' ',
                _ => return Err(format!("line {no}: unsupported escape \\{e}")),
            });
            continue;
        }
        out.push(c);
    }
    Err(format!("line {no}: unterminated quoted string"))
}

fn scalar_or_flow(v: &str, no: usize) -> Result<Value, String> {
    let v = strip_comment(v);
    if let Some(inner) = v.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| format!("line {no}: a flow sequence must end on its line"))?;
        let mut items = Vec::new();
        let mut rest = inner.trim();
        while !rest.is_empty() {
            let (item, used) = if rest.starts_with('"') || rest.starts_with('\'') {
                let (s, used) = quoted(rest, no)?;
                (Value::String(s), used)
            } else {
                let end = rest.find(',').unwrap_or(rest.len());
                (plain(rest[..end].trim(), no)?, end)
            };
            items.push(item);
            rest = rest[used..].trim_start();
            match rest.strip_prefix(',') {
                Some(r) => rest = r.trim_start(),
                None if rest.is_empty() => {}
                None => return Err(format!("line {no}: expected `,` in a flow sequence")),
            }
        }
        return Ok(Value::Array(items));
    }
    if v == "{}" {
        return Ok(Value::Object(Map::new()));
    }
    if v.starts_with('"') || v.starts_with('\'') {
        let (s, used) = quoted(v, no)?;
        let after = v[used..].trim();
        if !after.is_empty() && !after.starts_with('#') {
            return Err(format!("line {no}: text after a quoted string"));
        }
        return Ok(Value::String(s));
    }
    plain(v, no)
}

fn plain(v: &str, no: usize) -> Result<Value, String> {
    if v.is_empty() || v == "~" || v == "null" {
        return Ok(Value::Null);
    }
    match v.as_bytes()[0] {
        b'*' | b'&' => Err(format!(
            "line {no}: YAML anchors and aliases are not read (quote values that start with `*`, \
             as the kubelet's YAML needs too)"
        )),
        b'!' | b'|' | b'>' | b'{' | b'@' | b'`' | b'%' => Err(format!(
            "line {no}: this YAML form (tag, block scalar, flow mapping) is not read; \
             use a plain or quoted value"
        )),
        _ => Ok(Value::String(v.to_string())),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_example_shapes() {
        let v = parse(
            r#"---
apiVersion: kubelet.config.k8s.io/v1
kind: CredentialProviderConfig
providers:
  # the ECR one
  - name: ecr-credential-provider
    matchImages:
      - "*.dkr.ecr.*.amazonaws.com"
      - 'registry.io:8080/path'
    defaultCacheDuration: "12h"
    apiVersion: credentialprovider.kubelet.k8s.io/v1
    args: [get-credentials, "--v=2"]
    env:
    - name: AWS_PROFILE   # trailing comment
      value: it's
  - name: other
    matchImages: ["gcr.io"]
    defaultCacheDuration: 1m
    apiVersion: credentialprovider.kubelet.k8s.io/v1
"#,
        )
        .unwrap();
        let p = &v["providers"];
        assert_eq!(p[0]["matchImages"][0], "*.dkr.ecr.*.amazonaws.com");
        assert_eq!(p[0]["matchImages"][1], "registry.io:8080/path");
        assert_eq!(p[0]["args"][1], "--v=2");
        assert_eq!(p[0]["env"][0]["name"], "AWS_PROFILE");
        assert_eq!(p[0]["env"][0]["value"], "it's");
        assert_eq!(p[1]["matchImages"][0], "gcr.io");
        assert_eq!(p[1]["defaultCacheDuration"], "1m");
    }

    #[test]
    fn refuses_what_it_does_not_read() {
        for bad in [
            "a: *alias",
            "a: &anchor x",
            "a: |\n  text",
            "a: {b: c}",
            "a: 1\na: 2",
            "a:\n\t- b",
            "a: \"open",
            "---\na: 1\n---\nb: 2",
            "a: [x, y",
            "a: b\n  c: d",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn deep_nesting_is_bounded() {
        let mut s = String::new();
        for i in 0..100 {
            s.push_str(&" ".repeat(i));
            s.push_str("- \n");
        }
        let _ = parse(&s);
        let mut s = String::new();
        for i in 0..100 {
            s.push_str(&"  ".repeat(i));
            s.push_str("k:\n");
        }
        assert!(parse(&s).is_err());
    }
}
