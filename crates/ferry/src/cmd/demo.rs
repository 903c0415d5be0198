//! `ferry demo` — the README's first command: pack a directory of this machine into an
//! image that is lazy-loadable from birth, then read a few of its files back through the
//! index and report how little of the layer each read needed.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail};
use ferry_index::entry::EntryKind;
use ferry_index::image::open_layout_image;
use ferry_oci::OciLayout;
use sha2::{Digest as _, Sha256};

use super::{cat::counter, human};

/// Arguments of `ferry demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory to build the image from (the embedded default is this machine's Python
    /// standard library).
    #[arg(long, default_value = "/usr/lib/python3.11")]
    pub dir: PathBuf,
    /// Where to write the image layout.
    #[arg(long, default_value = "ferry-demo/image")]
    pub out: PathBuf,
    /// Files (relative to DIR) to read lazily; default: a few small ones and the largest.
    #[arg(long)]
    pub read: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    if !args.dir.is_dir() {
        bail!(
            "{} does not exist; pass --dir with a directory to pack",
            args.dir.display()
        );
    }
    let image = format!("oci:{}:demo", args.out.display());
    println!(
        "== 1. pack {} into {image} (gzip layer + ferry index, compressed on all cores)",
        args.dir.display()
    );
    super::pack::run(super::pack::Args {
        dir: args.dir.clone(),
        dest: image.clone(),
        span: ferry_index::pack::DEFAULT_SPAN,
        level: ferry_index::pack::PackOptions::default().level,
        threads: 0,
    })?;

    println!("\n== 2. inspect");
    super::inspect::run(super::inspect::Args {
        image: image.clone(),
        json: false,
        platform: None,
        registry: Default::default(),
    })?;

    println!("\n== 3. read files lazily through the index (each verified against the source)");
    let layout = OciLayout::open(&args.out)?;
    let (_, manifest) = layout.image_manifest("demo")?;
    let layer_size: u64 = manifest.layers().iter().map(|l| l.size()).sum();
    let total = Arc::new(AtomicU64::new(0));
    let (merged, _) = open_layout_image(&layout, "demo", &counter(total.clone()))?;
    let mut picks = args.read.clone();
    if picks.is_empty() {
        let files: Vec<_> = merged.layers()[0]
            .entries()
            .iter()
            .filter(|e| e.kind == EntryKind::File)
            .collect();
        for want in ["os.py", "json/decoder.py", "this.py"] {
            if files.iter().any(|e| e.path == want) {
                picks.push(want.to_string());
            }
        }
        if let Some(big) = files.iter().max_by_key(|e| e.size) {
            picks.push(big.path.clone());
        }
    }
    println!(
        "{:<48} {:>10} {:>14} {:>9}",
        "file", "size", "layer bytes", "of layer"
    );
    let mut read_sum = 0u64;
    for p in &picks {
        let before = total.load(Ordering::Relaxed);
        let mut got = Vec::new();
        merged
            .cat(p, &mut got)
            .with_context(|| format!("reading {p}"))?;
        let used = total.load(Ordering::Relaxed) - before;
        read_sum += used;
        let mut original = Vec::new();
        std::fs::File::open(args.dir.join(p))?.read_to_end(&mut original)?;
        if Sha256::digest(&got) != Sha256::digest(&original) {
            bail!("{p}: bytes read through ferry differ from the file on disk");
        }
        println!(
            "{:<48} {:>10} {:>14} {:>8.2}%",
            p,
            human(got.len() as u64),
            human(used),
            100.0 * used as f64 / layer_size.max(1) as f64
        );
    }
    println!(
        "\nread {} files ({} of compressed layer data) out of a {} layer: {:.2}%; every byte matched the source",
        picks.len(),
        human(read_sum),
        human(layer_size),
        100.0 * read_sum as f64 / layer_size.max(1) as f64
    );
    Ok(())
}
