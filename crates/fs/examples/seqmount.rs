//! Benchmark harness: mounts an OCI layout image through ferry-fs with a chunk store
//! and, optionally, the file cache, until SIGINT/SIGTERM. Used by `bench/seqread.sh`
//! to compare the decompress path, the cached-file pread path and FUSE passthrough on
//! the same mount code the daemon uses; not a user-facing command.
//!
//! ```text
//! seqmount oci:DIR:TAG MOUNTPOINT --store DIR [--file-cache off|pread|passthrough]
//!          [--stats FILE]
//! ```
//! `--stats FILE` is rewritten about every 200 ms with the file cache's counters and
//! the mount's FUSE read request count (JSON).

use std::path::PathBuf;
use std::sync::Arc;

use ferry_fs::{
    FerryFs, FetchConfig, FileCache, FileCacheConfig, ImageSource, MountOptions, MountedImage, View,
};
use ferry_store::{Store, StoreOptions};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Args {
    image: String,
    mountpoint: PathBuf,
    store: PathBuf,
    mode: String,
    stats: Option<PathBuf>,
}

fn parse() -> Res<Args> {
    let mut positional = Vec::new();
    let mut store = None;
    let mut mode = "passthrough".to_string();
    let mut stats = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--store" => store = it.next().map(PathBuf::from),
            "--file-cache" => mode = it.next().ok_or("--file-cache needs a value")?,
            "--stats" => stats = it.next().map(PathBuf::from),
            _ => positional.push(a),
        }
    }
    let [image, mountpoint] = <[String; 2]>::try_from(positional)
        .map_err(|_| "usage: seqmount oci:DIR:TAG MOUNTPOINT --store DIR [--file-cache off|pread|passthrough] [--stats FILE]")?;
    if !matches!(mode.as_str(), "off" | "pread" | "passthrough") {
        return Err(format!("--file-cache {mode}: off, pread or passthrough").into());
    }
    Ok(Args {
        image,
        mountpoint: PathBuf::from(mountpoint),
        store: store.ok_or("--store DIR is required")?,
        mode,
        stats,
    })
}

fn main() -> Res<()> {
    ferry_fs::block_stop_signals()?;
    let args = parse()?;
    let (dir, tag) = match args
        .image
        .strip_prefix("oci:")
        .and_then(|r| r.rsplit_once(':'))
    {
        Some((d, t)) => (PathBuf::from(d), t.to_string()),
        None => return Err("the image must be oci:DIR:TAG".into()),
    };
    let store = Arc::new(Store::open_with(
        &args.store,
        StoreOptions {
            max_bytes: Some(8 << 30),
            ..StoreOptions::default()
        },
    )?);
    let source = ImageSource::from_layout(&dir, &tag)?;
    let image = Arc::new(MountedImage::new(
        source,
        Some(store.clone()),
        FetchConfig::default(),
        &View::Merged,
    )?);
    let cache = match args.mode.as_str() {
        "off" => None,
        mode => {
            let config = FileCacheConfig {
                max_bytes: 4 << 30,
                passthrough: mode == "passthrough",
                ..FileCacheConfig::default()
            };
            Some(Arc::new(FileCache::open(&config, Some(store))?))
        }
    };
    let fs = FerryFs::with_file_cache(image, cache.clone());
    let probe = fs.clone();
    let stats_path = args.stats.clone();
    let publish = move || {
        let Some(path) = &stats_path else { return };
        let snap = cache.as_ref().map(|c| c.snapshot()).unwrap_or_default();
        let body = serde_json::json!({
            "read_requests": probe.read_requests(),
            "passthrough_active": probe.passthrough_active(),
            "file_cache": snap,
        });
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, body.to_string()).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    };
    let shown = args.mountpoint.display().to_string();
    ferry_fs::mount_foreground(
        fs,
        &args.mountpoint,
        &MountOptions::default(),
        || eprintln!("seqmount: mounted at {shown}"),
        publish,
    )?;
    Ok(())
}
