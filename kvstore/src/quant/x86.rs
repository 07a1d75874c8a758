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

    std::thread_local! {
        /// A mode-4 key group's high nibbles in place (`KEY_TOKEN_GROUP × c`), all zero
        /// between uses.
        static HIGH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }

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
                // Mode 4: its base body, then per group the wide channels' high nibbles
                // (`tail`), laid out as a group's `t × c` codes (`high`: the nibble shifted
                // into place, zero elsewhere) and OR-ed into the low nibbles of the channel
                // blocks that hold one (`marked`).
                let (k, (mut rest, mut tail)) = if mode == Mode::Q4ChannelWide {
                    let k = wide_channels(c);
                    (k, body.split_at(body_len(Mode::Q4Channel, n, c)))
                } else {
                    (0, (body, &[][..]))
                };
                // Kept zeroed between groups and calls: only the wide channels' entries are
                // written, and cleared again after their group.
                let mut high = HIGH.with(|h| std::mem::take(&mut *h.borrow_mut()));
                if high.len() < KEY_TOKEN_GROUP * c && k > 0 {
                    high.resize(KEY_TOKEN_GROUP * c, 0);
                }
                let mut marked = vec![false; c / 16];
                for rows in dst.chunks_mut(KEY_TOKEN_GROUP * 2 * c) {
                    let t = rows.len() / (2 * c);
                    let (head, after) = rest.split_at(4 * c);
                    let (codes, after) = after.split_at(t * per_row);
                    rest = after;
                    widen(head, &mut sm);
                    let (s, m) = sm.split_at(c);
                    let mut wide = &[][..];
                    if k > 0 {
                        let (w, after) = tail.split_at(2 * k);
                        let (nibbles, after) = after.split_at((t * k).div_ceil(2));
                        (wide, tail) = (w, after);
                        marked.fill(false);
                        for (w, jb) in wide.chunks_exact(2).enumerate() {
                            // Below `c`: checked with the payload's lengths.
                            let j = usize::from(u16::from_le_bytes([jb[0], jb[1]]));
                            marked[j / 16] = true;
                            for (i, h) in high[j..].iter_mut().step_by(c).take(t).enumerate() {
                                let e = i * k + w;
                                *h = ((nibbles[e / 2] >> ((e % 2) * 4)) & 15) << 4;
                            }
                        }
                    }
                    // Channel-outer: a channel block's scales and minimums stay in registers
                    // over the group's rows.
                    let blocks = s.chunks_exact(16).zip(m.chunks_exact(16));
                    for (jb, (s16, m16)) in blocks.enumerate() {
                        let (s0, s1) = (load8(&s16[..8]), load8(&s16[8..]));
                        let (m0, m1) = (load8(&m16[..8]), load8(&m16[8..]));
                        let or_high = k > 0 && marked[jb];
                        let cols = codes
                            .chunks_exact(per_row)
                            .zip(rows.chunks_exact_mut(2 * c));
                        for (i, (row_codes, row)) in cols.enumerate() {
                            let q = &row_codes[jb * per16..][..per16];
                            let (q0, q1) = if bytes {
                                bytes16::<false>(q)
                            } else if or_high {
                                nibbles16_or(q, &high[i * c + 16 * jb..][..16])
                            } else {
                                nibbles16(q)
                            };
                            let (y0, y1) =
                                (_mm256_fmadd_ps(q0, s0, m0), _mm256_fmadd_ps(q1, s1, m1));
                            store16(&mut row[32 * jb..][..32], y0, y1);
                        }
                    }
                    for jb in wide.chunks_exact(2) {
                        let j = usize::from(u16::from_le_bytes([jb[0], jb[1]]));
                        high[j..].iter_mut().step_by(c).take(t).for_each(|h| *h = 0);
                    }
                }
                HIGH.with(|h| *h.borrow_mut() = high);
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

    /// Sixteen 4-bit codes (`b.len() == 8`) OR-ed with sixteen bytes `h` (8-bit codes' high
    /// nibbles, shifted), in element order, as two vectors of f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn nibbles16_or(b: &[u8], h: &[u8]) -> (__m256, __m256) {
        let b: &[u8; 8] = b.try_into().expect("eight bytes");
        // SAFETY: eight bytes are readable at `b`.
        let b = unsafe { _mm_loadl_epi64(b.as_ptr().cast()) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(b, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
        let q = _mm_or_si128(_mm_unpacklo_epi8(lo, hi), codes16(h));
        (
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(q))),
        )
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
