//! `ragkv bench load`: concurrent clients against one server over real sockets, in the same
//! process (so its resident memory can be sampled). First one client (the baseline), then
//! `--clients` clients; every request is `POST /v1/query` with `stream: false`. Reports
//! throughput, latency, status codes (a 5xx is a failure of the run) and memory.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serve::ServeConfig;

use crate::{percentile, Error, Line};

/// Arguments of `ragkv bench load`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Concurrent clients in the main phase.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Length of the main phase, seconds.
    #[arg(long, default_value_t = 120)]
    pub seconds: u64,
    /// Length of the one-client baseline phase, seconds.
    #[arg(long, default_value_t = 30)]
    pub baseline_seconds: u64,
    /// Server admission capacity (`serve.max_inflight`); clients past it get 429.
    #[arg(long, default_value_t = 8)]
    pub max_inflight: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Chunks per question.
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Queries decoded together (`serve.max_batch`); 1 turns batching off.
    #[arg(long, default_value_t = ServeConfig::default().max_batch)]
    pub max_batch: usize,
    /// KV cache budget of the batch (`serve.kv_budget_mb`).
    #[arg(long, default_value_t = ServeConfig::default().kv_budget_mb)]
    pub kv_budget_mb: usize,
    /// The model.
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

const QUESTIONS: &[&str] = &[
    "Who was the last resident keeper of the Varrow Point Lighthouse?",
    "How often should a sourdough starter kept at room temperature be fed?",
    "How long is the Meridian Railway?",
    "How do honeybees encode the distance to food?",
    "How much did the Skarn Glacier retreat between 1998 and 2023?",
    "When does the Osterfeld Chess Club meet?",
];

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    rejected: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
    transport_errors: AtomicU64,
    latencies_ms: Mutex<Vec<f64>>,
}

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

fn phase(
    addr: std::net::SocketAddr,
    clients: usize,
    secs: u64,
    args: &Args,
    rag: &serve::Rag,
) -> (Tally, f64, Vec<f64>, u64) {
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let (tally, stop) = (tally.clone(), stop.clone());
            let (max_tokens, top_k) = (args.max_tokens, args.top_k);
            std::thread::spawn(move || {
                let mut i = c;
                while !stop.load(Ordering::Relaxed) {
                    let body = serde_json::json!({"question": QUESTIONS[i % QUESTIONS.len()],
                        "top_k": top_k, "max_tokens": max_tokens, "stream": false});
                    i += 1;
                    let t = Instant::now();
                    match serve::client::request(addr, "POST", "/v1/query", None, Some(&body)) {
                        Ok((200, _)) => {
                            tally.ok.fetch_add(1, Ordering::Relaxed);
                            tally
                                .latencies_ms
                                .lock()
                                .unwrap()
                                .push(t.elapsed().as_secs_f64() * 1e3);
                        }
                        Ok((429, _)) => {
                            tally.rejected.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(Duration::from_millis(200));
                        }
                        Ok((s, _)) if s >= 500 => {
                            tally.server_errors.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {
                            tally.client_errors.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            tally.transport_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    let mut rss = Vec::new();
    let mut kv_peak = 0;
    while start.elapsed() < Duration::from_secs(secs) {
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(100));
            kv_peak = kv_peak.max(rag.metrics.kv_reserved_bytes.load(Ordering::Relaxed));
        }
        rss.push(rss_mib());
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    let wall = start.elapsed().as_secs_f64();
    let tally = Arc::try_unwrap(tally).unwrap_or_default();
    (tally, wall, rss, kv_peak)
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let tmp = tempfile::tempdir().map_err(crate::io("temporary directory"))?;
    let work = args.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let engine = crate::engine::example(&work, &args.llm)?;
    let config = ServeConfig {
        max_inflight: args.max_inflight,
        max_batch: args.max_batch,
        kv_budget_mb: args.kv_budget_mb,
        ..ServeConfig::default()
    };
    let (rt, addr, rag) = crate::engine::serve_loopback(&engine, config)?;
    let rss_before = rss_mib();
    eprintln!("[load] baseline: 1 client for {} s", args.baseline_seconds);
    let (one, one_wall, _, _) = phase(addr, 1, args.baseline_seconds, args, &rag);
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (steps0, rows0) = (g(&rag.metrics.batch_steps), g(&rag.metrics.batch_rows));
    eprintln!(
        "[load] {} clients for {} s (capacity {})",
        args.clients, args.seconds, args.max_inflight
    );
    let (many, wall, rss, kv_peak) = phase(addr, args.clients, args.seconds, args, &rag);
    let steps = g(&rag.metrics.batch_steps) - steps0;
    let rows = g(&rag.metrics.batch_rows) - rows0;
    let mut lat = many.latencies_ms.lock().unwrap().clone();
    lat.sort_by(f64::total_cmp);
    let half = rss.len() / 2;
    let max_first = rss[..half.max(1)].iter().copied().fold(0.0, f64::max);
    let max_second = rss[half..].iter().copied().fold(0.0, f64::max);
    let mut line = Line::higher(
        "load_queries_per_s",
        g(&many.ok) as f64 / wall,
        g(&one.ok) as f64 / one_wall,
        "queries/s",
        "one client, same server",
    );
    line.detail = Some(serde_json::json!({
        "clients": args.clients, "seconds": args.seconds, "max_inflight": args.max_inflight,
        "ok": g(&many.ok), "rejected_429": g(&many.rejected), "server_errors_5xx": g(&many.server_errors),
        "client_errors_4xx": g(&many.client_errors), "transport_errors": g(&many.transport_errors),
        "latency_ms_p50": percentile(&lat, 0.5), "latency_ms_p99": percentile(&lat, 0.99),
        "rss_mib_before": rss_before, "rss_mib_max_first_half": max_first,
        "rss_mib_max_second_half": max_second,
        "server_rejected": g(&rag.metrics.rejected), "server_failed": g(&rag.metrics.failed),
        "max_batch": args.max_batch, "mean_batch": rows as f64 / steps.max(1) as f64,
        "kv_budget_mib": args.kv_budget_mb, "kv_reserved_mib_peak": kv_peak as f64 / (1u64 << 20) as f64,
        "quantized": args.llm.quantized, "model": args.llm.name(),
    }));
    // Stop the server and its threads before the working directory goes away.
    drop(rt);
    drop(rag);
    crate::engine::close(engine);
    if g(&many.server_errors) > 0 || g(&many.transport_errors) > 0 {
        return Err(Error::Check(format!(
            "load test saw failures: {}",
            line.detail.clone().unwrap_or_default()
        )));
    }
    Ok(vec![line])
}
