//! `ragkv bench peer --cache-dtype q8 --versus-cache f16`: ragkv's own throughput with one
//! decoding-cache dtype against another on the same engine, prompts and clients, and how
//! closely the two answer alike: teacher-forced (the `versus` caches' greedy answer to each
//! question fed through both kinds of caches the same way, the share of token decisions on
//! which they agree, with a 95 % bootstrap interval over the questions, and the mean KL
//! divergence of their next-token distributions, over all `--max-tokens` decisions and up to
//! the end of the answer proper) and free-running (the share of each answer both produce
//! from its start: greedy answers of 64 tokens drift apart after any near-tie, so this one is
//! low even between f32 and f16 caches). The f32 caches' teacher-forced agreement with the
//! same `versus` caches comes with it: the floor rounding alone sets for this measure.

use std::sync::Arc;

use serve::{CacheDtype, ServeConfig};

use crate::peer::{measure, Args, Ragkv, Side};
use crate::{score, Error, Line};

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
    let cold = || crate::ttft::cold(engine, &rag);
    let side = measure(
        &format!("ragkv-{}", name(versus)),
        &peer,
        prompts,
        args,
        &cold,
        args.resident_mb > 0,
    );
    drop(rt);
    drop(rag);
    side
}

/// Teacher-forced decisions compared: all of them, and those of the answer proper.
#[derive(Debug, Default, Clone)]
struct Forced {
    all: score::Forced,
    /// Agreeing and forced decisions of each question (all of them): its interval resamples
    /// whole questions, whose decisions within one answer are not independent.
    per_question: Vec<(f64, f64)>,
    /// Decisions up to and including the first one where the reference's own caches choose
    /// an end-of-turn token (answers run on past it: end-of-turn tokens are banned so that
    /// every answer is `--max-tokens` long, and what follows is the model rambling through
    /// near-ties).
    answer: score::Forced,
}

fn share(f: score::Forced) -> f64 {
    f.agree as f64 / f.tokens.max(1) as f64
}

fn kl_mean(f: score::Forced) -> f64 {
    f.kl_sum / f.tokens.max(1) as f64
}

/// Teacher-forced agreement of caches of each of `sides` with `versus` ones over
/// `questions`: the `versus` caches' greedy answer fed through both the same way.
fn forced_agreement(
    engine: &Arc<ingest::Engine>,
    config: &ServeConfig,
    versus: CacheDtype,
    sides: &[CacheDtype],
    questions: &[String],
    args: &Args,
) -> Result<Vec<Forced>, Error> {
    let start = |cache_dtype| {
        let c = ServeConfig {
            cache_dtype,
            ..config.clone()
        };
        serve::Rag::start(engine.clone(), c).map_err(|e| Error::Check(e.to_string()))
    };
    let reference = start(versus)?;
    let others = sides
        .iter()
        .map(|&d| start(d))
        .collect::<Result<Vec<_>, _>>()?;
    let eos = &engine.corpus().model().tokenizer().eos;
    let mut out = vec![Forced::default(); sides.len()];
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
        let hits = reference
            .retrieve(&query)
            .map_err(|e| Error::Check(e.to_string()))?;
        let r = reference
            .reference(&query, hits.clone())
            .map_err(|e| Error::Check(e.to_string()))?;
        // Every side teacher-forced the same way on the same answer, so that only the caches
        // differ (the forced pass itself rounds differently from the greedy one).
        let rows = |rag: &serve::Rag| -> Result<Vec<Vec<f32>>, Error> {
            let logits = rag
                .forced(&query, hits.clone(), &r.targets)
                .map_err(|e| Error::Check(e.to_string()))?;
            crate::qa::rows(&logits)
        };
        let want = rows(&reference)?;
        let decisions: Vec<u32> = want.iter().map(|r| score::argmax(r) as u32).collect();
        let end = decisions
            .iter()
            .position(|t| eos.contains(t))
            .map_or(decisions.len(), |i| i + 1);
        for (rag, f) in others.iter().zip(&mut out) {
            let got = rows(rag)?;
            let all = score::forced(&want, &got, &decisions);
            f.per_question.push((all.agree as f64, all.tokens as f64));
            f.all += all;
            let (w, g, t) = (&want[..end], &got[..end], &decisions[..end]);
            f.answer += score::forced(w, g, t);
        }
    }
    Ok(out)
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
    // f32 caches against `versus` too, unless one of the two is f32: the agreement that
    // rounding the cache to f16 alone leaves, the floor this measure can show.
    let mut sides = vec![args.cache_dtype];
    if args.cache_dtype != CacheDtype::F32 && versus != CacheDtype::F32 {
        sides.push(CacheDtype::F32);
    }
    let forced = forced_agreement(engine, config, versus, &sides, questions, args)?;
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
    let f = &forced[0];
    let ci = score::bootstrap_ratio_ci95(&f.per_question, score::RESAMPLES);
    let mut agree = Line::higher(
        &format!("peer.cache_answer_tokens.{}", name(args.cache_dtype)),
        share(f.all),
        1.0,
        "teacher-forced share of the baseline's answer-token decisions",
        &base,
    );
    let mut detail = serde_json::json!({
        "forced_tokens": f.all.tokens,
        "ci95": [ci.0, ci.1],
        "questions": f.per_question.len(),
        "kl_mean": kl_mean(f.all),
        "to_end_of_answer": {"share": share(f.answer), "tokens": f.answer.tokens,
                             "kl_mean": kl_mean(f.answer)},
        "free_running": {"identical_answers": identical, "of": theirs.answers.len(),
                         "common_prefix_tokens": common, "tokens": total},
    });
    if let Some(floor) = forced.get(1) {
        let ci = score::bootstrap_ratio_ci95(&floor.per_question, score::RESAMPLES);
        detail["f32_caches"] = serde_json::json!({
            "share": share(floor.all),
            "ci95": [ci.0, ci.1],
            "kl_mean": kl_mean(floor.all),
            "to_end_of_answer": share(floor.answer),
            "to_end_kl_mean": kl_mean(floor.answer),
        });
    }
    agree.detail = Some(detail);
    Ok(vec![qps, agree])
}
