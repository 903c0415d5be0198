//! Standard output of the commands that print results. A reader that goes away
//! (`ferry index … | head`) ends the command quietly, with success, instead of a panic
//! (`println!`) or an error message. SIGPIPE stays ignored, as Rust leaves it: the network
//! code writes with `writev`, and a peer that hangs up must be an error it handles, not a
//! signal that kills the process.

use std::fmt;
use std::io::{self, Write};

/// The error a command ends with when its standard output was closed; `main` exits
/// quietly on it.
#[derive(Debug)]
pub struct StdoutClosed;

impl fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// What a failed write to standard output becomes: [`StdoutClosed`] for a reader gone
/// away, the error itself otherwise.
pub fn stdout_error(e: io::Error) -> anyhow::Error {
    if e.kind() == io::ErrorKind::BrokenPipe {
        anyhow::Error::new(StdoutClosed)
    } else {
        anyhow::Error::new(e).context("writing to standard output")
    }
}

/// Writes one line to standard output.
pub fn line(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .map_err(stdout_error)
}

/// True when `e` is (or was caused by) standard output being closed.
pub fn is_stdout_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<StdoutClosed>())
}

/// `println!` for commands: writes a line to standard output and returns from the
/// enclosing function with [`StdoutClosed`] when the reader has gone away.
macro_rules! outln {
    () => {
        $crate::out::line(format_args!(""))?
    };
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))?
    };
}
pub(crate) use outln;
