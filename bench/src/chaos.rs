//! `ragkv bench chaos`: a real `ragkv serve` process under concurrent ingest, deletes,
//! queries, GC and rematerialization, killed with SIGKILL at random moments and restarted,
//! for `--seconds`. The harness keeps the state every acknowledged write implies (a document
//! present with its text, or deleted); a write in flight when the server died may have
//! happened or not, and either is accepted. At the end, on a last clean run, every document's
//! state is compared (lost: acknowledged present but missing or different; resurrected:
//! acknowledged deleted but present), GC runs (crash leftovers are reclaimed by design), the
//! server stops cleanly, and `ragkv verify --search` must find no wrong or unreadable KV, no
//! incomplete document and no orphan.
//!
//! Writes to one document id are issued one at a time by the harness (races between writers
//! of one document are the engine's `claims` tests); writes to different ids run
//! concurrently with each other and with everything else.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use serve::client::{self, Limits};

use crate::{Error, Line};

/// Arguments of `ragkv bench chaos`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// How long to run, seconds.
    #[arg(long, default_value_t = 600)]
    pub seconds: u64,
    /// Document ids the writers use.
    #[arg(long, default_value_t = 40)]
    pub docs: usize,
    /// Seed of the random schedule.
    #[arg(long, default_value_t = 11)]
    pub seed: u64,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// What the harness knows of one document.
#[derive(Debug, Clone, Default)]
struct Known {
    /// Acknowledged: `Some(text)` present, `None` deleted (or never written).
    acked: Option<String>,
    /// Writes in flight when the server died since the last acknowledged one: each may have
    /// been committed, so any of their outcomes is fine.
    maybe: Vec<Option<String>>,
}

#[derive(Default)]
struct Counts {
    writes_acked: AtomicU64,
    deletes_acked: AtomicU64,
    queries_ok: AtomicU64,
    answers_5xx: AtomicU64,
    transport_errors: AtomicU64,
    maintenance_ok: AtomicU64,
}

fn ragkv(data: &Path) -> Result<Command, Error> {
    let exe = std::env::current_exe().map_err(crate::io("locating the ragkv binary"))?;
    let mut c = Command::new(exe);
    c.arg("--data-dir").arg(data);
    Ok(c)
}

/// Starts a server; returns it and its address once `server.json` names it.
fn start_server(data: &Path) -> Result<(Child, SocketAddr), Error> {
    let file = data.join("server.json");
    let _ = std::fs::remove_file(&file);
    let mut child = ragkv(data)?
        .args(["serve", "--bind", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(crate::io("starting ragkv serve"))?;
    let t = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(&file) {
            if let Some(addr) = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v["url"].as_str()?.strip_prefix("http://")?.parse().ok())
            {
                return Ok((child, addr));
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(Error::Check(format!("ragkv serve exited: {st}")));
        }
        if t.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            return Err(Error::Check("ragkv serve did not start".into()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn text_of(id: usize, version: u64) -> String {
    format!(
        "Chaos ledger {id}, entry {version}. The tide gauge at berth {id} read {} centimetres \
         at dawn; the harbour master logged the reading and sealed the ledger.",
        version * 7 % 300
    )
}

/// One write to document `id` (a new version, or a delete), recorded in `known`.
fn write(
    addr: SocketAddr,
    rng: &mut SmallRng,
    id: usize,
    known: &Mutex<HashMap<usize, Known>>,
    counts: &Counts,
) {
    let name = format!("chaos-{id}");
    let delete = rng.gen_bool(0.3);
    let outcome: Option<String> = if delete {
        None
    } else {
        Some(text_of(id, rng.gen_range(0..1_000_000)))
    };
    let r = match &outcome {
        None => client::request_with(
            addr,
            "DELETE",
            &format!("/v1/documents/{name}"),
            None,
            None,
            Limits::WORK,
        ),
        Some(text) => client::request_with(
            addr,
            "POST",
            "/v1/documents",
            None,
            Some(&json!({"documents": [{"id": name, "text": text}], "materialize": "eager"})),
            Limits::WORK,
        ),
    };
    let mut k = known.lock().unwrap();
    let entry = k.entry(id).or_default();
    match r {
        Ok(reply) if reply.status == 200 || (delete && reply.status == 404) => {
            entry.acked = outcome;
            entry.maybe.clear();
            if delete {
                counts.deletes_acked.fetch_add(1, Ordering::Relaxed);
            } else {
                counts.writes_acked.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(reply) => {
            if reply.status >= 500 {
                counts.answers_5xx.fetch_add(1, Ordering::Relaxed);
            }
            entry.maybe.push(outcome);
        }
        Err(_) => {
            // The server died (or was dying): the write may have been committed.
            counts.transport_errors.fetch_add(1, Ordering::Relaxed);
            entry.maybe.push(outcome);
        }
    }
}

/// Runs the workers against `addr` until `stop`.
fn workload(
    addr: SocketAddr,
    args: &Args,
    round: u64,
    stop: &AtomicBool,
    known: &Mutex<HashMap<usize, Known>>,
    busy: &[Mutex<()>],
    counts: &Counts,
) {
    std::thread::scope(|s| {
        for w in 0..2u64 {
            s.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(args.seed ^ (round << 8) ^ w);
                while !stop.load(Ordering::Relaxed) {
                    let id = rng.gen_range(0..args.docs);
                    // One write at a time per document id.
                    let Ok(_g) = busy[id].try_lock() else {
                        continue;
                    };
                    write(addr, &mut rng, id, known, counts);
                }
            });
        }
        s.spawn(move || {
            let mut rng = SmallRng::seed_from_u64(args.seed ^ (round << 8) ^ 99);
            while !stop.load(Ordering::Relaxed) {
                let q = json!({"question": format!("What did the tide gauge at berth {} read?",
                                                   rng.gen_range(0..args.docs)),
                               "top_k": 2, "max_tokens": 4, "stream": false});
                match client::request_with(addr, "POST", "/v1/query", None, Some(&q), Limits::WORK)
                {
                    Ok(r) if r.status == 200 => {
                        counts.queries_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) if r.status >= 500 => {
                        counts.answers_5xx.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(_) => {
                        counts.transport_errors.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        });
        s.spawn(move || {
            let mut rng = SmallRng::seed_from_u64(args.seed ^ (round << 8) ^ 7);
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(rng.gen_range(500..3000)));
                let path = if rng.gen_bool(0.5) {
                    "/v1/admin/gc"
                } else {
                    "/v1/admin/rematerialize"
                };
                match client::request_with(addr, "POST", path, None, None, Limits::WORK) {
                    Ok(r) if r.status == 200 => {
                        counts.maintenance_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) if r.status >= 500 => {
                        counts.answers_5xx.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
        });
    });
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let tmp = tempfile::tempdir().map_err(crate::io("temporary directory"))?;
    let work = args.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let data = work.join("data");
    let corpus = crate::engine::example_corpus()?;
    let st = ragkv(&data)?
        .args(["ingest", "--progress", "quiet"])
        .arg(&corpus)
        .status()
        .map_err(crate::io("ragkv ingest"))?;
    if !st.success() {
        return Err(Error::Check(format!("initial ingest failed: {st}")));
    }
    let known = Mutex::new(HashMap::<usize, Known>::new());
    let busy: Vec<Mutex<()>> = (0..args.docs).map(|_| Mutex::new(())).collect();
    let counts = Counts::default();
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let start = Instant::now();
    let mut kills = 0u64;
    let mut round = 0u64;
    while start.elapsed() < Duration::from_secs(args.seconds) {
        let (mut child, addr) = start_server(&data)?;
        let stop = Arc::new(AtomicBool::new(false));
        let life = Duration::from_millis(rng.gen_range(4_000..30_000));
        let s2 = stop.clone();
        let pid = child.id();
        let killer = std::thread::spawn(move || {
            std::thread::sleep(life);
            // SAFETY: plain kill(2) of our own child.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            s2.store(true, Ordering::Relaxed);
        });
        workload(addr, args, round, &stop, &known, &busy, &counts);
        let _ = killer.join();
        let _ = child.wait();
        kills += 1;
        round += 1;
        eprintln!(
            "[chaos] {:>4.0} s: kill {kills}; {} writes, {} deletes, {} queries acknowledged",
            start.elapsed().as_secs_f64(),
            counts.writes_acked.load(Ordering::Relaxed),
            counts.deletes_acked.load(Ordering::Relaxed),
            counts.queries_ok.load(Ordering::Relaxed)
        );
    }

    // A last clean run: compare every document with what was acknowledged.
    let (mut child, addr) = start_server(&data)?;
    let (mut lost, mut resurrected, mut uncertain) = (0u64, 0u64, 0u64);
    let mut problems = Vec::new();
    for (id, k) in known.lock().unwrap().iter() {
        let r = client::request_with(
            addr,
            "GET",
            &format!("/v1/documents/chaos-{id}"),
            None,
            None,
            Limits::WORK,
        )
        .map_err(|e| Error::Check(e.to_string()))?;
        let found: Option<String> = match r.status {
            404 => None,
            200 => {
                let v: Value = serde_json::from_str(&r.body).unwrap_or_default();
                Some(
                    v["chunks"]
                        .as_array()
                        .map(|c| {
                            c.iter()
                                .filter_map(|c| c["text"].as_str())
                                .collect::<Vec<_>>()
                                .join(" ")
                        })
                        .unwrap_or_default(),
                )
            }
            s => return Err(Error::Check(format!("GET chaos-{id}: {s}"))),
        };
        let matches = |want: &Option<String>| match (want, &found) {
            (None, None) => true,
            (Some(w), Some(f)) => f.split_whitespace().eq(w.split_whitespace()),
            _ => false,
        };
        if matches(&k.acked) {
            continue;
        }
        if k.maybe.iter().any(matches) {
            uncertain += 1;
            continue;
        }
        match (&k.acked, &found) {
            (Some(_), _) => lost += 1,
            (None, Some(_)) => resurrected += 1,
            (None, None) => {}
        }
        problems.push(format!(
            "chaos-{id}: acknowledged {:?}, found {:?}",
            k.acked.as_ref().map(|t| &t[..t.len().min(40)]),
            found.as_ref().map(|t| &t[..t.len().min(40)])
        ));
    }
    let gc = client::request_with(addr, "POST", "/v1/admin/gc", None, None, Limits::WORK)
        .map_err(|e| Error::Check(e.to_string()))?;
    // SAFETY: plain kill(2) of our own child: a clean stop this time.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    let verify = ragkv(&data)?
        .args(["verify", "--search"])
        .output()
        .map_err(crate::io("ragkv verify"))?;
    let report: Value = String::from_utf8_lossy(&verify.stdout)
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_default();
    let index_problems = report["index"]["problems"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let orphans = index_problems
        .iter()
        .filter(|p| p.as_str().is_some_and(|p| p.contains("orphan")))
        .count() as u64;
    let wrong_kv = report["failed"].as_u64().unwrap_or(u64::MAX);
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let bad = lost + resurrected + wrong_kv + index_problems.len() as u64;
    let mut line = Line::lower(
        "chaos_problems",
        bad as f64,
        0.0,
        "problems",
        "none allowed (lost + resurrected + unreadable KV + index problems)",
    );
    line.detail = Some(json!({
        "seconds": start.elapsed().as_secs_f64(), "kills": kills, "docs": args.docs,
        "lost": lost, "resurrected": resurrected, "uncertain_outcomes_either_way": uncertain,
        "kv_blocks_failed": wrong_kv, "kv_blocks_ok": report["ok"], "orphans": orphans,
        "index_problems": index_problems, "verify_exit_ok": verify.status.success(),
        "final_gc_status": gc.status, "final_gc": serde_json::from_str::<Value>(&gc.body).unwrap_or_default(),
        "writes_acked": g(&counts.writes_acked), "deletes_acked": g(&counts.deletes_acked),
        "queries_ok": g(&counts.queries_ok), "maintenance_ok": g(&counts.maintenance_ok),
        "answers_5xx": g(&counts.answers_5xx), "transport_errors": g(&counts.transport_errors),
        "problems": problems,
    }));
    if bad > 0 || !verify.status.success() {
        eprintln!("{}", line.detail.clone().unwrap_or_default());
        return Err(Error::Check(format!("chaos: {bad} problems")));
    }
    Ok(vec![line])
}
