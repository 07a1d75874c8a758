//! Choosing a 4-bit group's scale and minimum by its squared error, not only by its range.
//!
//! The range of a group (`min = lo`, `min + 15 × scale = hi`) bounds every value's error by
//! half a step, but spends its 16 levels on the two extremes: with ~64 values per group most
//! of them fall between few levels. As llama.cpp's K-quants do for weights
//! (`make_qkx2_quants`), [`fit`] tries a few slightly finer steps, fits scale and minimum to
//! each one's codes by least squares, rounds them to f16 and keeps the candidate with the
//! smallest sum of squared errors, the range's own among them, so a group never gets worse.
//! Candidates that leave any value more than one step from its decoded value are refused:
//! the error of a value stays bounded by its group's step.
//!
//! Only the encoder changes: the format, the decoder and its speed stay as they are. The
//! search runs 22 passes over a group (a least-squares fit and an exact error per candidate);
//! its sums are kept in [`LANES`] independent lanes, so that the compiler vectorizes every
//! pass, and on x86 the same code is compiled for AVX2 ([`fit`] picks it at run time). The
//! lanes change no result: every term of the least-squares sums is exact in f64 for f16
//! inputs, so their order does not matter, and the portable and AVX2 builds add in the same
//! order (no contraction into fused multiply-adds), bit for bit (tested).

use half::f16;

use super::scale_min;

/// Steps tried besides the range's own: `levels + STEP_FROM + STEP_BY × i` codes over the
/// range, for `i` in `0..=STEPS`.
const STEPS: usize = 20;
const STEP_FROM: f32 = -1.0;
const STEP_BY: f32 = 0.1;

/// Independent accumulators per sum: wide enough for AVX2's 8 f32 lanes.
const LANES: usize = 8;

/// The f16 (scale, minimum) of the group `x` (its values, in any order) with codes
/// `0..=levels`: the range's pair unless a least-squares candidate measures a smaller sum of
/// squared errors and keeps every value within one step.
pub(super) fn fit(x: &[f32], levels: f32) -> (f16, f16) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above), all `fit_avx2` is compiled for.
            return unsafe { fit_avx2(x, levels) };
        }
    }
    fit_lanes(x, levels)
}

/// [`fit_lanes`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fit_avx2(x: &[f32], levels: f32) -> (f16, f16) {
    fit_lanes(x, levels)
}

#[inline(always)]
fn fit_lanes(x: &[f32], levels: f32) -> (f16, f16) {
    let (lo, hi) = bounds(x);
    let range = scale_min(lo, hi, levels);
    if hi <= lo || x.len() < 3 {
        return range;
    }
    let (mut best, mut best_err) = (range, sse(x, range, levels).unwrap_or(f64::INFINITY));
    let n = x.len() as f64;
    let sx = sum_lanes(x);
    for i in 0..=STEPS {
        let inv = (levels + STEP_FROM + STEP_BY * i as f32) / (hi - lo);
        // Codes of this step, then the scale and minimum that fit them best.
        let (sl, sl2, slx) = code_sums(x, lo, inv, levels);
        let Some((s, m)) = least_squares(n, sl, sl2, sx, slx) else {
            continue;
        };
        if let Some(err) = sse(x, (s, m), levels) {
            if err < best_err {
                (best, best_err) = ((s, m), err);
            }
        }
    }
    best
}

/// The scale and minimum (rounded to f16) that fit `n` values `x` best to their codes `l` by
/// least squares, from the sums of `l`, `l²`, `x` and `l × x`; `None` where the codes do not
/// determine a positive, finite scale.
fn least_squares(n: f64, sl: f64, sl2: f64, sx: f64, slx: f64) -> Option<(f16, f16)> {
    let d = n * sl2 - sl * sl;
    if d <= 0.0 {
        return None;
    }
    let scale = (n * slx - sl * sx) / d;
    let min = (sl2 * sx - sl * slx) / d;
    if !(scale > 0.0 && scale.is_finite() && min.is_finite()) {
        return None;
    }
    let (s, m) = (f16::from_f64(scale), f16::from_f64(min));
    (s.to_f32() > 0.0 && s.is_finite() && m.is_finite()).then_some((s, m))
}

/// The f16 (scale, minimum) of the group `x` from its range alone.
pub(super) fn range(x: &[f32], levels: f32) -> (f16, f16) {
    let (lo, hi) = bounds(x);
    scale_min(lo, hi, levels)
}

/// The smallest and largest of `x`.
#[inline(always)]
fn bounds(x: &[f32]) -> (f32, f32) {
    let (mut lo, mut hi) = ([f32::INFINITY; LANES], [f32::NEG_INFINITY; LANES]);
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for ch in chunks {
        for i in 0..LANES {
            lo[i] = lo[i].min(ch[i]);
            hi[i] = hi[i].max(ch[i]);
        }
    }
    for (i, v) in rest.iter().enumerate() {
        lo[i] = lo[i].min(*v);
        hi[i] = hi[i].max(*v);
    }
    let lo = lo.into_iter().fold(f32::INFINITY, f32::min);
    let hi = hi.into_iter().fold(f32::NEG_INFINITY, f32::max);
    (lo, hi)
}

/// The sum of `x` in f64.
#[inline(always)]
fn sum_lanes(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for ch in chunks {
        for i in 0..LANES {
            acc[i] += f64::from(ch[i]);
        }
    }
    for (i, v) in rest.iter().enumerate() {
        acc[i] += f64::from(*v);
    }
    acc.into_iter().sum()
}

/// For the codes `l` of `x` at step `1 / inv` from `lo`: the sums of `l`, `l²` and `l × x`.
/// The codes are whole numbers up to 255, so the first two sums are exact in f32 for any
/// group shorter than 2^24 / 255² (258) values, and are accumulated so; longer groups take
/// them in f64.
#[inline(always)]
fn code_sums(x: &[f32], lo: f32, inv: f32, levels: f32) -> (f64, f64, f64) {
    let code = |v: f32| ((v - lo) * inv).round().clamp(0.0, levels);
    let (mut sl, mut sl2, mut slx) = ([0f32; LANES], [0f32; LANES], [0f64; LANES]);
    let (mut big_l, mut big_l2) = (0f64, 0f64);
    for part in x.chunks(256) {
        let chunks = part.chunks_exact(LANES);
        let rest = chunks.remainder();
        for ch in chunks {
            for i in 0..LANES {
                let l = code(ch[i]);
                sl[i] += l;
                sl2[i] += l * l;
                slx[i] += f64::from(l) * f64::from(ch[i]);
            }
        }
        for (i, v) in rest.iter().enumerate() {
            let l = code(*v);
            sl[i] += l;
            sl2[i] += l * l;
            slx[i] += f64::from(l) * f64::from(*v);
        }
        // Flushed every 256 values, where the f32 lanes are still exact.
        big_l += sl.iter().map(|v| f64::from(*v)).sum::<f64>();
        big_l2 += sl2.iter().map(|v| f64::from(*v)).sum::<f64>();
        (sl, sl2) = ([0f32; LANES], [0f32; LANES]);
    }
    (big_l, big_l2, slx.into_iter().sum())
}

/// The sum of squared errors of `x` coded with (scale, min), or `None` where a value would
/// land more than one step from its decoded value. Codes as [`super::code`] gives them.
#[inline(always)]
fn sse(x: &[f32], (s, m): (f16, f16), levels: f32) -> Option<f64> {
    let (s, m) = (s.to_f32(), m.to_f32());
    if s <= 0.0 {
        // Every code is 0 (as `code` has it).
        let far = x.iter().any(|v| (m - v).abs() > s);
        return (!far).then(|| x.iter().map(|v| f64::from(m - v).powi(2)).sum());
    }
    // `code` without its cast to `u8` and back (whole numbers in `0..=levels` either way).
    let err = |v: f32| ((v - m) / s).round().clamp(0.0, levels) * s + m - v;
    let (mut sum, mut far) = ([0f64; LANES], [0f32; LANES]);
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for ch in chunks {
        for i in 0..LANES {
            let e = err(ch[i]);
            far[i] = far[i].max(e.abs());
            sum[i] += f64::from(e) * f64::from(e);
        }
    }
    for (i, v) in rest.iter().enumerate() {
        let e = err(*v);
        far[i] = far[i].max(e.abs());
        sum[i] += f64::from(e) * f64::from(e);
    }
    if far.into_iter().any(|f| f > s) {
        return None;
    }
    Some(sum.into_iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::code;
    use proptest::prelude::*;

    /// The search as first written: one value at a time, every sum in f64 in order, codes
    /// from the encoder's own [`code`] (the least-squares solve from the sums is shared).
    fn fit_in_order(x: &[f32], levels: f32) -> (f16, f16) {
        let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let range = scale_min(lo, hi, levels);
        if hi <= lo || x.len() < 3 {
            return range;
        }
        let sse = |(s, m): (f16, f16)| {
            let (s, m) = (s.to_f32(), m.to_f32());
            let mut sum = 0f64;
            for v in x {
                let e = f32::from(code(*v, (s, m), levels)) * s + m - v;
                if e.abs() > s {
                    return None;
                }
                sum += f64::from(e) * f64::from(e);
            }
            Some(sum)
        };
        let (mut best, mut best_err) = (range, sse(range).unwrap_or(f64::INFINITY));
        let n = x.len() as f64;
        for i in 0..=STEPS {
            let inv = (levels + STEP_FROM + STEP_BY * i as f32) / (hi - lo);
            let (mut sl, mut sl2, mut sx, mut slx) = (0f64, 0f64, 0f64, 0f64);
            for v in x {
                let l = f64::from(((v - lo) * inv).round().clamp(0.0, levels));
                let v = f64::from(*v);
                sl += l;
                sl2 += l * l;
                sx += v;
                slx += l * v;
            }
            let Some((s, m)) = least_squares(n, sl, sl2, sx, slx) else {
                continue;
            };
            if let Some(err) = sse((s, m)) {
                if err < best_err {
                    (best, best_err) = ((s, m), err);
                }
            }
        }
        best
    }

    proptest! {
        #[test]
        fn the_lanes_choose_what_the_search_in_order_chooses(
            x in prop::collection::vec(-60000f32..60000.0, 3..300),
            scale in prop::sample::select(vec![1e-4f32, 1e-2, 1.0]),
        ) {
            // f16 values, as the store holds them.
            let x: Vec<f32> = x.iter().map(|v| f16::from_f32(v * scale).to_f32()).collect();
            prop_assert_eq!(fit(&x, 15.0), fit_in_order(&x, 15.0));
            prop_assert_eq!(fit_lanes(&x, 15.0), fit_in_order(&x, 15.0));
        }

        #[test]
        fn never_worse_than_the_range_and_within_a_step(
            x in prop::collection::vec(-50f32..50.0, 3..130),
        ) {
            let range = range(&x, 15.0);
            let fitted = fit(&x, 15.0);
            let base = sse(&x, range, 15.0).unwrap();
            let got = sse(&x, fitted, 15.0);
            prop_assert!(got.is_some(), "a value beyond one step");
            prop_assert!(got.unwrap() <= base, "{} > {}", got.unwrap(), base);
        }
    }

    #[test]
    fn a_gaussian_group_gets_a_smaller_error_than_its_range() {
        // 64 values of a bell shape (a fixed pseudo-random sum of uniforms).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32
        };
        let x: Vec<f32> = (0..64)
            .map(|_| (0..4).map(|_| uniform()).sum::<f32>() - 2.0)
            .collect();
        let base = sse(&x, range(&x, 15.0), 15.0).unwrap();
        let got = sse(&x, fit(&x, 15.0), 15.0).unwrap();
        assert!(got < base * 0.95, "{got} vs {base}");
    }
}
