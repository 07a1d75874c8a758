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
//! search costs the encoder about 6x (q4 ~6 MB/s of f16 per thread against ~38 with range
//! groups, docs/BENCHMARKS.md); ranking candidates before their f16 rounding was cheaper but
//! chose worse.

use half::f16;

use super::{code, scale_min};

/// Steps tried besides the range's own: `levels + STEP_FROM + STEP_BY × i` codes over the
/// range, for `i` in `0..=STEPS`.
const STEPS: usize = 20;
const STEP_FROM: f32 = -1.0;
const STEP_BY: f32 = 0.1;

/// The f16 (scale, minimum) of the group `x` (its values, in any order) with codes
/// `0..=levels`: the range's pair unless a least-squares candidate measures a smaller sum of
/// squared errors and keeps every value within one step.
pub(super) fn fit(x: &[f32], levels: f32) -> (f16, f16) {
    let (lo, hi) = bounds(x);
    let range = scale_min(lo, hi, levels);
    if hi <= lo || x.len() < 3 {
        return range;
    }
    let (mut best, mut best_err) = (range, sse(x, range, levels).unwrap_or(f64::INFINITY));
    let n = x.len() as f64;
    for i in 0..=STEPS {
        let inv = (levels + STEP_FROM + STEP_BY * i as f32) / (hi - lo);
        // Codes of this step, then the scale and minimum that fit them best.
        let (mut sl, mut sl2, mut sx, mut slx) = (0f64, 0f64, 0f64, 0f64);
        for v in x {
            let l = f64::from(((v - lo) * inv).round().clamp(0.0, levels));
            let v = f64::from(*v);
            sl += l;
            sl2 += l * l;
            sx += v;
            slx += l * v;
        }
        let d = n * sl2 - sl * sl;
        if d <= 0.0 {
            continue;
        }
        let scale = (n * slx - sl * sx) / d;
        let min = (sl2 * sx - sl * slx) / d;
        if !(scale > 0.0 && scale.is_finite() && min.is_finite()) {
            continue;
        }
        let (s, m) = (f16::from_f64(scale), f16::from_f64(min));
        if !(s.to_f32() > 0.0 && s.is_finite() && m.is_finite()) {
            continue;
        }
        if let Some(err) = sse(x, (s, m), levels) {
            if err < best_err {
                (best, best_err) = ((s, m), err);
            }
        }
    }
    best
}

/// The f16 (scale, minimum) of the group `x` from its range alone.
pub(super) fn range(x: &[f32], levels: f32) -> (f16, f16) {
    let (lo, hi) = bounds(x);
    scale_min(lo, hi, levels)
}

/// The smallest and largest of `x`.
fn bounds(x: &[f32]) -> (f32, f32) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    (lo, hi)
}

/// The sum of squared errors of `x` coded with (scale, min), or `None` where a value would
/// land more than one step from its decoded value.
fn sse(x: &[f32], (s, m): (f16, f16), levels: f32) -> Option<f64> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
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
