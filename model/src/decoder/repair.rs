//! Repairing an assembled context: chunks computed alone never attended to each other, so
//! some of their tokens are recomputed with full attention over the whole context.
//!
//! [`Decoder::recompute`] (or [`Decoder::recompute_in`], in a decoding cache) does the
//! recomputing; what differs between the published repairs is
//! which tokens it is given:
//!
//! | selection | recomputes | cost beyond loading |
//! |---|---|---|
//! | [`Decoder::blend`] (CacheBlend) | the `share` of chunk tokens whose layer-1 KV deviates most from what full attention gives | layer 0 of every chunk token, then `share` of the tokens through every layer |
//! | [`link_positions`] (EPIC's LegoLink) | the first `k` tokens of every chunk (a chunk computed alone makes its first tokens an attention sink) | `k` tokens per chunk through every layer |
//! | [`sensitive_positions`] | the `k` tokens of every chunk whose rows moved most between the contexts ingest prefilled it in ([`Kv::drift`], recorded with the chunk) | `k` tokens per chunk through every layer |
//! | [`Decoder::question_attention`] + [`top_share`] (ProphetKV, QCFuse) | the `share` of chunk tokens the question attends to most on the first layers | the question through those layers, then `share` of the tokens through every layer |
//!
//! Recomputing every chunk token reproduces full prefill of the context (up to float rounding).

use candle_core::{DType, Tensor};

use super::Decoder;
use crate::error::{Ctx, Error, Result};
use crate::kv::{Kv, KvCache};

/// The first `k` positions of every chunk, for chunks of `lens` tokens that follow each other
/// from position `exact`: EPIC's selection. Ascending.
pub fn link_positions(exact: usize, lens: &[usize], k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(lens.len() * k);
    let mut start = exact;
    for &n in lens {
        out.extend(start..start + k.min(n));
        start += n;
    }
    out
}

/// `k` positions of every chunk, for chunks of `lens` tokens that follow each other from
/// position `exact`: the first `k` offsets of the chunk's `ranked` list (the chunk's tokens
/// whose rows moved most between the contexts ingest prefilled it in, most first; offsets
/// past the chunk are skipped), then, where the list runs short (a chunk without one), its
/// first tokens not yet taken, as [`link_positions`]. Ascending.
pub fn sensitive_positions(
    exact: usize,
    lens: &[usize],
    ranked: &[Vec<u16>],
    k: usize,
) -> Vec<usize> {
    let mut out = Vec::with_capacity(lens.len() * k);
    let mut start = exact;
    for (i, &n) in lens.iter().enumerate() {
        let want = k.min(n);
        let mut mine: Vec<usize> = Vec::with_capacity(want);
        let listed = ranked.get(i).map_or(&[][..], Vec::as_slice);
        for &o in listed {
            let o = usize::from(o);
            if mine.len() == want {
                break;
            }
            if o < n && !mine.contains(&o) {
                mine.push(o);
            }
        }
        let mut o = 0;
        while mine.len() < want {
            if !mine.contains(&o) {
                mine.push(o);
            }
            o += 1;
        }
        mine.sort_unstable();
        out.extend(mine.into_iter().map(|o| start + o));
        start += n;
    }
    out
}

/// The `share` (`0..=1`) of positions `exact..exact + scores.len()` whose scores are highest:
/// at least one unless `share` is 0; ties go to the earlier position. Ascending.
pub fn top_share(scores: &[f32], exact: usize, share: f64) -> Vec<usize> {
    let m = scores.len();
    if m == 0 || share <= 0.0 {
        return Vec::new();
    }
    let r = ((m as f64 * share).ceil() as usize).clamp(1, m);
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut sel: Vec<usize> = order[..r].iter().map(|&i| exact + i).collect();
    sel.sort_unstable();
    sel
}

/// Contiguous windows of `k` tokens, for chunks of `lens` tokens that follow each other from
/// position `exact` (`scores`: one per chunk token): the first `k` tokens of every chunk (its
/// boundary), then a window around each highest-scored position not yet covered (centred on
/// it, cut at its chunk's edges), until at least the `share` of the chunk tokens is covered
/// (or every boundary, if that is more). Ascending.
pub fn window_positions(
    exact: usize,
    lens: &[usize],
    scores: &[f32],
    k: usize,
    share: f64,
) -> Vec<usize> {
    let m: usize = lens.iter().sum();
    if m == 0 || k == 0 {
        return Vec::new();
    }
    let budget = ((m as f64 * share.clamp(0.0, 1.0)).ceil() as usize).min(m);
    let mut chosen = vec![false; m];
    // The chunk of every token: `(start, end)` in chunk-token offsets.
    let mut bounds = Vec::with_capacity(m);
    let mut start = 0;
    for &n in lens {
        bounds.extend(std::iter::repeat_n((start, start + n), n));
        chosen[start..start + k.min(n)].fill(true);
        start += n;
    }
    let mut count = chosen.iter().filter(|&&c| c).count();
    let mut order: Vec<usize> = (0..m.min(scores.len())).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    for p in order {
        if count >= budget {
            break;
        }
        if chosen[p] {
            continue;
        }
        let (lo, hi) = bounds[p];
        let from = p.saturating_sub(k / 2).max(lo);
        let to = (from + k).min(hi);
        let from = to.saturating_sub(k).max(lo);
        for c in &mut chosen[from..to] {
            count += usize::from(!*c);
            *c = true;
        }
    }
    chosen
        .iter()
        .enumerate()
        .filter(|(_, &c)| c)
        .map(|(i, _)| exact + i)
        .collect()
}

/// A repaired context, with the question run after it in the same pass.
#[derive(Debug, Clone)]
pub struct Repaired {
    /// The context's KV, the recomputed rows replaced, then the question's rows.
    pub kv: Kv,
    /// The context positions recomputed, ascending.
    pub positions: Vec<usize>,
    /// Logits `(vocab,)` after the question's last token; `None` when no question ran.
    pub logits: Option<Tensor>,
}

impl Decoder {
    /// Recomputes the tokens at `positions` (ascending) of an assembled context, then runs
    /// `question` after it, in one pass: `kv` holds `tokens` at positions `0..n`. The chosen
    /// tokens run through every layer, attending to the whole context causally, with their
    /// own rows replaced by what they compute at each layer before the layer's attention; the
    /// other rows keep their KV. The question's tokens (positions `n..`) run in the same pass
    /// and attend to the repaired rows, so the result is what recomputing first and then
    /// prefilling the question gives, with one pass's fixed cost instead of two (on the CPU
    /// each pass reads every weight at least once). [`Decoder::recompute_in`] on a copy of
    /// `kv` in its dtype.
    pub fn recompute(
        &self,
        kv: &Kv,
        tokens: &[u32],
        positions: &[usize],
        question: &[u32],
    ) -> Result<Repaired> {
        if positions.is_empty() && question.is_empty() {
            return Ok(Repaired {
                kv: kv.clone(),
                positions: Vec::new(),
                logits: None,
            });
        }
        let mut cache = KvCache::from_kv(kv, question.len())?;
        let logits = self.recompute_in(&mut cache, tokens, positions, question)?;
        Ok(Repaired {
            kv: cache.to_kv()?,
            positions: positions.to_vec(),
            logits,
        })
    }

    /// [`Decoder::recompute`] in place: `cache` holds `tokens` at positions `0..n`; the rows
    /// at `positions` are overwritten layer by layer and the question's rows appended, in the
    /// cache's dtype (an f16 decoding cache rounds the fresh rows as it takes them, as it
    /// does every decoded token's). No copy of the context is made: a query's cache is
    /// assembled once and repaired where it lies. Returns the logits `(vocab,)` after the
    /// question's last token, `None` when no question ran. On an error the cache's contents
    /// are unspecified.
    pub fn recompute_in(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        positions: &[usize],
        question: &[u32],
    ) -> Result<Option<Tensor>> {
        let n = cache.len();
        if tokens.len() != n {
            return Err(Error::Input {
                why: format!("recompute: {} tokens for a KV of {n}", tokens.len()),
            });
        }
        if positions.is_empty() && question.is_empty() {
            return Ok(None);
        }
        if !positions.windows(2).all(|w| w[0] < w[1]) || positions.last().is_some_and(|&p| p >= n) {
            return Err(Error::Input {
                why: format!("recompute: positions must ascend within 0..{n}"),
            });
        }
        let mut ids: Vec<u32> = positions.iter().map(|&p| tokens[p]).collect();
        ids.extend_from_slice(question);
        // One step of one sequence: the chosen rows recomputed in place, the question
        // appended ([`Decoder::step`] with `redo`'s path).
        let x = self.layers_over(&mut [(cache, &ids, positions)])?;
        if question.is_empty() {
            return Ok(None);
        }
        let last = x.narrow(0, ids.len() - 1, 1).ctx("last row")?;
        Ok(Some(self.logits(&last)?.squeeze(0).ctx("logits")?))
    }

    /// Selective recompute with CacheBlend's selection: brings the KV of independently
    /// computed chunks closer to what a full prefill of the whole context computes.
    ///
    /// `kv` holds `tokens` at positions `0..n` (each chunk already rotated to its place); the
    /// first `exact` tokens (the system prefix) are already what full prefill computes.
    /// Layer 0's keys and values depend on the token and its position only, so the stored
    /// ones are exact; its output, which attention over the whole context changes, is
    /// computed for every token. At layer 1 the keys and values of every token are computed
    /// from that output and compared with the stored ones; the `share` of tokens that deviate
    /// most are [recomputed](Decoder::recompute), and the rest keep their stored KV;
    /// `question` runs after the context in the same pass.
    pub fn blend(
        &self,
        kv: &Kv,
        tokens: &[u32],
        exact: usize,
        share: f64,
        question: &[u32],
    ) -> Result<Repaired> {
        let n = kv.len();
        if tokens.len() != n {
            return Err(Error::Input {
                why: format!("blend: {} tokens for a KV of {n}", tokens.len()),
            });
        }
        if !(0.0..=1.0).contains(&share) {
            return Err(Error::Input {
                why: format!("blend: share {share} is not in 0..=1"),
            });
        }
        if exact >= n || share == 0.0 || self.layers.len() < 2 {
            return self.recompute(kv, tokens, &[], question);
        }
        let m = n - exact;
        let ids = Tensor::new(&tokens[exact..], &self.device).ctx("token ids")?;
        let x = self.embed(&ids)?;

        // Layer 0 for every token, over the stored (exact) keys and values.
        let (k0, v0) = &kv.layers[0];
        let l0 = &self.layers[0];
        let h = self.rms(&x, &l0.attn_norm)?;
        let (q, _, _) = self.qkv(l0, &h)?;
        let q = self.rope_of(0).forward(&q, exact)?;
        let a = self.attend(l0, &q, k0, v0, Some(&self.mask(m, n, 0)?))?;
        let x = self.mlp(l0, (x + a).ctx("residual")?)?;

        // Layer 1: every token's fresh keys and values against the stored ones.
        let l1 = &self.layers[1];
        let (k1, v1) = &kv.layers[1];
        let h = self.rms(&x, &l1.attn_norm)?;
        let (_, k, v) = self.qkv(l1, &h)?;
        let k = self.rope_of(1).forward(&k, exact)?;
        let dev = |fresh: &Tensor, stored: &Tensor| -> Result<Tensor> {
            let stored = stored.narrow(2, exact, m).ctx("stored rows")?;
            (fresh - stored)
                .and_then(|d| d.to_dtype(DType::F32))
                .and_then(|d| d.sqr())
                .and_then(|d| d.sum((0, 1, 3)))
                .ctx("deviation")
        };
        let score: Vec<f32> = (dev(&k, k1)? + dev(&v, v1)?)
            .and_then(|d| d.to_vec1())
            .ctx("deviation")?;
        let positions = top_share(&score, exact, share);
        self.recompute(kv, tokens, &positions, question)
    }

    /// How much a question attends to each position of an assembled context on the model's
    /// first `layers` layers: `question` runs after `kv` (at positions `kv.len()..`, its own
    /// KV discarded), and the attention probabilities of every head and question token are
    /// summed per cached position. Returns `kv.len()` scores.
    pub fn question_attention(&self, kv: &Kv, question: &[u32], layers: usize) -> Result<Vec<f32>> {
        self.check_tokens(question)?;
        let (n, s) = (kv.len(), question.len());
        let layers = layers.clamp(1, self.layers.len());
        let ids = Tensor::new(question, &self.device).ctx("token ids")?;
        let mut x = self.embed(&ids)?;
        let mut score = Tensor::zeros(n, DType::F32, &self.device).ctx("scores")?;
        for (i, (layer, (ks, vs))) in self.layers.iter().zip(&kv.layers).enumerate() {
            if i == layers {
                break;
            }
            let mask = self.mask(s, n + s, i)?;
            let h = self.rms(&x, &layer.attn_norm)?;
            let (q, k, v) = self.qkv(layer, &h)?;
            let q = self.rope_of(i).forward(&q, n)?;
            let k = self.rope_of(i).forward(&k, n)?;
            let k = Tensor::cat(&[ks, &k], 2).ctx("keys")?;
            let p = self.probs(&self.grouped(&q)?, &k, Some(&mask))?;
            let attended = p
                .narrow(3, 0, n)
                .and_then(|p| p.to_dtype(DType::F32))
                .and_then(|p| p.sum((0, 1, 2)))
                .ctx("attention per key")?;
            score = (score + attended).ctx("scores")?;
            if i + 1 < layers {
                let v = Tensor::cat(&[vs, &v], 2).ctx("values")?;
                let a = self.attend(layer, &q, &k, &v, Some(&mask))?;
                x = self.mlp(layer, (x + a).ctx("residual")?)?;
            }
        }
        score.to_vec1().ctx("scores")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_takes_the_first_tokens_of_every_chunk() {
        assert_eq!(link_positions(3, &[4, 2, 5], 2), vec![3, 4, 7, 8, 9, 10]);
        // A chunk shorter than k is recomputed whole; k = 0 recomputes nothing.
        assert_eq!(link_positions(0, &[1, 3], 2), vec![0, 1, 2]);
        assert!(link_positions(5, &[4, 4], 0).is_empty());
        // k covering every chunk: every chunk token.
        assert_eq!(link_positions(2, &[3, 2], 9), (2..7).collect::<Vec<_>>());
    }

    #[test]
    fn sensitive_positions_take_each_chunks_ranked_offsets_then_its_first() {
        // Chunks of 5 and 4 after 2 exact tokens.
        let ranked = vec![vec![3, 0, 4], vec![]];
        assert_eq!(
            sensitive_positions(2, &[5, 4], &ranked, 2),
            vec![2, 5, 7, 8]
        );
        // Offsets past the chunk and repeats are skipped; a short list is topped up with
        // the first tokens not taken; k beyond a chunk takes all of it.
        let ranked = vec![vec![9, 2, 2], vec![1]];
        assert_eq!(
            sensitive_positions(0, &[3, 4], &ranked, 2),
            vec![0, 2, 3, 4]
        );
        assert_eq!(sensitive_positions(0, &[2], &[vec![1]], 5), vec![0, 1]);
        // No lists at all: `link`.
        assert_eq!(
            sensitive_positions(1, &[3, 3], &[], 2),
            link_positions(1, &[3, 3], 2)
        );
    }

    #[test]
    fn top_share_picks_the_highest_scores_in_order() {
        let s = [0.1, 0.9, 0.5, 0.9, 0.0];
        assert_eq!(top_share(&s, 10, 0.4), vec![11, 13]);
        // ceil(5 * 0.5) = 3; ties at 0.9 both in, then 0.5.
        assert_eq!(top_share(&s, 0, 0.5), vec![1, 2, 3]);
        // At least one; none at share 0; all at share 1.
        assert_eq!(top_share(&s, 0, 0.01), vec![1]);
        assert!(top_share(&s, 0, 0.0).is_empty());
        assert_eq!(top_share(&s, 0, 1.0), vec![0, 1, 2, 3, 4]);
        assert!(top_share(&[], 0, 0.5).is_empty());
    }

    #[test]
    fn windows_cover_the_boundaries_then_the_highest_scores() {
        // Chunks of 6 and 6 tokens after 2 exact ones; k = 2: boundaries 2,3 and 8,9.
        let scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0];
        assert_eq!(
            window_positions(2, &[6, 6], &scores, 2, 0.0),
            vec![2, 3, 8, 9]
        );
        // Budget ceil(12 * 0.5) = 6: one more window, centred on offset 9 (position 11).
        assert_eq!(
            window_positions(2, &[6, 6], &scores, 2, 0.5),
            vec![2, 3, 8, 9, 10, 11]
        );
        // A window at a chunk's end is cut to the chunk: offset 5 with k = 4 takes 2..6.
        let mut s = [0.0; 12];
        s[5] = 1.0;
        assert_eq!(
            window_positions(0, &[6, 6], &s, 4, 0.7),
            vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        );
        // Share 1 covers every chunk token; k = 0 or no chunks: nothing.
        assert_eq!(
            window_positions(1, &[3, 4], &[0.5; 7], 2, 1.0),
            (1..8).collect::<Vec<_>>()
        );
        assert!(window_positions(0, &[3], &[0.1; 3], 0, 1.0).is_empty());
        assert!(window_positions(0, &[], &[], 4, 1.0).is_empty());
    }
}
