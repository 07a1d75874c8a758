//! AVX-512 attention for heads of 64, 128 or 256 elements (SmolLM2 and Qwen2.5-0.5B use 64,
//! Qwen2.5-1.5B and Llama 3 128, Gemma 256): a head's query and its running output stay in
//! registers (`d / 16` vectors each) over every key of the task, as many heads of a KV group
//! per pass as sixteen query vectors hold (four of 64, two of 128, one of 256), so a key or
//! value row costs `d / 16` loads, shared by the pass's heads, and `d / 16` multiply-adds per
//! head instead of a call and a trip through memory.
//! The softmax's `exp` is ggml's vectorized one (as the AVX2 loops'); the division by the
//! sum is applied once to the output. Caches in f16 are widened to f32 as each row is
//! loaded (`vcvtph2ps`), so an f16 cache costs half the memory traffic and no extra pass;
//! q8 caches' codes likewise (`vpmovsxbd`), times their block's scale.

use std::arch::x86_64::*;

use half::f16;

use super::Ahead;

/// Cache elements the kernel reads as f32 lanes.
pub(super) trait Lanes: Copy {
    /// Elements a row of `d` takes in the cache (more than `d` where scales follow).
    fn row_len(d: usize) -> usize {
        d
    }

    /// Sixteen elements from `p` as f32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F; sixteen elements are readable at `p`.
    unsafe fn load16(p: *const Self) -> __m512;

    /// A whole row of `16 V` values from `at`, as f32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F; the row ([`Lanes::row_len`]) is readable at `at`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_row<const V: usize>(at: *const Self) -> [__m512; V] {
        // SAFETY: the caller's contract.
        std::array::from_fn(|c| unsafe { Self::load16(at.add(16 * c)) })
    }
}

impl Lanes for f32 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller's contract: sixteen f32 readable at `p`.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Lanes for f16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f16) -> __m512 {
        // SAFETY: the caller's contract: sixteen f16 readable at `p`.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
    }
}

/// q8 cache rows (`crate::kv_q8`): `d` signed codes, then an f32 scale per 32 of them; the
/// codes are widened as they load and multiplied by their block's scale in registers.
impl Lanes for u8 {
    fn row_len(d: usize) -> usize {
        crate::kv_q8::row_bytes(d)
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: the caller's contract: sixteen codes readable at `p`.
        let codes = unsafe { _mm_loadu_si128(p.cast()) };
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_row<const V: usize>(at: *const u8) -> [__m512; V] {
        // Heads of 64-256: blocks of 32, two vectors each; their scales follow the codes.
        let scales = at.wrapping_add(16 * V).cast::<f32>();
        std::array::from_fn(|c| {
            // SAFETY: the caller's contract: the codes and the `V / 2` scales are readable.
            unsafe {
                let s = scales.add(c / 2).read_unaligned();
                _mm512_mul_ps(Self::load16(at.add(16 * c)), _mm512_set1_ps(s))
            }
        })
    }
}

/// Whether this kernel takes heads of `d` elements.
pub(super) fn takes(d: usize) -> bool {
    matches!(d, 64 | 128 | 256)
}

pub(super) fn available() -> bool {
    crate::simd::allows_avx512() && is_x86_feature_detected!("avx512f")
}

/// Heads `q` (`rep` rows of `d`, [`takes`]) over the key and value rows `from..=pos` of `k`
/// and `v` (row strides `ks`, `vs`): the softmax-weighted sums of values into `o` (`rep` rows
/// of `d`), scores scaled by `scale`; `p` is scratch.
///
/// # Safety
/// The CPU has AVX-512F ([`available`]).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn group<T: Lanes>(
    q: &[f32],
    d: usize,
    k: &[T],
    ks: usize,
    v: &[T],
    vs: usize,
    (from, pos): (usize, usize),
    scale: f32,
    p: &mut Vec<f32>,
    o: &mut [f32],
) {
    let rep = q.len() / d;
    assert!(
        takes(d)
            && from <= pos
            && o.len() == q.len()
            && pos * ks + T::row_len(d) <= k.len()
            && pos * vs + T::row_len(d) <= v.len()
    );
    // Heads per pass: their queries fill at most sixteen registers.
    let most = 256 / d;
    let mut h = 0;
    while h < rep {
        let c = (rep - h).min(most);
        let (qh, oh) = (&q[h * d..(h + c) * d], &mut o[h * d..(h + c) * d]);
        let rows = Rows {
            k,
            ks,
            v,
            vs,
            from,
            n: pos + 1 - from,
        };
        // SAFETY: the caller's contract; the rows are in bounds (asserted above).
        unsafe {
            match (d, c) {
                (64, 1) => heads::<T, 1, 4>(qh, &rows, scale, p, oh),
                (64, 2) => heads::<T, 2, 4>(qh, &rows, scale, p, oh),
                (64, 3) => heads::<T, 3, 4>(qh, &rows, scale, p, oh),
                (64, _) => heads::<T, 4, 4>(qh, &rows, scale, p, oh),
                (128, 1) => heads::<T, 1, 8>(qh, &rows, scale, p, oh),
                (128, _) => heads::<T, 2, 8>(qh, &rows, scale, p, oh),
                _ => heads::<T, 1, 16>(qh, &rows, scale, p, oh),
            }
        }
        h += c;
    }
}

/// The keys and values a pass reads: `n` rows from `from`.
struct Rows<'a, T> {
    k: &'a [T],
    ks: usize,
    v: &'a [T],
    vs: usize,
    from: usize,
    n: usize,
}

/// `H` heads of `V` vectors (`16 V` elements) each.
#[target_feature(enable = "avx512f")]
unsafe fn heads<T: Lanes, const H: usize, const V: usize>(
    q: &[f32],
    r: &Rows<'_, T>,
    scale: f32,
    p: &mut Vec<f32>,
    o: &mut [f32],
) {
    // SAFETY: the caller's contract (AVX-512F); every pointer below stays in the rows `group`
    // asserted in bounds, `p` (resized to `H n`) and `q`, `o` (`H` heads of `16 V`).
    unsafe {
        let n = r.n;
        p.clear();
        p.resize(H * n, 0.0);
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load<T: Lanes, const V: usize>(at: *const T) -> [__m512; V] {
            // SAFETY: the CPU has AVX-512F; the rows are in bounds (asserted by `group`).
            unsafe { T::load_row::<V>(at) }
        }
        let qv: [[__m512; V]; H] =
            std::array::from_fn(|h| load::<f32, V>(q.as_ptr().add(h * 16 * V)));
        let (kp, vp, pp) = (r.k.as_ptr(), r.v.as_ptr(), p.as_mut_ptr());
        // The rows are read once per step, from memory: each row's lines are asked for a few
        // kilobytes ahead of its use ([`Ahead`]), never past the task's last row.
        let bytes = T::row_len(16 * V) * std::mem::size_of::<T>();
        let (ahead, last) = (Ahead::new(bytes), r.from + n - 1);
        // Two chains of multiply-adds, so that neither waits on the other's latency.
        let dot = |qh: &[__m512; V], kr: &[__m512; V]| {
            let mut acc = [_mm512_mul_ps(qh[0], kr[0]), _mm512_mul_ps(qh[1], kr[1])];
            for c in 2..V {
                acc[c % 2] = _mm512_fmadd_ps(qh[c], kr[c], acc[c % 2]);
            }
            _mm512_add_ps(acc[0], acc[1])
        };
        // Sixteen keys at a time: each head's sixteen partial products are summed together
        // ([`sum16`]: ~3 instructions per key instead of a horizontal sum's ~9), the scores
        // stored as one vector.
        let sv = _mm512_set1_ps(scale);
        let mut parts = [[_mm512_setzero_ps(); 16]; H];
        let mut j = 0;
        while j + 16 <= n {
            for k in 0..16 {
                let at = (r.from + j + k + ahead.rows).min(last);
                ahead.fetch(kp.wrapping_add(at * r.ks).cast());
                let kr = load::<T, V>(kp.add((r.from + j + k) * r.ks));
                for (part, qh) in parts.iter_mut().zip(&qv) {
                    part[k] = dot(qh, &kr);
                }
            }
            for (h, part) in parts.iter().enumerate() {
                _mm512_storeu_ps(pp.add(h * n + j), _mm512_mul_ps(sum16(part), sv));
            }
            j += 16;
        }
        while j < n {
            let kr = load::<T, V>(kp.add((r.from + j) * r.ks));
            for (h, qh) in qv.iter().enumerate() {
                *pp.add(h * n + j) = _mm512_reduce_add_ps(dot(qh, &kr)) * scale;
            }
            j += 1;
        }
        let mut inv = [0f32; H];
        for (h, inv) in inv.iter_mut().enumerate() {
            let s = std::slice::from_raw_parts_mut(pp.add(h * n), n);
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            *inv = 1.0 / exp_sub(s, max);
        }
        let mut ov = [[_mm512_setzero_ps(); V]; H];
        for j in 0..n {
            ahead.fetch(
                vp.wrapping_add((r.from + j + ahead.rows).min(last) * r.vs)
                    .cast(),
            );
            let vr = load::<T, V>(vp.add((r.from + j) * r.vs));
            for (h, oh) in ov.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*pp.add(h * n + j));
                for (acc, x) in oh.iter_mut().zip(&vr) {
                    *acc = _mm512_fmadd_ps(w, *x, *acc);
                }
            }
        }
        for (h, (oh, inv)) in ov.iter().zip(inv).enumerate() {
            let scale = _mm512_set1_ps(inv);
            for (c, acc) in oh.iter().enumerate() {
                _mm512_storeu_ps(
                    o.as_mut_ptr().add((h * V + c) * 16),
                    _mm512_mul_ps(*acc, scale),
                );
            }
        }
    }
}

/// The sums of sixteen vectors' lanes, as one vector: lane `j` is the sum of `v[j]`'s lanes
/// (a transposing tree of unpacks and lane shuffles, 45 instructions for all sixteen).
#[inline]
#[target_feature(enable = "avx512f")]
fn sum16(v: &[__m512; 16]) -> __m512 {
    // Pairs: within each 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
    let a: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (v[2 * k], v[2 * k + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
    });
    // Quads: within each 128-bit lane, the lane sums of four vectors in order.
    let b: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (_mm512_castps_pd(a[2 * m]), _mm512_castps_pd(a[2 * m + 1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
        )
    });
    // Across 128-bit lanes: pairs of lanes, then the rest.
    let pair = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    };
    let (c0, c1) = (pair(b[0], b[1]), pair(b[2], b[3]));
    pair(c0, c1)
}

/// ggml's `ggml_v_expf` on sixteen lanes, for arguments clamped at -87 (scores minus their
/// maximum: anything below is 0 to f32 anyway).
#[inline]
#[target_feature(enable = "avx512f")]
fn exp16(x: __m512) -> __m512 {
    let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
    let r = c(0x4b40_0000);
    let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
    let e = _mm512_slli_epi32(_mm512_castps_si512(z), 23);
    let k = _mm512_castsi512_ps(_mm512_add_epi32(
        e,
        _mm512_castps_si512(_mm512_set1_ps(1.0)),
    ));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        _mm512_mul_ps(c(0x3f7f_fff6), b),
    );
    _mm512_fmadd_ps(j, k, k)
}

/// `x = exp(x - max)` in place; returns the sum.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sub(x: &mut [f32], max: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    // SAFETY: the caller's contract (AVX-512F); `i + 16 <= n` for every load and store.
    unsafe {
        let m = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            let y = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), m));
            _mm512_storeu_ps(p.add(i), y);
            acc = _mm512_add_ps(acc, y);
            i += 16;
        }
        let mut sum = _mm512_reduce_add_ps(acc);
        while i < n {
            x[i] = (x[i] - max).exp();
            sum += x[i];
            i += 1;
        }
        sum
    }
}
