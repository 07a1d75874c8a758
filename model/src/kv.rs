//! KV caches: the exportable [`Kv`] and the preallocated [`KvCache`] used while decoding.
//!
//! Tensors are `(1, kv_heads, tokens, head_dim)` per layer, keys after RoPE. The byte form
//! ([`Kv::to_bytes`]) is the store's layer-major layout (`schema::KvLayout`):
//! `[layer][K, V][token][kv_head][head_dim]`, little-endian.

use candle_core::{DType, Device, Tensor};
use schema::KvLayout;

use crate::error::{Ctx, Error, Result};
use crate::kv_q8::{self, Q8_CACHE};

mod cache;
mod drift;
mod planes;

use cache::q8_check;
pub use cache::KvCache;

/// The KV of a token sequence: what prefill produces, the store keeps, and decoding resumes
/// from.
#[derive(Debug, Clone)]
pub struct Kv {
    /// `(k, v)` per layer, each `(1, kv_heads, len, head_dim)`.
    pub layers: Vec<(Tensor, Tensor)>,
    len: usize,
}

/// The `schema` dtype that stores a candle dtype (f32, f16, bf16).
pub fn to_schema_dtype(d: DType) -> Result<schema::DType> {
    Ok(match d {
        DType::F32 => schema::DType::F32,
        DType::F16 => schema::DType::F16,
        DType::BF16 => schema::DType::BF16,
        other => {
            return Err(Error::Kv {
                why: format!("dtype {other:?} cannot be stored"),
            })
        }
    })
}

pub(crate) fn from_schema_dtype(d: schema::DType) -> DType {
    match d {
        schema::DType::F32 => DType::F32,
        schema::DType::F16 => DType::F16,
        schema::DType::BF16 => DType::BF16,
    }
}

impl Kv {
    /// Wraps per-layer tensors; all must have the same length.
    pub fn new(layers: Vec<(Tensor, Tensor)>) -> Result<Kv> {
        let len = match layers.first() {
            Some((k, _)) => k.dim(2).ctx("kv dims")?,
            None => {
                return Err(Error::Kv {
                    why: "no layers".into(),
                })
            }
        };
        for (i, (k, v)) in layers.iter().enumerate() {
            if k.dims() != v.dims() || k.dim(2).ctx("kv dims")? != len || k.rank() != 4 {
                return Err(Error::Kv {
                    why: format!(
                        "layer {i}: k {:?} and v {:?} disagree (expected len {len})",
                        k.dims(),
                        v.dims()
                    ),
                });
            }
        }
        Ok(Kv { layers, len })
    }

    /// Number of tokens covered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it covers no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The store layout of this KV in `dtype`.
    pub fn layout(&self, dtype: DType) -> Result<KvLayout> {
        let (_, heads, _, dim) = self.layers[0].0.dims4().ctx("kv dims")?;
        Ok(KvLayout {
            layers: self.layers.len() as u16,
            kv_heads: heads as u16,
            head_dim: dim as u16,
            dtype: to_schema_dtype(dtype)?,
        })
    }

    /// Layer-major bytes in `dtype` (see the module docs).
    pub fn to_bytes(&self, dtype: DType) -> Result<Vec<u8>> {
        let layout = self.layout(dtype)?;
        let mut out = Vec::with_capacity(layout.bytes_for(self.len));
        for (k, v) in &self.layers {
            for t in [k, v] {
                // (1, heads, len, dim) -> (len, heads, dim)
                let t = t
                    .squeeze(0)
                    .and_then(|t| t.transpose(0, 1))
                    .ctx("kv export")?;
                append_bytes(&t, dtype, &mut out)?;
            }
        }
        Ok(out)
    }

    /// Builds KV from layer-major bytes. The tensors are created on `device` in the layout's
    /// dtype; convert with [`Kv::to`] if the model computes in another.
    pub fn from_bytes(bytes: &[u8], layout: &KvLayout, device: &Device) -> Result<Kv> {
        Kv::from_bytes_with(bytes, layout, device, &mut |_, _, t| Ok(t))
    }

    /// [`Kv::from_bytes`], each layer's keys and values passed through `each(layer, values,
    /// tensor)` as they are made: on the CPU while each is still in the core's caches (a
    /// loader re-positions and converts a chunk so in one pass over its bytes, where
    /// [`Kv::from_bytes`], [`crate::Decoder::reposition`] and [`Kv::to`] make three), on other
    /// devices after the import.
    pub fn from_bytes_with(
        bytes: &[u8],
        layout: &KvLayout,
        device: &Device,
        each: &mut dyn FnMut(usize, bool, Tensor) -> Result<Tensor>,
    ) -> Result<Kv> {
        let bpt = layout.bytes_per_token();
        if bytes.is_empty() || !bytes.len().is_multiple_of(bpt) {
            return Err(Error::Kv {
                why: format!(
                    "{} bytes is not a whole number of {bpt}-byte tokens",
                    bytes.len()
                ),
            });
        }
        let len = bytes.len() / bpt;
        let plane = layout.plane_token_bytes() * len;
        let (heads, dim) = (layout.kv_heads as usize, layout.head_dim as usize);
        let dtype = from_schema_dtype(layout.dtype);
        let layers_n = layout.layers as usize;
        if device.is_cpu() {
            let dims = (layers_n, len, heads, dim);
            let planes =
                planes::planes(bytes, dtype, dims, &mut |p, t| each(p / 2, p % 2 == 1, t))?;
            let mut it = planes.into_iter();
            let mut layers = Vec::with_capacity(layers_n);
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                layers.push((k, v));
            }
            return Ok(Kv { layers, len });
        }
        // Elsewhere one upload of every plane (on CUDA: one pinned host-to-device copy),
        // then a transposed copy of each plane on the device.
        let all = crate::upload::upload(bytes, dtype, &[2 * layers_n, len, heads, dim], device)?;
        debug_assert_eq!(plane, len * heads * dim * dtype.size_in_bytes());
        let mut layers = Vec::with_capacity(layers_n);
        for l in 0..layers_n {
            let part = |c: usize| -> Result<Tensor> {
                all.get(2 * l + c)
                    .and_then(|t| t.transpose(0, 1))
                    .and_then(|t| t.unsqueeze(0))
                    .and_then(|t| t.contiguous())
                    .ctx("kv import")
            };
            layers.push((each(l, false, part(0)?)?, each(l, true, part(1)?)?));
        }
        Ok(Kv { layers, len })
    }

    /// Copies the KV to `device` in `dtype`. This is the import step, kept apart from
    /// compute so that a loader can run it while the model decodes another request. With
    /// [`Q8_CACHE`] the rows are quantized for a q8 decoding cache (which takes them as they
    /// are); such a `Kv` only goes into a [`KvCache`].
    pub fn to(&self, device: &Device, dtype: DType) -> Result<Kv> {
        let conv = |t: &Tensor| Kv::tensor_to(t, device, dtype);
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| -> Result<_> { Ok((conv(k)?, conv(v)?)) })
            .collect::<Result<_>>()?;
        Ok(Kv {
            layers,
            len: self.len,
        })
    }

    /// One of a `Kv`'s key or value tensors as [`Kv::to`] converts it.
    pub fn tensor_to(t: &Tensor, device: &Device, dtype: DType) -> Result<Tensor> {
        let t = t.to_device(device).ctx("kv to device")?;
        if dtype == Q8_CACHE {
            q8_check(device, t.dim(3).ctx("kv dims")?)?;
            kv_q8::quantize(&t)
        } else {
            t.to_dtype(dtype).ctx("kv to device")
        }
    }

    /// Concatenates KVs along the token axis, in order.
    pub fn concat(parts: &[Kv]) -> Result<Kv> {
        let first = parts.first().ok_or(Error::Kv {
            why: "nothing to concatenate".into(),
        })?;
        let mut layers = Vec::with_capacity(first.layers.len());
        for l in 0..first.layers.len() {
            let ks: Vec<&Tensor> = parts.iter().map(|p| &p.layers[l].0).collect();
            let vs: Vec<&Tensor> = parts.iter().map(|p| &p.layers[l].1).collect();
            layers.push((
                Tensor::cat(&ks, 2).ctx("kv concat")?,
                Tensor::cat(&vs, 2).ctx("kv concat")?,
            ));
        }
        Kv::new(layers)
    }

    /// The element-wise mean of `parts` (all of the same shape: the same tokens' KV computed
    /// in different contexts), summed in f32 and returned in the first part's dtype.
    pub fn mean(parts: &[Kv]) -> Result<Kv> {
        let first = parts.first().ok_or(Error::Kv {
            why: "no KV to average".into(),
        })?;
        if let Some(p) = parts.iter().find(|p| p.layers.len() != first.layers.len()) {
            return Err(Error::Kv {
                why: format!(
                    "averaging KV of {} and {} layers",
                    first.layers.len(),
                    p.layers.len()
                ),
            });
        }
        let scale = 1.0 / parts.len() as f64;
        let mean = |pick: &dyn Fn(&Kv) -> &Tensor| -> Result<Tensor> {
            let dtype = pick(first).dtype();
            let mut sum = pick(first).to_dtype(DType::F32).ctx("kv mean")?;
            for p in &parts[1..] {
                let t = pick(p).to_dtype(DType::F32).ctx("kv mean")?;
                sum = sum.add(&t).ctx("kv mean")?;
            }
            sum.affine(scale, 0.0)
                .and_then(|t| t.to_dtype(dtype))
                .ctx("kv mean")
        };
        let layers = (0..first.layers.len())
            .map(|l| Ok((mean(&|p| &p.layers[l].0)?, mean(&|p| &p.layers[l].1)?)))
            .collect::<Result<_>>()?;
        Kv::new(layers)
    }

    /// The first `n` tokens.
    pub fn prefix(&self, n: usize) -> Result<Kv> {
        self.narrow(0, n)
    }

    /// Tokens `start..start + n` (contiguous copies).
    pub fn narrow(&self, start: usize, n: usize) -> Result<Kv> {
        if start + n > self.len {
            return Err(Error::Kv {
                why: format!("rows {start}..{} of a KV of {}", start + n, self.len),
            });
        }
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.narrow(2, start, n)
                        .and_then(|t| t.contiguous())
                        .ctx("kv rows")?,
                    v.narrow(2, start, n)
                        .and_then(|t| t.contiguous())
                        .ctx("kv rows")?,
                ))
            })
            .collect::<Result<_>>()?;
        Kv::new(layers)
    }
}

/// `x` rounded to f16 (to nearest, ties to even, as candle's `to_dtype`), eight at a time
/// (F16C where the CPU has it) where candle converts one element per call.
pub(crate) fn narrow_f16(x: &[f32]) -> Vec<half::f16> {
    let mut h = vec![half::f16::ZERO; x.len()];
    half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut h[..], x);
    h
}

/// `t`'s elements in `dtype`, in order, appended to `out` as little-endian bytes. f32 rows
/// on the CPU become f16 eight at a time (F16C where the CPU has it; candle converts one
/// element per call): the export ingest does for every chunk. Elsewhere the conversion
/// happens where `t` is (on a GPU before the copy to the host).
fn append_bytes(t: &Tensor, dtype: DType, out: &mut Vec<u8>) -> Result<()> {
    fn put<T, const N: usize>(out: &mut Vec<u8>, v: &[T], le: impl Fn(&T) -> [u8; N]) {
        let start = out.len();
        out.resize(start + N * v.len(), 0);
        for (o, x) in out[start..].chunks_exact_mut(N).zip(v) {
            o.copy_from_slice(&le(x));
        }
    }
    if dtype == DType::F16 && t.dtype() == DType::F32 && t.device().is_cpu() {
        let x = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .ctx("kv bytes")?;
        put(out, &narrow_f16(&x), |x| x.to_le_bytes());
        return Ok(());
    }
    let t = t
        .to_dtype(dtype)
        .and_then(|t| t.flatten_all())
        .ctx("kv bytes")?;
    match dtype {
        DType::F32 => put(out, &t.to_vec1::<f32>().ctx("kv bytes")?, |x| {
            x.to_le_bytes()
        }),
        DType::F16 => put(out, &t.to_vec1::<half::f16>().ctx("kv bytes")?, |x| {
            x.to_le_bytes()
        }),
        DType::BF16 => put(out, &t.to_vec1::<half::bf16>().ctx("kv bytes")?, |x| {
            x.to_le_bytes()
        }),
        other => {
            return Err(Error::Kv {
                why: format!("dtype {other:?} cannot be stored"),
            })
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn kv(len: usize, seed: f32) -> Kv {
        let layer = |o: f32| {
            let n = 2 * len * 4;
            let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + seed + o).sin()).collect();
            Tensor::from_vec(data, (1, 2, len, 4), &Device::Cpu).unwrap()
        };
        Kv::new(
            (0..3)
                .map(|l| (layer(l as f32), layer(l as f32 + 0.5)))
                .collect(),
        )
        .unwrap()
    }

    /// A cache assembled from parts (an empty one among them) holds their concatenation, in
    /// its own dtype (f16: each value rounded once), and overwritten rows land at their
    /// indices.
    #[test]
    fn parts_go_in_one_after_the_other_in_the_cache_dtype() {
        let parts = [kv(5, 0.0), kv(0, 9.0), kv(3, 1.0), kv(7, 2.0)];
        let whole = Kv::concat(&parts).unwrap();
        for dtype in [DType::F32, DType::F16] {
            let mut cache = KvCache::from_parts_in(&parts, 4, dtype).unwrap();
            assert_eq!((cache.len(), cache.dtype()), (15, dtype));
            let got = cache.to_kv().unwrap();
            for ((gk, gv), (wk, wv)) in got.layers.iter().zip(&whole.layers) {
                for (g, w) in [(gk, wk), (gv, wv)] {
                    let w = w.to_dtype(dtype).unwrap();
                    assert_eq!(crate::test_util::max_diff(g, &w), 0.0, "{dtype:?}");
                }
            }
            // Rows 2 and 9 of layer 1 replaced by ones.
            let ones = Tensor::ones((1, 2, 2, 4), DType::F32, &Device::Cpu).unwrap();
            let at: Vec<u32> = (0..2)
                .flat_map(|_| [2u32; 4].into_iter().chain([9; 4]))
                .collect();
            let at = Tensor::from_vec(at, (1, 2, 2, 4), &Device::Cpu).unwrap();
            cache.set_rows(1, &ones, &ones, &at).unwrap();
            let (k, _) = cache.rows(1, 15).unwrap();
            let k = k.to_dtype(DType::F32).unwrap();
            for row in 0..15 {
                let r: Vec<f32> = k
                    .narrow(2, row, 1)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let want = [2, 9].contains(&row);
                assert_eq!(r.iter().all(|&x| x == 1.0), want, "row {row}");
            }
        }
    }

    /// Export writes each plane token-major in the stored dtype, rounded as candle rounds
    /// (the vectorized f32 → f16 path included), and import reads the same values back.
    #[test]
    fn bytes_hold_the_planes_token_major_as_candle_rounds_them() {
        let kv = kv(9, 0.3);
        for dtype in [DType::F16, DType::F32] {
            let bytes = kv.to_bytes(dtype).unwrap();
            let mut want = Vec::new();
            for (k, v) in &kv.layers {
                for t in [k, v] {
                    let t = t.squeeze(0).unwrap().transpose(0, 1).unwrap();
                    let t = t.to_dtype(dtype).unwrap().flatten_all().unwrap();
                    match dtype {
                        DType::F16 => want.extend(
                            t.to_vec1::<half::f16>()
                                .unwrap()
                                .iter()
                                .flat_map(|x| x.to_le_bytes()),
                        ),
                        _ => want.extend(
                            t.to_vec1::<f32>()
                                .unwrap()
                                .iter()
                                .flat_map(|x| x.to_le_bytes()),
                        ),
                    }
                }
            }
            assert_eq!(bytes, want, "{dtype:?}");
            let back = Kv::from_bytes(&bytes, &kv.layout(dtype).unwrap(), &Device::Cpu).unwrap();
            for ((bk, bv), (k, v)) in back.layers.iter().zip(&kv.layers) {
                for (b, w) in [(bk, k), (bv, v)] {
                    let w = w.to_dtype(dtype).unwrap();
                    assert_eq!(crate::test_util::max_diff(b, &w), 0.0, "{dtype:?}");
                }
            }
        }
    }

    /// The mean of parts is each element's mean, in the first part's dtype; parts of other
    /// shapes, or none, are refused.
    #[test]
    fn the_mean_averages_every_element_of_every_layer() {
        let parts = [kv(6, 0.0), kv(6, 1.3), kv(6, 2.1)];
        let mean = Kv::mean(&parts).unwrap();
        assert_eq!(mean.len(), 6);
        for l in 0..3 {
            for side in 0..2 {
                let pick = |k: &Kv| {
                    let t = if side == 0 {
                        &k.layers[l].0
                    } else {
                        &k.layers[l].1
                    };
                    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                };
                let got = pick(&mean);
                let each: Vec<Vec<f32>> = parts.iter().map(pick).collect();
                for (i, g) in got.iter().enumerate() {
                    let want = each.iter().map(|e| e[i]).sum::<f32>() / 3.0;
                    assert!((g - want).abs() < 1e-6, "layer {l} side {side} element {i}");
                }
            }
        }
        let one = Kv::mean(&parts[1..2]).unwrap();
        assert_eq!(
            crate::test_util::max_diff(&one.layers[2].1, &parts[1].layers[2].1),
            0.0
        );
        let half = Kv::new(
            parts[0]
                .layers
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_dtype(DType::F16).unwrap(),
                        v.to_dtype(DType::F16).unwrap(),
                    )
                })
                .collect(),
        )
        .unwrap();
        let mixed = Kv::mean(&[half, parts[1].clone()]).unwrap();
        assert_eq!(mixed.layers[0].0.dtype(), DType::F16);
        assert!(Kv::mean(&[kv(6, 0.0), kv(5, 0.0)]).is_err());
        let fewer = Kv::new(parts[0].layers[..2].to_vec()).unwrap();
        assert!(Kv::mean(&[parts[0].clone(), fewer]).is_err());
        assert!(Kv::mean(&[]).is_err());
    }

    /// Bytes that are not whole tokens of the layout are a mismatch (stored KV that errs so
    /// is damaged); a device's failure is not.
    #[test]
    fn bytes_of_the_wrong_size_are_a_kv_mismatch() {
        let kv = kv(4, 0.0);
        let layout = kv.layout(DType::F16).unwrap();
        let bytes = kv.to_bytes(DType::F16).unwrap();
        assert_eq!(
            Kv::from_bytes(&bytes, &layout, &Device::Cpu).unwrap().len(),
            4
        );
        let e = Kv::from_bytes(&bytes[..bytes.len() - 2], &layout, &Device::Cpu).unwrap_err();
        assert!(e.is_kv_mismatch(), "{e}");
        let device = Error::Device {
            what: "device alloc".into(),
            why: "out of memory".into(),
        };
        assert!(!device.is_kv_mismatch());
    }
}
