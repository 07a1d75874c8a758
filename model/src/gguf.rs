//! GGUF files as llama.cpp writes them: typed access to the metadata, and the tensor names
//! of each family against the HF names ragkv holds weights under (`blk.N.attn_q.weight` is
//! `model.layers.N.self_attn.q_proj.weight`).

use std::collections::HashMap;

use candle_core::quantized::gguf_file;

use crate::config::Arch;
use crate::error::{Error, Result};

/// GGUF metadata accessors.
pub(crate) struct GgufMeta<'a>(pub &'a HashMap<String, gguf_file::Value>);

impl GgufMeta<'_> {
    pub fn get(&self, key: &str) -> Option<&gguf_file::Value> {
        self.0.get(key)
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        use gguf_file::Value as V;
        match self.get(key) {
            Some(V::U8(x)) => Ok(*x as usize),
            Some(V::U16(x)) => Ok(*x as usize),
            Some(V::U32(x)) => Ok(*x as usize),
            Some(V::U64(x)) => Ok(*x as usize),
            Some(V::I32(x)) if *x >= 0 => Ok(*x as usize),
            Some(V::I64(x)) if *x >= 0 => Ok(*x as usize),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected an unsigned integer, found {other:?}"),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        use gguf_file::Value as V;
        match self.get(key) {
            Some(V::F32(x)) => Ok(*x as f64),
            Some(V::F64(x)) => Ok(*x),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected a float, found {other:?}"),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            Some(gguf_file::Value::String(s)) => Ok(s),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected a string, found {other:?}"),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }

    pub fn array(&self, key: &str) -> Result<&Vec<gguf_file::Value>> {
        match self.get(key) {
            Some(gguf_file::Value::Array(a)) => Ok(a),
            Some(other) => Err(Error::Config {
                why: format!("{key}: expected an array, found {:?}", other.value_type()),
            }),
            None => Err(Error::Config {
                why: format!("{key}: missing from GGUF metadata"),
            }),
        }
    }
}

/// GGUF (llama.cpp) tensor names and their HF names: whole names, then per-layer suffixes
/// (`blk.N.` / `model.layers.N.`).
const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];
/// Gemma's norms around attention and the MLP (checked before [`LAYER_NAMES`], whose
/// `ffn_norm` is the Llama layer's `post_attention_layernorm`).
const GEMMA3_LAYER_NAMES: &[(&str, &str)] = &[
    ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
];
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// Maps a name through the tables, `from` side to the other (`gguf_side`: from GGUF to HF).
fn map_name(name: &str, gguf_side: bool, arch: Arch) -> Option<String> {
    let pick = |&(g, h): &(&'static str, &'static str)| if gguf_side { (g, h) } else { (h, g) };
    if let Some((_, to)) = GLOBAL_NAMES
        .iter()
        .map(pick)
        .find(|(from, _)| *from == name)
    {
        return Some(to.into());
    }
    let (prefix, other) = if gguf_side {
        ("blk.", "model.layers.")
    } else {
        ("model.layers.", "blk.")
    };
    let (layer, tail) = name.strip_prefix(prefix)?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let own: &[(&str, &str)] = if arch == Arch::Gemma3 {
        GEMMA3_LAYER_NAMES
    } else {
        &[]
    };
    let (_, to) = own
        .iter()
        .chain(LAYER_NAMES)
        .map(pick)
        .find(|(from, _)| *from == tail)?;
    Some(format!("{other}{layer}.{to}"))
}

/// Maps a GGUF tensor name to its HF name.
pub(crate) fn hf_name(gguf: &str, arch: Arch) -> Option<String> {
    map_name(gguf, true, arch)
}

/// Maps an HF tensor name to its GGUF name (the synthetic models' writer).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn gguf_name(hf: &str, arch: Arch) -> Option<String> {
    map_name(hf, false, arch)
}

/// Whether an HF tensor is an RMSNorm weight that Gemma applies as `1 + w` (llama.cpp's
/// converter adds the 1 into its GGUF files; ragkv holds every norm that way).
pub(crate) fn shifted_norm(arch: Arch, hf: &str) -> bool {
    arch == Arch::Gemma3 && hf.ends_with("norm.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_map_both_ways() {
        for (g, h) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            (
                "blk.3.attn_q_norm.weight",
                "model.layers.3.self_attn.q_norm.weight",
            ),
            (
                "blk.12.ffn_down.weight",
                "model.layers.12.mlp.down_proj.weight",
            ),
        ] {
            assert_eq!(hf_name(g, Arch::Llama).as_deref(), Some(h));
            assert_eq!(gguf_name(h, Arch::Llama).as_deref(), Some(g));
        }
        // Gemma 3's four norms per layer; the others as Llama's.
        for (g, h) in [
            (
                "blk.1.attn_norm.weight",
                "model.layers.1.input_layernorm.weight",
            ),
            (
                "blk.1.post_attention_norm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ),
            (
                "blk.1.ffn_norm.weight",
                "model.layers.1.pre_feedforward_layernorm.weight",
            ),
            (
                "blk.1.post_ffw_norm.weight",
                "model.layers.1.post_feedforward_layernorm.weight",
            ),
            ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ] {
            assert_eq!(hf_name(g, Arch::Gemma3).as_deref(), Some(h));
            assert_eq!(gguf_name(h, Arch::Gemma3).as_deref(), Some(g));
        }
        for unknown in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.0.nope",
            "model.layers.0",
        ] {
            assert_eq!(hf_name(unknown, Arch::Llama), None, "{unknown}");
            assert_eq!(gguf_name(unknown, Arch::Llama), None, "{unknown}");
        }
    }
}
