//! HF checkpoints in BF16 / F16 keep their matrices 16-bit when loaded with
//! `LoadOptions::quantized` (half of f32's memory; decode reads two bytes per weight): the
//! logits equal those of the same 16-bit weights widened to f32 at load, for a prompt
//! (prefill: blocks widened for the GEMM) and a decoding step (the row kernels).

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
        assert!(
            dp < 1e-4 && ds < 1e-4,
            "{arch:?}: prompt {dp:e}, step {ds:e}"
        );
    }
}
