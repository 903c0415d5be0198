//! `ferry daemon` (being written).

use anyhow::{Result, bail};

/// Arguments of `ferry daemon`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `ferry daemon`.
pub fn run(_args: Args) -> Result<()> {
    bail!("ferry daemon is not available in this build yet")
}
