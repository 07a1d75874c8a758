//! AVX2 + F16C decoding of `q8`/`q4` planes into f16 (see [`crate::quant`] for the format):
//! 16 elements per step, codes widened to f32, `q × scale (+ min)` in one fused multiply-add,
//! rounded to f16 with the hardware conversion. Bit for bit what the portable decoder writes.

use crate::quant::Mode;

/// Decodes one plane into `dst` (`n × c` f16) if this CPU and shape allow; `false`: use the
/// portable decoder.
pub(crate) fn decode_f16(mode: Mode, body: &[u8], n: usize, c: usize, dst: &mut [u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if c.is_multiple_of(16)
            && dst.len() == n * c * 2
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has every feature the kernels are compiled for (checked above).
            unsafe { avx2::decode(mode, body, n, c, dst) };
            return true;
        }
    }
    let _ = (mode, body, n, c, dst);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::quant::wide::wide_channels;
    use crate::quant::{body_len, q4_group, q8_group, Mode, KEY_TOKEN_GROUP};

    /// Lengths are the caller's: `dst` holds `n × c` f16 and `body` is the plane's whole body
    /// (checked against the format before decoding), `c` a multiple of 16. Scales and
    /// minimums are widened to f32 once per plane (or key group), not per step. The loops
    /// walk fixed-size chunks (no index arithmetic), so that no bounds or overflow check sits
    /// in them in any build profile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn decode(mode: Mode, body: &[u8], n: usize, c: usize, dst: &mut [u8]) {
        assert!(c.is_multiple_of(16) && dst.len() == n * c * 2);
        let mut sm = Vec::new();
        match mode {
            Mode::Q8Token => {
                let g = q8_group(c);
                let (scales, q) = body.split_at(n * (c / g) * 2);
                widen(scales, &mut sm);
                let groups = sm.iter().zip(q.chunks_exact(g));
                for ((&sk, qg), dg) in groups.zip(dst.chunks_exact_mut(2 * g)) {
                    let s = _mm256_set1_ps(sk);
                    for (q16, d) in qg.chunks_exact(16).zip(dg.chunks_exact_mut(32)) {
                        let (lo, hi) = bytes16::<true>(q16);
                        store16(d, _mm256_mul_ps(lo, s), _mm256_mul_ps(hi, s));
                    }
                }
            }
            Mode::Q4Channel | Mode::Q8Channel | Mode::Q4ChannelWide => {
                let bytes = mode == Mode::Q8Channel;
                // Code bytes per row, and per 16 channels.
                let (per_row, per16) = if bytes { (c, 16) } else { (c / 2, 8) };
                // Mode 4: its base body, then per group the wide channels and their codes'
                // high nibbles (`tail`, see `wide`).
                let (k, (mut rest, mut tail)) = if mode == Mode::Q4ChannelWide {
                    let k = wide_channels(c);
                    (k, body.split_at(body_len(Mode::Q4Channel, n, c)))
                } else {
                    (0, (body, &[][..]))
                };
                // A group's high nibbles, one byte each, shifted into place (`t` rows of `k`,
                // then 16 bytes of slack for the last row's window).
                let mut high = vec![0u8; KEY_TOKEN_GROUP * k + 16];
                // Per 16-channel block holding a wide channel: the index of its first wide
                // channel among the group's, and the shuffle that moves a row's window of
                // high nibbles from there onto the block's lanes (0x80: a lane of no wide
                // channel, zero).
                let mut shuffles: Vec<Option<(usize, [u8; 16])>> = vec![None; c / 16];
                for rows in dst.chunks_mut(KEY_TOKEN_GROUP * 2 * c) {
                    let t = rows.len() / (2 * c);
                    let (head, after) = rest.split_at(4 * c);
                    let (codes, after) = after.split_at(t * per_row);
                    rest = after;
                    widen(head, &mut sm);
                    let (s, m) = sm.split_at(c);
                    if k > 0 {
                        let (wide, after) = tail.split_at(2 * k);
                        let (nibbles, after) = after.split_at((t * k).div_ceil(2));
                        tail = after;
                        for (pair, b) in high.chunks_exact_mut(2).zip(nibbles) {
                            pair[0] = b << 4;
                            pair[1] = b & 0xf0;
                        }
                        shuffles.fill(None);
                        for (w, jb) in wide.chunks_exact(2).enumerate() {
                            // Below `c` and ascending: checked with the payload's lengths,
                            // so a block's wide channels are consecutive and at most 16.
                            let j = usize::from(u16::from_le_bytes([jb[0], jb[1]]));
                            let (first, lanes) = shuffles[j / 16].get_or_insert((w, [0x80; 16]));
                            lanes[j % 16] = (w - *first) as u8;
                        }
                    }
                    // Channel-outer: a channel block's scales and minimums stay in registers
                    // over the group's rows.
                    let blocks = s.chunks_exact(16).zip(m.chunks_exact(16));
                    for (jb, (s16, m16)) in blocks.enumerate() {
                        let (s0, s1) = (load8(&s16[..8]), load8(&s16[8..]));
                        let (m0, m1) = (load8(&m16[..8]), load8(&m16[8..]));
                        let (s, m) = ((s0, s1), (m0, m1));
                        // No closure in these loops: one would not inherit the target features,
                        // and the iterator calling it would not be inlined.
                        let cols = codes
                            .chunks_exact(per_row)
                            .zip(rows.chunks_exact_mut(2 * c));
                        let at = jb * per16;
                        if bytes {
                            for (q, row) in cols {
                                let q = bytes16::<false>(&q[at..][..16]);
                                fma16(&mut row[32 * jb..][..32], q, s, m);
                            }
                        } else if let Some((first, lanes)) = shuffles[jb] {
                            let lanes = codes16(&lanes);
                            for (i, (q, row)) in cols.enumerate() {
                                let window = &high[i * k + first..][..16];
                                let q = nibbles16_or(&q[at..][..8], window, lanes);
                                fma16(&mut row[32 * jb..][..32], q, s, m);
                            }
                        } else {
                            for (q, row) in cols {
                                fma16(&mut row[32 * jb..][..32], nibbles16(&q[at..][..8]), s, m);
                            }
                        }
                    }
                }
            }
            Mode::Q4Token => {
                let g = q4_group(c);
                let groups = n * (c / g);
                let (head, codes) = body.split_at(groups * 4);
                widen(head, &mut sm);
                let (scales, mins) = sm.split_at(groups);
                let groups = scales.iter().zip(mins).zip(codes.chunks_exact(g / 2));
                for (((&sk, &mk), qg), dg) in groups.zip(dst.chunks_exact_mut(2 * g)) {
                    let (s, m) = (_mm256_set1_ps(sk), _mm256_set1_ps(mk));
                    for (q8, d) in qg.chunks_exact(8).zip(dg.chunks_exact_mut(32)) {
                        let (q0, q1) = nibbles16(q8);
                        store16(d, _mm256_fmadd_ps(q0, s, m), _mm256_fmadd_ps(q1, s, m));
                    }
                }
            }
        }
    }

    /// Little-endian f16 bytes widened to f32 into `out` (replacing its contents).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn widen(bytes: &[u8], out: &mut Vec<f32>) {
        let n = bytes.len() / 2;
        out.clear();
        out.resize(n, 0.0);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: elements `i..i + 8` are in bounds of both `bytes` and `out`.
            unsafe {
                let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i).cast());
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for k in i..n {
            out[k] = half::f16::from_le_bytes([bytes[2 * k], bytes[2 * k + 1]]).to_f32();
        }
    }

    /// Eight f32 (`v.len() == 8`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load8(v: &[f32]) -> __m256 {
        let v: &[f32; 8] = v.try_into().expect("eight floats");
        // SAFETY: eight f32 are readable at `v`.
        unsafe { _mm256_loadu_ps(v.as_ptr()) }
    }

    /// Sixteen 8-bit codes (`b.len() == 16`) in one register.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn codes16(b: &[u8]) -> __m128i {
        let b: &[u8; 16] = b.try_into().expect("sixteen codes");
        // SAFETY: sixteen bytes are readable at `b`.
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }

    /// Sixteen 8-bit codes (`b.len() == 16`), signed (`SIGNED`) or unsigned, as two vectors of
    /// f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bytes16<const SIGNED: bool>(b: &[u8]) -> (__m256, __m256) {
        let b = codes16(b);
        let (lo, hi) = (b, _mm_srli_si128::<8>(b));
        let (lo, hi) = if SIGNED {
            (_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(hi))
        } else {
            (_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(hi))
        };
        (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi))
    }

    /// Sixteen 4-bit codes (`b.len() == 8`), in element order, as two vectors of f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn nibbles16(b: &[u8]) -> (__m256, __m256) {
        let b: &[u8; 8] = b.try_into().expect("eight bytes");
        // SAFETY: eight bytes are readable at `b`.
        let b = unsafe { _mm_loadl_epi64(b.as_ptr().cast()) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(b, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
        let q = _mm_unpacklo_epi8(lo, hi);
        (
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(q))),
        )
    }

    /// Sixteen 4-bit codes (`b.len() == 8`) OR-ed with the bytes of `window` (16: high
    /// nibbles, shifted) that `lanes` picks for each element (`0x80`: none), in element
    /// order, as two vectors of f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn nibbles16_or(b: &[u8], window: &[u8], lanes: __m128i) -> (__m256, __m256) {
        let b: &[u8; 8] = b.try_into().expect("eight bytes");
        // SAFETY: eight bytes are readable at `b`.
        let b = unsafe { _mm_loadl_epi64(b.as_ptr().cast()) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(b, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
        let high = _mm_shuffle_epi8(codes16(window), lanes);
        let q = _mm_or_si128(_mm_unpacklo_epi8(lo, hi), high);
        (
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(q))),
        )
    }

    /// `q × s + m` for 16 codes `q` (two vectors of f32, and their scales and minimums), as
    /// f16 into `d` (`d.len() == 32` bytes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fma16(
        d: &mut [u8],
        (q0, q1): (__m256, __m256),
        (s0, s1): (__m256, __m256),
        (m0, m1): (__m256, __m256),
    ) {
        store16(d, _mm256_fmadd_ps(q0, s0, m0), _mm256_fmadd_ps(q1, s1, m1));
    }

    /// Rounds 16 values to f16 into `d` (`d.len() == 32` bytes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn store16(d: &mut [u8], lo: __m256, hi: __m256) {
        let d: &mut [u8; 32] = d.try_into().expect("sixteen f16");
        let (a, b) = (
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(lo),
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(hi),
        );
        // SAFETY: 32 bytes are writable at `d`.
        unsafe {
            _mm_storeu_si128(d.as_mut_ptr().cast(), a);
            _mm_storeu_si128(d.as_mut_ptr().add(16).cast(), b);
        }
    }
}
