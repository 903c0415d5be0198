//! `ferry inspect IMAGE`

use anyhow::Result;

use super::{human, index::short};
use crate::out::outln;

/// Arguments of `ferry inspect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image: `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]` (only its manifest,
    /// index and the layers without one are fetched).
    pub image: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The platform to inspect from a multi-platform image (default: this machine's).
    #[arg(long, value_name = "OS/ARCH[/VARIANT]", value_parser = super::parse_platform)]
    pub platform: Option<ferry_oci::Platform>,
    #[command(flatten)]
    pub registry: super::remote::RegistryArgs,
}

pub fn run(args: Args) -> Result<()> {
    let (image, layers, manifest) =
        super::open_image(&args.image, &args.registry, args.platform.as_ref(), &|s| s)?;
    if args.json {
        let doc = serde_json::json!({
            "manifest": manifest,
            "layers": layers.iter().map(|l| serde_json::json!({
                "digest": l.descriptor.digest().to_string(),
                "mediaType": l.descriptor.media_type().to_string(),
                "size": l.descriptor.size(),
                "format": l.format,
                "entries": l.entries,
            })).collect::<Vec<_>>(),
            "mergedEntries": image.table().len(),
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    outln!("image {} manifest {manifest}", args.image);
    outln!(
        "{:<20} {:>10} {:<18} {:>8}  media type",
        "layer",
        "size",
        "format",
        "entries"
    );
    for l in &layers {
        outln!(
            "{:<20} {:>10} {:<18} {:>8}  {}",
            short(l.descriptor.digest().as_ref()),
            human(l.descriptor.size()),
            l.format,
            l.entries
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
            l.descriptor.media_type()
        );
    }
    outln!(
        "{} layers, {} paths in the merged root filesystem",
        layers.len(),
        image.table().len()
    );
    Ok(())
}
