//! What the kernel tests of [`super`], `kquant` and `half_rows` share: weights quantized by
//! candle (ggml's encoders) and a seeded source of uniform values.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// `(n, k)` weights quantized by candle, their bytes and their dequantized values.
pub(crate) fn weights(vals: &[f32], n: usize, k: usize, dtype: GgmlDType) -> (Vec<u8>, Vec<f32>) {
    let t = Tensor::from_slice(vals, (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let bytes = q.data().unwrap().into_owned();
    let back = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    (bytes, back)
}

/// Uniform values in `[-1, 1)` from `seed` (xorshift64).
pub(crate) fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
    }
}
