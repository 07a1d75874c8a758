//! Unit tests of `attention.rs` (a module of it, kept in its own file).

use super::loops::Elem;
use super::*;
use crate::test_util::max_diff;
use candle_core::{Device, Tensor};

/// softmax(q kᵀ · scale) v with candle's operations, for one query row.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, from: usize, scale: f32) -> Tensor {
    let (_, heads, _, d) = q.dims4().unwrap();
    let (kv, t) = (k.dim(1).unwrap(), k.dim(2).unwrap());
    let qg = q
        .contiguous()
        .unwrap()
        .reshape((1, kv, heads / kv, d))
        .unwrap();
    let (kw, vw) = (
        k.narrow(2, from, t - from).unwrap().contiguous().unwrap(),
        v.narrow(2, from, t - from).unwrap().contiguous().unwrap(),
    );
    let att = (qg.matmul(&kw.t().unwrap()).unwrap() * scale as f64).unwrap();
    let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
    att.matmul(&vw).unwrap().reshape((1, heads * d)).unwrap()
}

/// Several decoding sequences of a step, each over its own cache view (live rows of a
/// larger buffer), grouped heads, with and without a window: each row equals the
/// reference computed alone.
#[test]
fn matches_the_reference_on_cache_views() {
    let dev = Device::Cpu;
    let (heads, kv, d, cap) = (6, 2, 20, 40);
    let q = Tensor::randn(0f32, 1.0, (1, heads, 3, d), &dev).unwrap();
    let caches: Vec<(Tensor, Tensor)> = (0..2)
        .map(|_| {
            (
                Tensor::randn(0f32, 1.0, (1, kv, cap, d), &dev).unwrap(),
                Tensor::randn(0f32, 1.0, (1, kv, cap, d), &dev).unwrap(),
            )
        })
        .collect();
    let scale = 1.0 / (d as f32).sqrt();
    for (t0, t1, from) in [(29, 7, 0), (33, 21, 5)] {
        let views: Vec<(Tensor, Tensor)> = caches
            .iter()
            .zip([t0, t1])
            .map(|((k, v), t)| (k.narrow(2, 0, t).unwrap(), v.narrow(2, 0, t).unwrap()))
            .collect();
        // Sequence 0 is the step's row 2, sequence 1 its row 0 (strided rows of `q`).
        let seqs = [
            Seq {
                row: 2,
                len: 1,
                k: &views[0].0,
                v: &views[0].1,
                pos: None,
            },
            Seq {
                row: 0,
                len: 1,
                k: &views[1].0,
                v: &views[1].1,
                pos: None,
            },
        ];
        // A window that starts at `from` for sequence 0's token (at cache index t0 - 1).
        let window = (from > 0).then(|| t0 - from);
        let got = attend(&q, &seqs, window, scale).unwrap();
        assert_eq!(got.dims(), [3, heads * d]);
        for s in &seqs {
            let qi = q.narrow(2, s.row, 1).unwrap();
            let t = s.k.dim(2).unwrap();
            let lo = window.map_or(0, |w| t.saturating_sub(w));
            let want = reference(&qi, s.k, s.v, lo, scale);
            let diff = max_diff(&got.narrow(0, s.row, 1).unwrap(), &want);
            assert!(
                diff < 1e-5,
                "row {}, window {window:?}: differs by {diff}",
                s.row
            );
        }
    }
}

/// A repair's query rows at explicit cache indices (anywhere, not the last rows), heads
/// of 64 (the AVX-512 kernel where the CPU has it) and of 20: each row sees the keys up
/// to its own index, within the window.
#[test]
fn rows_at_explicit_positions_see_their_own_prefix() {
    let dev = Device::Cpu;
    for d in [64, 20] {
        let (heads, kv, t) = (6, 2, 40);
        let at = [2usize, 7, 8, 23, 39];
        let q = Tensor::randn(0f32, 1.0, (1, heads, at.len(), d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, kv, t, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, kv, t, d), &dev).unwrap();
        for window in [None, Some(5)] {
            let seqs = [Seq {
                row: 0,
                len: at.len(),
                k: &k,
                v: &v,
                pos: Some(&at),
            }];
            let got = attend(&q, &seqs, window, 0.125).unwrap();
            for (row, &pos) in at.iter().enumerate() {
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let (kk, vv) = (
                    k.narrow(2, 0, pos + 1).unwrap(),
                    v.narrow(2, 0, pos + 1).unwrap(),
                );
                let want = reference(&q.narrow(2, row, 1).unwrap(), &kk, &vv, lo, 0.125);
                let diff = max_diff(&got.narrow(0, row, 1).unwrap(), &want);
                assert!(
                    diff < 1e-5,
                    "d {d}, row {row} at {pos}, window {window:?}: {diff}"
                );
            }
        }
        // A position past the cache is refused.
        let bad = [2usize, 7, 8, 23, 40];
        let seqs = [Seq {
            row: 0,
            len: bad.len(),
            k: &k,
            v: &v,
            pos: Some(&bad),
        }];
        assert!(attend(&q, &seqs, None, 0.125).is_err());
    }
}

/// A decoding token (over a cache of `short` rows) and a prompt of `s` rows after `past`
/// cached ones, in one step: every row equals the reference computed alone, each prompt
/// row seeing the keys up to its own cache index (causal), within the window.
fn check_prompt_beside_a_token(heads: usize, kv: usize, d: usize, s: usize, past: usize) {
    let dev = Device::Cpu;
    let (t, short, cap) = (past + s, 11, past + s + 8);
    let q = Tensor::randn(0f32, 1.0, (1, heads, s + 1, d), &dev).unwrap();
    let kc = Tensor::randn(0f32, 1.0, (1, kv, cap, d), &dev).unwrap();
    let vc = Tensor::randn(0f32, 1.0, (1, kv, cap, d), &dev).unwrap();
    let view = |n| (kc.narrow(2, 0, n).unwrap(), vc.narrow(2, 0, n).unwrap());
    let ((k, v), (k1, v1)) = (view(t), view(short));
    for window in [None, Some(9)] {
        let seqs = [
            Seq {
                row: 0,
                len: 1,
                k: &k1,
                v: &v1,
                pos: None,
            },
            Seq {
                row: 1,
                len: s,
                k: &k,
                v: &v,
                pos: None,
            },
        ];
        let got = attend(&q, &seqs, window, 0.125).unwrap();
        // Row 0: the token at cache index `short - 1`; row 1 + i: the prompt's row i.
        let rows = std::iter::once(short - 1).chain((0..s).map(|i| past + i));
        for (row, pos) in rows.enumerate() {
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let (kk, vv) = view(pos + 1);
            let want = reference(&q.narrow(2, row, 1).unwrap(), &kk, &vv, lo, 0.125);
            let diff = max_diff(&got.narrow(0, row, 1).unwrap(), &want);
            assert!(
                diff < 1e-5,
                "{heads}/{kv} heads of {d}, row {row}, window {window:?}: differs by {diff}"
            );
        }
    }
}

/// A prompt longer than one task's rows, beside a decoding token (the AVX2 or portable
/// loops: 16-element heads).
#[test]
fn prompts_are_causal_and_windowed() {
    check_prompt_beside_a_token(4, 2, 16, ROWS_PER_TASK + 5, 9);
}

/// Heads of 64, 128 and 256 elements (the AVX-512 kernel where the CPU has it), in groups
/// of three and of seven query heads per KV head (passes of four, two or one heads, the
/// last one shorter).
#[test]
fn wide_heads_match_the_reference() {
    for d in [64, 128, 256] {
        check_prompt_beside_a_token(6, 2, d, 19, 23);
        check_prompt_beside_a_token(7, 1, d, 19, 23);
    }
}

/// Attention over caches that `store` makes from f32 values equals the f32 path over
/// what `widen` reads back from them, for heads of each of `dims` elements, with and
/// without a window; keys and values of different dtypes are refused.
fn matches_the_f32_path(
    dims: &[usize],
    tolerance: f32,
    store: impl Fn(Tensor) -> Tensor,
    widen: impl Fn(&Tensor) -> Tensor,
) {
    let dev = Device::Cpu;
    for &d in dims {
        let (heads, kv, cap, t, s) = (6, 2, 48, 37, 3);
        let q = Tensor::randn(0f32, 1.0, (1, heads, s, d), &dev).unwrap();
        let cache = || {
            let x = Tensor::randn(0f32, 1.0, (1, kv, cap, d), &dev).unwrap();
            store(x).narrow(2, 0, t).unwrap()
        };
        let (k, v) = (cache(), cache());
        let (k32, v32) = (widen(&k), widen(&v));
        let seq = |k, v| Seq {
            row: 0,
            len: s,
            k,
            v,
            pos: None,
        };
        for window in [None, Some(9)] {
            let got = attend(&q, &[seq(&k, &v)], window, 0.125).unwrap();
            let want = attend(&q, &[seq(&k32, &v32)], window, 0.125).unwrap();
            let diff = max_diff(&got, &want);
            assert!(
                diff < tolerance,
                "heads of {d}, window {window:?}: differs by {diff}"
            );
        }
        assert!(attend(&q, &[seq(&k, &v32)], None, 0.125).is_err());
    }
}

/// f16 caches (`serve.cache_dtype`): every row, decoding or prompt, windowed or not,
/// equals the f32 path over the same values widened, for heads of 64, 128 and 256
/// elements (the AVX-512 kernel where the CPU has it, else the AVX2 one or the loops) and
/// 20-element ones (the loops, with a tail shorter than a vector).
#[test]
fn f16_caches_match_the_f32_path_over_their_values() {
    matches_the_f32_path(
        &[64, 128, 256, 20],
        1e-5,
        |x| x.to_dtype(DType::F16).unwrap(),
        |x| x.to_dtype(DType::F32).unwrap(),
    );
}

/// q8 caches (`serve.cache_dtype = "q8"`): the same, over the values the codes and
/// scales stand for, rotation included (AVX-512 for 64-256 where the CPU has it, the AVX2
/// kernel for 96 and elsewhere, the portable loops without either), within what the AVX2
/// kernel's 16-bit codes of the query and of the weights change (up to ~2.5e-4 here, heads
/// of 256 over a window of 9 rows; the codes' own rounding is ~1e-2 of a row's largest
/// value; the loops and AVX-512 stay within 1e-5).
#[test]
fn q8_caches_match_the_f32_path_over_their_values() {
    matches_the_f32_path(
        &[64, 128, 256, 96],
        1e-3,
        |x| crate::kv_q8::quantize(&x).unwrap(),
        |x| crate::kv_q8::dequantize(x, DType::F32, &Device::Cpu).unwrap(),
    );
}

/// The AVX2 loops (where the CPU has them) agree with the portable ones, odd lengths
/// included.
#[test]
fn kernels_agree() {
    let best = Kernel::best();
    let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
    let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
    for n in [0, 1, 8, 15, 16, 37] {
        let (x, y) = (
            best.dot(&a[..n], &b[..n]),
            Kernel::Portable.dot(&a[..n], &b[..n]),
        );
        assert!((x - y).abs() < 1e-5, "dot {n}: {x} vs {y}");
        let (mut o1, mut o2) = (b[..n].to_vec(), b[..n].to_vec());
        best.axpy(&mut o1, 0.7, &a[..n]);
        Kernel::Portable.axpy(&mut o2, 0.7, &a[..n]);
        assert!(o1.iter().zip(&o2).all(|(x, y)| (x - y).abs() < 1e-6));
    }
    // Rows read in place: f16 (odd lengths too) and q8 (whole blocks of 32).
    let h: Vec<f16> = b.iter().map(|x| f16::from_f32(*x)).collect();
    for n in [0, 1, 8, 15, 16, 37] {
        let (x, y) = (
            f16::dot(best, &a[..n], &h[..n]),
            f16::dot(Kernel::Portable, &a[..n], &h[..n]),
        );
        assert!((x - y).abs() < 1e-5, "f16 dot {n}: {x} vs {y}");
        let (mut o1, mut o2) = (b[..n].to_vec(), b[..n].to_vec());
        f16::axpy(best, &mut o1, 0.7, &h[..n]);
        f16::axpy(Kernel::Portable, &mut o2, 0.7, &h[..n]);
        assert!(o1.iter().zip(&o2).all(|(x, y)| (x - y).abs() < 1e-6));
    }
    let long: Vec<f32> = (0..96).map(|i| (i as f32 * 0.29).sin() * 3.0).collect();
    for d in [32, 64, 96] {
        let mut row = vec![0u8; crate::kv_q8::row_bytes(d)];
        crate::kv_q8::quantize_row(&long[..d], &mut row);
        let mut widened = vec![0f32; d];
        crate::kv_q8::dequantize_row(&row, &mut widened);
        let q = &long[96 - d..];
        let want = Kernel::Portable.dot(q, &widened);
        for kernel in [best, Kernel::Portable] {
            let got = u8::dot(kernel, q, &row);
            assert!(
                (got - want).abs() < 1e-4 * want.abs().max(1.0),
                "q8 dot {d}: {got} vs {want}"
            );
            let (mut o1, mut o2) = (q.to_vec(), q.to_vec());
            u8::axpy(kernel, &mut o1, 0.7, &row);
            Kernel::Portable.axpy(&mut o2, 0.7, &widened);
            assert!(
                o1.iter().zip(&o2).all(|(x, y)| (x - y).abs() < 1e-5),
                "q8 axpy {d}"
            );
        }
    }
    // exp over the softmax's whole range, down to where f32 underflows.
    let xs: Vec<f32> = (0..400).map(|i| -(i as f32) * 0.25 + 3.0).collect();
    let (mut e1, mut e2) = (xs.clone(), xs.clone());
    let (s1, s2) = (
        best.exp_sub(&mut e1, 3.0),
        Kernel::Portable.exp_sub(&mut e2, 3.0),
    );
    for (x, y) in e1.iter().zip(&e2) {
        assert!((x - y).abs() <= 4e-7 * y.abs() + 1e-37, "exp: {x} vs {y}");
    }
    assert!((s1 - s2).abs() < 1e-5 * s2);
}

/// Whether `how` scores q8 keys against the query's 16-bit codes (the AVX2 kernel).
fn codes_for_q8(how: How) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let How::Avx2 = how {
        return true;
    }
    let _ = how;
    false
}

/// The values the 16-bit codes of each head of `d` of `q` stand for (`q` itself where no
/// kernel rounds it).
fn coded(q: &[f32], d: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        let mut out = Vec::with_capacity(q.len());
        for h in q.chunks_exact(d) {
            let mut codes = vec![0i16; d];
            let scale = avx2::query_codes(h, &mut codes);
            out.extend(codes.iter().map(|&c| c as f32 * scale));
        }
        out
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = d;
        q.to_vec()
    }
}

/// A query head's 16-bit codes stand for it within half a step (amax / 65,534) per
/// element; a zero head gives zero codes.
#[cfg(target_arch = "x86_64")]
#[test]
fn query_codes_are_within_half_a_step() {
    for d in [32, 64, 256] {
        let q: Vec<f32> = (0..d)
            .map(|i| ((i * 7 + 3) as f32 * 0.71).sin() * 9.0)
            .collect();
        let mut codes = vec![0i16; d];
        let scale = avx2::query_codes(&q, &mut codes);
        let amax = q.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!((scale * 32767.0 - amax).abs() <= amax * 1e-6);
        for (c, x) in codes.iter().zip(&q) {
            assert!((*c as f32 * scale - x).abs() <= scale * 0.5 + amax * 1e-6);
        }
        assert!(codes.iter().any(|&c| c.unsigned_abs() == 32767));
    }
    let mut codes = vec![7i16; 32];
    assert_eq!(avx2::query_codes(&[0.0; 32], &mut codes), 0.0);
    assert!(codes.iter().all(|&c| c == 0));
}

/// Every kernel's group (AVX2's widened chunks, AVX-512's registers, where the CPU has
/// them) equals the portable loops' over f32, f16 and q8 rows: head sizes with and
/// without whole column blocks of eight vectors, spans shorter than a block of eight
/// keys, not a whole number of chunks, starting past the first row, and several query
/// rows at once (a prompt's, causal, and a window's).
#[test]
fn every_kernel_matches_the_portable_loops() {
    let (rep, stride) = (3, 2);
    let cases: [&[(usize, usize)]; 7] = [
        &[(0, 0)],
        &[(3, 9)],
        &[(0, 31)],
        &[(5, 72)],
        &[(0, 79)],
        &[(0, 40), (0, 41), (0, 42), (0, 43)],
        &[(10, 30), (11, 31), (12, 32)],
    ];
    for d in [32, 64, 96, 128, 160] {
        let w = crate::kv_q8::row_bytes(d);
        let rows = 80;
        let val = |i: usize| ((i as f32) * 0.37).sin() * 2.0;
        let f: Vec<f32> = (0..rows * stride * d).map(val).collect();
        let h: Vec<f16> = f.iter().map(|&x| f16::from_f32(x)).collect();
        let mut q8 = vec![0u8; rows * stride * w];
        for (x, o) in f.chunks_exact(d).zip(q8.chunks_exact_mut(w)) {
            crate::kv_q8::quantize_row(x, o);
        }
        for spans in cases {
            let n = spans.len() * rep * d;
            let q: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.13).cos()).collect();
            let run = |how: How, q8q: &[f32]| {
                let (mut p, mut wide) = (Vec::new(), Vec::new());
                let mut outs = Vec::new();
                let mut o = vec![0f32; n];
                let (s, ds, sc) = (stride * d, stride * w, 0.2);
                let (f, h) = ((&f[..], s), (&h[..], s));
                let (fv, hv) = ((&f.0[d..], s), (&h.0[d..], s));
                how.group(&q, d, f, fv, spans, sc, &mut p, &mut wide, &mut o);
                outs.push(o.clone());
                how.group(&q, d, h, hv, spans, sc, &mut p, &mut wide, &mut o);
                outs.push(o.clone());
                let (k, v) = ((&q8[..], ds), (&q8[w..], ds));
                how.group(q8q, d, k, v, spans, sc, &mut p, &mut wide, &mut o);
                outs.push(o);
                outs
            };
            // The AVX2 kernel scores q8 keys against the query's 16-bit codes: the loops
            // get the query those codes stand for. It also rounds each head's weights to
            // 16-bit codes per chunk (`avx2/codes.rs` bounds that): within 1e-4 here.
            let best = How::best(d);
            let int = codes_for_q8(best);
            let q8q = if int { coded(&q, d) } else { q.clone() };
            let want = run(How::Loops(Kernel::Portable), &q8q);
            for (i, (got, want)) in run(best, &q).iter().zip(&want).enumerate() {
                let diff = got
                    .iter()
                    .zip(want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                let tolerance = if int && i == 2 { 1e-4 } else { 1e-5 };
                assert!(
                    diff < tolerance,
                    "heads of {d}, spans {spans:?}, cache {i}: differs by {diff}"
                );
            }
        }
    }
}

/// A random cache of `kv` heads, `t` rows of `d`, as `name` ("f16" or "q8") rows.
fn random_cache(name: &str, (kv, t, d): (usize, usize, usize)) -> Tensor {
    let x = Tensor::randn(0f32, 1.0, (1, kv, t, d), &Device::Cpu).unwrap();
    match name {
        "f16" => x.to_dtype(DType::F16).unwrap(),
        _ => crate::kv_q8::quantize(&x).unwrap(),
    }
}

/// The fastest of six runs of `f`, in milliseconds.
fn best_of_six_ms(mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..6 {
        let start = std::time::Instant::now();
        f();
        best = best.min(start.elapsed().as_secs_f64());
    }
    best * 1e3
}

/// Not a check: the time of a SmolLM2-shaped decode step's attention (30 layers, 8
/// sequences of 1,500 cached rows, 9 heads over 3 KV heads of 64) over f16 and q8 caches,
/// every layer's cache its own (155-270 MB in all, beyond the L3 as in a real step).
/// `cargo test --workspace --lib attention_step_time -- --ignored --nocapture`.
#[test]
#[ignore]
fn attention_step_time() {
    let dev = Device::Cpu;
    let (layers, seqs, t, heads, kv, d) = (30, 8, 1500, 9, 3, 64);
    let q = Tensor::randn(0f32, 1.0, (1, heads, seqs, d), &dev).unwrap();
    for name in ["f16", "q8"] {
        let cache = || random_cache(name, (kv, t, d));
        let kvs: Vec<Vec<(Tensor, Tensor)>> = (0..layers)
            .map(|_| (0..seqs).map(|_| (cache(), cache())).collect())
            .collect();
        let best = best_of_six_ms(|| {
            for layer in &kvs {
                let parts: Vec<Seq<'_>> = layer
                    .iter()
                    .enumerate()
                    .map(|(i, (k, v))| Seq {
                        row: i,
                        len: 1,
                        k,
                        v,
                        pos: None,
                    })
                    .collect();
                attend(&q, &parts, None, 0.125).unwrap();
            }
        });
        println!("{name}: {best:.2} ms a step");
    }
}

/// Not a check: the time of a SmolLM2-shaped question's attention in a prompt (30 layers, 48
/// rows over 1,500 cached positions and their own, 9 heads over 3 KV heads of 64) over f16 and
/// q8 caches. `cargo test --workspace --lib attention_prompt_time -- --ignored --nocapture`.
#[test]
#[ignore]
fn attention_prompt_time() {
    let dev = Device::Cpu;
    let (layers, rows, t, heads, kv, d) = (30, 48, 1548, 9, 3, 64);
    let q = Tensor::randn(0f32, 1.0, (1, heads, rows, d), &dev).unwrap();
    for name in ["f16", "q8"] {
        let cache = || random_cache(name, (kv, t, d));
        let kvs: Vec<(Tensor, Tensor)> = (0..layers).map(|_| (cache(), cache())).collect();
        let best = best_of_six_ms(|| {
            for (k, v) in &kvs {
                let parts = [Seq {
                    row: 0,
                    len: rows,
                    k,
                    v,
                    pos: None,
                }];
                attend(&q, &parts, None, 0.125).unwrap();
            }
        });
        println!("{name}: {best:.2} ms a prompt");
    }
}
