//! `ferry registry serve|gc|config`: run the OCI registry (or pull-through cache) and
//! maintain its storage. The registry itself lives in `ferry_registry::server`; this file
//! only turns flags and the config file into a `server::Config`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use ferry_registry::server::{self, Config};

/// Arguments of `ferry registry`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: RegistryCommand,
}

#[derive(Debug, clap::Subcommand)]
enum RegistryCommand {
    /// Serve the OCI distribution API (default 127.0.0.1:5000, storage ./ferry-data).
    Serve(ServeArgs),
    /// Delete blobs and manifests no tag or manifest references any more.
    Gc(GcArgs),
    /// Print the effective configuration as TOML (a starting point for --config).
    Config(ConfigArgs),
    /// Add a user to an htpasswd file (bcrypt), or change their password. The password is
    /// read from stdin (one line), so it never shows in the process list.
    Passwd(PasswdArgs),
}

#[derive(Debug, clap::Args)]
struct PasswdArgs {
    /// The htpasswd file (created with mode 0600 if absent; rewritten atomically).
    #[arg(long, default_value = "htpasswd", value_name = "FILE")]
    file: PathBuf,
    /// bcrypt cost (4–31); each +1 doubles the work of a login.
    #[arg(long, default_value_t = ferry_registry::auth::htpasswd::DEFAULT_BCRYPT_COST)]
    cost: u32,
    /// The user name.
    user: String,
}

/// Where the configuration comes from.
#[derive(Debug, clap::Args)]
struct ConfigArgs {
    /// TOML configuration file (all sections optional).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Store under this directory (filesystem storage), overriding the config.
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Listen address, overriding the config.
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<SocketAddr>,
}

#[derive(Debug, clap::Args)]
struct GcArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Report what would be deleted without deleting anything.
    #[arg(long)]
    dry_run: bool,
    /// Keep anything written more recently than this (e.g. 30m, 1h, 2d), so pushes in
    /// progress are safe. Defaults to the config's gc.grace (1h).
    #[arg(long, value_name = "DURATION", value_parser = ferry_oci::units::parse_duration)]
    grace: Option<Duration>,
    /// Also remove manifests no tag reaches (and what only they reference).
    #[arg(long)]
    delete_untagged: bool,
}

fn load_config(args: &ConfigArgs) -> Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(root) = &args.root {
        config.set_root(root.clone());
    }
    Ok(config)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("ferry-registry")
        .build()
        .context("starting the async runtime")
}

pub fn run(args: Args) -> Result<()> {
    match args.command {
        RegistryCommand::Serve(a) => serve(a),
        RegistryCommand::Gc(a) => gc(a),
        RegistryCommand::Passwd(a) => passwd(a),
        RegistryCommand::Config(a) => {
            // Secrets never reach a terminal, a ticket or a log through this command.
            let config = load_config(&a)?.redacted();
            print!(
                "{}",
                toml::to_string_pretty(&config).context("encoding the configuration")?
            );
            Ok(())
        }
    }
}

fn serve(args: ServeArgs) -> Result<()> {
    let mut config = load_config(&args.config)?;
    if let Some(addr) = args.addr {
        config.addr = addr;
    }
    runtime()?.block_on(async move {
        let server = server::Server::bind(&config)
            .await
            .context("starting the registry")?;
        let addr = server.local_addr()?;
        let scheme = if server.is_tls() { "https" } else { "http" };
        let mode = match &config.upstream {
            Some(_) => "pull-through cache",
            None => "registry",
        };
        println!(
            "ferry {mode} listening on {scheme}://{addr} (storage: {})",
            storage_summary(&config)
        );
        server
            .run(server::listener::shutdown_signal())
            .await
            .context("serving")
    })
}

fn storage_summary(config: &Config) -> String {
    use ferry_registry::storage::StorageConfig;
    match &config.storage {
        StorageConfig::Filesystem { root } => root.display().to_string(),
        StorageConfig::S3(_) => "s3".to_string(),
        StorageConfig::Memory => "memory".to_string(),
    }
}

fn gc(args: GcArgs) -> Result<()> {
    let mut config = load_config(&args.config)?;
    if let Some(grace) = args.grace {
        config.gc.grace = grace;
    }
    config.gc.delete_untagged |= args.delete_untagged;
    let opts = config.gc.options(args.dry_run);
    runtime()?.block_on(async move {
        let storage = ferry_registry::storage::open(&config.storage)
            .await
            .context("opening storage")?;
        let r = ferry_registry::storage::gc::collect(&*storage, &opts)
            .await
            .context("garbage collection")?;
        let verb = if opts.dry_run { "would remove" } else { "removed" };
        println!(
            "{} repositories: {verb} {} manifests, {} blob links, {} blobs ({} bytes), {} stale uploads; kept {} young items, {} pinned by pushes",
            r.repositories,
            r.manifests_deleted.len(),
            r.blob_links_removed,
            r.blobs_deleted,
            r.bytes_freed,
            r.uploads_removed,
            r.kept_young,
            r.kept_pinned
        );
        for (repo, digest) in &r.manifests_deleted {
            println!("  manifest {repo}@{digest}");
        }
        for p in &r.problems {
            eprintln!("ferry: warning: {p}");
        }
        Ok(())
    })
}

fn passwd(args: PasswdArgs) -> Result<()> {
    let mut password = String::new();
    std::io::stdin()
        .read_line(&mut password)
        .context("reading the password from stdin")?;
    let password = password.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        anyhow::bail!(
            "empty password: pipe it in, e.g. `echo \"$PW\" | ferry registry passwd USER`"
        );
    }
    ferry_registry::auth::set_user(&args.file, &args.user, password, args.cost)
        .with_context(|| format!("updating {}", args.file.display()))?;
    eprintln!("{}: set password for {}", args.file.display(), args.user);
    Ok(())
}
