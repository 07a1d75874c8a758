//! Stored KV bytes into a [`Kv`](super::Kv)'s tensors on the CPU. The store keeps each
//! layer's keys and values token-major (`[token][kv_head][head_dim]`, see
//! [`Kv::to_bytes`](super::Kv::to_bytes)), the caches want them head-major
//! (`(1, kv_heads, tokens, head_dim)`): each plane is copied once, row by row, from the
//! store's bytes into its tensor. (Going through one tensor of all the bytes and candle's
//! transposed copy took two passes, the second walking a multi-dimensional index per row: a
//! third of a loader thread's time.)

use candle_core::{DType, Device, Tensor, WithDType};
use half::{bf16, f16};

use crate::error::{Ctx, Error, Result};

/// What becomes of plane `p` (layer `p / 2`, its values if `p` is odd) once it is a tensor.
pub(super) type Each<'a> = &'a mut dyn FnMut(usize, Tensor) -> Result<Tensor>;

/// The `2 layers` planes of `bytes` (token-major rows of `dim` elements of `dtype`, `heads`
/// per token, `len` tokens a plane; keys then values of each layer) as head-major tensors
/// `(1, heads, len, dim)`, each passed through `each` as soon as it is made (while its bytes
/// are in the core's caches).
pub(super) fn planes(
    bytes: &[u8],
    dtype: DType,
    (layers, len, heads, dim): (usize, usize, usize, usize),
    each: Each<'_>,
) -> Result<Vec<Tensor>> {
    match dtype {
        DType::F16 => planes_of::<f16>(bytes, layers, (len, heads, dim), each),
        DType::BF16 => planes_of::<bf16>(bytes, layers, (len, heads, dim), each),
        DType::F32 => planes_of::<f32>(bytes, layers, (len, heads, dim), each),
        other => Err(Error::Kv {
            why: format!("stored KV of {other:?}"),
        }),
    }
}

fn planes_of<T: WithDType>(
    bytes: &[u8],
    layers: usize,
    (len, heads, dim): (usize, usize, usize),
    each: Each<'_>,
) -> Result<Vec<Tensor>> {
    let n = len * heads * dim;
    let row = dim * std::mem::size_of::<T>();
    if bytes.len() != 2 * layers * n * std::mem::size_of::<T>() {
        return Err(Error::Kv {
            why: format!(
                "{} bytes are not {} planes of {len} tokens × {heads} heads × {dim}",
                bytes.len(),
                2 * layers
            ),
        });
    }
    let mut out = Vec::with_capacity(2 * layers);
    for (p, plane) in bytes.chunks_exact(n * std::mem::size_of::<T>()).enumerate() {
        let mut v: Vec<T> = Vec::with_capacity(n);
        let dst = v.as_mut_ptr().cast::<u8>();
        for h in 0..heads {
            for t in 0..len {
                let src = &plane[(t * heads + h) * row..(t * heads + h + 1) * row];
                // SAFETY: row `(h, t)` of the output, bytes `(h len + t) row..+row` of `v`'s
                // `n` elements of capacity; `src` is another allocation's bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add((h * len + t) * row), row)
                };
            }
        }
        // SAFETY: the loops wrote every row `(h, t)` of the `heads × len` rows of `dim`
        // elements, all `n` of them; any bit pattern is an f16, bf16 or f32.
        unsafe { v.set_len(n) };
        let t = Tensor::from_vec(v, (1, heads, len, dim), &Device::Cpu).ctx("kv import")?;
        out.push(each(p, t)?);
    }
    Ok(out)
}
