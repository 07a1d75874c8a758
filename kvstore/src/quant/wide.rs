//! `q4` key planes with their widest channels at 8 bits (plane mode `4`, payload version 4).
//!
//! A per-channel key group's error is half its step, and its step is the channel's range over
//! the group's tokens divided by 15: the few channels with the widest range (RoPE's slow
//! dimensions, which carry most of a head's attention logits) lose the most. In every group
//! of up to [`KEY_TOKEN_GROUP`] tokens the [`wide_channels`] channels of widest range get 255
//! levels instead of 15. Their codes' low nibbles sit in the mode-`1` body like every other
//! channel's, their high nibbles after it. The SIMD decoder ([`super::x86`]) unpacks a
//! group's high nibbles once, then, in its one pass, ORs them into the low ones of the
//! 16-channel blocks that hold a wide channel with one byte shuffle per row and block (the
//! channels ascend, so a block's wide channels are consecutive in the list); the portable one
//! decodes the mode-`1` body, then rewrites the wide channels column by column ([`columns`]).
//!
//! Body of a mode-`4` plane of `n` tokens, `C` channels, `k = wide_channels(C)`:
//!
//! | part | bytes | field |
//! |---|---:|---|
//! | base | `body_len(1, n, C)` | a mode-`1` body; a wide channel's scale spans 255 levels and its nibble is its code's low 4 bits |
//! | per group of `t ≤ T` tokens, in order | `2k` | the wide channels, u16 little-endian, ascending, each `< C` |
//! | | `⌈t × k / 2⌉` | their codes' high 4 bits, token-major (`t` rows of `k`), two per byte, the first in the low nibble |
//!
//! Measured (docs/BENCHMARKS.md): +1.5 % of a q4 chunk's bytes (3.51x / 3.53x smaller than
//! f16 for SmolLM2 / Qwen2.5-0.5B), the KL of next-token distributions from q4 KV −23 % / −10 %.

use crate::quant::{h, KEY_TOKEN_GROUP};

/// Channels of each key group that go to 8 bits: a 32nd of the row (SmolLM2's 192: 6,
/// Qwen2.5-0.5B's 128: 4); rows under 32 channels have none (the plane stays mode `1`).
pub(crate) fn wide_channels(c: usize) -> usize {
    c / 32
}

/// Bytes after the base body of a mode-`4` plane of `n` tokens.
pub(crate) fn tail_len(n: usize, c: usize) -> usize {
    let k = wide_channels(c);
    (0..n)
        .step_by(KEY_TOKEN_GROUP)
        .map(|start| 2 * k + (KEY_TOKEN_GROUP.min(n - start) * k).div_ceil(2))
        .sum()
}

/// The `k` channels of widest range `hi − lo` (ties: the lower channel), ascending.
pub(crate) fn widest(lo: &[f32], hi: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lo.len()).collect();
    order.sort_by(|&a, &b| (hi[b] - lo[b]).total_cmp(&(hi[a] - lo[a])).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_unstable();
    order
}

/// Appends one group's tail: its wide channels, then the high nibbles `high` (`t` rows of
/// `wide.len()` codes' high halves, each `< 16`).
pub(crate) fn push_tail(wide: &[usize], high: &[u8], tail: &mut Vec<u8>) {
    for &j in wide {
        let j = u16::try_from(j).expect("a row holds fewer than 65,536 channels");
        tail.extend_from_slice(&j.to_le_bytes());
    }
    tail.extend(
        high.chunks(2)
            .map(|p| p[0] | p.get(1).map_or(0, |h| h << 4)),
    );
}

/// Checks that the wide channels named in `tail` lie within the row, ascending, as
/// [`widest`] writes them (lengths are the caller's, from [`tail_len`]): the SIMD decoder
/// relies on a 16-channel block's wide channels being consecutive in the list.
pub(crate) fn check(tail: &[u8], n: usize, c: usize) -> Result<(), String> {
    let k = wide_channels(c);
    let mut at = 0;
    for start in (0..n).step_by(KEY_TOKEN_GROUP) {
        let t = KEY_TOKEN_GROUP.min(n - start);
        let mut last = None;
        for w in tail[at..at + 2 * k].chunks_exact(2) {
            let j = usize::from(u16::from_le_bytes([w[0], w[1]]));
            if j >= c {
                return Err(format!("wide key channel {j} in a row of {c}"));
            }
            if let Some(l) = last.filter(|&l| l >= j) {
                return Err(format!("wide key channel {j} after channel {l}"));
            }
            last = Some(j);
        }
        at += 2 * k + (t * k).div_ceil(2);
    }
    Ok(())
}

/// One wide channel of one key group: its full 8-bit codes, token by token.
pub(crate) struct Column {
    /// The group's first token in the plane.
    pub start: usize,
    /// The channel.
    pub channel: usize,
    pub scale: f32,
    pub min: f32,
    /// Codes of the group's tokens (`len()` of them used).
    pub codes: [u8; KEY_TOKEN_GROUP],
    pub len: usize,
}

impl Column {
    /// `(element, value)` of every token, the element `token × c + channel`, the value
    /// `q × scale + min` as one fused multiply-add, as the base decoders compute every other
    /// element.
    pub(crate) fn values(&self, c: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
        self.codes[..self.len]
            .iter()
            .enumerate()
            .map(move |(i, &q)| {
                (
                    (self.start + i) * c + self.channel,
                    f32::from(q).mul_add(self.scale, self.min),
                )
            })
    }
}

/// Calls `f` with every wide channel of every group of a mode-`4` plane of `n` tokens: `base`
/// is its mode-`1` body, `tail` what follows it (both checked).
pub(crate) fn columns(base: &[u8], tail: &[u8], n: usize, c: usize, mut f: impl FnMut(&Column)) {
    let k = wide_channels(c);
    let (mut at, mut wat) = (0, 0);
    let mut highs = vec![0u8; 2 * (KEY_TOKEN_GROUP * k).div_ceil(2)];
    for start in (0..n).step_by(KEY_TOKEN_GROUP) {
        let t = KEY_TOKEN_GROUP.min(n - start);
        let sm = &base[at..at + 4 * c];
        let rows = &base[at + 4 * c..at + 4 * c + t * c / 2];
        let wide = &tail[wat..wat + 2 * k];
        let high = &tail[wat + 2 * k..wat + 2 * k + (t * k).div_ceil(2)];
        // The group's high nibbles unpacked once: `t` rows of `k`.
        let highs = &mut highs[..2 * high.len()];
        for (pair, b) in highs.chunks_exact_mut(2).zip(high) {
            pair[0] = b & 15;
            pair[1] = b >> 4;
        }
        for (w, jb) in wide.chunks_exact(2).enumerate() {
            let j = usize::from(u16::from_le_bytes([jb[0], jb[1]]));
            let mut col = Column {
                start,
                channel: j,
                scale: h(sm, j),
                min: h(sm, c + j),
                codes: [0; KEY_TOKEN_GROUP],
                len: t,
            };
            let shift = (j % 2) * 4;
            let lows = rows
                .chunks_exact(c / 2)
                .map(|row| (row[j / 2] >> shift) & 15);
            let his = highs[w..].iter().step_by(k);
            for ((q, lo), hi) in col.codes.iter_mut().zip(lows).zip(his) {
                *q = lo | hi << 4;
            }
            f(&col);
        }
        at += 4 * c + t * c / 2;
        wat += 2 * k + (t * k).div_ceil(2);
    }
}
