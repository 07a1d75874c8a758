//! `ragkv`: the command-line entry point. Thin: parses configuration and calls the libraries.

mod config;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use config::Config;

#[derive(Debug, Parser)]
#[command(name = "ragkv", version, about = "RAG with materialized KV caches")]
struct Cli {
    /// Configuration file (default: ./ragkv.toml if present).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Data directory (overrides `data_dir`).
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the KV store's counters and space accounting as JSON.
    Stats,
    /// Reclaim space: rewrite every segment holding deleted records.
    Gc,
    /// Read and verify every stored KV block; exits non-zero if any fails.
    Verify,
    /// Print the effective configuration (defaults, file, environment, flags) as TOML.
    Config,
    /// Benchmarks that print JSON lines comparing ragkv with a baseline.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The KV store vs file-per-block storage and RocksDB BlobDB.
    Kvstore(bench::kvstore::Args),
    /// The model runtime vs candle-transformers' stock Llama on the same weights.
    Model(bench::model::Args),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RAGKV_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let mut config = Config::load(cli.config.as_deref())?;
    if let Some(d) = cli.data_dir {
        config.data_dir = d;
    }
    config.validate()?;
    match cli.command {
        Command::Config => {
            print!("{}", toml::to_string_pretty(&config)?);
        }
        Command::Stats => {
            let store = open_store(&config)?;
            let s = store.stats();
            let segments: Vec<_> = s
                .segments
                .iter()
                .map(|g| {
                    serde_json::json!({"id": g.id, "bytes": g.len, "live_bytes": g.live_bytes,
                        "dead_bytes": g.dead_bytes, "live_records": g.live_records, "sealed": g.sealed})
                })
                .collect();
            let out = serde_json::json!({
                "entries": s.entries, "live_bytes": s.live_bytes, "dead_bytes": s.dead_bytes,
                "namespaces": s.namespaces, "segments": segments,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        Command::Gc => {
            let store = open_store(&config)?;
            let r = store.compact_all()?;
            println!(
                "{}",
                serde_json::json!({"segments_rewritten": r.segments_rewritten,
                    "segments_removed": r.segments_removed, "bytes_copied": r.bytes_copied,
                    "bytes_reclaimed": r.bytes_reclaimed, "corrupt_dropped": r.corrupt_dropped})
            );
        }
        Command::Verify => {
            let store = open_store(&config)?;
            let r = store.verify()?;
            for (key, e) in &r.failures {
                eprintln!("block {}: {e}", hex(key));
            }
            println!(
                "{}",
                serde_json::json!({"entries": r.entries, "ok": r.ok, "failed": r.failures.len()})
            );
            if !r.failures.is_empty() {
                anyhow::bail!(
                    "{} of {} blocks failed verification",
                    r.failures.len(),
                    r.entries
                );
            }
        }
        Command::Bench { which } => {
            let lines = match which {
                BenchCommand::Kvstore(args) => bench::kvstore::run(&args)?,
                BenchCommand::Model(args) => bench::model::run(&args)?,
            };
            for line in lines {
                println!("{}", serde_json::to_string(&line)?);
            }
        }
    }
    Ok(())
}

fn open_store(config: &Config) -> Result<kvstore::Store> {
    let dir = config.kv_dir();
    kvstore::Store::open(&dir, config.store_options()?)
        .with_context(|| format!("opening the KV store in {}", dir.display()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
