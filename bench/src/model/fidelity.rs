//! How close the quantized weights path (`model.weights = "quantized"`: the file's blocks,
//! activations rounded to 8 bits per block) comes to the dequantized reference (the same
//! weights widened to f32, f32 activations) on one text, position by position: what a
//! kernel's numerics cost, apart from its speed.

use std::path::Path;

use model::{LoadOptions, Logits, Model, ModelSource};

use super::{cerr, merr};
use crate::{Error, Line};

/// Greedy next tokens of `ours` against the reference's at each of the first `tokens` tokens
/// of `text` (one prefill each, every position's logits), as a line: percent equal, and in
/// its `detail` the mean KL(reference ‖ ours) of the next-token distributions.
pub(super) fn line(
    source: &ModelSource,
    ours: &Model,
    text: &Path,
    tokens: usize,
) -> Result<Line, Error> {
    let text = std::fs::read_to_string(text).map_err(crate::io(text.display().to_string()))?;
    let mut ids = ours.tokenizer().encode(&text).map_err(merr)?;
    ids.truncate(tokens);
    if ids.is_empty() {
        return Err(Error::Invalid {
            what: "--fidelity",
            why: "the text has no tokens".into(),
        });
    }
    let reference = Model::load(source, &LoadOptions::default()).map_err(merr)?;
    let logits = |m: &Model| -> Result<Vec<Vec<f32>>, Error> {
        let mut cache = m.decoder().new_cache(ids.len()).map_err(merr)?;
        let l = m
            .decoder()
            .forward(&mut cache, &ids, Logits::All)
            .map_err(merr)?;
        l.to_dtype(candle_core::DType::F32)
            .and_then(|l| l.to_vec2::<f32>())
            .map_err(cerr)
    };
    let (got, want) = (logits(ours)?, logits(&reference)?);
    let (mut equal, mut kl) = (0usize, 0f64);
    for (g, w) in got.iter().zip(&want) {
        equal += usize::from(argmax(g) == argmax(w));
        kl += kl_divergence(w, g);
    }
    let n = got.len();
    eprintln!(
        "fidelity: {equal}/{n} greedy next tokens equal to the reference's, mean KL {:.5}",
        kl / n as f64
    );
    Ok(Line::higher(
        "model.quantized_agreement",
        100.0 * equal as f64 / n as f64,
        100.0,
        "% greedy next tokens equal",
        "the dequantized reference (f32 weights and activations)",
    )
    .detail(serde_json::json!({"kl_mean": kl / n as f64, "positions": n})))
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

/// `log Σ exp(v)`, stably.
fn log_sum_exp(v: &[f32]) -> f64 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
}

/// KL(p ‖ q) of the softmaxes of logits `p` and `q`.
fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_sum_exp(p), log_sum_exp(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let log_p = a as f64 - lp;
            log_p.exp() * (log_p - (b as f64 - lq))
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_logits_and_positive_otherwise() {
        let p = [1.0f32, 2.0, 3.0];
        assert!(kl_divergence(&p, &p).abs() < 1e-12);
        // A shift of every logit is the same distribution.
        assert!(kl_divergence(&p, &[11.0, 12.0, 13.0]).abs() < 1e-9);
        let k = kl_divergence(&p, &[3.0, 2.0, 1.0]);
        assert!(k > 0.5, "{k}");
        assert_eq!(argmax(&p), 2);
    }
}
