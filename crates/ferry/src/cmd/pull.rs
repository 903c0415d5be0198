//! `ferry pull` (being written).

use anyhow::{Result, bail};

/// Arguments of `ferry pull`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `ferry pull`.
pub fn run(_args: Args) -> Result<()> {
    bail!("ferry pull is not available in this build yet")
}
