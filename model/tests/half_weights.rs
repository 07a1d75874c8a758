//! HF checkpoints in BF16 / F16 keep their matrices 16-bit when loaded with
//! `LoadOptions::quantized` (half of f32's memory; decode reads two bytes per weight): the
//! logits equal those of the same 16-bit weights widened to f32 at load, for a prompt
//! (prefill: the register-tile GEMMs) and a decoding step (the row kernels). Where the CPU
//! multiplies BF16 (AVX-512 BF16), a BF16 prefill rounds its activations to BF16: its logits
//! then stay within 2 % of the largest, and its KV has a namespace of its own.

mod common;

use candle_core::{DType, Device};
use common::max_diff;
use model::synthetic::{self, SyntheticSpec};
use model::{Arch, LoadOptions, Logits, Model, ModelSource};

#[test]
fn sixteen_bit_checkpoints_stay_sixteen_bit() {
    for (arch, dtype) in [(Arch::Qwen2, DType::BF16), (Arch::Gemma3, DType::F16)] {
        let dir = tempfile::tempdir().unwrap();
        let files = synthetic::write(&SyntheticSpec::new(arch), dir.path()).unwrap();
        // The checkpoint as a 16-bit one.
        let st = files.hf_dir.join("model.safetensors");
        let tensors = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
        let half: std::collections::HashMap<_, _> = tensors
            .into_iter()
            .map(|(k, t)| (k, t.to_dtype(dtype).unwrap()))
            .collect();
        candle_core::safetensors::save(&half, &st).unwrap();
        let source = ModelSource::HfDir(files.hf_dir.clone());
        let load = |quantized| {
            let opts = LoadOptions {
                quantized,
                ..LoadOptions::default()
            };
            Model::load(&source, &opts).unwrap()
        };
        let (kept, widened) = (load(true), load(false));
        assert!(
            kept.weights_bytes() * 10 < widened.weights_bytes() * 6,
            "{arch:?}: {} bytes kept against {} widened",
            kept.weights_bytes(),
            widened.weights_bytes()
        );
        // 20 prompt tokens: more than the row kernels' limit, so prefill takes the GEMM.
        let prompt: Vec<u32> = (0..20u32).map(|i| (i * 29 + 3) % 256).collect();
        let run = |m: &Model| {
            let mut cache = m.decoder().new_cache(prompt.len() + 1).unwrap();
            let d = m.decoder();
            let p = d.forward(&mut cache, &prompt, Logits::Last).unwrap();
            let s = d.forward(&mut cache, &[77], Logits::Last).unwrap();
            (p, s)
        };
        let ((kp, ks), (wp, ws)) = (run(&kept), run(&widened));
        let (dp, ds) = (max_diff(&kp, &wp), max_diff(&ks, &ws));
        let rounded = kept.weights_hash().contains("+bf16-activations");
        if let Some(expect) = bf16_products() {
            assert_eq!(
                rounded,
                expect && dtype == DType::BF16,
                "{arch:?} {dtype:?}"
            );
        }
        let bound = if rounded {
            let largest = wp.abs().unwrap().max_all().unwrap();
            2e-2 * largest.to_scalar::<f32>().unwrap()
        } else {
            1e-4
        };
        assert!(
            dp < bound && ds < bound,
            "{arch:?}: prompt {dp:e}, step {ds:e} (bound {bound:e})"
        );
    }
}

/// Whether BF16 prefill should round activations to BF16 here: the CPU has AVX-512 BF16 and
/// the kernel path is the automatic one (`None` when `RAGKV__MODEL__KERNELS` names a path).
fn bf16_products() -> Option<bool> {
    if std::env::var_os("RAGKV__MODEL__KERNELS").is_some() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    return Some(
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512bf16")
            && std::is_x86_feature_detected!("f16c"),
    );
    #[allow(unreachable_code)]
    Some(false)
}
