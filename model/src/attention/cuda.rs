//! The GPU path's attention in one launch per layer (`model/kernels/attention.cu`): causal, a
//! few query rows over one sequence's cache read in place (f16 or f32), grouped-query heads
//! mapped onto their KV head, scores in shared memory. It replaces a dozen candle operations
//! (the cache's rows converted to f32 and made contiguous, two products, scale, mask, softmax,
//! the heads' transpose), each its own launch, that a decode step on the GPU is bound by.
//!
//! `RAGKV_CUDA_ATTENTION=candle` keeps candle's operations instead, for comparison.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDType;
use candle_core::{DType, Device, Storage, Tensor};
use half::f16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// Threads per block (query row and head): one block per row and head leaves most of the GPU
/// idle at decode, so each block keeps as many keys in flight as a block can (Nsight Compute,
/// H100, SmolLM2's shape: 17.5 µs per layer with 256).
const THREADS: u32 = 1024;
/// Query rows beyond which candle's products win: a block per row and head scores every key
/// on CUDA cores, where a prompt's products run on the tensor cores. A decode step and a
/// question's prefill are below it; a chunk's prefill is above.
const MAX_ROWS: usize = 64;
/// Shared memory a block may take without opting in to more.
const SHARED_BYTES: usize = 48 * 1024;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("RAGKV_CUDA_ATTENTION").as_deref() != Ok("candle"))
}

/// Attention of `q` `(1, heads, s, d)` (f32, unit stride along `d`) over keys and values
/// `(1, kv_heads, t, d)` (f16 or f32 cache rows, unit stride along `d`), query row `i` at
/// cache index `t - s + i`, within `window` if set: `(1, s, heads * d)` f32. With `past` (an
/// i32 on the device: a CUDA graph's replay), `k` and `v` are the whole buffers and the rows
/// before this step's are `*past` (`t - s` otherwise). `None` when the operands are not CUDA
/// tensors of that form, or the visible span does not fit the kernel.
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
    scale: f32,
    past: Option<&Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    let Device::Cuda(dev) = q.device() else {
        return Ok(None);
    };
    let (&[1, heads, s, d], &[1, kv_heads, t, kd]) = (q.dims(), k.dims()) else {
        return Ok(None);
    };
    let span = window.map_or(t, |w| w.min(t));
    let shared = (d + span + THREADS as usize + 32) * 4;
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
        && shared <= SHARED_BYTES
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
    // SAFETY: every element is written by the kernel (each block writes its row's `d` outputs
    // of its head; the grid covers every head and row) before the tensor is read.
    let out = unsafe { dev.alloc::<f32>(s * heads * d) }?;
    let (q_head, q_row) = (q.stride()[1] as i64, q.stride()[2] as i64);
    let (kv_head, kv_row) = (k.stride()[1] as i64, k.stride()[2] as i64);
    let dims = [s as i32, t as i32, heads as i32, kv_heads as i32, d as i32];
    let window = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, s as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let past = match past {
        Some(p) => crate::gpu_ops::device_ptr_i32(p)?,
        None => 0,
    };
    let args = Args {
        q: &q_view,
        q_head,
        q_row,
        kv_head,
        kv_row,
        out,
        dims,
        window,
        scale,
        past,
        cfg,
    };
    let out = match k.dtype() {
        DType::F16 => launch::<f16>("ragkv_attend_f16", dev, (kc, kl), (vc, vl), args)?,
        _ => launch::<f32>("ragkv_attend_f32", dev, (kc, kl), (vc, vl), args)?,
    };
    let storage = candle_core::cuda_backend::CudaStorage::wrap_cuda_slice(out, dev.clone());
    Ok(Some(Tensor::from((
        Storage::Cuda(storage),
        (1, s, heads * d),
    ))))
}

struct Args<'a> {
    q: &'a candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>,
    q_head: i64,
    q_row: i64,
    kv_head: i64,
    kv_row: i64,
    out: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    dims: [i32; 5],
    window: i32,
    scale: f32,
    /// Device address of the i32 row count before this step, or 0.
    past: u64,
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
    let func = dev.get_or_load_custom_func(name, "ragkv_attention", PTX)?;
    let mut out = a.out;
    let [s, t, heads, kv_heads, d] = a.dims;
    let mut b = func.builder();
    b.arg(a.q)
        .arg(&a.q_head)
        .arg(&a.q_row)
        .arg(&k)
        .arg(&v)
        .arg(&a.kv_head)
        .arg(&a.kv_row)
        .arg(&mut out)
        .arg(&s)
        .arg(&t)
        .arg(&heads)
        .arg(&kv_heads)
        .arg(&d)
        .arg(&a.window)
        .arg(&a.scale)
        .arg(&a.past);
    // SAFETY: the arguments match the kernel's signature in order and type (pointers to f32
    // queries, `T` keys and values, f32 output; i64 strides; i32 sizes; f32 scale); every read
    // is inside the views (rows below `t`, elements below `d` at the given strides, checked by
    // the caller's shape test; with `past`, the caller keeps `*past + s` within the buffers)
    // and every write inside `out` (`s * heads * d` elements).
    unsafe { b.launch(a.cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(out)
}
