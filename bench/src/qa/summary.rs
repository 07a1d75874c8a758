//! The JSON lines of `ragkv eval qa`: each strategy's figures over the logged questions.

use serve::Assembly;

use super::codec;
use super::context::PLAIN_NAIVE;
use super::{default_strategy, Answer, Logged, QaLine, RunHeader};
use crate::score;

/// The figures of each strategy over `done` (one line per question); `full` last.
pub(crate) fn summarize(done: &[Logged], header: &RunHeader) -> Vec<QaLine> {
    let n = done.len().max(1) as f64;
    let plain_naive = (!header.context.is_empty()).then(|| PLAIN_NAIVE.to_string());
    let names: Vec<String> = plain_naive
        .into_iter()
        .chain(header.strategies.iter().cloned())
        .chain([Assembly::Full.to_string()])
        .collect();
    let of = |name: &str| -> Vec<&Answer> {
        done.iter()
            .filter_map(|l| l.answers.iter().find(|a| a.strategy == name))
            .collect()
    };
    let full = of(Assembly::Full.name());
    let full_f1 = full.iter().map(|a| a.f1).sum::<f64>() / n;
    let default_name = default_strategy().to_string();
    let mut lines: Vec<QaLine> = names
        .iter()
        .map(|name| {
            let xs = of(name);
            let sum = |f: &dyn Fn(&Answer) -> f64| xs.iter().map(|a| f(a)).sum::<f64>();
            let diffs: Vec<f64> = xs.iter().zip(&full).map(|(a, r)| a.f1 - r.f1).collect();
            let (lo, hi) = score::bootstrap_ci95(&diffs, score::RESAMPLES);
            let tokens = xs.iter().map(|a| a.forced_tokens).sum::<usize>();
            let agree = xs.iter().map(|a| a.forced_agree).sum::<usize>();
            let per_question: Vec<(f64, f64)> = xs
                .iter()
                .map(|a| (a.forced_agree as f64, a.forced_tokens as f64))
                .collect();
            let mut line = QaLine {
                eval: "qa",
                strategy: name.clone(),
                questions: xs.len(),
                f1: sum(&|a| a.f1) / n,
                em: sum(&|a| f64::from(u8::from(a.em))) / n,
                f1_points_vs_full: (sum(&|a| a.f1) / n - full_f1) * 100.0,
                f1_points_ci95: (lo * 100.0, hi * 100.0),
                agreement_answers: sum(&|a| f64::from(u8::from(a.identical))) / n,
                agreement_tokens: agree as f64 / tokens.max(1) as f64,
                agreement_tokens_ci95: score::bootstrap_ratio_ci95(&per_question, score::RESAMPLES),
                forced_tokens: tokens,
                kl_mean: sum(&|a| a.kl_sum) / tokens.max(1) as f64,
                gap_closed: None,
                default: *name == default_name,
                ttft_ms_mean: sum(&|a| a.ttft_ms) / n,
                recomputed_tokens_mean: sum(&|a| a.recomputed as f64) / n,
                top_k: header.top_k,
                model: header.model.clone(),
                chunk_preamble: header.chunk_preamble.clone(),
                context: match header.context.as_str() {
                    _ if name == PLAIN_NAIVE => "none".into(),
                    "" => "none".into(),
                    c => c.into(),
                },
                codec: None,
                f1_points_vs_uncompressed: None,
                f1_points_vs_uncompressed_ci95: None,
                agreement_tokens_vs_uncompressed: None,
                agreement_tokens_vs_uncompressed_ci95: None,
                kl_vs_uncompressed: None,
            };
            codec::vs_uncompressed(&mut line, &xs, header);
            line
        })
        .collect();
    // The gap is naive's on plain KV (with `--context`, its own line).
    let naive = lines
        .iter()
        .find(|l| l.strategy == PLAIN_NAIVE)
        .or_else(|| lines.iter().find(|l| l.strategy == Assembly::Naive.name()))
        .map(|l| l.agreement_tokens);
    for l in &mut lines {
        l.gap_closed = naive
            .filter(|&g| g < 1.0)
            .map(|g| (l.agreement_tokens - g) / (1.0 - g));
    }
    lines
}
