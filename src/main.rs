//! `ragkv`: the command-line entry point. Thin: parses configuration and calls the libraries.

mod config;
mod handoff;
mod interrupt;

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
    /// Garbage collection: drop KV namespaces unused for `ingest.namespace_grace_hours` (old
    /// models), detach orphaned KV, rewrite every segment holding dead bytes. Hands the work
    /// to a running server.
    Gc,
    /// Prefill again the chunks whose KV is missing (evicted, deleted, lost), corrupt, or stale
    /// (stored under another model's namespace, or, with `ingest.context = "neighbours:N"`,
    /// `"prompt+neighbours:N"` or `"[prompt+]mean:N"`, prefilled after neighbours that changed). Idempotent; hands
    /// the work to a running server, so it is safe from cron.
    Rematerialize(RematArgs),
    /// Read and verify every stored KV block, and check the vector index against the KV
    /// store (complete documents, every point's KV present, no orphans); exits non-zero on
    /// any problem.
    Verify {
        /// Also check that every chunk is found by searching its own text.
        #[arg(long)]
        search: bool,
    },
    /// Print the effective configuration (defaults, file, environment, flags) as TOML.
    Config,
    /// Ingest documents: chunk, embed, index, and materialize their KV.
    Ingest(IngestArgs),
    /// Serve the HTTP RAG endpoint (owns the data directory while it runs).
    Serve {
        /// Listen address (overrides `serve.bind`).
        #[arg(long)]
        bind: Option<String>,
    },
    /// Delete documents: their vectors, then their KV (space returns on the next GC).
    Delete {
        /// Document ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Benchmarks that print JSON lines comparing ragkv with a baseline.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
    /// Quality evaluations that print one JSON line per configuration.
    Eval {
        #[command(subcommand)]
        which: EvalCommand,
    },
}

#[derive(Debug, Subcommand)]
enum EvalCommand {
    /// Answer F1 / exact match of each assembly strategy vs full prefill (LongBench-HotpotQA).
    Qa(bench::qa::Args),
}

#[derive(Debug, clap::Args)]
struct IngestArgs {
    /// Directories (recursive), `.jsonl` files, text files, or `-` for JSONL on stdin.
    #[arg(required = true)]
    paths: Vec<String>,
    /// eager (prefill now), lazy (at first retrieval), none (vectors only).
    #[arg(long)]
    materialize: Option<ingest::Materialize>,
    /// Delete indexed documents that the given sources no longer contain (of this shard).
    #[arg(long)]
    prune: bool,
    /// Ingest only shard I of N (`0/2`, `1/2`): documents are split by a hash of their id, so N
    /// workers given the same sources each take their own part, into one Qdrant server and one
    /// shared KV tier (`[index] url`, `[remote]`).
    #[arg(long, value_name = "I/N")]
    shard: Option<ingest::Shard>,
    /// auto, bars, lines or quiet.
    #[arg(long, default_value = "auto")]
    progress: String,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct RematArgs {
    /// Only chunks stale after a model change (migration) or a change of their neighbours.
    #[arg(long, conflicts_with = "hot")]
    stale: bool,
    /// Only chunks read at least this many times (access statistics).
    #[arg(long, value_name = "MIN_READS")]
    hot: Option<u32>,
    /// At most this many chunks, hottest first.
    #[arg(long)]
    limit: Option<usize>,
    /// List what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// auto, bars, lines or quiet.
    #[arg(long, default_value = "auto")]
    progress: String,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The KV store vs file-per-block storage and RocksDB BlobDB.
    Kvstore(bench::kvstore::Args),
    /// The model runtime vs candle-transformers' stock Llama on the same weights.
    Model(bench::model::Args),
    /// Embedding throughput, vector search latency and recall, answer recall@5.
    Retrieval(bench::retrieval::Args),
    /// The ingest pipeline vs bare prefill of the same chunks.
    Ingest(bench::ingest::Args),
    /// Time to first token with stored KV vs full recompute; loader/decode overlap.
    Ttft(bench::ttft::Args),
    /// The shared KV tier: chunk gets vs the local store and recompute; remote-only TTFT.
    Remote(bench::remote_tier::Args),
    /// Scale-out with real processes: two sharded ingest workers (one killed and restarted),
    /// two serving nodes over one Qdrant server and one bucket, a delete through one node.
    Scaleout(bench::scaleout::Args),
    /// The corpus's chunks in the embedded index and on a Qdrant server: recall@10, latency.
    Index(bench::index_server::Args),
    /// Concurrent clients against one server (status codes, latency, memory).
    Load(bench::load::Args),
    /// ragkv vs llama.cpp's llama-server on the same GGUF and prompts: TTFT, queries/s.
    Peer(bench::peer::Args),
    /// The SGLang-LSM phased workload with the adaptive compaction controller on and off.
    Compaction(bench::compaction::Args),
    /// Hit rate of each eviction policy at several budgets on a Zipf-skewed trace.
    Eviction(bench::eviction::Args),
    /// Thousands of bad requests to every route: 5xx, non-JSON errors, cross-site accepted.
    Fuzz(bench::fuzz::Args),
    /// A server under ingest, deletes, queries and maintenance, SIGKILLed and restarted for
    /// minutes; then lost, resurrected and orphaned documents and unreadable KV are counted.
    Chaos(bench::chaos::Args),
}

fn main() {
    model::pin_thread_count();
    model::tune_heap();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RAGKV_LOG")
                // Qdrant Edge warns about server-only initialization it does not need.
                .unwrap_or_else(|_| "warn,qdrant_edge::common=error".into()),
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
    model::set_kernel_path(config.kernel_path()?).context("model.kernels")?;
    match cli.command {
        Command::Config => {
            print!("{}", toml::to_string_pretty(&config.redacted())?);
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
            let namespaces: Vec<_> = store
                .namespaces()
                .iter()
                .map(|n| {
                    serde_json::json!({"id": n.id.to_hex(), "group": n.group, "bytes": n.bytes,
                        "tokens": n.tokens, "bytes_per_token": n.bytes_per_token(),
                        "codec": n.codec.name(), "layout": n.layout.to_string(),
                        "registered_ms": n.registered_ms, "active_ms": n.active_ms})
                })
                .collect();
            let out = serde_json::json!({
                "entries": s.entries, "live_bytes": s.live_bytes, "dead_bytes": s.dead_bytes,
                "namespaces": namespaces, "segments": segments,
                "quota_bytes": store.options().capacity.quota_bytes,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        Command::Gc => {
            if let Some(server) = handoff::running_server(&config) {
                eprintln!(
                    "a server is running on this data directory: asking it (http://{})",
                    server.addr
                );
                let v = handoff::admin_post(&config, server, "/v1/admin/gc", None)?;
                println!("{v}");
            } else if config.vectors_dir().exists() {
                let r = open_engine(&config)?.gc()?;
                println!("{}", serde_json::to_string(&r)?);
            } else {
                let r = open_store(&config)?.compact_all()?;
                println!(
                    "{}",
                    serde_json::json!({"segments_rewritten": r.segments_rewritten,
                        "bytes_reclaimed": r.bytes_reclaimed})
                );
            }
        }
        Command::Rematerialize(args) => return remat_cmd(&config, args),
        Command::Ingest(args) => return ingest_cmd(&config, args),
        Command::Serve { bind } => {
            if let Some(b) = bind {
                config.serve.bind = b;
                config.validate()?;
            }
            return serve_cmd(&config);
        }
        Command::Delete { ids } => {
            if let Some(server) = handoff::running_server(&config) {
                let addr = server.addr;
                for id in &ids {
                    let path = format!("/v1/documents/{}", serve::client::encode_segment(id));
                    let token = Some(config.serve.admin_token.as_str());
                    let (status, body) =
                        serve::client::request(addr, "DELETE", &path, token, None)?;
                    match status {
                        200 => println!("{}", serde_json::json!({"id": id, "deleted": true})),
                        404 => println!("{}", serde_json::json!({"id": id, "deleted": false})),
                        _ => anyhow::bail!(
                            "server answered {status}: {}",
                            serve::client::error_message(&body)
                        ),
                    }
                }
                return Ok(());
            }
            let engine = open_engine(&config)?;
            for id in &ids {
                let existed = engine.delete_document(id)?;
                println!("{}", serde_json::json!({"id": id, "deleted": existed}));
            }
        }
        Command::Verify { search } => return verify_cmd(&config, search),
        Command::Bench { which } => {
            let lines = match which {
                BenchCommand::Kvstore(args) => bench::kvstore::run(&args)?,
                BenchCommand::Model(args) => bench::model::run(&args)?,
                BenchCommand::Retrieval(args) => bench::retrieval::run(&args)?,
                BenchCommand::Ingest(args) => bench::ingest::run(&args)?,
                BenchCommand::Ttft(args) => bench::ttft::run(&args)?,
                BenchCommand::Remote(args) => bench::remote_tier::run(&args)?,
                BenchCommand::Scaleout(args) => bench::scaleout::run(&args)?,
                BenchCommand::Index(args) => bench::index_server::run(&args)?,
                BenchCommand::Load(args) => bench::load::run(&args)?,
                BenchCommand::Peer(args) => bench::peer::run(&args)?,
                BenchCommand::Compaction(args) => bench::compaction::run(&args)?,
                BenchCommand::Eviction(args) => bench::eviction::run(&args)?,
                BenchCommand::Fuzz(args) => bench::fuzz::run(&args)?,
                BenchCommand::Chaos(args) => bench::chaos::run(&args)?,
            };
            for line in lines {
                println!("{}", serde_json::to_string(&line)?);
            }
        }
        Command::Eval {
            which: EvalCommand::Qa(args),
        } => {
            for line in bench::qa::run(&args)? {
                println!("{}", serde_json::to_string(&line)?);
            }
        }
    }
    Ok(())
}

fn serve_cmd(config: &Config) -> Result<()> {
    let engine = std::sync::Arc::new(open_engine(config)?);
    let rag = serve::Rag::start(engine, config.serve.clone())?;
    let instance = rag.instance.clone();
    let app = serve::app(serve::AppState::new(rag.clone()));
    let limits = serve::listen::Limits::from_config(&config.serve);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ragkv-http")
        .enable_all()
        .build()?;
    let server_file = config.server_file();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&config.serve.bind)
            .await
            .with_context(|| format!("binding {}", config.serve.bind))?;
        let addr = listener.local_addr()?;
        handoff::announce(config, addr, &instance)?;
        eprintln!("ragkv serving on http://{addr}");
        let served = serve::listen::serve(listener, app, limits, shutdown_signal()).await;
        let _ = std::fs::remove_file(&server_file);
        served.context("serving")
    })?;
    // Queued queries end, pending KV write-backs are stored, the threads are joined.
    rag.shutdown();
    eprintln!("ragkv: shut down");
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

fn verify_cmd(config: &Config, search: bool) -> Result<()> {
    let (store, check) = if config.vectors_dir().exists() {
        let engine = open_engine(config)?;
        let check = engine.check(search)?;
        (engine.corpus().store().clone(), Some(check))
    } else {
        (std::sync::Arc::new(open_store(config)?), None)
    };
    let r = store.verify()?;
    for (key, e) in &r.failures {
        eprintln!("block {}: {e}", hex(key));
    }
    let mut problems = r.failures.len();
    if let Some(c) = &check {
        for p in &c.problems {
            eprintln!("index: {p}");
        }
        problems += c.problems.len();
    }
    println!(
        "{}",
        serde_json::json!({"entries": r.entries, "ok": r.ok, "failed": r.failures.len(), "index": check})
    );
    anyhow::ensure!(problems == 0, "verification found {problems} problems");
    Ok(())
}

fn remat_cmd(config: &Config, args: RematArgs) -> Result<()> {
    let opts = ingest::RematOptions {
        scope: match (args.stale, args.hot) {
            (true, _) => ingest::Scope::Stale,
            (false, Some(min_reads)) => ingest::Scope::Hot { min_reads },
            (false, None) => ingest::Scope::All,
        },
        limit: args.limit,
        dry_run: args.dry_run,
    };
    let report: ingest::RematReport = if let Some(server) = handoff::running_server(config) {
        eprintln!(
            "a server is running on this data directory: handing the work to http://{}",
            server.addr
        );
        let v = handoff::admin_post(
            config,
            server,
            "/v1/admin/rematerialize",
            Some(&serde_json::to_value(opts)?),
        )?;
        serde_json::from_value(v).context("decoding the server's report")?
    } else {
        let stop = interrupt::flag()?;
        let engine = open_engine(config)?;
        eprintln!("rematerializing (Ctrl-C stops after the current chunk; a rerun does the rest)");
        let progress = ingest::Progress::start(progress_mode(&args.progress)?);
        let r = engine.rematerialize_until(&opts, &progress.counters, || {
            stop.load(std::sync::atomic::Ordering::Relaxed)
        })?;
        drop(progress);
        r
    };
    for p in &report.plan {
        eprintln!(
            "would redo {}#{} ({} tokens, {:?}, {} reads)",
            p.doc_id, p.chunk, p.tokens, p.reason, p.reads
        );
    }
    for f in &report.failures {
        eprintln!("failed: {f}");
    }
    eprintln!(
        "chunks: {} checked, {} present, {} missing, {} corrupt, {} stale, {} with changed \
         neighbours; {} {}, {} prefilled, {} attached, {} failed ({:.1} s)",
        report.chunks,
        report.present,
        report.missing,
        report.corrupt,
        report.stale,
        report.neighbours_changed,
        report.planned,
        if report.dry_run {
            "would be redone"
        } else if report.interrupted {
            "planned"
        } else {
            "redone"
        },
        report.prefilled,
        report.attached,
        report.failures.len(),
        report.elapsed_s
    );
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    if report.interrupted {
        eprintln!("interrupted before the end: run again to redo the rest");
    }
    if !report.failures.is_empty() || report.interrupted {
        std::process::exit(EXIT_PARTIAL);
    }
    Ok(())
}

fn progress_mode(s: &str) -> Result<ingest::ProgressMode> {
    Ok(match s {
        "auto" => ingest::ProgressMode::Auto,
        "bars" => ingest::ProgressMode::Bars,
        "lines" => ingest::ProgressMode::Lines,
        "quiet" => ingest::ProgressMode::Quiet,
        other => anyhow::bail!("--progress: {other:?} (auto, bars, lines, quiet)"),
    })
}

/// Exit status of an ingest run in which some documents failed (the rest were committed).
const EXIT_PARTIAL: i32 = 3;

fn ingest_cmd(config: &Config, args: IngestArgs) -> Result<()> {
    let mode = progress_mode(&args.progress)?;
    let sources: Vec<ingest::Source> = args
        .paths
        .iter()
        .map(|p| ingest::Source::from_arg(p))
        .collect();
    for s in &sources {
        if let ingest::Source::File(p) | ingest::Source::Jsonl(p) = s {
            anyhow::ensure!(p.exists(), "{} does not exist", p.display());
        }
    }
    if let Some(server) = handoff::running_server(config) {
        anyhow::ensure!(
            !args.prune,
            "--prune is not supported while a server runs on this data directory (it owns the \
             store): stop the server, or delete documents with `ragkv delete`"
        );
        anyhow::ensure!(
            args.shard.is_none(),
            "--shard is not supported while a server runs on this data directory: stop it, or \
             run the shard's worker on its own data directory"
        );
        let materialize = args.materialize.unwrap_or(config.ingest.materialize);
        if !handoff::ingest(config, server, &sources, materialize, args.json)? {
            std::process::exit(EXIT_PARTIAL);
        }
        return Ok(());
    }
    let engine = open_engine(config)?;
    let opts = ingest::RunOptions {
        materialize: args.materialize.unwrap_or(config.ingest.materialize),
        prune: args.prune,
        shard: args.shard,
    };
    let progress = ingest::Progress::start(mode);
    let report = engine.ingest(&sources, &opts, &progress.counters)?;
    drop(progress);
    for f in &report.failures {
        eprintln!("skipped {}: {}", f.origin, f.reason);
    }
    eprintln!("{}", report.summary());
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    if !report.ok() {
        std::process::exit(EXIT_PARTIAL);
    }
    Ok(())
}

/// Store, vector index, embedder and model, bound into an ingest engine.
fn open_engine(config: &Config) -> Result<ingest::Engine> {
    let store = std::sync::Arc::new(open_store(config)?);
    let embedder =
        retrieval::Embedder::new(&config.embedder).context("loading the embedding model")?;
    let index = retrieval::VectorIndex::open(&config.vectors_dir(), embedder.dim(), &config.index)
        .context("opening the vector index")?;
    let path = config.model_path();
    let spec = path.to_string_lossy();
    let source = if model::hub::is_reference(&spec) {
        // Fetching is blocking network I/O; this runs before any async work starts.
        model::ModelSource::resolve(&spec)?
    } else {
        model::ModelSource::from_path(&path).with_context(|| {
            format!(
                "model {} (run scripts/setup.sh to fetch it)",
                path.display()
            )
        })?
    };
    let opts = model::LoadOptions {
        device: config.device_spec()?.open().context("model.device")?,
        quantized: config.quantized_weights()?,
        ..model::LoadOptions::default()
    };
    let llm = model::Model::load(&source, &opts)
        .with_context(|| format!("loading {}", path.display()))?;
    let corpus = ingest::Corpus::new(
        store,
        std::sync::Arc::new(index),
        std::sync::Arc::new(embedder),
        std::sync::Arc::new(llm),
        config.ingest.clone(),
        config.kv_dtype()?,
    )?;
    if !config.remote.enabled() {
        return Ok(ingest::Engine::new(corpus));
    }
    let tier = remote::Remote::open(&config.remote).context("opening the shared KV tier")?;
    Ok(ingest::Engine::new(
        corpus.with_remote(std::sync::Arc::new(tier)),
    ))
}

fn open_store(config: &Config) -> Result<kvstore::Store> {
    let dir = config.kv_dir();
    kvstore::Store::open(&dir, config.store_options()?)
        .with_context(|| format!("opening the KV store in {}", dir.display()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
