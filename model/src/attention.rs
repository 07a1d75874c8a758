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
//! registers), heads of a multiple of eight elements on other AVX2+FMA CPUs in [`avx2`]
//! (a chunk of rows widened once for every query head of the group, scores eight keys at a
//! time), other shapes with loops (AVX2+FMA with ggml's vectorized `exp` where the CPU has
//! them, portable otherwise: [`loops`]); [`How`] picks once per call. Caches in f32, f16
//! (half the bytes a decode step reads) or q8 (about a quarter), read in place by every
//! kernel: rows are widened to f32 as they are loaded (by the AVX2 kernel into a scratch
//! block of 32 rows that stays in L1), q8 codes times their block's scale, except that the
//! AVX2 kernel multiplies q8 rows in 16-bit integers, query and weights rounded to 16-bit
//! codes (`attention/avx2/codes.rs`); f32 queries, on
//! the CPU; other dtypes and devices take the general path. The x86 kernels ask for each
//! row's cache lines a few kilobytes ahead of reading it ([`Ahead`]): a step's cache comes
//! from memory, not from a cache level.

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use half::f16;

use crate::quant::SharedOut;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(feature = "cuda")]
mod cuda;
mod loops;

use loops::Kernel;

/// Cache elements every kernel reads in place.
#[cfg(target_arch = "x86_64")]
trait Cell: loops::Elem + avx512::Lanes + avx2::WidenRow {}
/// Cache elements every kernel reads in place.
#[cfg(not(target_arch = "x86_64"))]
trait Cell: loops::Elem {}
impl Cell for f32 {}
impl Cell for f16 {}
impl Cell for u8 {}

/// The kernel one call's groups take, chosen once for its head size and the CPU.
#[derive(Clone, Copy)]
enum How {
    /// Heads of 64, 128 or 256 elements where the CPU has AVX-512.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// Heads of a multiple of eight elements where it has AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Everything else.
    Loops(Kernel),
}

impl How {
    fn best(d: usize) -> How {
        #[cfg(target_arch = "x86_64")]
        if avx512::takes(d) && avx512::available() {
            return How::Avx512;
        }
        let kernel = Kernel::best();
        #[cfg(target_arch = "x86_64")]
        if matches!(kernel, Kernel::Avx2) && avx2::takes(d) {
            return How::Avx2;
        }
        How::Loops(kernel)
    }

    /// Query rows of one sequence, `rep` heads `q` each (rows of `rep d`), over the key and
    /// value rows of their spans (first and last position, inclusive) of `k` and `v`
    /// (elements, row stride): the softmax-weighted sums of values into `o` (like `q`); `p`
    /// and `wide` are scratch.
    #[allow(clippy::too_many_arguments)]
    fn group<T: Cell>(
        self,
        q: &[f32],
        d: usize,
        (k, ks): (&[T], usize),
        (v, vs): (&[T], usize),
        spans: &[(usize, usize)],
        scale: f32,
        p: &mut Vec<f32>,
        wide: &mut Vec<f32>,
        o: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if let How::Avx2 = self {
            // SAFETY: `best` checked the AVX2 kernels' features (`Kernel::best`).
            return unsafe { avx2::group(q, d, k, ks, v, vs, spans, scale, p, wide, o) };
        }
        let _ = wide;
        let w = q.len() / spans.len().max(1);
        for ((q, o), &(from, pos)) in q.chunks_exact(w).zip(o.chunks_exact_mut(w)).zip(spans) {
            match self {
                // SAFETY: `best` checked `avx512::available()`.
                #[cfg(target_arch = "x86_64")]
                How::Avx512 => unsafe {
                    avx512::group(q, d, k, ks, v, vs, (from, pos), scale, p, o)
                },
                #[cfg(target_arch = "x86_64")]
                How::Avx2 => unreachable!("taken above"),
                How::Loops(kernel) => {
                    let krows = (from..=pos).map(|j| j * ks);
                    let vrows = (from..=pos).map(|j| j * vs);
                    kernel.group(q, k, krows, v, vrows, pos + 1 - from, d, scale, p, o)
                }
            }
        }
    }
}

/// Software prefetch of cache rows for the x86 kernels. A decode step reads every cache row
/// of every layer once (at eight sequences of 1,500 rows, SmolLM2: 155-270 MB), from memory,
/// in short streams (a task's keys, then its values), which the hardware's prefetchers pick
/// up late: the kernels ask for each row's lines [`Ahead::BYTES`] ahead of the row they
/// read. Measured (`attention_step_time`, Emerald Rapids, two threads, three runs each in
/// turns): a step's attention over f16 caches 28.6 -> 17.6 ms, over q8 21.1 -> 11.5 ms; on
/// the AVX2 kernel 32.4 -> 27.1 and 25.9 -> 21.1 ms.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Ahead {
    /// Rows between the one read and the one asked for.
    rows: usize,
    /// Bytes of a row.
    bytes: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ahead {
    /// How far ahead, in bytes (4 KiB: 32 f16 rows of 64, 56 q8 rows of 64; 12 rows ahead
    /// measured slower than 24 or 48, which were alike).
    const BYTES: usize = 4096;

    fn new(bytes: usize) -> Ahead {
        Ahead {
            rows: (Self::BYTES / bytes.max(1)).max(1),
            bytes,
        }
    }

    /// Asks for the lines of the row at `row` (no fault: `prefetcht0` of any address is
    /// harmless, and the kernels pass rows within their asserted bounds anyway).
    #[inline(always)]
    fn fetch(self, row: *const i8) {
        let mut off = 0;
        while off < self.bytes {
            // SAFETY: a prefetch reads nothing architecturally and cannot fault; SSE is
            // part of x86_64.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    row.wrapping_add(off),
                )
            };
            off += 64;
        }
    }
}

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

/// On a GPU, attention of `q` `(1, heads, s, d)` over one sequence's cache rows `k`, `v`
/// `(1, kv_heads, t, d)` in two launches (`cuda.rs`), query row `i` at cache index `t - s + i`,
/// within `window` if set: `(1, s, heads * d)`; with `past` (a CUDA graph's replay: the rows
/// before the step's, in device memory) `k`, `v` are the whole buffers; with `rows_at` (`s`
/// i32 on the device) query row `i` sits at cache index `rows_at[i]`. `None` where that
/// kernel does not take the operands (the CPU, other dtypes, more than 64 query rows, a build
/// without `cuda`): the caller then takes candle's operations.
pub(crate) fn attend_device(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
    scale: f32,
    past: Option<&Tensor>,
    rows_at: Option<&Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return cuda::attend(q, k, v, window, scale, (past, rows_at));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, k, v, window, scale, past, rows_at);
        Ok(None)
    }
}

/// Whether [`attend`] takes caches of this dtype.
pub(crate) fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | crate::kv_q8::Q8_CACHE)
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
    let how = How::best(d);
    let mut out = vec![0f32; rows * heads * d];
    let dst = SharedOut(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(tasks.len(), |range| {
        let dst = &dst;
        let (mut qg, mut og, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        let (mut p, mut wide) = (Vec::new(), Vec::new());
        for &(i, g, r0, r1) in &tasks[range] {
            let (k, v, t) = views[i];
            let s = &seqs[i];
            let (k0, v0) = (k.start + g * k.head, v.start + g * v.head);
            // The task's query rows, each with its group's heads, and the positions each sees.
            qg.clear();
            spans.clear();
            for r in r0..r1 {
                let row = s.row + r;
                for head in g * rep..(g + 1) * rep {
                    let at = q0 + head * qst[1] + row * qst[2];
                    qg.extend((0..d).map(|x| qd[at + x * qst[3]]));
                }
                let pos = s.pos.map_or(t - s.len + r, |p| p[r]);
                spans.push((window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos));
            }
            // q8 rows hold `R x` (`kv_q8::rotation`): scores against `R q`, and the weighted
            // sum of values comes out as `R o`.
            let q8 = matches!(k.data, Elems::Q8(_));
            if q8 {
                crate::kv_q8::rotate(&mut qg, d);
            }
            og.clear();
            og.resize(qg.len(), 0.0);
            let (qg, og, sp, p, wide) = (&qg[..], &mut og[..], &spans[..], &mut p, &mut wide);
            match (k.data, v.data) {
                (Elems::F32(kd), Elems::F32(vd)) => {
                    let (kv, vv) = ((&kd[k0..], k.row), (&vd[v0..], v.row));
                    how.group(qg, d, kv, vv, sp, scale, p, wide, og)
                }
                (Elems::F16(kd), Elems::F16(vd)) => {
                    let (kv, vv) = ((&kd[k0..], k.row), (&vd[v0..], v.row));
                    how.group(qg, d, kv, vv, sp, scale, p, wide, og)
                }
                (Elems::Q8(kd), Elems::Q8(vd)) => {
                    let (kv, vv) = ((&kd[k0..], k.row), (&vd[v0..], v.row));
                    how.group(qg, d, kv, vv, sp, scale, p, wide, og)
                }
                _ => unreachable!("keys and values share a dtype (checked)"),
            }
            if q8 {
                crate::kv_q8::unrotate(og, d);
            }
            for (r, o) in (r0..r1).zip(og.chunks_exact(rep * d)) {
                let row = s.row + r;
                // SAFETY: the tasks are disjoint (sequence, KV head, rows); the pair
                // (row, head group) owns `rep * d` contiguous outputs, written only here,
                // and `out` outlives `execute_chunked`.
                unsafe {
                    let at = dst.0.add((row * heads + g * rep) * d);
                    std::ptr::copy_nonoverlapping(o.as_ptr(), at, rep * d);
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
#[path = "attention_tests.rs"]
mod tests;
