//! `ferry trace` (being written).

use anyhow::{Result, bail};

/// Arguments of `ferry trace`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `ferry trace`.
pub fn run(_args: Args) -> Result<()> {
    bail!("ferry trace is not available in this build yet")
}
