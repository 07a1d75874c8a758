//! `ragkv bench peer`: ragkv against llama.cpp's `llama-server`, the server a user would
//! otherwise run, on the same GGUF file, the same corpus and the identical prompts, both over
//! HTTP on loopback.
//!
//! The corpus (LongBench-HotpotQA's first `--docs` documents) is indexed and the chunks each
//! question retrieves are materialized (stored KV, as eager ingest leaves it). Each
//! question's whole prompt (system prefix, retrieved chunks, question, in the model's chat
//! template) is computed once by ragkv ([`serve::Rag::prompt_tokens`]) and sent to
//! llama-server as token ids, so both sides answer the identical prompt; ragkv answers its
//! own HTTP query (its retrieval included) and the prompt length it reports is checked
//! against those tokens, as is the number llama-server says it evaluated. llama-server runs
//! with `--parallel` slots and `cache_prompt: false` (every prompt prefilled in full: what
//! RAG without stored KV costs); ragkv with `serve.max_batch` = the same number. Both
//! generate exactly `--max-tokens` greedy tokens (`ignore_eos`).
//!
//! Phases, one server at a time (ragkv's is shut down before llama-server starts):
//! 1. time to first token, one query at a time, after a warm-up: ragkv from stored KV read
//!    cold (the segment files' pages dropped and the resident tier emptied before each
//!    query), llama-server's full prefill (`peer.ttft_p50`; `peer.ttft_after_retrieval_p50`
//!    the same with ragkv's retrieval taken out, since llama-server is sent the retrieved
//!    prompt); then every question again without dropping anything (`peer.ttft_warm_p50`:
//!    ragkv's stored KV in the page cache, as hot chunks are on a serving machine, or with
//!    `--resident-mb` already on the model's device);
//! 2. queries/s with each of `--clients` concurrent clients (1, 4, 8), every client sending
//!    `--rounds` queries over the questions in turn (ragkv's segment pages stay cached, as
//!    on a serving machine);
//! 3. (ragkv) every question again with `assembly: full`: its answers and the stored-KV ones
//!    are compared with llama-server's to the same prompt tokens (identical answers, common
//!    prefix), the engines' numerics side by side.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use retrieval::SearchFilter;
use serve::ServeConfig;

use llama::{start_llama, Llama};
use report::{agreement, lines, scaling};

use crate::sse::{post, Streamed};
use crate::{dataset, Error, Line};

// The decoding-cache comparison and llama-server's side.
mod cache;
mod llama;
mod report;

/// Arguments of `ragkv bench peer`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// llama.cpp's llama-server (default: the one scripts/llama-server.sh builds into the
    /// cache).
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// Dev questions (distinct prompts).
    #[arg(long, default_value_t = 8)]
    pub questions: usize,
    /// Chunks per question.
    #[arg(long, default_value_t = 4)]
    pub top_k: usize,
    /// Model tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// Tokens generated per answer (both sides, end-of-turn tokens banned).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Concurrent client counts, one throughput phase each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub clients: Vec<usize>,
    /// Queries each client sends per throughput phase.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Sequences served at once: llama-server's `--parallel`, ragkv's `serve.max_batch`.
    #[arg(long, default_value_t = 8)]
    pub slots: usize,
    /// Threads for llama-server (ragkv uses every CPU the process may: RAYON_NUM_THREADS).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Corpus documents indexed.
    #[arg(long, default_value_t = 200)]
    pub docs: usize,
    /// LongBench-HotpotQA directory (default: the shared datasets).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// The model (both servers run the same GGUF).
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Measure ragkv alone (no llama-server phases; only the scaling line is printed): for
    /// working on ragkv's side.
    #[arg(long)]
    pub skip_llama: bool,
    /// Working directory (default: a fresh temporary one); with an index there, indexing
    /// is skipped, and stored chunks are not prefilled again.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// ragkv's decoding caches (`serve.cache_dtype`): f16, f32 or q8.
    #[arg(long, default_value = "f16", value_parser = cache::parse_cache)]
    pub cache_dtype: serve::CacheDtype,
    /// Also measure ragkv with these caches, and compare (`peer.cache_qps`,
    /// `peer.cache_answer_tokens`).
    #[arg(long, value_parser = cache::parse_cache)]
    pub versus_cache: Option<serve::CacheDtype>,
    /// ragkv's chunk KV kept on the model's device between queries (`serve.resident_mb`; 0:
    /// none, as by default): the cold phase empties it before each query, the warm phase
    /// finds every chunk there.
    #[arg(long, default_value_t = 0)]
    pub resident_mb: usize,
    /// Codec of ragkv's stored chunk KV (`kvstore.codec`: none, q8, q4, ...; `ragkv ingest`
    /// stores q8 by default); use a separate `--dir` per codec.
    #[arg(long, default_value = "none", value_parser = crate::qa::parse_codec)]
    pub codec: kvstore::Codec,
    /// What the chunks are prefilled after (`--context`, `--exact-first`).
    #[command(flatten)]
    pub materialization: crate::engine::Materialization,
}

/// One answered query, as the client saw it.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) first_ms: f64,
    pub(crate) total_ms: f64,
    /// Prompt tokens the server reports: ragkv's assembled prompt, llama-server's evaluated.
    pub(crate) prompt: usize,
    pub(crate) completion: usize,
    /// Where ragkv says the time went (retrieve, queue, load, assemble, prefill, decode;
    /// ms); none from llama-server.
    pub(crate) stages: Option<[f64; 6]>,
    /// The answer's text.
    pub(crate) answer: String,
}

/// The stages of [`Outcome::stages`].
const STAGES: [&str; 6] = [
    "retrieve_ms",
    "queue_ms",
    "load_ms",
    "assemble_ms",
    "prefill_ms",
    "decode_ms",
];

/// A server under test: how to send question `i`.
pub(crate) trait Peer: Sync {
    fn ask(&self, i: usize) -> Result<Outcome, String>;
}

pub(crate) const TIMEOUT: Duration = Duration::from_secs(900);

pub(crate) fn json_usize(v: &serde_json::Value, path: &[&str]) -> usize {
    path.iter()
        .try_fold(v, |v, k| v.get(k))
        .and_then(|v| v.as_u64())
        .unwrap_or(0) as usize
}

pub(crate) fn first(r: &Streamed, what: &str) -> Result<f64, String> {
    if r.status != 200 {
        let msg = r.events.last().map(|e| e.1.as_str()).unwrap_or("");
        return Err(format!("{what}: HTTP {}: {msg}", r.status));
    }
    r.first_ms
        .ok_or_else(|| format!("{what}: no token event in the response"))
}

pub(crate) struct Ragkv<'a> {
    pub(crate) addr: SocketAddr,
    pub(crate) questions: &'a [String],
    pub(crate) top_k: usize,
    pub(crate) max_tokens: usize,
    /// The assembly strategy (`None`: the server's default).
    pub(crate) assembly: Option<&'static str>,
}

impl Peer for Ragkv<'_> {
    fn ask(&self, i: usize) -> Result<Outcome, String> {
        let mut body = serde_json::json!({
            "question": self.questions[i], "top_k": self.top_k, "max_tokens": self.max_tokens,
            "stream": true, "ignore_eos": true,
        });
        if let Some(a) = self.assembly {
            body["assembly"] = a.into();
        }
        let r = post(self.addr, "/v1/query", &body, b"event: token", TIMEOUT)
            .map_err(|e| e.to_string())?;
        let first_ms = first(&r, "ragkv")?;
        let done = r
            .events
            .iter()
            .find(|e| e.0.as_deref() == Some("done"))
            .and_then(|e| serde_json::from_str::<serde_json::Value>(&e.1).ok())
            .ok_or_else(|| format!("ragkv: no done event: {:?}", r.events.last()))?;
        let stage = |k: &str| done["timings"][k].as_f64().unwrap_or(f64::NAN);
        Ok(Outcome {
            first_ms,
            total_ms: r.total_ms,
            prompt: json_usize(&done, &["prompt_tokens"]),
            completion: json_usize(&done, &["completion_tokens"]),
            stages: Some(STAGES.map(stage)),
            answer: done["answer"].as_str().unwrap_or_default().to_string(),
        })
    }
}

/// `clients` threads, each sending `rounds` queries (client `c`'s round `r` asks question
/// `(c + r * clients) % n`), client `c` to `peers[c % peers.len()]`: the outcomes and the
/// wall time, or the first failure.
pub(crate) fn phase(
    peers: &[&dyn Peer],
    n: usize,
    clients: usize,
    rounds: usize,
) -> Result<(Vec<Outcome>, f64), String> {
    let t = Instant::now();
    let results: Vec<Result<Vec<Outcome>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                let peer = peers[c % peers.len()];
                s.spawn(move || {
                    (0..rounds)
                        .map(|r| peer.ask((c + r * clients) % n))
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("client thread panicked".into()))
            })
            .collect()
    });
    let wall = t.elapsed().as_secs_f64();
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    Ok((all, wall))
}

/// What one side measured.
#[derive(Debug, Default)]
pub(crate) struct Side {
    /// Time to first token of each question alone, sorted.
    ttft: Vec<f64>,
    /// The same from the end of retrieval (ragkv; llama-server is given the retrieved
    /// prompt, so its own), sorted.
    ttft_retrieved: Vec<f64>,
    /// The same again with nothing dropped before each query (ragkv's stored KV in the page
    /// cache, as hot chunks are on a serving machine), sorted.
    ttft_warm: Vec<f64>,
    /// Queries/s per client count.
    pub(crate) qps: Vec<f64>,
    /// Prompts whose reported length differs from the tokens computed for them.
    prompt_mismatches: usize,
    /// Answers that did not have `max_tokens` tokens.
    short_answers: usize,
    /// Mean latency per client count, ms.
    latency_ms: Vec<f64>,
    /// Mean of each stage per client count (ragkv only).
    stages: Vec<Option<serde_json::Value>>,
    /// Each question's answer in the time-to-first-token phase.
    pub(crate) answers: Vec<String>,
}

/// One side's phases. `before_each` runs before each cold query; with `prime`, each question
/// is asked once, untimed, before its warm query (ragkv with a resident tier, which the cold
/// pass emptied before every query).
pub(crate) fn measure(
    name: &str,
    peer: &dyn Peer,
    prompts: &[Vec<u32>],
    args: &Args,
    before_each: &dyn Fn() -> Result<(), Error>,
    prime: bool,
) -> Result<Side, Error> {
    let fail = |e: String| Error::Check(format!("{name}: {e}"));
    let n = prompts.len();
    let mut side = Side::default();
    let check = |o: &Outcome, i: usize, side: &mut Side| {
        side.prompt_mismatches += usize::from(o.prompt != prompts[i].len());
        side.short_answers += usize::from(o.completion != args.max_tokens);
    };
    peer.ask(0).map_err(fail)?;
    for i in 0..n {
        before_each()?;
        let o = peer.ask(i).map_err(fail)?;
        eprintln!(
            "[peer] {name}: question {i}: first token {:.0} ms, answer {:.0} ms ({} prompt tokens), stages {:?}",
            o.first_ms, o.total_ms, o.prompt, o.stages
        );
        check(&o, i, &mut side);
        side.ttft.push(o.first_ms);
        side.ttft_retrieved
            .push(o.first_ms - o.stages.map_or(0.0, |s| s[0]));
        side.answers.push(o.answer);
    }
    side.ttft.sort_by(f64::total_cmp);
    side.ttft_retrieved.sort_by(f64::total_cmp);
    for i in 0..n {
        if prime {
            peer.ask(i).map_err(fail)?;
        }
        let o = peer.ask(i).map_err(fail)?;
        eprintln!(
            "[peer] {name}: question {i} again (warm): first token {:.0} ms, stages {:?}",
            o.first_ms, o.stages
        );
        side.ttft_warm.push(o.first_ms);
    }
    side.ttft_warm.sort_by(f64::total_cmp);
    for &c in &args.clients {
        let (outcomes, wall) = phase(&[peer], n, c, args.rounds).map_err(fail)?;
        let qps = outcomes.len() as f64 / wall;
        let mean = outcomes.iter().map(|o| o.total_ms).sum::<f64>() / outcomes.len() as f64;
        eprintln!(
            "[peer] {name}: {c} clients: {} queries in {wall:.1} s = {qps:.3}/s, mean latency {mean:.0} ms",
            outcomes.len()
        );
        let stages = outcomes
            .iter()
            .map(|o| o.stages)
            .collect::<Option<Vec<_>>>();
        let stages = stages.map(|all| {
            let mut means = serde_json::Map::new();
            for (i, name) in STAGES.iter().enumerate() {
                let m = all.iter().map(|s| s[i]).sum::<f64>() / all.len() as f64;
                means.insert(name.to_string(), m.into());
            }
            eprintln!("[peer] {name}: {c} clients: mean stages {means:?}");
            serde_json::Value::Object(means)
        });
        side.qps.push(qps);
        side.latency_ms.push(mean);
        side.stages.push(stages);
    }
    Ok(side)
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    if args.clients.is_empty() || args.clients.contains(&0) || args.rounds == 0 {
        return Err(Error::Invalid {
            what: "--clients/--rounds",
            why: "each client count and the rounds must be ≥ 1".into(),
        });
    }
    // Found first, so that a missing binary fails before the minutes of indexing; not
    // needed at all with `--skip-llama`.
    let llama_bin = if args.skip_llama {
        None
    } else {
        Some(crate::llama::binary(
            args.llama_server.as_deref(),
            "llama-server",
        )?)
    };
    let model_path = args
        .llm
        .model
        .clone()
        .unwrap_or_else(|| model::models_dir().join(model::SMOLLM2_FILE));
    if model_path.extension().and_then(|e| e.to_str()) != Some("gguf") {
        return Err(Error::Invalid {
            what: "--model",
            why: "llama-server needs a GGUF file".into(),
        });
    }
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let work_dir = crate::WorkDir::new(args.dir.as_deref())?;
    let ingest_config = args.materialization.config(args.chunk_tokens);
    let engine = std::sync::Arc::new(crate::engine::open_indexed(
        work_dir.path(),
        &args.llm,
        ingest_config,
        &ds,
        args.docs,
        "peer",
        args.codec,
    )?);
    let questions: Vec<String> = dataset::questions(&ds, args.questions)?
        .into_iter()
        .map(|q| q.question.trim().to_string())
        .collect();
    let max_clients = args.clients.iter().copied().max().unwrap_or(1);
    let config = ServeConfig {
        max_inflight: max_clients.max(args.slots) * 2,
        max_batch: args.slots,
        cache_dtype: args.cache_dtype,
        resident_mb: args.resident_mb,
        ..ServeConfig::default()
    };
    let (rt, addr, rag) = crate::engine::serve_loopback(&engine, config.clone())?;

    // The prompts, and the chunks they retrieve materialized.
    let t = Instant::now();
    let mut prompts = Vec::with_capacity(questions.len());
    let mut materialized = 0;
    for q in &questions {
        let v = engine
            .corpus()
            .embedder()
            .embed_one(q)
            .map_err(|e| Error::Check(format!("embed: {e}")))?;
        let hits = engine
            .corpus()
            .index()
            .search(&v, args.top_k, &SearchFilter::default())
            .map_err(|e| Error::Check(format!("search: {e}")))?;
        materialized += crate::engine::materialize(&engine, &hits)?;
        prompts.push(
            rag.prompt_tokens(q, &hits)
                .map_err(|e| Error::Check(e.to_string()))?,
        );
    }
    engine.corpus().store().sync()?;
    let prompt_mean = prompts.iter().map(Vec::len).sum::<usize>() as f64 / prompts.len() as f64;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    eprintln!(
        "[peer] {} prompts of {prompt_mean:.0} tokens on average ({materialized} chunks \
         materialized in {:.1} s)",
        prompts.len(),
        t.elapsed().as_secs_f64()
    );

    let ours = {
        let peer = Ragkv {
            addr,
            questions: &questions,
            top_k: args.top_k,
            max_tokens: args.max_tokens,
            assembly: None,
        };
        let cold = || crate::ttft::cold(&engine, &rag);
        measure("ragkv", &peer, &prompts, args, &cold, args.resident_mb > 0)?
    };
    // The same prompts prefilled in full (`assembly: full`): the engines' numerics side by
    // side, without the stored chunks' assembly in between.
    let full = Ragkv {
        assembly: Some("full"),
        addr,
        questions: &questions,
        top_k: args.top_k,
        max_tokens: args.max_tokens,
    };
    let full_answers = (0..questions.len())
        .map(|i| full.ask(i).map(|o| o.answer))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Check(format!("ragkv full: {e}")))?;
    let kv_hits_all = rag
        .metrics
        .kv_misses
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0;
    drop(rt);
    drop(rag);
    let versus = match args.versus_cache {
        Some(d) => {
            let side = cache::measure_versus(&engine, &config, d, &questions, &prompts, args)?;
            cache::lines(&engine, &config, &questions, args, d, &ours, &side)?
        }
        None => Vec::new(),
    };
    crate::engine::close(engine);

    let Some(llama_bin) = llama_bin else {
        return Ok(scaling(args, &ours).into_iter().chain(versus).collect());
    };
    let ctx_per_slot = (longest + args.max_tokens + 64).div_ceil(256) * 256;
    let theirs = {
        let log = work_dir.path().join("llama-server.log");
        let (_server, addr) = start_llama(&llama_bin, &model_path, args, ctx_per_slot, &log)?;
        let peer = Llama {
            addr,
            prompts: &prompts,
            max_tokens: args.max_tokens,
        };
        measure("llama-server", &peer, &prompts, args, &|| Ok(()), false)?
    };
    let mut out = lines(args, &ours, &theirs, prompt_mean, kv_hits_all)?;
    if let Some(detail) = out[0].detail.as_mut() {
        detail["answers_full_prefill"] = agreement("full", &full_answers, &theirs.answers);
        detail["answers_stored_kv"] = agreement("stored", &ours.answers, &theirs.answers);
    }
    out.extend(versus);
    Ok(out)
}
