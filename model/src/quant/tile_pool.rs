//! How the repacked layouts' kernels share candle's barrier pool: [`tiled_matmul`] splits
//! the matrices' groups of 16 rows over the threads and hands each kernel call its place
//! ([`TilePass`]); [`quantize_rows`] quantizes the activation rows on the pool first.

use super::SharedOut;

/// One call of a tile kernel in [`tiled_matmul`]: matrix `w`'s group `g` (rows `16g..16g +
/// lanes`) against activation rows `rows`; row `i`'s results go to `out + (i - rows.start) *
/// stride`, lanes `0..lanes`.
pub(crate) struct TilePass {
    pub(crate) w: usize,
    pub(crate) g: usize,
    pub(crate) rows: std::ops::Range<usize>,
    pub(crate) lanes: usize,
    pub(crate) out: *mut f32,
    pub(crate) stride: usize,
}

/// The pool driver of the repacked layouts' kernels: the matrices' groups of 16 rows
/// (`heights[w]` rows in matrix `w`), numbered one after the other, are split over candle's
/// barrier pool; `m` activation rows (`act_row_bytes` each, once quantized) are taken in
/// chunks that stay in L2 (~256 KiB) while every group a thread owns passes over them, `step`
/// rows per `pass`. Returns each matrix's `m` rows of results; `pass` must write every lane
/// it is handed and no other.
pub(crate) fn tiled_matmul(
    heights: &[usize],
    m: usize,
    act_row_bytes: usize,
    step: usize,
    pass: impl Fn(TilePass) + Sync,
) -> Vec<Vec<f32>> {
    // `first[w]`: matrix `w`'s first group.
    let mut first = vec![0];
    for n in heights {
        first.push(first.last().copied().unwrap_or(0) + n.div_ceil(16));
    }
    let groups = first.last().copied().unwrap_or(0);
    let chunk = (256 * 1024 / act_row_bytes.max(1)).clamp(step, 256) / step * step;
    // Not zeroed first: the passes write every element (below), and zeroing hundreds of
    // megabytes per prefill ran on the calling thread alone while the pool waited.
    let mut outs: Vec<Vec<f32>> = heights.iter().map(|n| Vec::with_capacity(m * n)).collect();
    let dsts: Vec<SharedOut> = outs.iter_mut().map(|o| SharedOut(o.as_mut_ptr())).collect();
    candle_core::utils::barrier_pool().execute_chunked(groups, |range| {
        for a0 in (0..m).step_by(chunk) {
            let a1 = (a0 + chunk).min(m);
            for at in range.clone() {
                let w = first.partition_point(|&f| f <= at) - 1;
                let (n, g) = (heights[w], at - first[w]);
                for i in (a0..a1).step_by(step) {
                    pass(TilePass {
                        w,
                        g,
                        rows: i..(i + step).min(a1),
                        lanes: (n - 16 * g).min(16),
                        // In bounds: row `i < m`, column `16g < n`. Outputs `16g..16g + lanes`
                        // of these rows belong to this task (disjoint ranges of groups), and
                        // `outs` outlives `execute_chunked`.
                        out: dsts[w].0.wrapping_add(i * n + 16 * g),
                        stride: n,
                    });
                }
            }
        }
    });
    for (o, n) in outs.iter_mut().zip(heights) {
        // SAFETY: the capacity is `m * n`; the tasks covered every group `g` of the matrix
        // (lanes `16g..16g + min(16, n - 16g)`, so every column) for every row `0..m`, and
        // `pass` writes every lane it is handed (its contract), so all `m * n` elements are
        // initialized. Had a pass panicked, `execute_chunked` would not have returned.
        unsafe { o.set_len(m * n) };
    }
    outs
}

/// Activation rows below which quantizing is not worth a pass over the thread pool.
const PARALLEL_ROWS: usize = 16;

/// The `m` rows of `k` in `x`, each quantized by `row` into `nb` blocks (`zero` fills the
/// buffer first), row after row; on the thread pool when there are many rows.
pub(crate) fn quantize_rows<B: Copy + Send>(
    x: &[f32],
    k: usize,
    nb: usize,
    zero: B,
    row: fn(&[f32]) -> Vec<B>,
) -> Vec<B> {
    let m = x.len() / k;
    if m < PARALLEL_ROWS {
        return x.chunks_exact(k).flat_map(row).collect();
    }
    let mut out = vec![zero; m * nb];
    struct Dst<B>(*mut B);
    // SAFETY: each task writes the rows of its own range only.
    unsafe impl<B: Send> Sync for Dst<B> {}
    let dst = Dst(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(m, |range| {
        let dst = &dst;
        // SAFETY: rows `range` of `out` (`nb` blocks each) belong to this task; `out`
        // outlives the call.
        let o = unsafe {
            std::slice::from_raw_parts_mut(dst.0.add(range.start * nb), range.len() * nb)
        };
        for (i, o) in range.zip(o.chunks_exact_mut(nb)) {
            o.copy_from_slice(&row(&x[i * k..(i + 1) * k]));
        }
    });
    out
}
