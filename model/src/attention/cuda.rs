//! The GPU path's attention in two launches per layer (`model/kernels/attention.cu`): causal,
//! a few query rows over one sequence's cache read in place (f16 or f32), grouped-query heads
//! mapped onto their KV head, split over chunks of keys (a block per head, row and chunk), the
//! chunks' partial outputs combined by the second launch. It replaces a dozen candle
//! operations (the cache's rows converted to f32 and made contiguous, two products, scale,
//! mask, softmax, the heads' transpose), each its own launch, that a decode step on the GPU is
//! bound by.
//!
//! `RAGKV_CUDA_ATTENTION=candle` keeps candle's operations instead, for comparison.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDType;
use candle_core::{DType, Device, Storage, Tensor};
use half::f16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// Threads per block (query row, head and chunk of keys): four warps.
const THREADS: u32 = 128;
/// Keys per block: the kernel's `KEYS_PER_WARP` (8) for each of the four warps. A block per
/// head and row (the kernel before) left most of the GPU idle at decode and walked a long
/// cache in one block: 34 µs per layer at 512 keys on an H200 (Nsight Compute, SmolLM2's
/// shape), more than all of the layer's other kernels together.
const CHUNK: usize = 32;
/// Query rows beyond which candle's products win: a block per row, head and chunk scores keys
/// on CUDA cores, where a prompt's products run on the tensor cores. A decode step and a
/// question's prefill are below it; a chunk's prefill is above.
const MAX_ROWS: usize = 64;

/// Threads of the combining launch: groups of the head's elements (rounded up to 32), each
/// group over every few chunks (four groups at SmolLM2's and Qwen2.5's 64 elements per head).
const COMBINE_THREADS: u32 = 256;

/// `RAGKV_CUDA_COMBINE=serial`: the combining kernel's first form, for comparison.
fn serial_combine() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("RAGKV_CUDA_COMBINE").as_deref() == Ok("serial"))
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("RAGKV_CUDA_ATTENTION").as_deref() != Ok("candle"))
}

/// Attention of `q` `(1, heads, s, d)` (f32, unit stride along `d`) over keys and values
/// `(1, kv_heads, t, d)` (f16 or f32 cache rows, unit stride along `d`), query row `i` at
/// cache index `t - s + i`, within `window` if set: `(1, s, heads * d)` f32. With `past` (an
/// i32 on the device: a CUDA graph's replay), `k` and `v` are the whole buffers and the rows
/// before this step's are `*past` (`t - s` otherwise). With `rows_at` (`s` i32 on the device,
/// each below `t`), query row `i` sits at cache index `rows_at[i]` instead. `None` when the
/// operands are not CUDA tensors of that form.
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
    scale: f32,
    (past, rows_at): (Option<&Tensor>, Option<&Tensor>),
) -> candle_core::Result<Option<Tensor>> {
    let Device::Cuda(dev) = q.device() else {
        return Ok(None);
    };
    let (&[1, heads, s, d], &[1, kv_heads, t, kd]) = (q.dims(), k.dims()) else {
        return Ok(None);
    };
    let fits = enabled()
        && q.dtype() == DType::F32
        && k.dtype() == v.dtype()
        && matches!(k.dtype(), DType::F16 | DType::F32)
        && kd == d
        && v.dims() == k.dims()
        && k.stride() == v.stride()
        && q.stride()[3] == 1
        && k.stride()[3] == 1
        && (1..=256).contains(&d)
        && kv_heads > 0
        && heads % kv_heads == 0
        && (1..=t.min(MAX_ROWS)).contains(&s)
        && t.div_ceil(CHUNK) <= 65_535
        && rows_at.is_none_or(|r| r.dtype() == DType::I32 && r.dims() == [s])
        && k.device().same_device(q.device())
        && v.device().same_device(q.device());
    if !fits {
        return Ok(None);
    }
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cuda(qc), Storage::Cuda(kc), Storage::Cuda(vc)) = (&*qs, &*ks, &*vs) else {
        return Ok(None);
    };
    let q_view = qc.as_cuda_slice::<f32>()?.slice(ql.start_offset()..);
    // The chunks cover every row the buffers hold (with `past`, the whole capacity: a graph's
    // later steps see more rows than its capture).
    let chunks = t.div_ceil(CHUNK);
    // SAFETY: every element is written by the split kernel (each block writes its head's,
    // row's and chunk's `d + 2` values, the grid covers every head, row and chunk) before the
    // combining kernel reads them.
    let part = unsafe { dev.alloc::<f32>(s * heads * chunks * (d + 2)) }?;
    let (q_head, q_row) = (q.stride()[1] as i64, q.stride()[2] as i64);
    let (kv_head, kv_row) = (k.stride()[1] as i64, k.stride()[2] as i64);
    let dims = [s as i32, t as i32, heads as i32, kv_heads as i32, d as i32];
    let window = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
    let shared = (d + CHUNK + 32 + (THREADS as usize / 32) * d) * 4;
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, s as u32, chunks as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let ptr = |t: Option<&Tensor>| t.map_or(Ok(0), crate::gpu_ops::device_ptr_i32);
    let (past, rows_at) = (ptr(past)?, ptr(rows_at)?);
    let args = Args {
        q: &q_view,
        q_head,
        q_row,
        kv_head,
        kv_row,
        part,
        dims,
        window,
        scale,
        past,
        rows_at,
        cfg,
    };
    let part = match k.dtype() {
        DType::F16 => launch::<f16>("ragkv_attend_split_f16", dev, (kc, kl), (vc, vl), args)?,
        _ => launch::<f32>("ragkv_attend_split_f32", dev, (kc, kl), (vc, vl), args)?,
    };
    // SAFETY: every element is written by the combining kernel (block (h, i) writes row `i`'s
    // `d` outputs of head `h`) before the tensor is read.
    let mut out = unsafe { dev.alloc::<f32>(s * heads * d) }?;
    let (heads32, d32, chunks32) = (heads as i32, d as i32, chunks as i32);
    let [s32, t32, ..] = dims;
    let chunk = CHUNK as i32;
    let serial = serial_combine();
    let name = if serial {
        "ragkv_attend_combine_serial"
    } else {
        "ragkv_attend_combine"
    };
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&part)
        .arg(&mut out)
        .arg(&heads32)
        .arg(&d32)
        .arg(&chunks32);
    let threads = if serial {
        d.next_multiple_of(32).min(256) as u32
    } else {
        b.arg(&s32).arg(&t32).arg(&past).arg(&rows_at).arg(&chunk);
        COMBINE_THREADS
    };
    // SAFETY: arguments in the kernel's order and types (the serial kernel takes the first
    // five); block (h, i) reads at most its `chunks` partials (`d + 2` floats each) of
    // `part`, `*past` when `past` is set and `rows_at[i]` when that is (both i32 on the
    // device, as the split kernel read them), and writes `d` elements of `out`, inside every
    // buffer. The serial kernel's threads go over the head's elements; COMBINE_THREADS is a
    // multiple of 32, at most 1024 and at least `d` (≤ 256) rounded up to 32, as the other
    // kernel needs.
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (heads as u32, s as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .map_err(candle_core::Error::wrap)?;
    let storage = candle_core::cuda_backend::CudaStorage::wrap_cuda_slice(out, dev.clone());
    Ok(Some(Tensor::from((
        Storage::Cuda(storage),
        (1, s, heads * d),
    ))))
}

const MODULE: &str = "ragkv_attention";

struct Args<'a> {
    q: &'a candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>,
    q_head: i64,
    q_row: i64,
    kv_head: i64,
    kv_row: i64,
    part: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    dims: [i32; 5],
    window: i32,
    scale: f32,
    /// Device address of the i32 row count before this step, or 0.
    past: u64,
    /// Device address of the query rows' i32 cache indices, or 0.
    rows_at: u64,
    cfg: LaunchConfig,
}

fn launch<T: CudaDType>(
    name: &str,
    dev: &candle_core::CudaDevice,
    (kc, kl): (
        &candle_core::cuda_backend::CudaStorage,
        &candle_core::Layout,
    ),
    (vc, vl): (
        &candle_core::cuda_backend::CudaStorage,
        &candle_core::Layout,
    ),
    a: Args<'_>,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
    let k = kc.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
    let v = vc.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut part = a.part;
    let [s, t, heads, kv_heads, d] = a.dims;
    let chunk = CHUNK as i32;
    let mut b = func.builder();
    b.arg(a.q)
        .arg(&a.q_head)
        .arg(&a.q_row)
        .arg(&k)
        .arg(&v)
        .arg(&a.kv_head)
        .arg(&a.kv_row)
        .arg(&mut part)
        .arg(&s)
        .arg(&t)
        .arg(&heads)
        .arg(&kv_heads)
        .arg(&d)
        .arg(&a.window)
        .arg(&a.scale)
        .arg(&a.past)
        .arg(&a.rows_at)
        .arg(&chunk);
    // SAFETY: the arguments match the kernel's signature in order and type (pointers to f32
    // queries, `T` keys and values, f32 partials; i64 strides; i32 sizes; f32 scale); every
    // read is inside the views (rows below `t`, elements below `d` at the given strides,
    // checked by the caller's shape test; with `past`, the caller keeps `*past + s` within the
    // buffers; `rows_at` holds `s` indices below `t`, by the caller) and every write inside
    // `part` (`s * heads * chunks * (d + 2)` elements, `chunks` the grid's third dimension).
    unsafe { b.launch(a.cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(part)
}
