//! Sampling and the generation loop.

use candle_core::{Tensor, D};
use rand::{Rng, SeedableRng};

use crate::decoder::{Decoder, Logits};
use crate::error::{Ctx, Error, Result};
use crate::kv::KvCache;
use crate::tokenizer::{TokenStream, Tokenizer};

/// Generation options. `temperature == 0` is greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1.0: all).
    pub top_p: f64,
    pub seed: u64,
    /// Extra stop tokens besides the tokenizer's end-of-turn tokens.
    pub stop_tokens: Vec<u32>,
    /// Stop once the generated text contains any of these (the stop string is cut off).
    pub stop_strings: Vec<String>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop_tokens: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

impl GenerateParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Input { why });
        if self.max_tokens == 0 {
            return bad("max_tokens must be ≥ 1".into());
        }
        if !(0.0..=5.0).contains(&self.temperature) {
            return bad(format!("temperature {} outside 0..=5", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} outside (0, 1]", self.top_p));
        }
        Ok(())
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-turn token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The callback asked to stop (e.g. the client went away).
    Cancelled,
}

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
}

/// Picks the next token from `logits` (vocab,).
#[derive(Debug)]
pub struct Sampler {
    params: GenerateParams,
    rng: rand::rngs::StdRng,
}

impl Sampler {
    pub fn new(params: GenerateParams) -> Sampler {
        Sampler {
            rng: rand::rngs::StdRng::seed_from_u64(params.seed),
            params,
        }
    }

    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        if self.params.temperature <= 0.0 {
            return logits
                .argmax(D::Minus1)
                .and_then(|t| t.to_scalar::<u32>())
                .ctx("argmax");
        }
        let mut l: Vec<f32> = logits.to_vec1().ctx("logits")?;
        let t = self.params.temperature as f32;
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for x in l.iter_mut() {
            *x = ((*x - max) / t).exp();
        }
        let mut idx: Vec<usize> = (0..l.len()).collect();
        idx.sort_unstable_by(|a, b| l[*b].total_cmp(&l[*a]));
        if self.params.top_k > 0 {
            idx.truncate(self.params.top_k);
        }
        let total: f32 = idx.iter().map(|i| l[*i]).sum();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = 0;
            for i in &idx {
                acc += l[*i] / total;
                keep += 1;
                if acc >= self.params.top_p as f32 {
                    break;
                }
            }
            idx.truncate(keep.max(1));
        }
        let total: f32 = idx.iter().map(|i| l[*i]).sum();
        let mut r = self.rng.gen::<f32>() * total;
        for i in &idx {
            r -= l[*i];
            if r <= 0.0 {
                return Ok(*i as u32);
            }
        }
        Ok(*idx.last().expect("non-empty") as u32)
    }
}

/// Generates after `prompt`, which is appended to `cache` first (it may be empty if the cache
/// already ends with the prompt's last token and `first_logits` is given). `on_text` receives
/// each new piece of text; returning `false` cancels.
pub fn generate(
    model: &Decoder,
    tokenizer: &Tokenizer,
    cache: &mut KvCache,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation> {
    params.validate()?;
    if prompt.is_empty() {
        return Err(Error::Input {
            why: "empty prompt".into(),
        });
    }
    let mut logits = model.forward(cache, prompt, Logits::Last)?;
    let mut sampler = Sampler::new(params.clone());
    let mut stream = TokenStream::new(tokenizer);
    let mut out = Generation {
        tokens: Vec::new(),
        text: String::new(),
        finish: FinishReason::Length,
    };
    for step in 0..params.max_tokens {
        let next = sampler.sample(&logits)?;
        if tokenizer.eos.contains(&next) || params.stop_tokens.contains(&next) {
            out.finish = FinishReason::Stop;
            break;
        }
        out.tokens.push(next);
        if let Some(piece) = stream.push(next)? {
            out.text.push_str(&piece);
            if let Some(cut) = params
                .stop_strings
                .iter()
                .filter_map(|s| out.text.find(s.as_str()))
                .min()
            {
                let keep = out.text.len() - piece.len();
                if cut > keep && !on_text(&out.text[keep..cut]) {
                    out.finish = FinishReason::Cancelled;
                }
                out.text.truncate(cut);
                if out.finish != FinishReason::Cancelled {
                    out.finish = FinishReason::Stop;
                }
                break;
            }
            if !on_text(&piece) {
                out.finish = FinishReason::Cancelled;
                break;
            }
        }
        if step + 1 == params.max_tokens {
            break;
        }
        logits = model.forward(cache, &[next], Logits::Last)?;
    }
    if out.finish == FinishReason::Length {
        if let Some(rest) = stream.finish()? {
            out.text.push_str(&rest);
            on_text(&rest);
        }
    }
    Ok(out)
}
