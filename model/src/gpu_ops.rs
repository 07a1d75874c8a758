//! A decode step's small fused operations on a GPU (`model/kernels/step.cu`), each one launch
//! where candle takes several: the joined Q/K/V projection's rows rotated and stored (queries
//! into a fresh tensor, keys and values into the sequence's cache in its own dtype), the MLP's
//! gate over the joined gate/up projection, and RMSNorm with a block per row. Each function
//! answers `None` (or `false`) where its kernel does not take the operands (the CPU, a build
//! without `cuda`, other dtypes or layouts), and the caller takes candle's operations.
//!
//! `RAGKV_CUDA_FUSED=off` turns them off, for comparison.

use candle_core::Tensor;

mod q8;

#[cfg(feature = "cuda")]
pub(crate) use q8::{norm_q8, swiglu_q8};
pub(crate) use q8::{product_q8, Q8Rows};

/// Rows `row0..row0 + n` of the joined Q/K/V output `y` `(1, n, (heads + 2 kv_heads) d)`
/// (f32, contiguous) rotated by `cos`, `sin` `(n, d / 2)`: queries into `q_out`
/// `(1, heads, n_total, d)` at rows `row0..`, keys (rotated) and values into the cache
/// buffers `kc`, `vc` `(1, kv_heads, capacity, d)` at rows `at..` (at rows `*past..` when
/// `past`, an i32 on the device, is given: a CUDA graph's replay; the caller then keeps them
/// within the capacity). With `rows_at` (`n` i32 on the device), row `r`'s keys and values go
/// to cache row `rows_at[r]` instead (rows recomputed in place among appended ones; the
/// caller keeps each below the capacity). `false` if not taken (nothing written then).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_store(
    y: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    q_out: &Tensor,
    row0: usize,
    (kc, vc): (&Tensor, &Tensor),
    at: usize,
    interleaved: bool,
    past: Option<&Tensor>,
    rows_at: Option<&Tensor>,
) -> candle_core::Result<bool> {
    #[cfg(feature = "cuda")]
    return cuda::rope_store(
        y,
        cos,
        sin,
        q_out,
        row0,
        kc,
        vc,
        at,
        interleaved,
        (past, rows_at),
    );
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (
            y,
            cos,
            sin,
            q_out,
            row0,
            kc,
            vc,
            at,
            interleaved,
            past,
            rows_at,
        );
        Ok(false)
    }
}

/// A query tensor `(1, heads, n, d)` f32 on `like`'s device for [`rope_store`] to fill (its
/// contents undefined until every row is stored), or `None` off the GPU.
pub(crate) fn new_queries(
    like: &Tensor,
    heads: usize,
    n: usize,
    d: usize,
) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return cuda::new_queries(like, heads, n, d);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (like, heads, n, d);
        Ok(None)
    }
}

/// `x` `(…, dim)` (f32, contiguous) divided by each row's root mean square (plus `eps`) and
/// scaled by `w` `(dim)`, one block per row.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return cuda::rms_norm(x, w, eps);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, w, eps);
        Ok(None)
    }
}

/// `silu(g) · u` of the joined gate/up output `gu` `(…, 2 w)` (f32, contiguous): `(…, w)`.
pub(crate) fn swiglu_joined(gu: &Tensor) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return cuda::swiglu_joined(gu);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = gu;
        Ok(None)
    }
}

/// Whether the graphed decode step adds, norms and quantizes in one launch
/// ([`norm_q8`]; `RAGKV_CUDA_NORM_Q8=off` and `RAGKV_CUDA_FUSED=off` turn it off).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn q8_enabled() -> bool {
    #[cfg(feature = "cuda")]
    return q8::enabled();
    #[cfg(not(feature = "cuda"))]
    false
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::device_ptr_i32;

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::OnceLock;

    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{DType, Device, Layout, Storage, Tensor};
    use half::f16;

    pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/step.ptx"));
    pub(super) const MODULE: &str = "ragkv_step";

    /// The device address of an i32 tensor's first element.
    pub(crate) fn device_ptr_i32(t: &Tensor) -> candle_core::Result<u64> {
        let (s, l) = t.storage_and_layout();
        let Storage::Cuda(c) = &*s else {
            candle_core::bail!("not a CUDA tensor");
        };
        let slice = c.as_cuda_slice::<i32>()?;
        let view = slice.slice(l.start_offset()..);
        let (ptr, _sync) = view.device_ptr(slice.stream());
        Ok(ptr)
    }

    pub(super) fn enabled() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| std::env::var("RAGKV_CUDA_FUSED").as_deref() != Ok("off"))
    }

    /// Start offset of a tensor whose elements are contiguous, unit stride.
    pub(super) fn start(l: &Layout) -> Option<usize> {
        l.contiguous_offsets().map(|(a, _)| a)
    }

    pub(super) fn new_queries(
        like: &Tensor,
        heads: usize,
        n: usize,
        d: usize,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(dev) = like.device() else {
            return Ok(None);
        };
        if !enabled() {
            return Ok(None);
        }
        // SAFETY: the caller stores every row of every head (`rope_store` over all of the
        // step's rows) before the tensor is read.
        let q = unsafe { dev.alloc::<f32>(heads * n * d) }?;
        let storage = CudaStorage::wrap_cuda_slice(q, dev.clone());
        Ok(Some(Tensor::from((
            Storage::Cuda(storage),
            (1, heads, n, d),
        ))))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_store(
        y: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        q_out: &Tensor,
        row0: usize,
        kc: &Tensor,
        vc: &Tensor,
        at: usize,
        interleaved: bool,
        (past, rows_at): (Option<&Tensor>, Option<&Tensor>),
    ) -> candle_core::Result<bool> {
        let Device::Cuda(dev) = y.device() else {
            return Ok(false);
        };
        if rows_at.is_some_and(|r| r.dtype() != DType::I32 || r.dims() != [y.dim(1).unwrap_or(0)]) {
            return Ok(false);
        }
        let (&[1, n, width], &[1, heads, n_total, d], &[1, kv_heads, cap, kd]) =
            (y.dims(), q_out.dims(), kc.dims())
        else {
            return Ok(false);
        };
        let ok = enabled()
            && [y.dtype(), cos.dtype(), sin.dtype(), q_out.dtype()] == [DType::F32; 4]
            && kc.dtype() == vc.dtype()
            && matches!(kc.dtype(), DType::F16 | DType::F32)
            && kd == d
            && d % 2 == 0
            && width == (heads + 2 * kv_heads) * d
            && cos.dims() == [n, d / 2]
            && sin.dims() == [n, d / 2]
            && vc.dims() == kc.dims()
            && vc.stride() == kc.stride()
            && kc.stride()[3] == 1
            && row0 + n <= n_total
            && (rows_at.is_some() || at + n <= cap)
            && q_out.is_contiguous()
            && y.is_contiguous()
            && cos.is_contiguous()
            && sin.is_contiguous();
        if !ok {
            return Ok(false);
        }
        let (ys, yl) = y.storage_and_layout();
        let (cs, cl) = cos.storage_and_layout();
        let (ss, sl) = sin.storage_and_layout();
        let (qs, ql) = q_out.storage_and_layout();
        let (Storage::Cuda(yc), Storage::Cuda(cc), Storage::Cuda(sc), Storage::Cuda(qc)) =
            (&*ys, &*cs, &*ss, &*qs)
        else {
            return Ok(false);
        };
        let (Some(y0), Some(c0), Some(s0), Some(q0)) = (start(yl), start(cl), start(sl), start(ql))
        else {
            return Ok(false);
        };
        let yv = yc.as_cuda_slice::<f32>()?.slice(y0..);
        let cv = cc.as_cuda_slice::<f32>()?.slice(c0..);
        let sv = sc.as_cuda_slice::<f32>()?.slice(s0..);
        let qv = qc.as_cuda_slice::<f32>()?.slice(q0..);
        let (kv_head, kv_row) = (kc.stride()[1] as i64, kc.stride()[2] as i64);
        let ints = [
            n_total as i32,
            row0 as i32,
            at as i32,
            heads as i32,
            kv_heads as i32,
            d as i32,
            i32::from(interleaved),
        ];
        let cfg = LaunchConfig {
            grid_dim: (n as u32, (heads + 2 * kv_heads) as u32, 1),
            block_dim: ((d / 2).min(128) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let floats = [&yv, &cv, &sv, &qv];
        let ptr = |t: Option<&Tensor>| t.map_or(Ok(0), device_ptr_i32);
        let strides = (kv_head, kv_row, ptr(past)?, ptr(rows_at)?);
        let name = match kc.dtype() {
            DType::F16 => "ragkv_rope_store_f16",
            _ => "ragkv_rope_store_f32",
        };
        match kc.dtype() {
            DType::F16 => store::<f16>(name, dev, floats, (kc, vc), strides, ints, cfg),
            _ => store::<f32>(name, dev, floats, (kc, vc), strides, ints, cfg),
        }?;
        Ok(true)
    }

    type View<'a> = candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>;

    #[allow(clippy::too_many_arguments)]
    fn store<T: CudaDType>(
        name: &str,
        dev: &candle_core::CudaDevice,
        [y, cos, sin, q]: [&View<'_>; 4],
        (kc, vc): (&Tensor, &Tensor),
        (kv_head, kv_row, past, rows_at): (i64, i64, u64, u64),
        ints: [i32; 7],
        cfg: LaunchConfig,
    ) -> candle_core::Result<()> {
        let (ks, kl) = kc.storage_and_layout();
        let (vs, vl) = vc.storage_and_layout();
        let (Storage::Cuda(kcs), Storage::Cuda(vcs)) = (&*ks, &*vs) else {
            candle_core::bail!("rope_store: the cache is not on the GPU");
        };
        let k = kcs.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let v = vcs.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let [n_total, row0, at, heads, kv_heads, d, interleaved] = ints;
        let mut b = func.builder();
        b.arg(y)
            .arg(cos)
            .arg(sin)
            .arg(q)
            .arg(&k)
            .arg(&v)
            .arg(&kv_head)
            .arg(&kv_row)
            .arg(&n_total)
            .arg(&row0)
            .arg(&at)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&d)
            .arg(&interleaved)
            .arg(&past)
            .arg(&rows_at);
        // SAFETY: the arguments match `rope_store`'s signature in order and type. Reads: `n`
        // rows of `y` (`(heads + 2 kv_heads) d` wide) and of the tables (`d / 2` wide);
        // writes: rows `row0..row0 + n` of `q` (`(heads, n_total, d)`) and rows `at..at + n`
        // (or `*past..`, or `rows_at[..n]`) of the cache's `kv_heads` heads, all inside their
        // buffers (checked by the caller; with `past`, the graph's caller checks it before
        // each replay; `rows_at` holds `n` indices below the capacity, by its caller).
        // The queries' and the cache's buffers are written through shared views: the cache
        // is this sequence's own (`&mut KvCache` upstream), the queries fresh, and this
        // thread's stream orders every later read after the launch.
        unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
        Ok(())
    }

    pub(super) fn rms_norm(
        x: &Tensor,
        w: &Tensor,
        eps: f32,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let Some(&dim) = x.dims().last() else {
            return Ok(None);
        };
        if !enabled() || x.dtype() != DType::F32 || w.dtype() != DType::F32 || w.dims() != [dim] {
            return Ok(None);
        }
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (Storage::Cuda(xc), Storage::Cuda(wc), Some(x0), Some(w0)) =
            (&*xs, &*ws, start(xl), start(wl))
        else {
            return Ok(None);
        };
        let rows = x.elem_count() / dim.max(1);
        if rows == 0 {
            return Ok(None);
        }
        let xv = xc.as_cuda_slice::<f32>()?.slice(x0..);
        let wv = wc.as_cuda_slice::<f32>()?.slice(w0..);
        // SAFETY: every element is written by the kernel (a block per row, its threads over
        // the row) before the tensor is read.
        let mut out = unsafe { dev.alloc::<f32>(rows * dim) }?;
        let func = dev.get_or_load_custom_func("ragkv_rmsnorm", MODULE, PTX)?;
        let dim32 = dim as i32;
        let mut b = func.builder();
        b.arg(&xv).arg(&wv).arg(&mut out).arg(&dim32).arg(&eps);
        // SAFETY: arguments in the kernel's order and types; block `r` reads row `r` of `x`
        // (`dim` elements from the view's start) and `w`, and writes row `r` of `out`.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(candle_core::Error::wrap)?;
        let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
        Ok(Some(Tensor::from((Storage::Cuda(storage), x.dims()))))
    }

    pub(super) fn swiglu_joined(gu: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(dev) = gu.device() else {
            return Ok(None);
        };
        let dims = gu.dims();
        let Some(&width) = dims.last() else {
            return Ok(None);
        };
        if !enabled() || gu.dtype() != DType::F32 || width % 2 != 0 {
            return Ok(None);
        }
        let (gs, gl) = gu.storage_and_layout();
        let (Storage::Cuda(gc), Some(g0)) = (&*gs, start(gl)) else {
            return Ok(None);
        };
        let w = width / 2;
        let n = gu.elem_count() / width;
        let gv = gc.as_cuda_slice::<f32>()?.slice(g0..);
        // SAFETY: the kernel writes every one of the `n * w` elements before it is read.
        let mut out = unsafe { dev.alloc::<f32>(n * w) }?;
        let func = dev.get_or_load_custom_func("ragkv_swiglu", MODULE, PTX)?;
        let (n32, w32) = (n as i32, w as i32);
        let threads = 256u32;
        let blocks = ((n * w).div_ceil(threads as usize)).min(65_535) as u32;
        let mut b = func.builder();
        b.arg(&gv).arg(&mut out).arg(&n32).arg(&w32);
        // SAFETY: arguments in the kernel's order and types; it reads `n * 2w` elements of
        // `gu` and writes `n * w` of `out` (grid-stride loop).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (blocks.max(1), 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(candle_core::Error::wrap)?;
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("rank > 0") = w;
        let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
        Ok(Some(Tensor::from((Storage::Cuda(storage), shape))))
    }
}
