//! Stored KV bytes onto the model's device.
//!
//! On the CPU: one copy into a tensor. On CUDA the bytes go through a page-locked staging
//! buffer (taken from a pool for the copy and given back after it: a loader's helper threads
//! come and go with each query, and pinning fresh memory costs milliseconds) with one
//! asynchronous host-to-device copy.
//! candle issues each host thread's work on that thread's own stream (CUDA's per-thread
//! default stream), so a loader thread's copies and kernels are not queued behind the decoder
//! thread's: the copy overlaps decode, and the loader waits for its own stream only. A
//! loader hands tensors to another thread only after [`settle`] (its stream drained), since
//! nothing orders one thread's stream after another's.
//!
//! `RAGKV_CUDA_UPLOAD=plain` takes candle's own copy instead (pageable memory), for
//! comparison.

use candle_core::{DType, Device, Tensor};

use crate::error::{Ctx, Result};

/// `bytes` (native-endian elements of `dtype`) as a contiguous tensor of `shape` on `device`.
pub(crate) fn upload(
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    const _: () = assert!(cfg!(target_endian = "little"), "KV bytes are little-endian");
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) if cuda::pinned_path() => cuda::upload(bytes, dtype, shape, dev),
        _ => Tensor::from_raw_buffer(bytes, dtype, shape, device).ctx("kv from bytes"),
    }
}

/// Waits until the work this thread queued on `device` is done (a no-op on the CPU): tensors
/// made here may then be used from another thread.
pub(crate) fn settle(device: &Device) -> Result<()> {
    device.synchronize().ctx("device synchronize")
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::{Arc, Mutex, PoisonError};

    use candle_core::cuda_backend::cudarc::driver::{
        result, CudaContext, CudaSlice, DevicePtrMut, DeviceRepr, PinnedHostSlice,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
    use candle_core::{DType, Storage, Tensor};
    use half::{bf16, f16};

    use crate::error::{Error, Result};

    /// Whether stored KV goes through pinned memory (`RAGKV_CUDA_UPLOAD` unset or `pinned`).
    pub(super) fn pinned_path() -> bool {
        std::env::var("RAGKV_CUDA_UPLOAD").as_deref() != Ok("plain")
    }

    /// A staging buffer, for one CUDA context.
    struct Staging {
        ctx: Arc<CudaContext>,
        buf: PinnedHostSlice<u8>,
    }

    /// Staging buffers no copy is using.
    static POOL: Mutex<Vec<Staging>> = Mutex::new(Vec::new());
    /// Buffers the pool keeps at most (the largest): one per loading thread.
    const POOL_MAX: usize = 16;

    /// A buffer of `ctx` holding at least `len` bytes: the pool's smallest that does, or a
    /// new one with room for some growth (blocks of one model differ in length).
    fn take(ctx: &Arc<CudaContext>, len: usize) -> Result<Staging> {
        {
            let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
            let best = (0..pool.len())
                .filter(|&i| Arc::ptr_eq(&pool[i].ctx, ctx) && pool[i].buf.len() >= len)
                .min_by_key(|&i| pool[i].buf.len());
            if let Some(i) = best {
                return Ok(pool.swap_remove(i));
            }
        }
        // SAFETY: the buffer is written before any read of it (by `copy`, the only user).
        let buf = unsafe { ctx.alloc_pinned::<u8>(len.next_power_of_two()) }
            .map_err(|e| err("pinned buffer", e))?;
        Ok(Staging {
            ctx: ctx.clone(),
            buf,
        })
    }

    /// `s` back into the pool once no copy reads it; past [`POOL_MAX`] the smallest goes.
    fn give_back(s: Staging) {
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        pool.push(s);
        if pool.len() > POOL_MAX {
            if let Some(i) = (0..pool.len()).min_by_key(|&i| pool[i].buf.len()) {
                pool.swap_remove(i);
            }
        }
    }

    fn err(what: &str, e: impl std::fmt::Display) -> Error {
        Error::Device {
            what: what.to_string(),
            why: e.to_string(),
        }
    }

    pub(super) fn upload(
        bytes: &[u8],
        dtype: DType,
        shape: &[usize],
        dev: &CudaDevice,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n * dtype.size_in_bytes() != bytes.len() {
            return Err(Error::Kv {
                why: format!("{} bytes are not {n} elements of {dtype:?}", bytes.len()),
            });
        }
        let storage = match dtype {
            DType::F16 => copy::<f16>(bytes, n, dev)?,
            DType::BF16 => copy::<bf16>(bytes, n, dev)?,
            DType::F32 => copy::<f32>(bytes, n, dev)?,
            DType::U8 => copy::<u8>(bytes, n, dev)?,
            other => {
                return Err(Error::Kv {
                    why: format!("no pinned upload for {other:?}"),
                })
            }
        };
        Ok(Tensor::from((Storage::Cuda(storage), shape)))
    }

    /// Stages `bytes` in page-locked memory and copies them into a fresh device slice of `n`
    /// elements on this thread's stream; returns once the copy has landed (the staging buffer
    /// is then free for the next block).
    fn copy<T: CudaDType + DeviceRepr>(
        bytes: &[u8],
        n: usize,
        dev: &CudaDevice,
    ) -> Result<CudaStorage> {
        let stream = dev.cuda_stream();
        let ctx = stream.context().clone();
        let mut s = take(&ctx, bytes.len())?;
        let host = match s.buf.as_mut_slice() {
            Ok(h) => h,
            Err(e) => return Err(err("pinned buffer", e)),
        };
        host[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: every element is written by the copy below before the slice is read.
        let mut dst: CudaSlice<T> = match unsafe { stream.alloc::<T>(n) } {
            Ok(d) => d,
            Err(e) => {
                give_back(s);
                return Err(err("device alloc", e));
            }
        };
        let landed = {
            let (ptr, _record) = dst.device_ptr_mut(&stream);
            // SAFETY: `ptr` holds `n` elements, `bytes.len()` bytes; the source is page-locked
            // and outlives the copy (the stream is drained below before the buffer goes back
            // to the pool; should the copy or the drain fail, the buffer is never freed).
            unsafe { result::memcpy_htod_async(ptr, &host[..bytes.len()], stream.cu_stream()) }
                .map_err(|e| err("host-to-device copy", e))
                .and_then(|()| stream.synchronize().map_err(|e| err("copy", e)))
        };
        if let Err(e) = landed {
            // The copy may still be reading the buffer: leaked rather than freed under it.
            std::mem::forget(s);
            return Err(e);
        }
        give_back(s);
        Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
    }
}
