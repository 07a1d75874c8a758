//! The preallocated per-sequence [`KvCache`] a decode step writes into.

use candle_core::{DType, Device, Tensor};

use super::Kv;
use crate::error::{Ctx, Error, Result};
use crate::kv_q8::{self, Q8_CACHE};
/// Whether a q8 cache can hold heads of `d` elements on `device`.
pub(super) fn q8_check(device: &Device, d: usize) -> Result<()> {
    if !device.is_cpu() {
        return Err(Error::Kv {
            why: "q8 decoding caches are CPU-only".into(),
        });
    }
    if !kv_q8::supports(d) {
        return Err(Error::Kv {
            why: format!("q8 decoding caches need heads of a multiple of 32 elements, not {d}"),
        });
    }
    Ok(())
}

/// Rows `(1, heads, n, d)` in the cache's `dtype`, contiguous: quantized for a q8 cache.
fn to_cache_rows(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if dtype == Q8_CACHE && t.dtype() == Q8_CACHE {
        t.contiguous().ctx("kv cache rows")
    } else if dtype == Q8_CACHE {
        kv_q8::quantize(t)
    } else if dtype == DType::F16 && t.dtype() == DType::F32 && t.device().is_cpu() {
        let x = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .ctx("kv cache rows")?;
        Tensor::from_vec(super::narrow_f16(&x), t.dims(), t.device()).ctx("kv cache rows")
    } else {
        t.to_dtype(dtype)
            .and_then(|t| t.contiguous())
            .ctx("kv cache rows")
    }
}

/// A preallocated per-sequence cache: appends write into place (`slice_set`), growing by
/// doubling when full, so decoding does not concatenate per token. Its dtype is f32, f16, or
/// [`Q8_CACHE`] (8-bit rows with a scale each, `model/src/kv_q8.rs`; CPU only).
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
    /// Position of the first cached token (0 unless a chunk is prefilled "in place").
    start_pos: usize,
    /// The decode step captured over these buffers on a GPU (`decoder/graph.rs`); dropped
    /// when the buffers are replaced.
    pub(crate) graph: Option<Box<crate::gpu_graph::StepGraph>>,
}

impl KvCache {
    /// An empty cache for `layers` layers of `(kv_heads, head_dim)`.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<KvCache> {
        let capacity = capacity.max(16);
        if dtype == Q8_CACHE {
            q8_check(device, head_dim)?;
        }
        let width = if dtype == Q8_CACHE {
            kv_q8::row_bytes(head_dim)
        } else {
            head_dim
        };
        let layers = (0..layers)
            .map(|_| -> Result<_> {
                let z = Tensor::zeros((1, kv_heads, capacity, width), dtype, device)
                    .ctx("kv cache alloc")?;
                Ok((z.clone(), z.zeros_like().ctx("kv cache alloc")?))
            })
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            len: 0,
            capacity,
            start_pos: 0,
            graph: None,
        })
    }

    /// A cache holding `kv` in its own dtype, with room for `extra` more tokens.
    pub fn from_kv(kv: &Kv, extra: usize) -> Result<KvCache> {
        KvCache::from_kv_in(kv, extra, kv.layers[0].0.dtype())
    }

    /// A cache in `dtype` holding `kv` (converted), with room for `extra` more tokens: an
    /// f16 cache halves what every decode step's attention reads (`serve.cache_dtype`).
    pub fn from_kv_in(kv: &Kv, extra: usize, dtype: DType) -> Result<KvCache> {
        KvCache::from_parts_in(std::slice::from_ref(kv), extra, dtype)
    }

    /// A cache in `dtype` holding `parts` one after the other (converted as they are
    /// copied in, once, into a fresh buffer: neither a concatenated copy first nor a zeroed
    /// cache to copy into), with room for `extra` more tokens.
    pub fn from_parts_in(parts: &[Kv], extra: usize, dtype: DType) -> Result<KvCache> {
        let first = parts.first().ok_or_else(|| Error::Kv {
            why: "no KV to hold".into(),
        })?;
        let k0 = &first.layers[0].0;
        let (_, heads, _, width0) = k0.dims4().ctx("kv dims")?;
        // Parts quantized for a q8 cache on the loader thread hold rows wider than a head.
        let dim = if k0.dtype() == Q8_CACHE {
            kv_q8::dim_of(width0)
        } else {
            width0
        };
        let n_layers = first.layers.len();
        let parts: Vec<&Kv> = parts.iter().filter(|kv| !kv.is_empty()).collect();
        if let Some(bad) = parts.iter().find(|kv| kv.layers.len() != n_layers) {
            return Err(Error::Kv {
                why: format!("parts of {} and {n_layers} layers", bad.layers.len()),
            });
        }
        let total: usize = parts.iter().map(|kv| kv.len()).sum();
        let capacity = (total + extra).max(16);
        if total == 0 {
            return KvCache::new(n_layers, heads, dim, capacity, dtype, k0.device());
        }
        if dtype == Q8_CACHE {
            q8_check(k0.device(), dim)?;
        }
        let width = if dtype == Q8_CACHE {
            kv_q8::row_bytes(dim)
        } else {
            dim
        };
        let pad = Tensor::zeros((1, heads, capacity - total, width), dtype, k0.device())
            .ctx("kv cache alloc")?;
        let side = |l: usize, values: bool| -> Result<Tensor> {
            let mut ts = parts
                .iter()
                .map(|kv| {
                    let (k, v) = &kv.layers[l];
                    to_cache_rows(if values { v } else { k }, dtype)
                })
                .collect::<Result<Vec<_>>>()?;
            if capacity > total {
                ts.push(pad.clone());
            }
            // The cache's buffers are its own (appends write into them in place), never a
            // part's storage, which may be shared (a resident chunk's values): `cat` of one
            // tensor would return that tensor itself.
            match ts.as_slice() {
                [one] => one.copy(),
                _ => Tensor::cat(&ts, 2),
            }
            .ctx("kv cache fill")
        };
        let layers = (0..n_layers)
            .map(|l| Ok((side(l, false)?, side(l, true)?)))
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            len: total,
            capacity,
            start_pos: 0,
            graph: None,
        })
    }

    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The dtype the cache keeps keys and values in (appended rows are converted to it).
    pub fn dtype(&self) -> DType {
        self.layers[0].0.dtype()
    }

    /// Position of the first cached token.
    pub fn start_pos(&self) -> usize {
        self.start_pos
    }

    /// Makes the (empty) cache start at `pos`: the next token gets position `pos`.
    pub fn set_start_pos(&mut self, pos: usize) -> Result<()> {
        if self.len != 0 {
            return Err(Error::Kv {
                why: "start position of a non-empty cache".into(),
            });
        }
        self.start_pos = pos;
        Ok(())
    }

    /// Position the next appended token gets.
    pub fn next_pos(&self) -> usize {
        self.start_pos + self.len
    }

    /// Writes `k`, `v` of layer `l` at the current length (does not advance it).
    fn write(&mut self, l: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(2).ctx("kv dims")?;
        self.reserve(n)?;
        let (ck, cv) = &mut self.layers[l];
        let dtype = ck.dtype();
        ck.slice_set(&to_cache_rows(k, dtype)?, 2, self.len)
            .ctx("kv write")?;
        cv.slice_set(&to_cache_rows(v, dtype)?, 2, self.len)
            .ctx("kv write")?;
        Ok(())
    }

    /// Room for `n` rows past the length in every layer (the buffers doubled if need be).
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        if self.len + n > self.capacity {
            let new_cap = (self.len + n).max(self.capacity * 2);
            for (ck, cv) in self.layers.iter_mut() {
                let (b, h, _, d) = ck.dims4().ctx("kv dims")?;
                let pad =
                    Tensor::zeros((b, h, new_cap - self.capacity, d), ck.dtype(), ck.device())
                        .ctx("kv grow")?;
                *ck = Tensor::cat(&[&*ck, &pad], 2).ctx("kv grow")?;
                *cv = Tensor::cat(&[&*cv, &pad], 2).ctx("kv grow")?;
            }
            self.capacity = new_cap;
            self.graph = None;
        }
        Ok(())
    }

    /// Rows the buffers hold.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Layer `l`'s whole key and value buffers `(1, kv_heads, capacity, width)`, for a kernel
    /// that writes rows past the length in place ([`KvCache::reserve`] first, then
    /// [`KvCache::advance`] once every layer has its rows).
    pub(crate) fn buffers(&self, l: usize) -> (&Tensor, &Tensor) {
        let (k, v) = &self.layers[l];
        (k, v)
    }

    /// Appends `k`, `v` for layer `l` and returns the layer's whole cached K and V.
    /// Call [`KvCache::advance`] once every layer has appended.
    pub(crate) fn append(&mut self, l: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(2).ctx("kv dims")?;
        self.write(l, k, v)?;
        let (ck, cv) = &self.layers[l];
        Ok((
            ck.narrow(2, 0, self.len + n).ctx("kv view")?,
            cv.narrow(2, 0, self.len + n).ctx("kv view")?,
        ))
    }

    /// Overwrites rows of layer `l` below the length with `k`, `v` `(1, kv_heads, r, d)`:
    /// row `j` goes to the cache index that `at` `(1, kv_heads, r, d)`, u32, holds at `j`.
    pub(crate) fn set_rows(&mut self, l: usize, k: &Tensor, v: &Tensor, at: &Tensor) -> Result<()> {
        let (ck, cv) = &self.layers[l];
        let dtype = ck.dtype();
        // A q8 row is wider than its floats: the index of its first element, across it.
        let at = if dtype == Q8_CACHE {
            let (b, h, r, _) = at.dims4().ctx("kv rows")?;
            &at.narrow(3, 0, 1)
                .and_then(|a| a.broadcast_as((b, h, r, ck.dim(3)?)))
                .and_then(|a| a.contiguous())
                .ctx("kv rows")?
        } else {
            at
        };
        ck.scatter_set(at, &to_cache_rows(k, dtype)?, 2)
            .ctx("kv rows")?;
        cv.scatter_set(at, &to_cache_rows(v, dtype)?, 2)
            .ctx("kv rows")?;
        Ok(())
    }

    /// Layer `l`'s first `n` cached rows, keys and values, as the cache holds them (q8 rows
    /// as [`kv_q8`] lays them out: see [`KvCache::float_rows`]).
    pub(crate) fn rows(&self, l: usize, n: usize) -> Result<(Tensor, Tensor)> {
        let (ck, cv) = &self.layers[l];
        Ok((
            ck.narrow(2, 0, n).ctx("kv view")?,
            cv.narrow(2, 0, n).ctx("kv view")?,
        ))
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// `t` (rows of the cache) as floats in `dtype`: widened from q8, converted otherwise.
    pub(crate) fn float_rows(t: &Tensor, dtype: DType) -> Result<Tensor> {
        if t.dtype() == Q8_CACHE {
            kv_q8::dequantize(t, dtype, t.device())
        } else {
            t.to_dtype(dtype).ctx("cache rows")
        }
    }

    /// A copy of the cached KV (a q8 cache's widened to f32).
    pub fn to_kv(&self) -> Result<Kv> {
        let export = |t: &Tensor| -> Result<Tensor> {
            let t = t
                .narrow(2, 0, self.len)
                .and_then(|t| t.contiguous())
                .ctx("kv export")?;
            if t.dtype() == Q8_CACHE {
                kv_q8::dequantize(&t, DType::F32, t.device())
            } else {
                Ok(t)
            }
        };
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| Ok((export(k)?, export(v)?)))
            .collect::<Result<_>>()?;
        Kv::new(layers)
    }

    /// Forgets everything past `n` tokens.
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 rows go into an f16 cache as candle's conversion rounds them (to nearest, ties to
    /// even), bit for bit, through the vectorized path; q8 rows from f16 and from f32
    /// floats of the same values are the same bytes.
    #[test]
    fn rows_convert_as_candle_rounds_them() {
        let dev = Device::Cpu;
        let x: Vec<f32> = (0..2 * 37 * 64)
            .map(|i| ((i as f32) * 0.37).sin() * 300.0 + 1e-4 * i as f32)
            .collect();
        let t = Tensor::from_vec(x, (1, 2, 37, 64), &dev).unwrap();
        let fast = to_cache_rows(&t, DType::F16).unwrap();
        let want = t.to_dtype(DType::F16).unwrap();
        assert_eq!(fast.dims(), want.dims());
        let bits = |t: &Tensor| -> Vec<u16> {
            let v = t.flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
            v.iter().map(|h| h.to_bits()).collect()
        };
        assert_eq!(bits(&fast), bits(&want));
        let from_f16 = to_cache_rows(&want, Q8_CACHE).unwrap();
        let from_f32 = to_cache_rows(&want.to_dtype(DType::F32).unwrap(), Q8_CACHE).unwrap();
        let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
        assert_eq!(bytes(&from_f16), bytes(&from_f32));
    }
}
