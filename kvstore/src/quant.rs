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
//!   `0..=15`. A plane whose 4-bit error, channel by channel, exceeds [`Q4_MAX_REL_ERROR`] (an
//!   outlier-heavy layer) is written at 8 bits instead, recorded per plane. A chunk's first
//!   token (the block at its start) is written at 8 bits in every plane ("head" tokens,
//!   [`Q4_HEAD_TOKENS`]) and left out of the 4-bit groups: it is the attention sink that every
//!   later token of the prompt attends to most, and at 4 bits it alone doubled the KL of
//!   SmolLM2's next-token distributions over the rest of the chunk's KV (docs/BENCHMARKS.md).
//!
//! Scales are rounded up and minimums down to f16, so every value lies in the range its
//! group's codes cover and the error of a value is at most half a step (plus the rounding to
//! the layout's dtype). No rotation is applied: stored keys are quantized after RoPE at
//! positions `0..n` and re-positioned (rotated by the chunk's offset) only after they are
//! decoded, so the codec never has to commute with RoPE; per-channel key groups are what
//! tames the outlier channels a Hadamard rotation would otherwise be needed for.
//!
//! Payload of a `q8` or `q4` record, version 3 (little-endian; `P` planes, `n` tokens,
//! `C = kv_heads × head_dim` elements per token and plane). Version 2 is the same with byte 1
//! zero; version 1 is version 2 without mode `3`; readers take all three.
//!
//! | offset | size | field                                                                  |
//! |-------:|-----:|------------------------------------------------------------------------|
//! | 0      | 1    | quantized payload version (`3`; `2` and `1` still read)                |
//! | 1      | 1    | head tokens `h` (`0`, or `1` in a `q4` chunk's first block), `h < n`   |
//! | 2      | P    | one mode per plane, layout order: `0` q8 per token, `1` q4 per channel, `2` q4 per token, `3` q8 per channel |
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
//!
//! 4-bit codes are packed two per byte along the row: element `2i` in the low nibble, `2i+1`
//! in the high one. Decoding into f16 (the layout the store holds by default) runs in AVX2 +
//! F16C on x86 ([`x86`]); every other dtype and CPU takes the portable loop, which
//! the tests hold the SIMD one to bit for bit.

use half::{bf16, f16};
use schema::{DType, KvLayout};

// AVX2 + F16C decoding, beside the portable loop below.
mod x86;

/// Version of the quantized payload format written; [`VERSION_2`] and [`VERSION_1`] are still
/// read.
const VERSION: u8 = 3;
/// No head tokens (byte 1 reserved, zero).
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
}

impl Mode {
    fn from_byte(b: u8) -> Option<Mode> {
        [
            Mode::Q8Token,
            Mode::Q4Channel,
            Mode::Q4Token,
            Mode::Q8Channel,
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
        encode_plane(Mode::Q8Token, &all[..head * c], c, &mut out);
        let (x, tokens) = (&all[head * c..], tokens - head);
        let start = out.len();
        let mode = if bits == 8 {
            if p % 2 == 0 && tokens >= MIN_CHANNEL_TOKENS {
                // Keys: per channel where that measures finer than per token.
                encode_plane(Mode::Q8Channel, x, c, &mut out);
                let channel = channel_rel_error(Mode::Q8Channel, x, tokens, c, &out[start..]);
                let mid = out.len();
                encode_plane(Mode::Q8Token, x, c, &mut out);
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
                Mode::Q4Channel
            } else {
                Mode::Q4Token
            };
            encode_plane(mode, x, c, &mut out);
            if channel_rel_error(mode, x, tokens, c, &out[start..]) <= Q4_MAX_REL_ERROR {
                out[2 + p] = mode as u8;
                continue;
            }
            out.truncate(start);
            Mode::Q8Token
        };
        encode_plane(mode, x, c, &mut out);
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

fn encode_plane(mode: Mode, x: &[f32], c: usize, out: &mut Vec<u8>) {
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
        Mode::Q4Channel | Mode::Q8Channel => {
            let levels = if mode == Mode::Q8Channel { 255.0 } else { 15.0 };
            for rows in x.chunks(KEY_TOKEN_GROUP * c) {
                let t = rows.len() / c;
                let (mut lo, mut hi) = (vec![f32::INFINITY; c], vec![f32::NEG_INFINITY; c]);
                for row in rows.chunks_exact(c) {
                    for (j, v) in row.iter().enumerate() {
                        lo[j] = lo[j].min(*v);
                        hi[j] = hi[j].max(*v);
                    }
                }
                let (scales, mins): (Vec<f16>, Vec<f16>) =
                    (0..c).map(|j| scale_min(lo[j], hi[j], levels)).unzip();
                scales
                    .iter()
                    .chain(&mins)
                    .for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
                let sm = |j: usize| (scales[j].to_f32(), mins[j].to_f32());
                for i in 0..t {
                    let row = &rows[i * c..(i + 1) * c];
                    if mode == Mode::Q8Channel {
                        out.extend((0..c).map(|j| code(row[j], sm(j), levels)));
                    } else {
                        pack4(row, sm, out);
                    }
                }
            }
        }
        Mode::Q4Token => {
            let g = q4_group(c);
            let (scales, mins): (Vec<f16>, Vec<f16>) = x
                .chunks_exact(g)
                .map(|grp| {
                    let lo = grp.iter().copied().fold(f32::INFINITY, f32::min);
                    let hi = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    scale_min(lo, hi, 15.0)
                })
                .unzip();
            scales
                .iter()
                .chain(&mins)
                .for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
            for (r, row) in x.chunks_exact(c).enumerate() {
                let k = r * (c / g);
                pack4(
                    row,
                    |j| (scales[k + j / g].to_f32(), mins[k + j / g].to_f32()),
                    out,
                );
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

/// Packs a row's 4-bit codes, element `2i` in the low nibble; `sm(j)` is element `j`'s
/// (scale, min).
fn pack4(row: &[f32], sm: impl Fn(usize) -> (f32, f32), out: &mut Vec<u8>) {
    let q = |j: usize| code(row[j], sm(j), 15.0);
    for j in (0..row.len()).step_by(2) {
        out.push(q(j) | (q(j + 1) << 4));
    }
}

/// One plane of a payload: its head tokens' mode-`0` body, its mode and the other tokens' body.
struct Plane<'a> {
    head: &'a [u8],
    mode: Mode,
    body: &'a [u8],
}

/// Splits a payload into its head token count and planes, checking every length.
fn planes<'a>(
    layout: &KvLayout,
    tokens: usize,
    enc: &'a [u8],
) -> Result<(usize, Vec<Plane<'a>>), String> {
    let c = layout.kv_heads as usize * layout.head_dim as usize;
    let n = layout.planes();
    let known = |v: u8| v == VERSION || v == VERSION_2 || v == VERSION_1;
    if enc.len() < 2 + n || !known(enc[0]) {
        return Err(match enc.first() {
            Some(&v) if !known(v) => format!("quantized payload version {v} is not known"),
            _ => format!("quantized payload of {} bytes is truncated", enc.len()),
        });
    }
    let head = if enc[0] == VERSION {
        enc[1] as usize
    } else {
        0
    };
    if head > 0 && head >= tokens {
        return Err(format!("{head} head tokens in a block of {tokens}"));
    }
    let mut at = 2 + n;
    let mut out = Vec::with_capacity(n);
    let mut take = |len: usize, p: usize| {
        let body = enc
            .get(at..at + len)
            .ok_or_else(|| format!("plane {p}: body truncated"));
        at += len;
        body
    };
    for p in 0..n {
        let mode = Mode::from_byte(enc[2 + p])
            .filter(|&m| enc[0] != VERSION_1 || m != Mode::Q8Channel)
            .ok_or_else(|| format!("plane {p}: mode {} in version {}", enc[2 + p], enc[0]))?;
        let head_body = take(body_len(Mode::Q8Token, head, c), p)?;
        let body = take(body_len(mode, tokens - head, c), p)?;
        out.push(Plane {
            head: head_body,
            mode,
            body,
        });
    }
    if at != enc.len() {
        return Err(format!("{} bytes after the last plane", enc.len() - at));
    }
    Ok((head, out))
}

/// Decodes a payload into `out`, where plane `p`'s `tokens` rows go at element offset
/// `(p × total + start) × C` (the block's place in a layer-major buffer of `total` tokens).
pub(crate) fn decode_into_place(
    layout: &KvLayout,
    tokens: usize,
    enc: &[u8],
    out: &mut [u8],
    total: usize,
    start: usize,
) -> Result<(), String> {
    let c = layout.kv_heads as usize * layout.head_dim as usize;
    let tb = layout.plane_token_bytes();
    let (head, parts) = planes(layout, tokens, enc)?;
    if out.len() < layout.planes() * total * tb || start + tokens > total {
        return Err("output buffer too small".into());
    }
    for (p, plane) in parts.into_iter().enumerate() {
        let at = (p * total + start) * tb;
        let (dh, dst) = out[at..at + tokens * tb].split_at_mut(head * tb);
        if head > 0 {
            decode_plane(Mode::Q8Token, plane.head, head, c, layout.dtype, dh);
        }
        decode_plane(plane.mode, plane.body, tokens - head, c, layout.dtype, dst);
    }
    Ok(())
}

/// One plane's body into `dst` (`n × c` elements of `dtype`): SIMD for f16 where the CPU has
/// it, else the portable loop.
fn decode_plane(mode: Mode, body: &[u8], n: usize, c: usize, dtype: DType, dst: &mut [u8]) {
    if dtype == DType::F16 && x86::decode_f16(mode, body, n, c, dst) {
        return;
    }
    decode_plane_portable(mode, body, n, c, dtype, dst);
}

/// The portable decoder: every element through f32, `q × scale + min` as one fused
/// multiply-add (what the SIMD decoder computes, so both agree bit for bit).
pub(crate) fn decode_plane_portable(
    mode: Mode,
    body: &[u8],
    n: usize,
    c: usize,
    dtype: DType,
    dst: &mut [u8],
) {
    let mut y = vec![0f32; n * c];
    decode_plane_f32(mode, body, n, c, &mut y);
    let size = dtype.size();
    for (i, v) in y.iter().enumerate() {
        write_elem(dtype, *v, &mut dst[i * size..(i + 1) * size]);
    }
}

fn h(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

fn decode_plane_f32(mode: Mode, body: &[u8], n: usize, c: usize, y: &mut [f32]) {
    let nib = |b: &[u8], j: usize| f32::from((b[j / 2] >> ((j % 2) * 4)) & 15);
    match mode {
        Mode::Q8Token => {
            let g = q8_group(c);
            let (scales, q) = body.split_at(n * (c / g) * 2);
            for (i, v) in y.iter_mut().enumerate() {
                *v = f32::from(q[i] as i8) * h(scales, i / g);
            }
        }
        Mode::Q4Channel | Mode::Q8Channel => {
            let wide = mode == Mode::Q8Channel;
            let mut at = 0;
            for rows in y.chunks_mut(KEY_TOKEN_GROUP * c) {
                let t = rows.len() / c;
                let len = if wide { t * c } else { t * c / 2 };
                let sm = &body[at..at + 4 * c];
                let codes = &body[at + 4 * c..at + 4 * c + len];
                for (i, v) in rows.iter_mut().enumerate() {
                    let j = i % c;
                    let q = if wide {
                        f32::from(codes[i])
                    } else {
                        nib(codes, i)
                    };
                    *v = q.mul_add(h(sm, j), h(sm, c + j));
                }
                at += 4 * c + len;
            }
        }
        Mode::Q4Token => {
            let g = q4_group(c);
            let groups = n * (c / g);
            let (sm, codes) = body.split_at(groups * 4);
            for (i, v) in y.iter_mut().enumerate() {
                *v = nib(codes, i).mul_add(h(sm, i / g), h(sm, groups + i / g));
            }
        }
    }
}

#[cfg(test)]
#[path = "quant_tests.rs"]
mod tests;
