//! A decode step's normed input quantized once, in the norm's own launch, for candle's
//! quantized products on a GPU.
//!
//! candle's quantized product of a few rows is two launches: the f32 input quantized to 8-bit
//! blocks (`block_q8_1`), then the matrix-vector kernel over them. Before the Q/K/V and the
//! gate/up products the input is an RMSNorm of the residual stream, itself one launch after
//! the residual add: `ragkv_rmsnorm_q8` (`model/kernels/step.cu`) adds, norms and quantizes in
//! one, and [`product_q8`] launches candle-kernels' matrix-vector kernel (the one candle's
//! `QMatMul` launches) over its blocks. Three launches become one per product; the values
//! are the ones the separate launches compute (the same operations in the same order). The
//! MLP's gate before the down projection is quantized in its own launch the same way
//! ([`swiglu_q8`]).
//!
//! `RAGKV_CUDA_NORM_Q8=off` turns it off (the separate launches), for comparison.

use candle_core::quantized::QTensor;
use candle_core::Tensor;

/// Rows normed and quantized for [`product_q8`]: `rows` rows of `k` elements, each padded to
/// `kpad` elements of `block_q8_1` (36 bytes per 32 elements), in a u8 tensor on the GPU.
pub(crate) struct Q8Rows {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    data: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    rows: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    k: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kpad: usize,
}

/// `x + delta` (or `x`) `(1, rows, k)` normed by each row's root mean square (plus `eps`),
/// scaled by `w` `(k)` and quantized for [`product_q8`]; with `delta`, the sum too (the new
/// residual stream). `None` where it does not apply (the CPU, a build without `cuda`, other
/// dtypes or layouts, more than 8 rows, `RAGKV_CUDA_NORM_Q8=off`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn norm_q8(
    x: &Tensor,
    delta: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
) -> candle_core::Result<Option<(Option<Tensor>, Q8Rows)>> {
    #[cfg(feature = "cuda")]
    return cuda::norm_q8(x, delta, w, eps);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, delta, w, eps);
        Ok(None)
    }
}

/// `silu(g) · u` of the joined gate/up output `gu` `(1, rows, 2 w)` (f32, contiguous),
/// quantized for [`product_q8`] (the down projection) in the same launch; `None` where it
/// does not apply (as [`norm_q8`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn swiglu_q8(gu: &Tensor) -> candle_core::Result<Option<Q8Rows>> {
    #[cfg(feature = "cuda")]
    return cuda::swiglu_q8(gu);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = gu;
        Ok(None)
    }
}

/// `y · wᵀ` of rows quantized by [`norm_q8`] or [`swiglu_q8`]: `(1, rows, out)` f32, `w` `(out, k)` on the
/// GPU in a block type candle's matrix-vector kernels take; `None` otherwise.
pub(crate) fn product_q8(w: &QTensor, y: &Q8Rows) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return cuda::product_q8(w, y);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (w, y);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
pub(super) fn enabled() -> bool {
    cuda::enabled()
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::ffi::c_void;
    use std::sync::OnceLock;

    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaStorage;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Device, Storage, Tensor};
    use candle_kernels::ffi;

    use super::Q8Rows;

    /// candle's padding of a quantized product's input rows (`MATRIX_ROW_PADDING`).
    const ROW_PADDING: usize = 512;
    /// Bytes of one `block_q8_1` (32 elements).
    const BLOCK_BYTES: usize = 36;
    /// The matrix-vector kernels' widest batch.
    const MAX_ROWS: usize = 8;

    pub(super) fn enabled() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| {
            super::super::cuda::enabled()
                && std::env::var("RAGKV_CUDA_NORM_Q8").as_deref() != Ok("off")
        })
    }

    pub(super) fn norm_q8(
        x: &Tensor,
        delta: Option<&Tensor>,
        w: &Tensor,
        eps: f32,
    ) -> candle_core::Result<Option<(Option<Tensor>, Q8Rows)>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let &[1, rows, k] = x.dims() else {
            return Ok(None);
        };
        let ok = enabled()
            && (1..=MAX_ROWS).contains(&rows)
            && k > 0
            && x.dtype() == DType::F32
            && w.dtype() == DType::F32
            && w.dims() == [k]
            && delta.is_none_or(|d| d.dims() == x.dims() && d.dtype() == DType::F32);
        if !ok {
            return Ok(None);
        }
        let start = super::super::cuda::start;
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (Storage::Cuda(xc), Storage::Cuda(wc), Some(x0), Some(w0)) =
            (&*xs, &*ws, start(xl), start(wl))
        else {
            return Ok(None);
        };
        let ds = delta.map(|d| d.storage_and_layout());
        let dv = match &ds {
            Some((s, l)) => {
                let (Storage::Cuda(dc), Some(d0)) = (&**s, start(l)) else {
                    return Ok(None);
                };
                Some(dc.as_cuda_slice::<f32>()?.slice(d0..))
            }
            None => None,
        };
        let xv = xc.as_cuda_slice::<f32>()?.slice(x0..);
        let wv = wc.as_cuda_slice::<f32>()?.slice(w0..);
        let kpad = k.div_ceil(ROW_PADDING) * ROW_PADDING;
        // SAFETY: the kernel writes every byte: each row's `kpad / 32` blocks (the padding's
        // as zeros) and, with `delta`, every element of the sum.
        let mut q = unsafe { dev.alloc::<u8>(rows * kpad / 32 * BLOCK_BYTES) }?;
        let mut sum = match dv {
            // SAFETY: as above.
            Some(_) => Some(unsafe { dev.alloc::<f32>(rows * k) }?),
            None => None,
        };
        let func = dev.get_or_load_custom_func(
            "ragkv_rmsnorm_q8",
            super::super::cuda::MODULE,
            super::super::cuda::PTX,
        )?;
        let (k32, kpad32) = (k as i32, kpad as i32);
        // A null pointer where there is no residual to add (the kernel tests it).
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&xv);
        match &dv {
            Some(d) => b.arg(d),
            None => b.arg(&null),
        };
        match &mut sum {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(&wv).arg(&mut q).arg(&k32).arg(&kpad32).arg(&eps);
        // SAFETY: arguments in the kernel's order and types; block `r` reads row `r` of `x`
        // (and of `delta`, `k` elements each) and `w`, writes row `r` of the sum (`k`
        // elements) and its `kpad / 32` blocks of `q`, all inside their buffers.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(candle_core::Error::wrap)?;
        let data = Tensor::from((
            Storage::Cuda(CudaStorage::wrap_cuda_slice(q, dev.clone())),
            (rows * kpad / 32 * BLOCK_BYTES,),
        ));
        let sum = sum.map(|s| {
            Tensor::from((
                Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
                x.dims(),
            ))
        });
        Ok(Some((
            sum,
            Q8Rows {
                data,
                rows,
                k,
                kpad,
            },
        )))
    }

    pub(super) fn swiglu_q8(gu: &Tensor) -> candle_core::Result<Option<Q8Rows>> {
        let Device::Cuda(dev) = gu.device() else {
            return Ok(None);
        };
        let &[1, rows, width] = gu.dims() else {
            return Ok(None);
        };
        if !enabled() || gu.dtype() != DType::F32 || width % 2 != 0 || width == 0 {
            return Ok(None);
        }
        if !(1..=MAX_ROWS).contains(&rows) {
            return Ok(None);
        }
        let (gs, gl) = gu.storage_and_layout();
        let (Storage::Cuda(gc), Some(g0)) = (&*gs, super::super::cuda::start(gl)) else {
            return Ok(None);
        };
        let gv = gc.as_cuda_slice::<f32>()?.slice(g0..);
        let k = width / 2;
        let kpad = k.div_ceil(ROW_PADDING) * ROW_PADDING;
        // SAFETY: the kernel writes every one of the `rows * kpad / 32` blocks.
        let mut q = unsafe { dev.alloc::<u8>(rows * kpad / 32 * BLOCK_BYTES) }?;
        let func = dev.get_or_load_custom_func(
            "ragkv_swiglu_q8",
            super::super::cuda::MODULE,
            super::super::cuda::PTX,
        )?;
        let (k32, kpad32) = (k as i32, kpad as i32);
        const WARPS: usize = 8;
        let mut b = func.builder();
        b.arg(&gv).arg(&mut q).arg(&k32).arg(&kpad32);
        // SAFETY: arguments in the kernel's order and types; block (r, y) reads row `r` of
        // `gu` (`2 k` elements) and writes blocks `y * 8..y * 8 + 8` of row `r` of `q`
        // (those below `kpad / 32`), all inside their buffers.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows as u32, (kpad / 32).div_ceil(WARPS) as u32, 1),
                block_dim: (32 * WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(candle_core::Error::wrap)?;
        let data = Tensor::from((
            Storage::Cuda(CudaStorage::wrap_cuda_slice(q, dev.clone())),
            (rows * kpad / 32 * BLOCK_BYTES,),
        ));
        Ok(Some(Q8Rows {
            data,
            rows,
            k,
            kpad,
        }))
    }

    /// candle-kernels' matrix-vector launcher over q8_1 input for a block type.
    type Launcher = unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *mut c_void,
        i32,
        i32,
        i32,
        i32,
        i32,
        *mut c_void,
    );

    fn launcher(t: GgmlDType) -> Option<Launcher> {
        Some(match t {
            GgmlDType::Q4_0 => ffi::launch_mmvq_gguf_q4_0_f32_plain,
            GgmlDType::Q4_1 => ffi::launch_mmvq_gguf_q4_1_f32_plain,
            GgmlDType::Q5_0 => ffi::launch_mmvq_gguf_q5_0_f32_plain,
            GgmlDType::Q5_1 => ffi::launch_mmvq_gguf_q5_1_f32_plain,
            GgmlDType::Q8_0 => ffi::launch_mmvq_gguf_q8_0_f32_plain,
            GgmlDType::Q2K => ffi::launch_mmvq_gguf_q2_k_f32_plain,
            GgmlDType::Q3K => ffi::launch_mmvq_gguf_q3_k_f32_plain,
            GgmlDType::Q4K => ffi::launch_mmvq_gguf_q4_k_f32_plain,
            GgmlDType::Q5K => ffi::launch_mmvq_gguf_q5_k_f32_plain,
            GgmlDType::Q6K => ffi::launch_mmvq_gguf_q6_k_f32_plain,
            _ => return None,
        })
    }

    pub(super) fn product_q8(w: &QTensor, y: &Q8Rows) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(dev) = y.data.device() else {
            return Ok(None);
        };
        let Some(launch) = launcher(w.dtype()) else {
            return Ok(None);
        };
        let Ok((out, k)) = w.shape().dims2() else {
            return Ok(None);
        };
        if k != y.k || !w.device().same_device(y.data.device()) {
            return Ok(None);
        }
        let weights = w.device_ptr()? as *const c_void;
        let (ys, yl) = y.data.storage_and_layout();
        let Storage::Cuda(yc) = &*ys else {
            return Ok(None);
        };
        let stream = dev.cuda_stream();
        let yv = yc.as_cuda_slice::<u8>()?.slice(yl.start_offset()..);
        // SAFETY: the kernel writes all `rows * out` outputs before the tensor is read.
        let dst = unsafe { dev.alloc::<f32>(y.rows * out) }?;
        {
            let (y_ptr, _y_sync) = yv.device_ptr(&stream);
            let (d_ptr, _d_sync) = dst.device_ptr(&stream);
            // SAFETY: the launcher's arguments as candle's own call passes them (fast_mmvq):
            // the weights' `out × k` blocks, `rows` input rows of `kpad / 32` blocks each,
            // `rows × out` outputs (row stride `out`), on this device's stream, which orders
            // the launch after the norm that wrote `y` and before every later read of `dst`.
            unsafe {
                launch(
                    weights,
                    y_ptr as *const c_void,
                    d_ptr as *mut c_void,
                    k as i32,
                    out as i32,
                    (y.kpad / 32) as i32,
                    out as i32,
                    y.rows as i32,
                    stream.cu_stream() as *mut c_void,
                )
            };
        }
        Ok(Some(Tensor::from((
            Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, dev.clone())),
            (1, y.rows, out),
        ))))
    }
}
