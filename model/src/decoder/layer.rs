//! One transformer layer's weights, read from [`Weights`] by HF name.

use candle_core::{DType, Tensor};

use crate::config::{Arch, ModelConfig};
use crate::error::{Error, Result};
use crate::joined::Joined;
use crate::linear::Proj;
use crate::weights::Weights;

/// A layer: the Llama layer's weights, and Gemma's extra norms.
#[derive(Debug)]
pub(super) struct Layer {
    pub attn_norm: Tensor,
    /// The query, key and value projections (joined into one matrix on a GPU).
    pub qkv: Joined<3>,
    pub o: Proj,
    /// Per-head RMSNorm weights of queries and keys (Qwen3, Gemma 3).
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// Applied to the attention's output before the residual sum (Gemma 3).
    pub post_attn_norm: Option<Tensor>,
    /// The MLP's input norm.
    pub ffn_norm: Tensor,
    /// Applied to the MLP's output before the residual sum (Gemma 3).
    pub post_ffn_norm: Option<Tensor>,
    /// The MLP's gate and up projections (joined on a GPU).
    pub gate_up: Joined<2>,
    pub down: Proj,
}

impl Layer {
    /// Layer `i` of the model.
    pub fn load(w: &Weights, cfg: &ModelConfig, i: usize, dtype: DType) -> Result<Layer> {
        let (h, kv, hd) = (cfg.hidden, cfg.kv_heads, cfg.head_dim);
        let q_out = cfg.heads * hd;
        let p = format!("model.layers.{i}");
        let lin = |name: &str, bias: bool, shape: (usize, usize)| {
            linear(w, &format!("{p}.{name}"), bias, shape, dtype)
        };
        let gemma = cfg.arch == Arch::Gemma3;
        // Gemma's MLP input norm is `pre_feedforward_layernorm`; its
        // `post_attention_layernorm` is the attention's output norm.
        let (ffn_norm, post_attn) = if gemma {
            (
                "pre_feedforward_layernorm",
                Some("post_attention_layernorm"),
            )
        } else {
            ("post_attention_layernorm", None)
        };
        let vector = |name: &str| norm(w, &format!("{p}.{name}.weight"), true, h);
        Ok(Layer {
            attn_norm: w.get(&format!("{p}.input_layernorm.weight"))?.clone(),
            qkv: Joined::new([
                lin("self_attn.q_proj", cfg.attn_bias, (q_out, h))?,
                lin("self_attn.k_proj", cfg.attn_bias, (kv * hd, h))?,
                lin("self_attn.v_proj", cfg.attn_bias, (kv * hd, h))?,
            ])?,
            o: lin("self_attn.o_proj", false, (h, q_out))?,
            q_norm: norm(w, &format!("{p}.self_attn.q_norm.weight"), cfg.qk_norm, hd)?,
            k_norm: norm(w, &format!("{p}.self_attn.k_norm.weight"), cfg.qk_norm, hd)?,
            post_attn_norm: match post_attn {
                Some(name) => vector(name)?,
                None => None,
            },
            ffn_norm: w.get(&format!("{p}.{ffn_norm}.weight"))?.clone(),
            post_ffn_norm: if gemma {
                vector("post_feedforward_layernorm")?
            } else {
                None
            },
            gate_up: Joined::new([
                lin("mlp.gate_proj", false, (cfg.intermediate, h))?,
                lin("mlp.up_proj", false, (cfg.intermediate, h))?,
            ])?,
            down: lin("mlp.down_proj", false, (h, cfg.intermediate))?,
        })
    }
}

/// The matrix `name` (`(out, in)`, quantized if the weights keep it so) as a projection in
/// `dtype`.
pub(super) fn matrix(w: &Weights, name: &str, b: Option<Tensor>, dtype: DType) -> Result<Proj> {
    if let Some(p) = w.packed(name) {
        return Ok(Proj::packed(p.clone(), b, dtype));
    }
    match w.quantized(name) {
        Some(q) => Proj::quant(q.clone(), b, dtype),
        None => Ok(Proj::dense(w.get(name)?.clone(), b)),
    }
}

fn linear(
    w: &Weights,
    name: &str,
    bias: bool,
    shape: (usize, usize),
    dtype: DType,
) -> Result<Proj> {
    let b = if bias {
        Some(w.get(&format!("{name}.bias"))?.clone())
    } else {
        w.opt(&format!("{name}.bias")).cloned()
    };
    let p = matrix(w, &format!("{name}.weight"), b, dtype)?;
    let dims = p.dims()?;
    if dims != shape {
        return Err(Error::Weight {
            name: format!("{name}.weight"),
            why: format!("shape {dims:?}, expected {shape:?}"),
        });
    }
    Ok(p)
}

/// A norm's weight: required (of `dim` values) when `wanted`, absent otherwise.
fn norm(w: &Weights, name: &str, wanted: bool, dim: usize) -> Result<Option<Tensor>> {
    if !wanted {
        return Ok(None);
    }
    let t = w.get(name)?.clone();
    if t.dims() != [dim] {
        return Err(Error::Weight {
            name: name.into(),
            why: format!("shape {:?}, expected [{dim}]", t.dims()),
        });
    }
    Ok(Some(t))
}
