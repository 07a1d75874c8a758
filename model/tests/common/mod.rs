//! Helpers shared by the integration tests and, as `crate::test_util`, the unit tests.

use candle_core::{DType, Tensor};

/// The largest absolute difference of two tensors of as many elements, compared in f32.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
    (flat(a) - flat(b))
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
