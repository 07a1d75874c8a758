//! Decoding of `q8`/`q4` payloads (format in [`crate::quant`]): the payload split into its
//! planes with every length checked, then each plane decoded into its layer-major place, in
//! SIMD where the CPU and dtype allow ([`super::x86`]) and through the portable loop
//! otherwise.

use schema::{DType, KvLayout};

use super::{
    body_len, h, q4_group, q8_group, wide, write_elem, x86, Mode, KEY_TOKEN_GROUP, VERSION,
    VERSION_1, VERSION_3,
};

/// One plane of a payload: its head tokens' mode-`0` body, its mode and the other tokens' body.
pub(super) struct Plane<'a> {
    pub(super) head: &'a [u8],
    pub(super) mode: Mode,
    pub(super) body: &'a [u8],
}

/// Splits a payload into its head token count and planes, checking every length.
pub(super) fn planes<'a>(
    layout: &KvLayout,
    tokens: usize,
    enc: &'a [u8],
) -> Result<(usize, Vec<Plane<'a>>), String> {
    let c = layout.kv_heads as usize * layout.head_dim as usize;
    let n = layout.planes();
    let known = |v: u8| (VERSION_1..=VERSION).contains(&v);
    if enc.len() < 2 + n || !known(enc[0]) {
        return Err(match enc.first() {
            Some(&v) if !known(v) => format!("quantized payload version {v} is not known"),
            _ => format!("quantized payload of {} bytes is truncated", enc.len()),
        });
    }
    let head = if enc[0] >= VERSION_3 {
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
            .filter(|&m| enc[0] == VERSION || m != Mode::Q4ChannelWide)
            .ok_or_else(|| format!("plane {p}: mode {} in version {}", enc[2 + p], enc[0]))?;
        let head_body = take(body_len(Mode::Q8Token, head, c), p)?;
        let body = take(body_len(mode, tokens - head, c), p)?;
        if mode == Mode::Q4ChannelWide {
            let base = body_len(Mode::Q4Channel, tokens - head, c);
            wide::check(&body[base..], tokens - head, c).map_err(|e| format!("plane {p}: {e}"))?;
        }
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
pub(super) fn decode_plane(
    mode: Mode,
    body: &[u8],
    n: usize,
    c: usize,
    dtype: DType,
    dst: &mut [u8],
) {
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

pub(super) fn decode_plane_f32(mode: Mode, body: &[u8], n: usize, c: usize, y: &mut [f32]) {
    let nib = |b: &[u8], j: usize| f32::from((b[j / 2] >> ((j % 2) * 4)) & 15);
    match mode {
        Mode::Q4ChannelWide => {
            let (base, tail) = body.split_at(body_len(Mode::Q4Channel, n, c));
            decode_plane_f32(Mode::Q4Channel, base, n, c, y);
            wide::columns(base, tail, n, c, |col| {
                col.values(c).for_each(|(i, v)| y[i] = v);
            });
        }
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
