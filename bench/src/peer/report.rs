//! `bench peer`'s JSON lines from what each side measured, and how the two sides' answers
//! compare.

use super::{Args, Side};
use crate::{percentile, Error, Line};

/// How ragkv's answers compare with llama-server's to the same prompts: identical answers,
/// and the mean share of llama-server's answer that ragkv's matches from its start.
pub(super) fn agreement(what: &str, ours: &[String], theirs: &[String]) -> serde_json::Value {
    let identical = ours
        .iter()
        .zip(theirs)
        .filter(|(a, b)| a.trim() == b.trim())
        .count();
    let prefix: f64 = ours
        .iter()
        .zip(theirs)
        .enumerate()
        .map(|(i, (a, b))| {
            let common = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
            eprintln!(
                "[peer] {what} answer {i}: {common} chars in common\n  ragkv: {a:?}\n  llama: {b:?}"
            );
            common as f64 / b.chars().count().max(1) as f64
        })
        .sum::<f64>()
        / theirs.len().max(1) as f64;
    serde_json::json!({"identical": identical, "of": theirs.len(), "common_prefix_share": prefix})
}

/// ragkv's queries/s with the most clients against its own with one client.
pub(super) fn scaling(args: &Args, ours: &Side) -> Option<Line> {
    let max = args.clients.iter().copied().max()?;
    let one = args.clients.iter().position(|&c| c == 1)?;
    let top = args.clients.iter().position(|&c| c == max)?;
    let mut l = Line::higher(
        &format!("peer.batch_scaling.c{max}"),
        ours.qps[top],
        ours.qps[one],
        "queries/s",
        "ragkv itself with one client",
    )
    .bar(4.0);
    l.detail = Some(serde_json::json!({"ragkv_stages_ms_mean": ours.stages[top]}));
    Some(l)
}

pub(super) fn lines(
    args: &Args,
    ours: &Side,
    theirs: &Side,
    prompt_mean: f64,
    kv_hits_all: bool,
) -> Result<Vec<Line>, Error> {
    let base = format!(
        "llama.cpp llama-server, same GGUF and prompt tokens, full prefill (cache_prompt off), \
         {} slots",
        args.slots
    );
    let mut out = Vec::new();
    for (name, p) in [("peer.ttft_p50", 0.5), ("peer.ttft_p90", 0.9)] {
        let l = Line::lower(
            name,
            percentile(&ours.ttft, p),
            percentile(&theirs.ttft, p),
            "ms",
            &base,
        );
        out.push(if p == 0.5 { l.bar(10.0) } else { l });
    }
    out.push(Line::lower(
        "peer.ttft_after_retrieval_p50",
        percentile(&ours.ttft_retrieved, 0.5),
        percentile(&theirs.ttft_retrieved, 0.5),
        "ms",
        &format!(
            "{base}; ragkv's time from its retrieval's end (llama-server is sent the retrieved \
             prompt: it does no retrieval)"
        ),
    ));
    let warm = if args.resident_mb > 0 {
        "ragkv's chunk KV resident on the model's device (serve.resident_mb)"
    } else {
        "ragkv's stored KV in the page cache (not dropped)"
    };
    out.push(Line::lower(
        "peer.ttft_warm_p50",
        percentile(&ours.ttft_warm, 0.5),
        percentile(&theirs.ttft_warm, 0.5),
        "ms",
        &format!("{base}; {warm}"),
    ));
    out[0].detail = Some(serde_json::json!({
        "model": args.llm.name(), "quantized": args.llm.quantized, "questions": args.questions,
        "top_k": args.top_k, "chunk_tokens": args.chunk_tokens, "prompt_tokens_mean": prompt_mean,
        "max_tokens": args.max_tokens, "ragkv_prompt_mismatches": ours.prompt_mismatches,
        "llama_prompt_mismatches": theirs.prompt_mismatches,
        "ragkv_short_answers": ours.short_answers, "llama_short_answers": theirs.short_answers,
        "ragkv_all_kv_hits": kv_hits_all, "ragkv_kv_read": "cold (pages dropped)",
    }));
    let max = args.clients.iter().copied().max().unwrap_or(1);
    for (i, &c) in args.clients.iter().enumerate() {
        let mut l = Line::higher(
            &format!("peer.queries_per_s.c{c}"),
            ours.qps[i],
            theirs.qps[i],
            "queries/s",
            &base,
        );
        if c == max {
            l = l.bar(1.0);
        }
        l.detail = Some(serde_json::json!({
            "clients": c, "queries": c * args.rounds,
            "ragkv_latency_ms_mean": ours.latency_ms[i], "llama_latency_ms_mean": theirs.latency_ms[i],
            "ragkv_stages_ms_mean": ours.stages[i],
        }));
        out.push(l);
    }
    out.extend(scaling(args, ours));
    if ours.prompt_mismatches + theirs.prompt_mismatches > 0 {
        eprintln!(
            "[peer] warning: prompt lengths differ from the computed prompts (ragkv {}, \
             llama-server {}): see the detail",
            ours.prompt_mismatches, theirs.prompt_mismatches
        );
    }
    Ok(out)
}
