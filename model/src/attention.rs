//! Causal attention of a step's tokens over their own sequences' caches, on the CPU, reading
//! each cache in place: every sequence of a batch step (decoding tokens and prompts alike)
//! in one pass over the thread pool, with no mask.
//!
//! The general path (`Decoder::attend_heads`) is a dozen candle operations per layer: its
//! products need the keys and values contiguous (every step copied each sequence's whole
//! cache of every layer), and a prompt materializes its `(s, t)` mask and scores. Here a task
//! is a few query rows of one sequence and one KV head with the query heads that share it
//! (grouped-query attention): each key and value row is read once for all of them, which
//! matters because decoding over a long cache is bound by reading it (SmolLM2 at 2,000 cached
//! tokens: ~100 MB of f32 keys and values per sequence and step, as much as its quantized
//! weights). Query row `i` of a sequence whose cache holds `t` rows after this step sits at
//! cache index `t - s + i` and sees keys up to it, within the sliding window if any (HF's
//! rule: `q - k < window`). Scores, softmax and the weighted sum of values in f32: heads of
//! 64, 128 or 256 elements on AVX-512 CPUs in [`avx512`] (queries and outputs held in
//! registers), other shapes
//! with AVX2+FMA loops (and a vectorized `exp`, ggml's) where the CPU has them, a portable
//! loop otherwise ([`loops`]). Caches in f32 or f16 (half the bytes a decode step reads; the AVX-512
//! kernel widens f16 rows as it loads them, the other loops widen a task's rows into a
//! scratch buffer), f32 queries, on the CPU; other dtypes and devices take the general path.

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use half::f16;

use crate::quant::SharedOut;

#[cfg(target_arch = "x86_64")]
mod avx512;
mod loops;

use loops::Kernel;

/// Query rows per task: enough work per hand-off, enough tasks to share among threads.
const ROWS_PER_TASK: usize = 16;

/// One sequence of a step: its rows among the step's queries (`row..row + len`), and the
/// live rows of its cache for the layer after this step's keys and values went in (keys
/// and values `(1, kv_heads, t, d)`, unit stride along `d`, `t ≥ len`). Query row `i` sits
/// at cache index `pos[i]` when `pos` is given (a repair's rows, anywhere in the cache),
/// else at `t - len + i` (the cache's last rows).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seq<'a> {
    pub row: usize,
    pub len: usize,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub pos: Option<&'a [usize]>,
}

/// A cache's elements, in the dtype the cache keeps (q8: rows of codes and a scale).
#[derive(Clone, Copy)]
enum Elems<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Q8(&'a [u8]),
}

/// A cache view as raw parts: elements, start offset, head stride, row stride.
#[derive(Clone, Copy)]
struct Raw<'a> {
    data: Elems<'a>,
    start: usize,
    head: usize,
    row: usize,
}

fn f32_data<'a>(s: &'a Storage, what: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        Storage::Cpu(CpuStorage::F32(d)) => Ok(d),
        _ => candle_core::bail!("attention: {what} is not an f32 CPU tensor"),
    }
}

fn elems<'a>(s: &'a Storage, what: &str) -> candle_core::Result<Elems<'a>> {
    match s {
        Storage::Cpu(CpuStorage::F32(d)) => Ok(Elems::F32(d)),
        Storage::Cpu(CpuStorage::F16(d)) => Ok(Elems::F16(d)),
        Storage::Cpu(CpuStorage::U8(d)) => Ok(Elems::Q8(d)),
        _ => candle_core::bail!("attention: {what} is not an f32, f16 or q8 CPU tensor"),
    }
}

fn raw<'a>(data: Elems<'a>, l: &Layout) -> Raw<'a> {
    let st = l.stride();
    Raw {
        data,
        start: l.start_offset(),
        head: st[1],
        row: st[2],
    }
}

/// Whether [`attend`] takes caches of this dtype.
pub(crate) fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | crate::kv_q8::Q8_CACHE)
}

/// Rows `rows` of `d` elements widened to f32 one after the other into `dst`, `row(j, out)`
/// writing row `j`: the scratch the loops read for f16 and q8 caches.
fn widen(
    rows: std::ops::RangeInclusive<usize>,
    d: usize,
    dst: &mut Vec<f32>,
    row: impl Fn(usize, &mut [f32]),
) {
    dst.clear();
    dst.resize(rows.clone().count() * d, 0.0);
    for (out, j) in dst.chunks_exact_mut(d).zip(rows) {
        row(j, out);
    }
}

/// Attention of the queries `q` `(1, heads, rows, d)` (any strides) over each sequence's
/// own keys and values, causal, within `window` if set, scaled by `scale`:
/// `(rows, heads * d)`, the rows of `q` that `seqs` cover (the others left zero).
pub(crate) fn attend(
    q: &Tensor,
    seqs: &[Seq<'_>],
    window: Option<usize>,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let (&[1, heads, rows, d], qst) = (q.dims(), q.stride()) else {
        candle_core::bail!("attention: query {:?}", q.dims());
    };
    let (q_store, ql) = q.storage_and_layout();
    let qd = f32_data(&q_store, "the query")?;
    let q0 = ql.start_offset();
    let mut guards = Vec::with_capacity(seqs.len());
    let mut kv_heads = 0;
    for s in seqs {
        let (kd, vd) = (s.k.dims(), s.v.dims());
        let ok = kd.len() == 4
            && kd == vd
            && kd[0] == 1
            && kd[3]
                == if s.k.dtype() == crate::kv_q8::Q8_CACHE {
                    crate::kv_q8::row_bytes(d)
                } else {
                    d
                }
            && kd[1] > 0
            && heads % kd[1] == 0
            && (kv_heads == 0 || kv_heads == kd[1])
            && s.k.dtype() == s.v.dtype()
            && s.k.stride()[3] == 1
            && s.v.stride()[3] == 1
            && s.len > 0
            && s.len <= kd[2]
            && s.row + s.len <= rows
            && s.pos
                .is_none_or(|p| p.len() == s.len && p.iter().all(|&p| p < kd[2]));
        if !ok {
            candle_core::bail!(
                "attention: query {:?}, keys {kd:?} (strides {:?}), values {vd:?} \
                 (strides {:?}), rows {}..+{}",
                q.dims(),
                s.k.stride(),
                s.v.stride(),
                s.row,
                s.len
            );
        }
        kv_heads = kd[1];
        guards.push((s.k.storage_and_layout(), s.v.storage_and_layout(), kd[2]));
    }
    let mut views = Vec::with_capacity(seqs.len());
    for ((ks, kl), (vs, vl), t) in &guards {
        views.push((
            raw(elems(ks, "the keys")?, kl),
            raw(elems(vs, "the values")?, vl),
            *t,
        ));
    }
    let rep = heads / kv_heads.max(1);
    // Tasks: (sequence, KV head, block of query rows).
    let mut tasks = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        for g in 0..kv_heads {
            for r in (0..s.len).step_by(ROWS_PER_TASK) {
                tasks.push((i, g, r, (r + ROWS_PER_TASK).min(s.len)));
            }
        }
    }
    // Longest first (rows times the keys they read): the threads take tasks in order, so the
    // last ones taken are the shortest and the threads finish together (a step's sequences
    // differ in length: a decoding token over 1,800 cached rows costs 1.6x one over 1,100).
    tasks.sort_by_key(|&(i, _, r0, r1)| std::cmp::Reverse((r1 - r0) * guards[i].2));
    let kernel = Kernel::best();
    // Heads of 64, 128 or 256 elements take the AVX-512 kernel where the CPU has it.
    #[cfg(target_arch = "x86_64")]
    let wide = avx512::takes(d) && avx512::available();
    let mut out = vec![0f32; rows * heads * d];
    let dst = SharedOut(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(tasks.len(), |range| {
        let dst = &dst;
        let mut qg = vec![0f32; rep * d];
        let mut p = Vec::new();
        let (mut kw, mut vw) = (Vec::new(), Vec::new());
        for &(i, g, r0, r1) in &tasks[range] {
            let (k, v, t) = views[i];
            let s = &seqs[i];
            let (k0, v0) = (k.start + g * k.head, v.start + g * v.head);
            for r in r0..r1 {
                let row = s.row + r;
                for h in 0..rep {
                    let head = g * rep + h;
                    for (x, at) in qg[h * d..(h + 1) * d].iter_mut().zip(0..d) {
                        *x = qd[q0 + head * qst[1] + row * qst[2] + at * qst[3]];
                    }
                }
                let pos = s.pos.map_or(t - s.len + r, |p| p[r]);
                let from = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                // SAFETY: the tasks are disjoint (sequence, KV head, rows); the pair
                // (row, head group) owns `rep * d` contiguous outputs, written only here,
                // and `out` outlives `execute_chunked`.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(dst.0.add((row * heads + g * rep) * d), rep * d)
                };
                #[cfg(target_arch = "x86_64")]
                if wide {
                    let span = (from, pos);
                    // SAFETY: `avx512::available()` was checked.
                    unsafe {
                        match (k.data, v.data) {
                            (Elems::F32(kd), Elems::F32(vd)) => avx512::group(
                                &qg,
                                d,
                                &kd[k0..],
                                k.row,
                                &vd[v0..],
                                v.row,
                                span,
                                scale,
                                &mut p,
                                o,
                            ),
                            (Elems::F16(kd), Elems::F16(vd)) => avx512::group(
                                &qg,
                                d,
                                &kd[k0..],
                                k.row,
                                &vd[v0..],
                                v.row,
                                span,
                                scale,
                                &mut p,
                                o,
                            ),
                            (Elems::Q8(kd), Elems::Q8(vd)) => avx512::group(
                                &qg,
                                d,
                                &kd[k0..],
                                k.row,
                                &vd[v0..],
                                v.row,
                                span,
                                scale,
                                &mut p,
                                o,
                            ),
                            _ => unreachable!("keys and values share a dtype (checked)"),
                        }
                    }
                    continue;
                }
                let n = pos + 1 - from;
                match (k.data, v.data) {
                    (Elems::F32(kd), Elems::F32(vd)) => kernel.group(
                        &qg,
                        &kd[k0..],
                        (from..=pos).map(|j| j * k.row),
                        &vd[v0..],
                        (from..=pos).map(|j| j * v.row),
                        n,
                        d,
                        scale,
                        &mut p,
                        o,
                    ),
                    (Elems::F16(kd), Elems::F16(vd)) => {
                        use half::slice::HalfFloatSliceExt;
                        let (ks, vs) = (&kd[k0..], &vd[v0..]);
                        widen(from..=pos, d, &mut kw, |j, out| {
                            ks[j * k.row..j * k.row + d].convert_to_f32_slice(out)
                        });
                        widen(from..=pos, d, &mut vw, |j, out| {
                            vs[j * v.row..j * v.row + d].convert_to_f32_slice(out)
                        });
                        let rows = || (0..n).map(|j| j * d);
                        kernel.group(&qg, &kw, rows(), &vw, rows(), n, d, scale, &mut p, o);
                    }
                    (Elems::Q8(kd), Elems::Q8(vd)) => {
                        use crate::kv_q8::{dequantize_row, row_bytes};
                        let (ks, vs, w) = (&kd[k0..], &vd[v0..], row_bytes(d));
                        widen(from..=pos, d, &mut kw, |j, out| {
                            dequantize_row(&ks[j * k.row..j * k.row + w], out)
                        });
                        widen(from..=pos, d, &mut vw, |j, out| {
                            dequantize_row(&vs[j * v.row..j * v.row + w], out)
                        });
                        let rows = || (0..n).map(|j| j * d);
                        kernel.group(&qg, &kw, rows(), &vw, rows(), n, d, scale, &mut p, o);
                    }
                    _ => unreachable!("keys and values share a dtype (checked)"),
                }
            }
        }
    });
    drop(views);
    drop(guards);
    drop(q_store);
    Tensor::from_vec(out, (rows, heads * d), q.device())
}

#[cfg(test)]
mod tests {
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

    /// f16 caches (`serve.cache_dtype`): every row, decoding or prompt, windowed or not,
    /// equals the f32 path over the same values widened, for heads of 64, 128 and 256
    /// elements (the AVX-512 kernel where the CPU has it, widening as it loads) and 20-element
    /// ones (rows widened into scratch); keys and values of different dtypes are refused.
    /// Attention over caches that `store` makes from f32 values equals the f32 path over
    /// what `widen` reads back from them, for heads of each of `dims` elements, with and
    /// without a window; returns the stored keys and values of the last shape.
    fn matches_the_f32_path(
        dims: &[usize],
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
                    diff < 1e-5,
                    "heads of {d}, window {window:?}: differs by {diff}"
                );
            }
            assert!(attend(&q, &[seq(&k, &v32)], None, 0.125).is_err());
        }
    }

    /// f16 caches (`serve.cache_dtype`): every row, decoding or prompt, windowed or not,
    /// equals the f32 path over the same values widened, for heads of 64, 128 and 256
    /// elements (the AVX-512 kernel where the CPU has it, widening as it loads) and 20-element
    /// ones (rows widened into scratch); keys and values of different dtypes are refused.
    #[test]
    fn f16_caches_match_the_f32_path_over_their_values() {
        matches_the_f32_path(
            &[64, 128, 256, 20],
            |x| x.to_dtype(DType::F16).unwrap(),
            |x| x.to_dtype(DType::F32).unwrap(),
        );
    }

    /// q8 caches (`serve.cache_dtype = "q8"`): the same, over the values the codes and
    /// scales stand for (AVX-512 scaling in registers for 64-256, scratch widening for 96).
    #[test]
    fn q8_caches_match_the_f32_path_over_their_values() {
        matches_the_f32_path(
            &[64, 128, 256, 96],
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
}
