//! `ragkv bench peer --cache-dtype q8 --versus-cache f16`: ragkv's own throughput with one
//! decoding-cache dtype against another on the same engine, prompts and clients, and how
//! closely the two answer alike: teacher-forced (the `versus` caches' greedy answer to each
//! question fed through both kinds of caches the same way, the share of token decisions on
//! which they agree) and free-running (the share of each answer both produce
//! from its start: greedy answers of 64 tokens drift apart after any near-tie, so this one
//! is low even between f32 and f16 caches).

use std::sync::Arc;

use serve::{CacheDtype, ServeConfig};

use crate::peer::{measure, Args, Ragkv, Side};
use crate::{Error, Line};

/// Parses `f16`, `f32` or `q8`.
pub(crate) fn parse_cache(s: &str) -> Result<CacheDtype, String> {
    match s {
        "f16" => Ok(CacheDtype::F16),
        "f32" => Ok(CacheDtype::F32),
        "q8" => Ok(CacheDtype::Q8),
        _ => Err(format!("{s:?} is not a cache dtype (f16, f32, q8)")),
    }
}

fn name(d: CacheDtype) -> &'static str {
    match d {
        CacheDtype::F16 => "f16",
        CacheDtype::F32 => "f32",
        CacheDtype::Q8 => "q8",
    }
}

/// Serves the same engine with `versus` caches and measures it as [`measure`] does.
pub(crate) fn measure_versus(
    engine: &Arc<ingest::Engine>,
    config: &ServeConfig,
    versus: CacheDtype,
    questions: &[String],
    prompts: &[Vec<u32>],
    args: &Args,
) -> Result<Side, Error> {
    let config = ServeConfig {
        cache_dtype: versus,
        ..config.clone()
    };
    let (rt, addr, rag) = crate::engine::serve_loopback(engine, config)?;
    let peer = Ragkv {
        addr,
        questions,
        top_k: args.top_k,
        max_tokens: args.max_tokens,
        assembly: None,
    };
    let drop_pages = || crate::ttft::drop_segment_pages(engine);
    let side = measure(
        &format!("ragkv-{}", name(versus)),
        &peer,
        prompts,
        args,
        &drop_pages,
    );
    drop(rt);
    drop(rag);
    side
}

/// Teacher-forced agreement of `args.cache_dtype` caches with `versus` ones over
/// `questions`: (agreeing decisions, decisions).
fn forced_agreement(
    engine: &Arc<ingest::Engine>,
    config: &ServeConfig,
    versus: CacheDtype,
    questions: &[String],
    args: &Args,
) -> Result<(usize, usize), Error> {
    let start = |cache_dtype| {
        let c = ServeConfig {
            cache_dtype,
            ..config.clone()
        };
        serve::Rag::start(engine.clone(), c).map_err(|e| Error::Check(e.to_string()))
    };
    let (reference, ours) = (start(versus)?, start(args.cache_dtype)?);
    let (mut agree, mut total) = (0, 0);
    for q in questions {
        let query = serve::Query {
            question: q.clone(),
            top_k: args.top_k,
            filter: Default::default(),
            params: model::GenerateParams {
                max_tokens: args.max_tokens,
                ignore_eos: true,
                ..Default::default()
            },
            kv: serve::KvMode::On,
            assembly: serve::Assembly::default(),
        };
        let hits = ours
            .retrieve(&query)
            .map_err(|e| Error::Check(e.to_string()))?;
        let r = reference
            .reference(&query, hits.clone())
            .map_err(|e| Error::Check(e.to_string()))?;
        // Both sides teacher-forced the same way on the same answer, so that only the caches
        // differ (the forced pass itself rounds differently from the greedy one).
        let decisions = |rag: &serve::Rag| -> Result<Vec<u32>, Error> {
            let logits = rag
                .forced(&query, hits.clone(), &r.targets)
                .map_err(|e| Error::Check(e.to_string()))?;
            logits
                .argmax(model::D::Minus1)
                .and_then(|t| t.to_vec1())
                .map_err(|e| Error::Check(format!("argmax: {e}")))
        };
        let (want, got) = (decisions(&reference)?, decisions(&ours)?);
        agree += got.iter().zip(&want).filter(|(a, b)| a == b).count();
        total += want.len();
    }
    Ok((agree, total))
}

/// Queries/s at the most clients, and the answers' token agreement, of `ours` (cache
/// `args.cache_dtype`) against `theirs` (cache `versus`).
pub(crate) fn lines(
    engine: &Arc<ingest::Engine>,
    config: &ServeConfig,
    questions: &[String],
    args: &Args,
    versus: CacheDtype,
    ours: &Side,
    theirs: &Side,
) -> Result<Vec<Line>, Error> {
    let (forced_agree, forced_total) = forced_agreement(engine, config, versus, questions, args)?;
    let tok = engine.corpus().model().tokenizer();
    let (mut common, mut total, mut identical) = (0usize, 0usize, 0usize);
    for (a, b) in ours.answers.iter().zip(&theirs.answers) {
        let enc = |s: &str| {
            tok.encode(s)
                .map_err(|e| Error::Check(format!("tokenize: {e}")))
        };
        let (x, y) = (enc(a)?, enc(b)?);
        common += x.iter().zip(&y).take_while(|(p, q)| p == q).count();
        total += y.len();
        identical += usize::from(x == y);
    }
    let base = format!("ragkv with {} decoding caches", name(versus));
    let max = args.clients.iter().copied().max().unwrap_or(1);
    let top = args.clients.iter().position(|&c| c == max).unwrap_or(0);
    let mut qps = Line::higher(
        &format!("peer.cache_qps.c{max}.{}", name(args.cache_dtype)),
        ours.qps[top],
        theirs.qps[top],
        "queries/s",
        &base,
    );
    qps.detail = Some(serde_json::json!({
        "qps_by_clients": {"clients": args.clients, "ours": ours.qps, "baseline": theirs.qps},
    }));
    let share = forced_agree as f64 / forced_total.max(1) as f64;
    let mut agree = Line::higher(
        &format!("peer.cache_answer_tokens.{}", name(args.cache_dtype)),
        share,
        1.0,
        "teacher-forced share of the baseline's answer-token decisions",
        &base,
    );
    agree.detail = Some(serde_json::json!({
        "forced_tokens": forced_total,
        "free_running": {"identical_answers": identical, "of": theirs.answers.len(),
                         "common_prefix_tokens": common, "tokens": total},
    }));
    Ok(vec![qps, agree])
}
