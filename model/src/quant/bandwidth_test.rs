//! Decode-shaped products against a plain read of the same bytes (ignored: a measurement,
//! run by hand with `cargo test --workspace --lib bandwidth -- --ignored --nocapture`).

use super::packed::Packed;
use super::test_util::{uniform, weights};
use candle_core::quantized::GgmlDType;

/// Bytes read per second by `f`, best of 5, over `bytes`.
fn rate(bytes: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

#[test]
#[ignore]
fn decode_bandwidth() {
    let (n, k) = (8960, 1536);
    let mut u = uniform(3);
    let vals: Vec<f32> = (0..n * k).map(|_| u()).collect();
    let x: Vec<f32> = (0..k).map(|_| u()).collect();
    for (name, dtype) in [
        ("Q4_K", GgmlDType::Q4K),
        ("Q6_K", GgmlDType::Q6K),
        ("Q8_0", GgmlDType::Q8_0),
        ("Q5_0", GgmlDType::Q5_0),
        ("Q4_1", GgmlDType::Q4_1),
    ] {
        let (raw, _) = weights(&vals, n, k, dtype);
        // 40 copies: ~300-450 MB, far beyond the last-level cache.
        let mats: Vec<Packed> = (0..40)
            .map(|_| Packed::new(super::packed::PackKind::of(dtype).unwrap(), &raw, n, k))
            .collect();
        let bytes: usize = mats.iter().map(Packed::bytes).sum();
        let kernel = rate(bytes, || {
            for m in &mats {
                std::hint::black_box(m.matmul(&x));
            }
        });
        // Each matrix's tiles summed as u64 words on the pool, as the kernel splits them.
        let plain = rate(bytes, || {
            for m in &mats {
                std::hint::black_box(sum_words(m.tiles()));
            }
        });
        // One small matrix again and again: its tiles stay in L2, the kernel's own speed.
        let sn = 512;
        let (raw_s, _) = weights(&vals[..sn * k], sn, k, dtype);
        let small_m = Packed::new(super::packed::PackKind::of(dtype).unwrap(), &raw_s, sn, k);
        let cached = rate(small_m.bytes() * 200, || {
            for _ in 0..200 {
                std::hint::black_box(small_m.matmul(&x));
            }
        });
        eprintln!(
            "{name}: kernel {kernel:.1} GB/s from memory, {cached:.1} GB/s from cache; plain read {plain:.1} GB/s ({} MB)",
            bytes >> 20
        );
    }
}

/// The sum of `bytes` as u64 words, split over the pool as the kernels split a matrix.
fn sum_words(bytes: &[u8]) -> u64 {
    let words: &[u64] = bytemuck_words(bytes);
    let parts = std::sync::Mutex::new(0u64);
    let chunk = 4096;
    candle_core::utils::barrier_pool().execute_chunked(words.len().div_ceil(chunk), |r| {
        let (a, b) = (r.start * chunk, (r.end * chunk).min(words.len()));
        let s = words[a..b].iter().fold(0u64, |s, w| s.wrapping_add(*w));
        *parts.lock().unwrap() ^= s;
    });
    parts.into_inner().unwrap()
}

fn bytemuck_words(b: &[u8]) -> &[u64] {
    // SAFETY: any bytes are valid u64s; `align_to` puts the unaligned ends aside.
    let (_, words, _) = unsafe { b.align_to::<u64>() };
    words
}
