//! The lossy KV codecs `q8` and `q4`: block payloads quantized to 8 or 4 bits in groups with
//! f16 scales, decoded straight into their layer-major place in the reader's buffer.
//!
//! - `q8`: value planes per token, in groups of [`q8_group`] elements along the token's row
//!   (`kv_heads × head_dim`), symmetric: `x = q × scale`, `q` in `-127..=127`. Key planes of
//!   at least [`MIN_CHANNEL_TOKENS`] tokens are also encoded per **channel** (as `q4`'s keys,
//!   asymmetric, `q` in `0..=255`), and whichever of the two measures the smaller error
//!   channel by channel is kept: a key channel carrying a large offset (Qwen2's key biases)
//!   sets the scale of its whole per-token group, and crushes the other channels' codes.
//! - `q4` (KIVI's split): key planes per **channel** (blocks of at least [`MIN_CHANNEL_TOKENS`]
//!   tokens), each channel's values over a group of up to [`KEY_TOKEN_GROUP`] tokens sharing a scale and a minimum (a channel's large constant
//!   offset, as Qwen2's key biases put in a few channels, costs nothing); value planes per
//!   **token**, in groups of [`q4_group`] elements; asymmetric: `x = q × scale + min`, `q` in
//!   `0..=15`; in every key group the widest [`wide::wide_channels`] channels (a 32nd) get
//!   255 levels instead ([`wide`], plane mode `4`). A plane whose 4-bit error, channel by channel, exceeds [`Q4_MAX_REL_ERROR`] (an
//!   outlier-heavy layer) is written at 8 bits instead, recorded per plane. A chunk's first
//!   token (the block at its start) is written at 8 bits in every plane ("head" tokens,
//!   [`Q4_HEAD_TOKENS`]) and left out of the 4-bit groups: it is the attention sink that every
//!   later token of the prompt attends to most, and at 4 bits it alone doubled the KL of
//!   SmolLM2's next-token distributions over the rest of the chunk's KV (docs/BENCHMARKS.md).
//!
//! 8-bit groups' scales are rounded up and minimums down to f16, so every value lies in the
//! range its group's codes cover and the error of a value is at most half a step (plus the
//! rounding to the layout's dtype). 4-bit groups' scale and minimum are fitted to the least
//! squared error over the group ([`fit`]; the range's own pair is among the candidates), which
//! may clip a group's extremes by less than a step: a value's error is at most one step.
//!
//! No rotation is applied: stored keys are quantized after RoPE at positions `0..n` and
//! re-positioned (rotated by the chunk's offset) only after they are decoded, so the codec
//! never has to commute with RoPE; per-channel key groups are what tames the outlier channels
//! a Hadamard rotation would otherwise be needed for.
//!
//! Payload of a `q8` or `q4` record, version 4 (little-endian; `P` planes, `n` tokens,
//! `C = kv_heads × head_dim` elements per token and plane). Version 3 is the same without
//! mode `4`; version 2 is version 3 with byte 1 zero; version 1 is version 2 without mode `3`;
//! readers take all four.
//!
//! | offset | size | field                                                                  |
//! |-------:|-----:|------------------------------------------------------------------------|
//! | 0      | 1    | quantized payload version (`4`; `3`, `2` and `1` still read)           |
//! | 1      | 1    | head tokens `h` (`0`, or `1` in a `q4` chunk's first block), `h < n`   |
//! | 2      | P    | one mode per plane, layout order: `0` q8 per token, `1` q4 per channel, `2` q4 per token, `3` q8 per channel, `4` q4 per channel with its widest channels at 8 bits |
//! | 2 + P  | …    | per plane, in plane order: its first `h` tokens as a mode-`0` body, then the other `n − h` tokens as a body of the plane's mode |
//!
//! Plane bodies (`G8 = q8_group(C)`, `G4 = q4_group(C)`, `T = KEY_TOKEN_GROUP`):
//!
//! | mode | body                                                                                   |
//! |-----:|----------------------------------------------------------------------------------------|
//! | 0    | `n × C/G8` f16 scales (token-major), then `n × C` i8 codes                             |
//! | 1    | per group of `t ≤ T` tokens: `C` f16 scales, `C` f16 minimums, then `t × C/2` bytes    |
//! | 2    | `n × C/G4` f16 scales, `n × C/G4` f16 minimums, then `n × C/2` bytes                   |
//! | 3    | per group of `t ≤ T` tokens: `C` f16 scales, `C` f16 minimums, then `t × C` bytes      |
//! | 4    | a mode-`1` body, then per group its wide channels and their codes' high nibbles ([`wide`]) |
//!
//! 4-bit codes are packed two per byte along the row: element `2i` in the low nibble, `2i+1`
//! in the high one. Decoding into f16 (the layout the store holds by default) runs in AVX2 +
//! F16C on x86 ([`x86`]); every other dtype and CPU takes the portable loop, which
//! the tests hold the SIMD one to bit for bit.

use half::{bf16, f16};
use schema::{DType, KvLayout};

pub(crate) use decode::decode_into_place;
use decode::decode_plane_f32;
#[cfg(test)]
use decode::{decode_plane, decode_plane_portable, planes};

// Payloads split into planes and decoded.
mod decode;
// 4-bit groups' scales and minimums chosen by squared error.
mod fit;
// Mode 4: the widest key channels at 8 bits.
mod wide;
// AVX2 + F16C decoding, beside the portable loop below.
mod x86;

/// Version of the quantized payload format written; versions 3, 2 and 1 are still read.
const VERSION: u8 = 4;
/// No plane in [`Mode::Q4ChannelWide`].
const VERSION_3: u8 = 3;
/// No head tokens (byte 1 reserved, zero); read as [`VERSION_1`]..=[`VERSION`], named for
/// the tests.
#[cfg(test)]
const VERSION_2: u8 = 2;
/// The first version: no head tokens, no plane in [`Mode::Q8Channel`].
const VERSION_1: u8 = 1;
/// Tokens at the start of a chunk that `q4` writes at 8 bits (the attention sink).
pub(crate) const Q4_HEAD_TOKENS: usize = 1;
/// Tokens per key group of a per-channel key plane (`q4`, and `q8` where it measures better).
pub(crate) const KEY_TOKEN_GROUP: usize = 64;
/// Fewest tokens a key plane is quantized per channel at; shorter blocks' keys go per token
/// (the tail block of a chunk can hold a single token).
pub(crate) const MIN_CHANNEL_TOKENS: usize = 8;
/// A `q4` plane whose [`channel_rel_error`] exceeds this is written at 8 bits.
pub(crate) const Q4_MAX_REL_ERROR: f32 = 0.25;

/// How one plane is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Q8Token = 0,
    Q4Channel = 1,
    Q4Token = 2,
    Q8Channel = 3,
    Q4ChannelWide = 4,
}

impl Mode {
    fn from_byte(b: u8) -> Option<Mode> {
        [
            Mode::Q8Token,
            Mode::Q4Channel,
            Mode::Q4Token,
            Mode::Q8Channel,
            Mode::Q4ChannelWide,
        ]
        .get(b as usize)
        .copied()
    }
}

/// Elements per `q8` group along a row of `c`: 64, 32, or the whole row when neither divides.
pub(crate) fn q8_group(c: usize) -> usize {
    [64, 32]
        .into_iter()
        .find(|g| c.is_multiple_of(*g))
        .unwrap_or(c)
}

/// Elements per `q4` value group along a row of `c`: the largest multiple of 16 up to 128
/// that divides it (SmolLM2's 192: 96; 128 and 256: 128), or the whole row.
pub(crate) fn q4_group(c: usize) -> usize {
    (1..=8)
        .rev()
        .map(|k| k * 16)
        .find(|g| c.is_multiple_of(*g))
        .unwrap_or(c)
}

/// Bytes of a plane's body of `n` tokens in `mode`.
fn body_len(mode: Mode, n: usize, c: usize) -> usize {
    match mode {
        Mode::Q8Token => n * (c / q8_group(c)) * 2 + n * c,
        Mode::Q4Channel => n.div_ceil(KEY_TOKEN_GROUP) * c * 4 + n * c / 2,
        Mode::Q4Token => n * (c / q4_group(c)) * 4 + n * c / 2,
        Mode::Q8Channel => n.div_ceil(KEY_TOKEN_GROUP) * c * 4 + n * c,
        Mode::Q4ChannelWide => body_len(Mode::Q4Channel, n, c) + wide::tail_len(n, c),
    }
}

/// The smallest f16 not below `x` (`x` finite, within f16's range).
fn f16_up(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() >= x {
        h
    } else {
        next_toward(h, f32::INFINITY)
    }
}

/// The largest f16 not above `x`.
fn f16_down(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() <= x {
        h
    } else {
        next_toward(h, f32::NEG_INFINITY)
    }
}

fn next_toward(h: f16, dir: f32) -> f16 {
    let b = h.to_bits();
    let up = dir > h.to_f32();
    let bits = if h.to_f32() == 0.0 {
        if up {
            0x0001
        } else {
            0x8001
        }
    } else if (b & 0x8000 == 0) == up {
        b + 1
    } else {
        b - 1
    };
    f16::from_bits(bits)
}

/// Element `i` of little-endian f16 bytes `b`, widened.
fn h(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

pub(crate) fn read_elem(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
    }
}

pub(crate) fn write_elem(dtype: DType, x: f32, b: &mut [u8]) {
    match dtype {
        DType::F32 => b.copy_from_slice(&x.to_le_bytes()),
        DType::F16 => b.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
        DType::BF16 => b.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
    }
}

/// Encodes `raw` (layer-major KV of `tokens` tokens in `layout`) at 8 bits (`bits == 8`) or
/// 4 (`bits == 4`, falling back to 8 per plane where 4 bits measure too coarse; the first
/// [`Q4_HEAD_TOKENS`] at 8 bits where the block is its chunk's first, `first`).
pub(crate) fn encode(
    layout: &KvLayout,
    tokens: usize,
    raw: &[u8],
    bits: u8,
    first: bool,
) -> Result<Vec<u8>, String> {
    let c = layout.kv_heads as usize * layout.head_dim as usize;
    let planes = layout.planes();
    if !c.is_multiple_of(2) {
        return Err(format!(
            "a row of {c} elements cannot be packed in 4-bit pairs"
        ));
    }
    let plane_bytes = tokens * layout.plane_token_bytes();
    if raw.len() != planes * plane_bytes {
        return Err(format!(
            "{} bytes of KV, expected {}",
            raw.len(),
            planes * plane_bytes
        ));
    }
    let head = if bits == 4 && first && tokens > Q4_HEAD_TOKENS {
        Q4_HEAD_TOKENS
    } else {
        0
    };
    let mut out = vec![VERSION, head as u8];
    out.resize(2 + planes, 0);
    let mut all = vec![0f32; tokens * c];
    for p in 0..planes {
        let src = &raw[p * plane_bytes..(p + 1) * plane_bytes];
        for (i, v) in all.iter_mut().enumerate() {
            *v = read_elem(layout.dtype, &src[i * layout.dtype.size()..]);
            if !v.is_finite() || v.abs() > 65504.0 {
                return Err(format!("plane {p} holds {v}, outside f16's range"));
            }
        }
        // The head tokens at 8 bits, then the others in the plane's mode.
        encode_plane(Mode::Q8Token, &all[..head * c], c, false, &mut out);
        let (x, tokens) = (&all[head * c..], tokens - head);
        let start = out.len();
        let mode = if bits == 8 {
            if p % 2 == 0 && tokens >= MIN_CHANNEL_TOKENS {
                // Keys: per channel where that measures finer than per token.
                encode_plane(Mode::Q8Channel, x, c, false, &mut out);
                let channel = channel_rel_error(Mode::Q8Channel, x, tokens, c, &out[start..]);
                let mid = out.len();
                encode_plane(Mode::Q8Token, x, c, false, &mut out);
                let token = channel_rel_error(Mode::Q8Token, x, tokens, c, &out[mid..]);
                if channel <= token {
                    out.truncate(mid);
                    out[2 + p] = Mode::Q8Channel as u8;
                } else {
                    out.drain(start..mid);
                    out[2 + p] = Mode::Q8Token as u8;
                }
                continue;
            }
            Mode::Q8Token
        } else {
            // A key group's scales and minimums cost 4 bytes per channel: below
            // `MIN_CHANNEL_TOKENS` tokens they would outweigh the codes (and the payload grow
            // past the raw bytes), so short blocks quantize keys per token too.
            let mode = if p % 2 == 0 && tokens >= MIN_CHANNEL_TOKENS {
                if wide::wide_channels(c) > 0 {
                    Mode::Q4ChannelWide
                } else {
                    Mode::Q4Channel
                }
            } else {
                Mode::Q4Token
            };
            // Whether 4 bits suit the plane is judged on its groups' ranges (the threshold
            // was measured so); what is written has its groups fitted ([`fit`]).
            encode_plane(mode, x, c, false, &mut out);
            if channel_rel_error(mode, x, tokens, c, &out[start..]) <= Q4_MAX_REL_ERROR {
                out.truncate(start);
                encode_plane(mode, x, c, true, &mut out);
                out[2 + p] = mode as u8;
                continue;
            }
            out.truncate(start);
            Mode::Q8Token
        };
        encode_plane(mode, x, c, false, &mut out);
        out[2 + p] = mode as u8;
    }
    Ok(out)
}

/// How coarse `body` (the plane `x`, `n × c`, encoded in `mode`) is, channel by channel: the
/// root mean over channels of (mean squared error / the channel's own power), where a
/// channel's power is its variance over the tokens (its constant part costs a per-channel key
/// group nothing) or, for fewer than 8 tokens, its mean square; channels with less than a
/// thousandth of the mean power are measured against that floor. A plane whose large values
/// crush the codes of its small ones scores far above a Gaussian-like one (~0.1 at 4 bits).
pub(crate) fn channel_rel_error(mode: Mode, x: &[f32], n: usize, c: usize, body: &[u8]) -> f32 {
    let mut y = vec![0f32; x.len()];
    decode_plane_f32(mode, body, n, c, &mut y);
    let (mut sum, mut sq, mut err) = (vec![0f64; c], vec![0f64; c], vec![0f64; c]);
    for (i, (a, b)) in x.iter().zip(&y).enumerate() {
        let j = i % c;
        sum[j] += f64::from(*a);
        sq[j] += f64::from(*a).powi(2);
        err[j] += f64::from(a - b).powi(2);
    }
    let nf = n as f64;
    let power: Vec<f64> = (0..c)
        .map(|j| {
            if n >= 8 {
                (sq[j] / nf - (sum[j] / nf).powi(2)).max(0.0)
            } else {
                sq[j] / nf
            }
        })
        .collect();
    let floor = power.iter().sum::<f64>() / c as f64 * 1e-3 + 1e-30;
    let mean = (0..c)
        .map(|j| err[j] / nf / power[j].max(floor))
        .sum::<f64>()
        / c as f64;
    mean.sqrt() as f32
}

/// Appends the body of `x` (`n × c`) in `mode`; `fitted`: 4-bit groups' scales and minimums
/// chosen by [`fit::fit`], else by their ranges.
fn encode_plane(mode: Mode, x: &[f32], c: usize, fitted: bool, out: &mut Vec<u8>) {
    match mode {
        Mode::Q8Token => {
            let g = q8_group(c);
            let scales: Vec<f16> = x
                .chunks_exact(g)
                .map(|grp| f16_up(grp.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0))
                .collect();
            scales
                .iter()
                .for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
            for (grp, s) in x.chunks_exact(g).zip(&scales) {
                let s = s.to_f32();
                for v in grp {
                    let q = if s > 0.0 { (v / s).round() } else { 0.0 };
                    out.push(q.clamp(-127.0, 127.0) as i8 as u8);
                }
            }
        }
        Mode::Q4Channel | Mode::Q8Channel | Mode::Q4ChannelWide => {
            let base = if mode == Mode::Q8Channel { 255.0 } else { 15.0 };
            let k = if mode == Mode::Q4ChannelWide {
                wide::wide_channels(c)
            } else {
                0
            };
            // Mode 4's groups' wide channels and high nibbles, after the whole base body.
            let mut tail = Vec::new();
            for rows in x.chunks(KEY_TOKEN_GROUP * c) {
                let t = rows.len() / c;
                let (mut lo, mut hi) = (vec![f32::INFINITY; c], vec![f32::NEG_INFINITY; c]);
                for row in rows.chunks_exact(c) {
                    for (j, v) in row.iter().enumerate() {
                        lo[j] = lo[j].min(*v);
                        hi[j] = hi[j].max(*v);
                    }
                }
                let wide = wide::widest(&lo, &hi, k);
                let mut levels = vec![base; c];
                wide.iter().for_each(|&j| levels[j] = 255.0);
                let mut column = Vec::with_capacity(t);
                let (scales, mins): (Vec<f16>, Vec<f16>) = (0..c)
                    .map(|j| {
                        if fitted && levels[j] == 15.0 {
                            column.clear();
                            column.extend(rows.iter().skip(j).step_by(c));
                            fit::fit(&column, 15.0)
                        } else {
                            scale_min(lo[j], hi[j], levels[j])
                        }
                    })
                    .unzip();
                scales
                    .iter()
                    .chain(&mins)
                    .for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
                let mut high = Vec::with_capacity(t * k);
                for row in rows.chunks_exact(c) {
                    let q =
                        |j: usize| code(row[j], (scales[j].to_f32(), mins[j].to_f32()), levels[j]);
                    if mode == Mode::Q8Channel {
                        out.extend((0..c).map(q));
                    } else {
                        pack4(c, q, out);
                        high.extend(wide.iter().map(|&j| q(j) >> 4));
                    }
                }
                if k > 0 {
                    wide::push_tail(&wide, &high, &mut tail);
                }
            }
            out.extend_from_slice(&tail);
        }
        Mode::Q4Token => {
            let g = q4_group(c);
            let (scales, mins): (Vec<f16>, Vec<f16>) = x
                .chunks_exact(g)
                .map(|grp| {
                    if fitted {
                        fit::fit(grp, 15.0)
                    } else {
                        fit::range(grp, 15.0)
                    }
                })
                .unzip();
            scales
                .iter()
                .chain(&mins)
                .for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
            for (r, row) in x.chunks_exact(c).enumerate() {
                let k = r * (c / g);
                let sm = |j: usize| (scales[k + j / g].to_f32(), mins[k + j / g].to_f32());
                pack4(c, |j| code(row[j], sm(j), 15.0), out);
            }
        }
    }
}

/// An asymmetric group's f16 scale (rounded up) and minimum (rounded down) for values in
/// `lo..=hi` with codes `0..=levels`: `min + levels × scale` reaches `hi`.
fn scale_min(lo: f32, hi: f32, levels: f32) -> (f16, f16) {
    let min = f16_down(lo);
    let range = hi - min.to_f32();
    let mut scale = f16_up(range / levels);
    // f32 rounding of `levels × scale` may still fall short of `hi` by an ulp.
    while min.to_f32() + levels * scale.to_f32() < hi {
        scale = next_toward(scale, f32::INFINITY);
    }
    (scale, min)
}

/// The code of `x` in a group of (scale, min) with codes `0..=levels`.
fn code(x: f32, (s, m): (f32, f32), levels: f32) -> u8 {
    if s > 0.0 {
        ((x - m) / s).round().clamp(0.0, levels) as u8
    } else {
        0
    }
}

/// Packs the low 4 bits of a row's `c` codes `q(j)`, element `2i` in the low nibble.
fn pack4(c: usize, q: impl Fn(usize) -> u8, out: &mut Vec<u8>) {
    for j in (0..c).step_by(2) {
        out.push((q(j) & 15) | (q(j + 1) << 4));
    }
}

#[cfg(test)]
#[path = "quant_tests.rs"]
mod tests;
