//! [`Kv::drift`]: how far each token's rows move between the same tokens' KV computed in
//! different contexts (ingest's `mean:N` ranks a chunk's tokens by it).

use candle_core::{DType, Tensor};

use super::Kv;
use crate::error::{Ctx, Error, Result};

impl Kv {
    /// How far each token's rows move between `parts` (the same tokens' KV computed in
    /// different contexts, as [`Kv::mean`] takes them): per token, the squared distance of
    /// its rows from their mean over the parts, summed over heads, relative to the mean
    /// squared size of a token's mean rows in that layer (keys or values), summed over
    /// layers, keys and values: a layer's keys and values count by how much they move for
    /// their size, so a layer whose rows do not depend on the context (the first, up to
    /// rounding) adds nothing. One score per token; zeros for fewer than two parts.
    pub fn drift(parts: &[Kv]) -> Result<Vec<f32>> {
        let Some(first) = parts.first() else {
            return Ok(Vec::new());
        };
        let n = first.len;
        let mut out = vec![0f32; n];
        if parts.len() < 2 {
            return Ok(out);
        }
        if let Some(p) = parts
            .iter()
            .find(|p| p.len != n || p.layers.len() != first.layers.len())
        {
            return Err(Error::Kv {
                why: format!(
                    "drift of KV of {} and {} tokens ({} and {} layers)",
                    n,
                    p.len,
                    first.layers.len(),
                    p.layers.len()
                ),
            });
        }
        let rows = |t: &Tensor| -> Result<Vec<f32>> {
            t.to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .ctx("kv drift")
        };
        for l in 0..first.layers.len() {
            for values in [false, true] {
                let pick = |p| side(p, l, values);
                // `(1, heads, n, dim)`: token `t`'s row of head `h` at `(h * n + t) * dim`.
                let (_, heads, _, dim) = pick(first).dims4().ctx("kv drift")?;
                let all = parts
                    .iter()
                    .map(|p| rows(pick(p)))
                    .collect::<Result<Vec<_>>>()?;
                let (mut dev, mut energy) = (vec![0f64; n], 0f64);
                for h in 0..heads {
                    for (t, dev) in dev.iter_mut().enumerate() {
                        let at = (h * n + t) * dim;
                        for i in at..at + dim {
                            let mean = all.iter().map(|a| a[i]).sum::<f32>() / all.len() as f32;
                            energy += f64::from(mean).powi(2);
                            *dev += all
                                .iter()
                                .map(|a| f64::from(a[i] - mean).powi(2))
                                .sum::<f64>();
                        }
                    }
                }
                let scale = energy / n as f64;
                if scale > 0.0 {
                    for (o, d) in out.iter_mut().zip(&dev) {
                        *o += (d / scale) as f32;
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Layer `l`'s keys or values.
fn side(kv: &Kv, l: usize, values: bool) -> &Tensor {
    if values {
        &kv.layers[l].1
    } else {
        &kv.layers[l].0
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::super::tests::kv;
    use super::Kv;

    /// Only the tokens whose rows differ between the parts drift, by how much for their
    /// layer's size; the same parts twice drift nowhere.
    #[test]
    fn drift_ranks_the_tokens_whose_rows_move_between_contexts() {
        let base = kv(5, 0.0);
        assert_eq!(
            Kv::drift(&[base.clone(), base.clone()]).unwrap(),
            vec![0.0; 5]
        );
        assert_eq!(Kv::drift(std::slice::from_ref(&base)).unwrap(), [0.0; 5]);
        assert!(Kv::drift(&[]).unwrap().is_empty());
        // Token 3 moves a little in layer 0's keys (head 1), token 1 by more in layer 2's
        // values (head 0), whose scale is a thousand times larger.
        let moved = |t: &Tensor, token: usize, head: usize, by: f32, scale: f32| {
            let mut x = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for v in &mut x {
                *v *= scale;
            }
            x[(head * 5 + token) * 4] += by;
            Tensor::from_vec(x, (1, 2, 5, 4), &Device::Cpu).unwrap()
        };
        let mut layers = base.layers.clone();
        layers[2].1 = moved(&layers[2].1, 0, 0, 0.0, 1000.0);
        let other = {
            let mut l = layers.clone();
            l[0].0 = moved(&l[0].0, 3, 1, 0.1, 1.0);
            l[2].1 = moved(&l[2].1, 1, 0, 50.0, 1.0);
            Kv::new(l).unwrap()
        };
        let d = Kv::drift(&[Kv::new(layers).unwrap(), other]).unwrap();
        // Relative to their layers' sizes, token 3's small move is the larger one.
        assert!(d[3] > d[1] && d[1] > 0.0, "{d:?}");
        assert_eq!([d[0], d[2], d[4]], [0.0; 3]);
        // Scaling every layer's keys, in all parts alike, changes nothing.
        let scaled = |k: &Kv| {
            let l = k
                .layers
                .iter()
                .map(|(a, b)| (a.affine(3.0, 0.0).unwrap(), b.clone()));
            Kv::new(l.collect()).unwrap()
        };
        let (a, b) = (kv(5, 0.0), kv(5, 0.7));
        let (x, y) = (
            Kv::drift(&[a.clone(), b.clone()]).unwrap(),
            Kv::drift(&[scaled(&a), scaled(&b)]).unwrap(),
        );
        for (x, y) in x.iter().zip(&y) {
            assert!((x - y).abs() < 1e-4 * x.abs().max(1.0), "{x} {y}");
        }
        assert!(Kv::drift(&[kv(5, 0.0), kv(4, 0.0)]).is_err());
    }
}
