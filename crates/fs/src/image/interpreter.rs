//! Following a Python interpreter's imports from the moment it starts, for an image
//! without a trace: when the first read of an interpreter's binary
//! (`PREFIX/bin/python3.X`) waited — the kernel loading it for an `exec` — the modules
//! every start of that interpreter imports from files (`encodings` and the codecs it
//! loads, Debian's `sitecustomize`; before 3.11 also `site`, `os` and the rest of its
//! start that later versions freeze into the binary) are followed at once, and, once the
//! `exec` has replaced the process's command line, what the command line names: the
//! code of `-c`, the module of `-m`, or the imports of the script it runs (read from the
//! image). Both go through [`crate::image::imports`]: resolved in the image, fetched in
//! one request per layer, kept in the small-file pack and followed in turn.
//!
//! Why: following a module's imports when the interpreter reads it
//! ([`crate::image::imports`]) is one round trip behind the interpreter at every
//! level of a package's imports, and starts only when the first module is read. The
//! interpreter's own start (its libraries, locale, time zone, codecs) takes several
//! round trips; started with the binary, the program's first modules travel meanwhile,
//! and a command that imports several packages has them all on the way at once
//! instead of one after the other (a pandas + numpy + scipy start waited for
//! `encodings`, `sitecustomize`, `pandas/__init__` and `__future__` in turn, and for
//! `scipy.linalg`'s modules only once pandas was done).
//!
//! The command line is the reading process's (`/proc/PID/cmdline`, the process the
//! kernel names in the FUSE request, in the daemon's PID namespace), read once per
//! interpreter binary per mount, bounded, and used for nothing but these guesses: a
//! command line that is not an interpreter's, or a PID the daemon cannot see (a daemon
//! in a PID namespace of its own), only leaves the interpreter's start followed. The
//! scanner of source imports ([`source_imports`]) is line-based and bounded: it finds
//! `import a.b, c` and `from a import b` statements (any indentation, `;`-separated,
//! comments dropped) and misses what a tokenizer would find (imports split over lines,
//! inside strings); a wrong guess costs bytes within the budget of files' rests, a
//! missed one the wait the interpreter would have had anyway.

use std::io::Read;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ferry_index::merged::Location;

use crate::image::MountedImage;
use crate::image::imports::{Module, follow_resolved};
use crate::image::pyc::Import;

/// Most bytes of a command line read (Linux allows 2 MiB of arguments; a Python
/// command's are far fewer).
const MAX_COMMAND_LINE: u64 = 64 << 10;
/// Most bytes of a script read for its imports.
const MAX_SCRIPT_BYTES: u64 = 256 << 10;
/// Most imports taken from one command line or script.
const MAX_SOURCE_IMPORTS: usize = 256;
/// How long the command line is watched for the `exec` that loads the interpreter to
/// replace it (it does in microseconds once the binary's header is read; a process
/// that never becomes the interpreter costs this much of a helper thread).
const EXEC_WAIT: Duration = Duration::from_millis(200);

/// How a Python command line runs its program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Run {
    /// `-c CODE`.
    Code(String),
    /// `-m MODULE`.
    Module(String),
    /// A script's path (as given: relative to the working directory, or absolute).
    Script(String),
    /// Standard input or an interactive prompt.
    Interactive,
}

/// What a Python interpreter's command line says about its start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CommandLine {
    /// Whether `site` runs (no `-S`).
    pub(crate) site: bool,
    /// What it runs.
    pub(crate) run: Run,
}

/// Parses an interpreter's arguments (`args[0]` its name, `python…`); `None` when
/// `args[0]` is not a Python interpreter's name.
pub(crate) fn command_line(args: &[String]) -> Option<CommandLine> {
    let name = args.first()?.rsplit('/').next()?;
    if !name.starts_with("python") {
        return None;
    }
    let mut site = true;
    let mut i = 1;
    let done = |site, run| Some(CommandLine { site, run });
    while let Some(arg) = args.get(i) {
        if arg == "-" {
            return done(site, Run::Interactive);
        }
        if arg == "--" {
            return match args.get(i + 1) {
                Some(s) => done(site, Run::Script(s.clone())),
                None => done(site, Run::Interactive),
            };
        }
        if let Some(long) = arg.strip_prefix("--") {
            // The one long option that takes a value as the next argument.
            i += if long == "check-hash-based-pycs" {
                2
            } else {
                1
            };
            continue;
        }
        let Some(flags) = arg.strip_prefix('-') else {
            return done(site, Run::Script(arg.clone()));
        };
        // A cluster of one-letter options (`-Bc CODE`, `-mpkg`): `c` and `m` end the
        // options with their value, `W` and `X` take one.
        let mut skip_next = false;
        for (at, flag) in flags.char_indices() {
            let rest = &flags[at + flag.len_utf8()..];
            let value = || {
                if rest.is_empty() {
                    args.get(i + 1).cloned()
                } else {
                    Some(rest.to_string())
                }
            };
            match flag {
                'c' => return done(site, Run::Code(value()?)),
                'm' => return done(site, Run::Module(value()?)),
                'W' | 'X' => {
                    skip_next = rest.is_empty();
                    break;
                }
                'S' => site = false,
                _ => {}
            }
        }
        i += if skip_next { 2 } else { 1 };
    }
    done(site, Run::Interactive)
}

/// The imports of Python source `code`, as a line-based scan finds them (see the
/// module's doc), absolute ones only, at most [`MAX_SOURCE_IMPORTS`].
pub(crate) fn source_imports(code: &str) -> Vec<Import> {
    let mut out = Vec::new();
    let dotted = |s: &str| {
        let s = s.trim();
        (!s.is_empty()
            && s.split('.')
                .all(|p| !p.is_empty() && p.chars().all(|c| c == '_' || c.is_alphanumeric())))
        .then(|| s.to_string())
    };
    // `a as b` → `a`; `(a,` → `a`.
    let first_word = |s: &str| {
        s.trim()
            .trim_matches(|c| c == '(' || c == ')' || c == '\\')
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string()
    };
    for line in code.lines() {
        let line = line.split('#').next().unwrap_or("");
        for statement in line.split(';') {
            let s = statement.trim();
            if let Some(rest) = s.strip_prefix("import ") {
                for part in rest.split(',') {
                    if let Some(module) = dotted(&first_word(part)) {
                        out.push(Import {
                            module,
                            level: 0,
                            names: Vec::new(),
                        });
                    }
                }
            } else if let Some(rest) = s.strip_prefix("from ")
                && let Some((module, names)) = rest.split_once(" import ")
                && let Some(module) = dotted(module)
            {
                let names = names
                    .split(',')
                    .map(first_word)
                    .filter(|n| !n.is_empty() && n != "*")
                    .collect();
                out.push(Import {
                    module,
                    level: 0,
                    names,
                });
            }
            if out.len() >= MAX_SOURCE_IMPORTS {
                out.truncate(MAX_SOURCE_IMPORTS);
                return out;
            }
        }
    }
    out
}

/// What an interpreter of minor version `minor` imports from files at every start,
/// before the program's own code runs (`site`: unless `-S`): the `encodings` package
/// with its alias table and the UTF-8 codec, and the `sitecustomize` a distribution
/// may ship; before 3.11, which froze them into the binary, also `site` and the
/// modules it imports.
pub(crate) fn startup_imports(minor: u32, site: bool) -> Vec<Import> {
    let module = |m: &str, names: &[&str]| Import {
        module: m.to_string(),
        level: 0,
        names: names.iter().map(|n| n.to_string()).collect(),
    };
    let mut out = vec![module("encodings", &["aliases", "utf_8"])];
    if minor < 11 {
        out.push(module("codecs", &[]));
        out.push(module("io", &[]));
        out.push(module("abc", &[]));
    }
    if site {
        if minor < 11 {
            for m in [
                "site",
                "os",
                "stat",
                "posixpath",
                "genericpath",
                "_collections_abc",
                "_sitebuiltins",
            ] {
                out.push(module(m, &[]));
            }
        }
        out.push(module("sitecustomize", &[]));
    }
    out
}

/// Whether `path` (absolute) is an interpreter's binary that [`Module::interpreter`]
/// knows.
pub(crate) fn is_interpreter(path: &str) -> bool {
    Module::interpreter(path, None).is_some()
}

/// The command line of process `pid` (`/proc/PID/cmdline`, at most
/// [`MAX_COMMAND_LINE`] bytes); `None` when it cannot be read.
fn process_command_line(pid: u32) -> Option<Vec<String>> {
    let mut bytes = Vec::new();
    std::fs::File::open(format!("/proc/{pid}/cmdline"))
        .ok()?
        .take(MAX_COMMAND_LINE)
        .read_to_end(&mut bytes)
        .ok()?;
    // Each argument ends with a NUL: the last split is empty.
    let mut args: Vec<String> = bytes
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    if args.last().is_some_and(String::is_empty) {
        args.pop();
    }
    Some(args)
}

/// The command line of `pid` once it is an interpreter's ([`command_line`]), watched
/// for at most [`EXEC_WAIT`] while the `exec` that loads the interpreter completes.
fn interpreter_command_line(pid: u32) -> Option<CommandLine> {
    let started = Instant::now();
    loop {
        let args = process_command_line(pid)?;
        if let Some(line) = command_line(&args) {
            return Some(line);
        }
        if started.elapsed() >= EXEC_WAIT {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

impl MountedImage {
    /// After the first read of the interpreter binary at `loc` (`path`) waited, read by
    /// process `pid` (0: unknown): its start's imports are followed now, and its
    /// command line's once the `exec` is done (once per binary per mount).
    pub(crate) fn follow_interpreter(self: &Arc<Self>, loc: Location, path: &str, pid: u32) {
        if !self.nearby.follows_headers() || !self.nearby.first_interpreter((loc.layer, loc.entry))
        {
            return;
        }
        let Some(module) = Module::interpreter(path, None) else {
            return;
        };
        let image = Arc::downgrade(self);
        let binary = path.to_string();
        {
            let (image, module, binary) = (image.clone(), module.clone(), binary.clone());
            crate::image::nearby::submit_task(Box::new(move || {
                let Some(image) = image.upgrade() else {
                    return;
                };
                // `-S` is rare: `sitecustomize` is a few kilobytes.
                let imports = startup_imports(module.minor(), true);
                follow_resolved(&image, &module, &imports, &binary);
            }));
        }
        if pid == 0 {
            return;
        }
        // Watching for the exec sleeps: a thread of its own, not the fetch pool.
        let spawned = std::thread::Builder::new()
            .name("ferry-python-argv".into())
            .spawn(move || {
                if let Some(line) = interpreter_command_line(pid) {
                    follow_command_line(&image, &module, &binary, line);
                }
            });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "interpreter's command line not watched");
        }
    }
}

/// Follows what command line `line` of the interpreter `module` (`binary`) runs.
pub(crate) fn follow_command_line(
    image: &Weak<MountedImage>,
    module: &Module,
    binary: &str,
    line: CommandLine,
) {
    let Some(image) = image.upgrade() else {
        return;
    };
    let (module, imports) = match line.run {
        Run::Code(code) => (module.clone(), source_imports(&code)),
        Run::Module(name) => (
            module.clone(),
            vec![
                Import {
                    module: "runpy".into(),
                    level: 0,
                    names: Vec::new(),
                },
                Import {
                    module: name,
                    level: 0,
                    names: Vec::new(),
                },
            ],
        ),
        // A relative path is the container's working directory's, which the mount
        // does not know.
        Run::Script(script) if script.starts_with('/') => {
            let Some(source) = script_source(&image, &script) else {
                return;
            };
            let dir = script.rsplit_once('/').map_or("/", |(d, _)| d);
            let dir = if dir.is_empty() { "/" } else { dir };
            let Some(module) = Module::interpreter(binary, Some(dir)) else {
                return;
            };
            (module, source_imports(&source))
        }
        Run::Script(_) | Run::Interactive => return,
    };
    tracing::debug!(
        binary,
        imports = imports.len(),
        "nearby: an interpreter's command line followed"
    );
    follow_resolved(&image, &module, &imports, binary);
}

/// The text of the script at `path` in the image (its first [`MAX_SCRIPT_BYTES`]),
/// fetched as a guess of a file's rest (the interpreter reads it next).
fn script_source(image: &MountedImage, path: &str) -> Option<String> {
    let at = image.regular_file(path)?;
    let size = image.image.entry(at)?.size.min(MAX_SCRIPT_BYTES);
    image.make_local(at, 0, size);
    let layer = image.image.layers().get(at.layer)?;
    let mut data = vec![0u8; usize::try_from(size).ok()?];
    let n = crate::device::in_background(|| layer.read_at(at.entry, 0, &mut data)).ok()?;
    data.truncate(n);
    Some(String::from_utf8_lossy(&data).into_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::image::pyc::tests::imp;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_command_line_says_what_the_interpreter_runs() {
        let code = "import pandas";
        for (a, want) in [
            (
                args(&["python3", "-c", code]),
                Some((true, Run::Code(code.into()))),
            ),
            (
                args(&["/usr/bin/python3.11", "-BS", "-c", code]),
                Some((false, Run::Code(code.into()))),
            ),
            (
                args(&["python3", "-Bc", code]),
                Some((true, Run::Code(code.into()))),
            ),
            (
                args(&["python", "-W", "ignore", "-X", "dev", "-mhttp.server"]),
                Some((true, Run::Module("http.server".into()))),
            ),
            (
                args(&["python3", "-u", "/app/main.py", "-c", "x"]),
                Some((true, Run::Script("/app/main.py".into()))),
            ),
            (
                args(&["python3", "--check-hash-based-pycs", "never", "app.py"]),
                Some((true, Run::Script("app.py".into()))),
            ),
            (
                args(&["python3", "--", "-weird.py"]),
                Some((true, Run::Script("-weird.py".into()))),
            ),
            (args(&["python3"]), Some((true, Run::Interactive))),
            (args(&["python3", "-"]), Some((true, Run::Interactive))),
            // `-c` without its code: not a start that runs
            (args(&["python3", "-c"]), None),
            (args(&["/bin/sh", "-c", "python3 -c 'import x'"]), None),
            (Vec::new(), None),
        ] {
            let got = command_line(&a).map(|l| (l.site, l.run));
            assert_eq!(got, want, "{a:?}");
        }
    }

    #[test]
    fn source_imports_are_found_line_by_line() {
        let code = "import pandas, numpy as np, scipy.linalg; print('ready')\n\
                    from os.path import join, (dirname)  # a comment: import nothing\n\
                    \x20   import json\n\
                    from . import sibling\n\
                    from x import *\n\
                    x = 'import'\n\
                    import ../etc\n";
        assert_eq!(
            source_imports(code),
            vec![
                imp("pandas", 0, &[]),
                imp("numpy", 0, &[]),
                imp("scipy.linalg", 0, &[]),
                imp("os.path", 0, &["join", "dirname"]),
                imp("json", 0, &[]),
                imp("x", 0, &[]),
            ]
        );
        let many = "import a\n".repeat(10_000);
        assert_eq!(source_imports(&many).len(), MAX_SOURCE_IMPORTS);
        assert!(source_imports("\u{feff}\0\u{ffff}import").is_empty());
    }

    #[test]
    fn an_interpreter_knows_its_version_and_directories() {
        let m = Module::interpreter("/usr/bin/python3.11", None).unwrap();
        assert_eq!(m.minor(), 11);
        let v = Module::interpreter("/opt/venv/bin/python3.12", Some("/app")).unwrap();
        assert_eq!(v.minor(), 12);
        assert!(is_interpreter("/usr/local/bin/python3.9"));
        for not in [
            "/usr/bin/python3",
            "/usr/bin/python3.11-config",
            "/usr/bin/python2.7",
            "python3.11",
            "/usr/bin/python3.",
        ] {
            assert!(!is_interpreter(not), "{not}");
        }
        // 3.11 freezes `site` and its modules; 3.10 reads them from files
        let names = |v: Vec<Import>| v.into_iter().map(|i| i.module).collect::<Vec<_>>();
        assert_eq!(
            names(startup_imports(11, true)),
            ["encodings", "sitecustomize"]
        );
        assert_eq!(names(startup_imports(11, false)), ["encodings"]);
        let old = names(startup_imports(10, true));
        assert!(old.contains(&"site".to_string()) && old.contains(&"codecs".to_string()));
    }

    #[test]
    fn this_process_command_line_is_read() {
        let own = process_command_line(std::process::id()).unwrap();
        assert_eq!(own, std::env::args().collect::<Vec<_>>());
        assert!(process_command_line(u32::MAX).is_none());
    }
}
