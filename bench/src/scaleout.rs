//! `ragkv bench scaleout`: the scale-out path end to end, with real processes against a real
//! Qdrant server (`--qdrant-url`) and a real S3 server (`--s3-url`; Garage as
//! `scripts/test-servers.sh start` runs it). Every node is a child `ragkv` process of this
//! binary with a data directory and configuration of its own; all of them share one Qdrant
//! collection and one bucket prefix, fresh for each run. With `--pin` (the default on a
//! machine with two or more cores) each node runs on one core, standing in for a machine.
//!
//! 1. **One process** ingests `--baseline-docs` other documents of the dataset (its own
//!    collection and prefix): the per-process rate the two workers are compared with.
//! 2. **Two workers** ingest the first `--docs` documents as shards `0/2` and `1/2`, at once;
//!    worker 1 is killed with SIGKILL `--kill-after` seconds in and restarted, and must
//!    complete its shard. Every document is then found through a serving node, and the bucket
//!    holds exactly one object per distinct chunk.
//! 3. **Two serving nodes**: A on worker 0's data directory, B on an empty one. B answers
//!    the dev questions from KV it fetches from the bucket (its inline-prefill counter must not
//!    move), then again from its local copies, then with `assembly: full` (everything
//!    prefilled): time to first token from the tier, locally and by recompute. Then
//!    queries/s: `2 × --clients` clients on A alone, and `--clients` on each node at once.
//! 4. **Deletion through one node**: the document of B's first citation is deleted through
//!    A; it must be gone from both nodes' searches, B's local copy detached by B's GC, and its
//!    objects gone from the bucket after A's GC.
//!
//! The run's collections and bucket prefixes are left in place for inspection (named by the
//! run's timestamp; the last line of its log names them).

mod node;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::peer::{phase, Peer, Ragkv};
use crate::{dataset, percentile, Error, Line};
use node::{Cluster, Node, Running, Server};

/// Arguments of `ragkv bench scaleout`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The Qdrant server's gRPC URL.
    #[arg(long, env = "QDRANT_URL")]
    pub qdrant_url: String,
    /// The S3 server's URL (`scripts/test-servers.sh start` exports RAGKV_TEST_S3_URL).
    #[arg(long, env = "RAGKV_TEST_S3_URL")]
    pub s3_url: String,
    /// The bucket.
    #[arg(long, env = "RAGKV_TEST_S3_BUCKET")]
    pub bucket: String,
    /// The S3 region (`garage` for Garage).
    #[arg(long, env = "RAGKV_TEST_S3_REGION", default_value = "garage")]
    pub region: String,
    /// `env` or a credentials file (`[remote] credentials`).
    #[arg(long, env = "RAGKV_TEST_S3_CREDENTIALS", default_value = "env")]
    pub credentials: String,
    /// Documents ingested by the two workers (the dataset's first).
    #[arg(long, default_value_t = 200)]
    pub docs: usize,
    /// Documents (the next ones) ingested by the one-process baseline.
    #[arg(long, default_value_t = 60)]
    pub baseline_docs: usize,
    /// Seconds into the sharded ingest at which worker 1 is killed.
    #[arg(long, default_value_t = 60.0)]
    pub kill_after: f64,
    /// Dev questions asked.
    #[arg(long, default_value_t = 16)]
    pub questions: usize,
    /// Chunks per question.
    #[arg(long, default_value_t = 4)]
    pub top_k: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Clients per node in the throughput phase.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Queries per client in the throughput phase.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Pin each node to one core (`auto`: when there are two or more and `taskset` exists).
    #[arg(long, default_value = "auto")]
    pub pin: String,
    /// LongBench-HotpotQA directory (default: the shared datasets).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// The model.
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

fn check(what: impl std::fmt::Display) -> Error {
    Error::Check(what.to_string())
}

fn cores(pin: &str) -> Result<Option<usize>, Error> {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    let taskset = std::process::Command::new("taskset")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    match pin {
        "auto" => Ok((n >= 2 && taskset).then_some(n)),
        "on" if taskset => Ok(Some(n)),
        "on" => Err(check("--pin on: taskset (util-linux) not found")),
        "off" => Ok(None),
        o => Err(Error::Invalid {
            what: "--pin",
            why: format!("{o:?} (auto, on or off)"),
        }),
    }
}

/// Writes documents `range` of the dataset as JSONL.
fn corpus(ds: &Path, range: std::ops::Range<usize>, path: &Path) -> Result<usize, Error> {
    let docs = dataset::documents(ds, range.end)?;
    let mut out = String::new();
    for d in &docs[range.start.min(docs.len())..] {
        out += &json!({"id": d.id, "text": d.text}).to_string();
        out.push('\n');
    }
    std::fs::write(path, out).map_err(crate::io(format!("writing {}", path.display())))?;
    Ok(docs.len().saturating_sub(range.start))
}

/// The ingest report `ragkv ingest --json` printed as `what`, after checking it succeeded.
fn report(node: &Node, what: &str, child: &mut Running) -> Result<Value, Error> {
    let st = child
        .0
        .wait()
        .map_err(crate::io("waiting for ragkv ingest"))?;
    if !st.success() {
        return Err(check(format!(
            "{}: ragkv ingest exited {st}: {}",
            node.name,
            node.errors(what)
        )));
    }
    let out = node.output(what);
    let r: Value = out
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| check(format!("{}: no JSON report from ragkv ingest", node.name)))?;
    if r["docs_failed"].as_u64() != Some(0) {
        return Err(check(format!(
            "{}: documents failed: {}",
            node.name, r["failures"]
        )));
    }
    Ok(r)
}

fn ingest(node: &Node, what: &str, corpus: &Path, shard: Option<&str>) -> Result<Running, Error> {
    let path = corpus.to_string_lossy();
    let mut args = vec!["ingest", &path, "--progress", "lines", "--json"];
    if let Some(s) = shard {
        args.extend(["--shard", s]);
    }
    let child = node
        .command(what, &args)?
        .spawn()
        .map_err(crate::io("starting ragkv ingest"))?;
    Ok(Running(child))
}

fn rate(r: &Value) -> f64 {
    r["tokens_prefilled"].as_f64().unwrap_or(0.0) / r["elapsed_s"].as_f64().unwrap_or(f64::NAN)
}

/// Phase 1: one process alone; its tokens/s.
fn baseline(cluster: &Cluster, work: &Path, ds: &Path, args: &Args) -> Result<Value, Error> {
    let solo = Cluster {
        collection: format!("{}-solo", cluster.collection),
        prefix: format!("{}-solo", cluster.prefix),
        ..cluster.clone()
    };
    let node = solo.node(work, "solo", 0)?;
    let path = work.join("baseline.jsonl");
    corpus(ds, args.docs..args.docs + args.baseline_docs, &path)?;
    let mut child = ingest(&node, "ingest", &path, None)?;
    let r = report(&node, "ingest", &mut child)?;
    eprintln!("[scaleout] one process: {:.0} tokens/s ({r})", rate(&r));
    Ok(r)
}

/// Phase 2: the two workers, worker 1 killed and restarted. Returns their reports (worker
/// 1's restarted run) and the wall time.
fn sharded(work: &Path, nodes: &[Node; 2], args: &Args) -> Result<(Value, Value, f64), Error> {
    let path = work.join("corpus.jsonl");
    let t = Instant::now();
    let mut w0 = ingest(&nodes[0], "ingest", &path, Some("0/2"))?;
    let mut w1 = ingest(&nodes[1], "ingest-killed", &path, Some("1/2"))?;
    while t.elapsed().as_secs_f64() < args.kill_after {
        if !matches!(w1.0.try_wait(), Ok(None)) {
            return Err(check(format!(
                "worker 1 ended before the kill at {} s ({}): lower --kill-after or raise --docs",
                args.kill_after,
                nodes[1].errors("ingest-killed")
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    w1.0.kill().map_err(crate::io("SIGKILL to worker 1"))?;
    let st = w1.0.wait().map_err(crate::io("waiting for worker 1"))?;
    eprintln!(
        "[scaleout] worker 1 killed at {:.1} s ({st}); restarting it",
        t.elapsed().as_secs_f64()
    );
    let mut w1 = ingest(&nodes[1], "ingest", &path, Some("1/2"))?;
    let r1 = report(&nodes[1], "ingest", &mut w1)?;
    let r0 = report(&nodes[0], "ingest", &mut w0)?;
    let wall = t.elapsed().as_secs_f64();
    eprintln!("[scaleout] worker 0: {r0}\n[scaleout] worker 1 (restarted): {r1}");
    Ok((r0, r1, wall))
}

/// Every document of the corpus as a node sees it: (chunks, distinct KV keys, tokens).
fn documents(a: &Server, ids: &[String]) -> Result<(usize, usize, u64), Error> {
    let mut keys = std::collections::HashSet::new();
    let (mut chunks, mut tokens) = (0, 0);
    for id in ids {
        let (status, doc) = a.call("GET", &format!("/v1/documents/{id}"), None)?;
        if status != 200 {
            return Err(check(format!(
                "document {id} not found after ingest ({status})"
            )));
        }
        for c in doc["chunks"].as_array().into_iter().flatten() {
            chunks += 1;
            tokens += c["tokens"].as_u64().unwrap_or(0);
            keys.insert(c["kv_key"].to_string());
        }
    }
    Ok((chunks, keys.len(), tokens))
}

/// Objects in the bucket under the run's prefix.
fn objects(cluster: &Cluster) -> Result<usize, Error> {
    let tier = remote::Remote::open(&remote::RemoteConfig {
        url: cluster.s3_url.clone(),
        bucket: cluster.bucket.clone(),
        region: cluster.region.clone(),
        credentials: cluster.credentials.clone(),
        prefix: cluster.prefix.clone(),
        ..remote::RemoteConfig::default()
    })
    .map_err(check)?;
    Ok(tier.usage().map_err(check)?.values().map(|v| v.0).sum())
}

/// Times to first token of every question, asked one at a time (sorted), and the answers.
fn ttft(peer: &Ragkv<'_>) -> Result<(Vec<f64>, Vec<String>), Error> {
    let (mut times, mut answers) = (Vec::new(), Vec::new());
    for i in 0..peer.questions.len() {
        let o = peer.ask(i).map_err(check)?;
        times.push(o.first_ms);
        answers.push(o.answer);
    }
    times.sort_by(f64::total_cmp);
    Ok((times, answers))
}

/// `clients` clients spread over `peers`, `rounds` queries each: queries/s.
fn throughput(peers: &[&dyn Peer], n: usize, clients: usize, rounds: usize) -> Result<f64, Error> {
    let (done, wall) = phase(peers, n, clients, rounds).map_err(check)?;
    Ok(done.len() as f64 / wall)
}

/// The documents a query cites.
fn cited(s: &Server, question: &str, top_k: usize) -> Result<Vec<String>, Error> {
    let body = json!({"question": question, "top_k": top_k, "max_tokens": 1, "stream": false});
    let (status, r) = s.call("POST", "/v1/query", Some(&body))?;
    if status != 200 {
        return Err(check(format!("query: HTTP {status}: {r}")));
    }
    Ok(r["citations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["doc_id"].as_str().map(String::from))
        .collect())
}

/// Phase 4: delete through A; gone from both, B's copy detached, the objects released.
fn deletion(
    a: &Server,
    b: &Server,
    cluster: &Cluster,
    question: &str,
    top_k: usize,
) -> Result<Value, Error> {
    let doc = cited(b, question, top_k)?
        .into_iter()
        .next()
        .ok_or_else(|| check("the first question cites nothing"))?;
    let (before_chunks, before_keys, _) = documents(a, std::slice::from_ref(&doc))?;
    let objects_before = objects(cluster)?;
    let (status, r) = a.call("DELETE", &format!("/v1/documents/{doc}"), None)?;
    if status != 200 {
        return Err(check(format!("DELETE {doc} through A: HTTP {status}: {r}")));
    }
    for (name, s) in [("A", a), ("B", b)] {
        let (status, _) = s.call("GET", &format!("/v1/documents/{doc}"), None)?;
        if status != 404 {
            return Err(check(format!(
                "{doc} still listed by node {name} ({status})"
            )));
        }
        if cited(s, question, top_k)?.contains(&doc) {
            return Err(check(format!("node {name} still retrieves {doc}")));
        }
    }
    let gc = |s: &Server, name: &str| -> Result<Value, Error> {
        let (status, r) = s.call("POST", "/v1/admin/gc", None)?;
        if status != 200 {
            return Err(check(format!("gc on node {name}: HTTP {status}: {r}")));
        }
        Ok(r)
    };
    let gc_b = gc(b, "B")?;
    if gc_b["orphans_detached"].as_u64().unwrap_or(0) == 0 {
        return Err(check(format!(
            "node B's GC detached no copy of {doc}: {gc_b}"
        )));
    }
    let gc_a = gc(a, "A")?;
    let objects_after = objects(cluster)?;
    // Every chunk of the document leaves the bucket (a chunk another document shares would
    // stay: the dataset's first documents share none, as the counts after ingest show).
    if objects_before.checked_sub(objects_after) != Some(before_keys) {
        return Err(check(format!(
            "{doc}: {before_keys} objects expected gone, the bucket went {objects_before} -> {objects_after}"
        )));
    }
    Ok(json!({
        "doc": doc, "chunks": before_chunks, "objects_before": objects_before,
        "objects_after": objects_after, "gc_a": gc_a, "gc_b": gc_b,
    }))
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    if args.docs < 2 || args.questions < 2 || args.clients == 0 || args.rounds == 0 {
        return Err(Error::Invalid {
            what: "--docs/--questions/--clients/--rounds",
            why: "at least 2 documents and questions, 1 client and round".into(),
        });
    }
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let work_dir = crate::WorkDir::new(args.dir.as_deref())?;
    let work = work_dir.path().to_path_buf();
    let stamp = crate::unix_secs();
    let cluster = Cluster {
        qdrant_url: args.qdrant_url.clone(),
        collection: format!("ragkv-scaleout-{stamp}"),
        s3_url: args.s3_url.clone(),
        bucket: args.bucket.clone(),
        region: args.region.clone(),
        credentials: args.credentials.clone(),
        prefix: format!("scaleout/{stamp}"),
        model: args.llm.model.clone(),
        device: args.llm.device.clone(),
        cores: cores(&args.pin)?,
    };
    eprintln!(
        "[scaleout] collection {}, prefix {}, pinned: {:?}",
        cluster.collection, cluster.prefix, cluster.cores
    );
    let docs = dataset::documents(&ds, args.docs)?;
    let ids: Vec<String> = docs.iter().map(|d| d.id.clone()).collect();
    corpus(&ds, 0..args.docs, &work.join("corpus.jsonl"))?;

    let solo = baseline(&cluster, &work, &ds, args)?;
    let workers = [
        cluster.node(&work, "worker-0", 0)?,
        cluster.node(&work, "worker-1", 1)?,
    ];
    let (r0, r1, wall) = sharded(&work, &workers, args)?;

    let a = workers[0].serve()?;
    let (chunks, keys, tokens) = documents(&a, &ids)?;
    let stored = objects(&cluster)?;
    if stored != keys {
        return Err(check(format!(
            "the bucket holds {stored} objects for {keys} distinct chunks"
        )));
    }
    eprintln!(
        "[scaleout] {} documents, {chunks} chunks ({keys} distinct), {tokens} tokens, all found",
        ids.len()
    );
    let node_b = cluster.node(&work, "node-b", 1)?;
    let b = node_b.serve()?;

    let questions: Vec<String> = dataset::questions(&ds, args.questions + 1)?
        .into_iter()
        .map(|q| q.question)
        .collect();
    let (warm, asked) = questions
        .split_last()
        .ok_or_else(|| check("no questions"))?;
    let peer = |s: &Server, assembly| Ragkv {
        addr: s.addr(),
        questions: asked,
        top_k: args.top_k,
        max_tokens: args.max_tokens,
        assembly,
    };
    let (pa, pb) = (peer(&a, None), peer(&b, None));
    let warm_up = Ragkv {
        questions: std::slice::from_ref(warm),
        ..peer(&b, None)
    };
    warm_up.ask(0).map_err(check)?;
    let (hits0, misses0) = (
        b.metric("ragkv_remote_hits_total")?,
        b.metric("ragkv_kv_misses_total")?,
    );
    let (remote, _) = ttft(&pb)?;
    let (hits1, misses1) = (
        b.metric("ragkv_remote_hits_total")?,
        b.metric("ragkv_kv_misses_total")?,
    );
    let (local, answers_b) = ttft(&pb)?;
    let misses2 = b.metric("ragkv_kv_misses_total")?;
    if misses1 != misses0 || misses2 != misses0 || hits1 <= hits0 {
        return Err(check(format!(
            "node B prefilled chunks inline ({misses0} -> {misses1} -> {misses2}) or fetched none ({hits0} -> {hits1})"
        )));
    }
    let (recompute, _) = ttft(&peer(&b, Some("full")))?;
    // A's pass warms it (its other shard's chunks come from the bucket) and gives its answers:
    // the same stored KV, so the same greedy answers as B's.
    let (_, answers_a) = ttft(&pa)?;
    let same = answers_a
        .iter()
        .zip(&answers_b)
        .filter(|(x, y)| x == y)
        .count();
    eprintln!(
        "[scaleout] nodes A and B gave the same answer to {same} of {} questions",
        asked.len()
    );
    let one = throughput(&[&pa], asked.len(), 2 * args.clients, args.rounds)?;
    let two = throughput(&[&pa, &pb], asked.len(), 2 * args.clients, args.rounds)?;
    eprintln!("[scaleout] q/s: one node {one:.3}, two nodes {two:.3}");
    let deleted = deletion(&a, &b, &cluster, &asked[0], args.top_k)?;
    eprintln!("[scaleout] deletion: {deleted}");
    a.stop();
    b.stop();
    eprintln!(
        "[scaleout] left for inspection: Qdrant collections {0} and {0}-solo, bucket prefixes \
         {1} and {1}-solo (delete them with Qdrant's API and your S3 tool)",
        cluster.collection, cluster.prefix,
    );

    let both = (r0["tokens_prefilled"].as_f64().unwrap_or(0.0)
        + r1["tokens_prefilled"].as_f64().unwrap_or(0.0))
        / wall;
    let p50 = |v: &[f64]| percentile(v, 0.5);
    let pinned = json!(cluster.cores.map(|n| format!("one core per node of {n}")));
    Ok(vec![
        Line::higher("scaleout.ingest_two_workers", both, rate(&solo), "tokens/s", "one process")
            .detail(json!({
                "pinned": pinned, "worker_0_tokens_per_s": rate(&r0),
                "worker_1_restarted_tokens_per_s": rate(&r1), "wall_s": wall,
                "killed_after_s": args.kill_after, "worker_0": r0, "worker_1_restarted": r1,
                "documents": ids.len(), "chunks": chunks, "objects": stored, "one_process": solo,
            })),
        Line::lower("scaleout.ttft_remote_tier", p50(&remote), p50(&recompute), "ms", "recompute (assembly full)")
            .detail(json!({"p90": percentile(&remote, 0.9), "remote_hits": hits1 - hits0, "inline_prefills": misses2 - misses0, "answers_identical_a_b": same, "questions": asked.len()})),
        Line::lower("scaleout.ttft_local", p50(&local), p50(&recompute), "ms", "recompute (assembly full)")
            .detail(json!({"p90": percentile(&local, 0.9), "recompute_p90": percentile(&recompute, 0.9)})),
        Line::higher("scaleout.qps_two_nodes", two, one, "queries/s", "one node")
            .detail(json!({"clients": 2 * args.clients, "rounds": args.rounds, "max_tokens": args.max_tokens, "pinned": pinned, "deletion": deleted})),
    ])
}
