//! `ferry status` (being written).

use anyhow::{Result, bail};

/// Arguments of `ferry status`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `ferry status`.
pub fn run(_args: Args) -> Result<()> {
    bail!("ferry status is not available in this build yet")
}
