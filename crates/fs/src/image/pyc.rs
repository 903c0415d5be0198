//! The imports a compiled Python module (`__pycache__/NAME.cpython-3XY.pyc`) makes when
//! it runs: the `IMPORT_NAME` instructions of its module-level code, with each one's
//! level (relative imports) and `from … import` list. An interpreter imports a
//! package's modules one after another, each found only once the one before it runs, so
//! on a lazy mount each first read of a module waited a round trip of its own; read from
//! the module's bytecode, the modules it imports can travel while it is still loading
//! ([`crate::image::imports`]).
//!
//! The bytes come from a file in an image, so from a stranger: the `marshal` reader is
//! bounded ([`MAX_DEPTH`] nesting, [`MAX_OBJECTS`] objects, every length checked against
//! the bytes left before anything is allocated), never panics, and reads only CPython
//! 3.8 to 3.12 files (magic numbers 3400-3531), whose code-object layout and
//! instruction numbers it knows. Imports inside functions run later, if ever, and are
//! not listed; imports at module level inside `try` are (the caller fetches only what
//! exists).

use std::rc::Rc;

/// Nesting of containers and code objects read, at most.
pub const MAX_DEPTH: usize = 64;
/// Objects read from one file, at most (a large module has some tens of thousands).
pub const MAX_OBJECTS: usize = 1 << 20;
/// Imports listed from one module, at most.
pub const MAX_IMPORTS: usize = 1024;
/// The `.pyc` header: magic, flags, and source mtime and size (or a hash).
const HEADER: usize = 16;

/// Magic numbers of CPython 3.8 (3400) to 3.12 (3531); 3.11 (3450 on) changed the code
/// object's fields.
const MAGIC_FIRST: u16 = 3400;
const MAGIC_311: u16 = 3450;
const MAGIC_LAST: u16 = 3531;

// Instruction numbers, the same from 3.8 to 3.12 (3.13 renumbered them).
const OP_CACHE: u8 = 0;
const OP_LOAD_CONST: u8 = 100;
const OP_IMPORT_NAME: u8 = 108;
const OP_EXTENDED_ARG: u8 = 144;

/// One `import` (or `from … import`) a module runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Import {
    /// The dotted name imported (empty for `from . import x`).
    pub module: String,
    /// 0 for an absolute import, 1 for `from .`, 2 for `from ..`, …
    pub level: u32,
    /// The names of `from module import a, b` (submodules, or attributes).
    pub names: Vec<String>,
}

/// Why no imports were read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PycError {
    /// Not a `.pyc` of CPython 3.8 to 3.12.
    #[error("not a .pyc file of CPython 3.8-3.12")]
    NotPyc,
    /// The bytes end inside an object.
    #[error("the .pyc file ends inside an object")]
    Truncated,
    /// An object `marshal` does not write, or a reference to nothing.
    #[error("not a marshal stream CPython writes: {0}")]
    Malformed(&'static str),
    /// Deeper or larger than the bounds.
    #[error("beyond the reader's bounds (depth {MAX_DEPTH}, {MAX_OBJECTS} objects)")]
    Bounds,
}

/// The imports of the module-level code of the `.pyc` file `data` (whole), in the
/// order the module runs them, each once.
pub fn imports(data: &[u8]) -> Result<Vec<Import>, PycError> {
    let magic = match data.get(..4) {
        Some([a, b, b'\r', b'\n']) => u16::from_le_bytes([*a, *b]),
        _ => return Err(PycError::NotPyc),
    };
    if !(MAGIC_FIRST..=MAGIC_LAST).contains(&magic) {
        return Err(PycError::NotPyc);
    }
    let body = data.get(HEADER..).ok_or(PycError::Truncated)?;
    let mut reader = Reader {
        data: body,
        pos: 0,
        refs: Vec::new(),
        objects: 0,
        new_code: magic >= MAGIC_311,
    };
    match reader.object(0)? {
        Obj::Code(code) => Ok(scan(&code)),
        _ => Err(PycError::Malformed("the file holds no code object")),
    }
}

/// What the reader keeps of an object: strings, small ints and tuples (import names,
/// levels, from-lists) and code objects; the rest is read past.
#[derive(Debug, Clone)]
enum Obj {
    Null,
    Int(i64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<[Obj]>),
    Code(Rc<Code>),
    Other,
}

#[derive(Debug)]
struct Code {
    code: Rc<[u8]>,
    consts: Rc<[Obj]>,
    names: Rc<[Obj]>,
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
    refs: Vec<Obj>,
    objects: usize,
    /// 3.11's code object layout (else 3.8-3.10's).
    new_code: bool,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PycError> {
        let end = self.pos.checked_add(n).ok_or(PycError::Truncated)?;
        let got = self.data.get(self.pos..end).ok_or(PycError::Truncated)?;
        self.pos = end;
        Ok(got)
    }

    fn u8(&mut self) -> Result<u8, PycError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, PycError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A count of items that each take at least one byte: at most the bytes left.
    fn count(&mut self, n: usize) -> Result<usize, PycError> {
        if n > self.data.len() - self.pos {
            return Err(PycError::Truncated);
        }
        Ok(n)
    }

    fn text(&mut self, n: usize) -> Result<Obj, PycError> {
        let b = self.take(n)?;
        Ok(Obj::Str(String::from_utf8_lossy(b).into()))
    }

    fn items(&mut self, n: usize, depth: usize) -> Result<Vec<Obj>, PycError> {
        let n = self.count(n)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.object(depth + 1)?);
        }
        Ok(v)
    }

    fn object(&mut self, depth: usize) -> Result<Obj, PycError> {
        if depth > MAX_DEPTH {
            return Err(PycError::Bounds);
        }
        self.objects += 1;
        if self.objects > MAX_OBJECTS {
            return Err(PycError::Bounds);
        }
        let code = self.u8()?;
        let (flagged, kind) = (code & 0x80 != 0, code & 0x7f);
        // marshal numbers a flagged object's slot before reading what it contains.
        let slot = (flagged && kind != b'r').then(|| {
            self.refs.push(Obj::Null);
            self.refs.len() - 1
        });
        let obj = match kind {
            b'0' => Obj::Null,
            b'N' | b'F' | b'T' | b'S' | b'.' => Obj::Other,
            b'i' => Obj::Int(i64::from(self.u32()? as i32)),
            b'l' => {
                let digits = (self.u32()? as i32).unsigned_abs() as usize;
                self.take(digits.checked_mul(2).ok_or(PycError::Truncated)?)?;
                Obj::Other
            }
            b'g' => {
                self.take(8)?;
                Obj::Other
            }
            b'y' => {
                self.take(16)?;
                Obj::Other
            }
            b'f' => {
                let n = self.u8()? as usize;
                self.take(n)?;
                Obj::Other
            }
            b'x' => {
                for _ in 0..2 {
                    let n = self.u8()? as usize;
                    self.take(n)?;
                }
                Obj::Other
            }
            b's' => {
                let n = self.u32()? as usize;
                Obj::Bytes(self.take(n)?.into())
            }
            b't' | b'u' | b'a' | b'A' => {
                let n = self.u32()? as usize;
                self.text(n)?
            }
            b'z' | b'Z' => {
                let n = self.u8()? as usize;
                self.text(n)?
            }
            b'(' => {
                let n = self.u32()? as usize;
                Obj::Tuple(self.items(n, depth)?.into())
            }
            b')' => {
                let n = self.u8()? as usize;
                Obj::Tuple(self.items(n, depth)?.into())
            }
            b'[' | b'<' | b'>' => {
                let n = self.u32()? as usize;
                self.items(n, depth)?;
                Obj::Other
            }
            b'{' => {
                loop {
                    if matches!(self.object(depth + 1)?, Obj::Null) {
                        break;
                    }
                    self.object(depth + 1)?;
                }
                Obj::Other
            }
            b'r' => {
                let i = self.u32()? as usize;
                self.refs
                    .get(i)
                    .cloned()
                    .ok_or(PycError::Malformed("a reference to no object"))?
            }
            b'c' => self.code(depth)?,
            _ => return Err(PycError::Malformed("an unknown object type")),
        };
        if let Some(i) = slot {
            self.refs[i] = obj.clone();
        }
        Ok(obj)
    }

    /// A code object: its bytecode, constants and names kept, the rest read past.
    fn code(&mut self, depth: usize) -> Result<Obj, PycError> {
        // argcount, posonlyargcount, kwonlyargcount, [nlocals,] stacksize, flags
        self.take(if self.new_code { 5 * 4 } else { 6 * 4 })?;
        let code = match self.object(depth + 1)? {
            Obj::Bytes(b) => b,
            _ => return Err(PycError::Malformed("a code object without bytecode")),
        };
        let consts = match self.object(depth + 1)? {
            Obj::Tuple(t) => t,
            _ => return Err(PycError::Malformed("a code object without constants")),
        };
        let names = match self.object(depth + 1)? {
            Obj::Tuple(t) => t,
            _ => return Err(PycError::Malformed("a code object without names")),
        };
        if self.new_code {
            // localsplusnames, localspluskinds, filename, name, qualname
            for _ in 0..5 {
                self.object(depth + 1)?;
            }
            self.take(4)?; // firstlineno
            // linetable, exceptiontable
            for _ in 0..2 {
                self.object(depth + 1)?;
            }
        } else {
            // varnames, freevars, cellvars, filename, name
            for _ in 0..5 {
                self.object(depth + 1)?;
            }
            self.take(4)?; // firstlineno
            self.object(depth + 1)?; // lnotab / linetable
        }
        Ok(Obj::Code(Rc::new(Code {
            code,
            consts,
            names,
        })))
    }
}

/// The `IMPORT_NAME`s of `code`'s own instructions (not of functions it defines): each
/// follows `LOAD_CONST level` and `LOAD_CONST fromlist`.
fn scan(code: &Code) -> Vec<Import> {
    let mut out: Vec<Import> = Vec::new();
    let mut ext: u32 = 0;
    // The arguments of the last two LOAD_CONSTs right before this instruction.
    let mut consts: [Option<u32>; 2] = [None, None];
    for ins in code.code.chunks_exact(2) {
        let (op, arg) = (ins[0], (ext << 8) | u32::from(ins[1]));
        ext = 0;
        match op {
            OP_EXTENDED_ARG => {
                ext = arg;
                continue;
            }
            OP_CACHE => continue,
            OP_LOAD_CONST => {
                consts = [consts[1], Some(arg)];
                continue;
            }
            OP_IMPORT_NAME => {
                let name = match code.names.get(arg as usize) {
                    Some(Obj::Str(s)) => s.to_string(),
                    _ => continue,
                };
                let level = match consts[0].and_then(|i| code.consts.get(i as usize)) {
                    Some(Obj::Int(l)) if (0..=64).contains(l) => *l as u32,
                    _ => 0,
                };
                let names = match consts[1].and_then(|i| code.consts.get(i as usize)) {
                    Some(Obj::Tuple(t)) => t
                        .iter()
                        .filter_map(|o| match o {
                            Obj::Str(s) if &**s != "*" => Some(s.to_string()),
                            _ => None,
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                let import = Import {
                    module: name,
                    level,
                    names,
                };
                if !out.contains(&import) {
                    out.push(import);
                    if out.len() == MAX_IMPORTS {
                        break;
                    }
                }
            }
            _ => {}
        }
        consts = [None, None];
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;

    /// `python3.11 -c 'import py_compile; py_compile.compile("m.py", "m.pyc")'` of
    /// `m.py`:
    ///
    /// ```python
    /// import os, json.decoder
    /// from . import sibling
    /// from ..up import a, b
    /// try:
    ///     import optional_thing
    /// except ImportError:
    ///     pass
    /// def later():
    ///     import never_at_import_time
    /// ```
    const M_311: &str = include_str!("pyc_fixture_311.hex");

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// An [`Import`] to compare with (here and in `imports`' tests).
    pub(crate) fn imp(module: &str, level: u32, names: &[&str]) -> Import {
        Import {
            module: module.into(),
            level,
            names: names.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn module_level_imports_of_a_311_file_in_order() {
        let got = imports(&unhex(M_311)).unwrap();
        assert_eq!(
            got,
            vec![
                imp("os", 0, &[]),
                imp("json.decoder", 0, &[]),
                imp("", 1, &["sibling"]),
                imp("up", 2, &["a", "b"]),
                imp("optional_thing", 0, &[]),
            ]
        );
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let data = unhex(M_311);
        for n in 0..data.len() {
            assert!(imports(&data[..n]).is_err(), "{n} bytes");
        }
    }

    #[test]
    fn other_versions_and_other_files_are_refused() {
        let mut data = unhex(M_311);
        data[..2].copy_from_slice(&3571u16.to_le_bytes()); // 3.13
        assert_eq!(imports(&data), Err(PycError::NotPyc));
        assert_eq!(imports(b"\x7fELF\x02\x01\x01"), Err(PycError::NotPyc));
        assert_eq!(imports(b""), Err(PycError::NotPyc));
    }

    #[test]
    fn claimed_sizes_beyond_the_bytes_allocate_nothing() {
        let mut data = unhex(M_311)[..HEADER].to_vec();
        // a tuple claiming 2^32-1 items, a string claiming 4 GiB, a deep nest
        for body in [
            &b"(\xff\xff\xff\xff"[..],
            &b"s\xff\xff\xff\xff"[..],
            &[b'('; 200][..],
        ] {
            data.truncate(HEADER);
            data.extend_from_slice(body);
            assert!(imports(&data).is_err());
        }
        let mut deep = unhex(M_311)[..HEADER].to_vec();
        for _ in 0..(MAX_DEPTH + 2) {
            deep.extend_from_slice(b")\x01");
        }
        deep.push(b'N');
        assert_eq!(imports(&deep), Err(PycError::Bounds));
    }
}
