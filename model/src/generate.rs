//! Sampling and the generation loop.

use candle_core::{Tensor, D};
use rand::{Rng, SeedableRng};

use crate::decoder::{Decoder, Logits};
use crate::error::{Ctx, Error, Result};
use crate::kv::KvCache;
use crate::tokenizer::{TokenStream, Tokenizer};

/// Row `i` of a `(rows, vocab)` logits tensor, as one sequence's `(vocab,)` logits (a batched
/// step's rows are in the order of its sequences).
pub fn logits_row(logits: &Tensor, i: usize) -> Result<Tensor> {
    logits.get(i).ctx("logits row")
}

/// Generation options. `temperature == 0` is greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// Most tokens generated.
    pub max_tokens: usize,
    /// Sampling temperature; 0: greedy.
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1.0: all).
    pub top_p: f64,
    /// Seed of the sampler's random generator.
    pub seed: u64,
    /// Extra stop tokens besides the tokenizer's end-of-turn tokens.
    pub stop_tokens: Vec<u32>,
    /// Stop once the generated text contains any of these (the stop string is cut off).
    pub stop_strings: Vec<String>,
    /// Never sample the tokenizer's end-of-turn tokens, so that generation runs to
    /// `max_tokens` (`stop_tokens` and `stop_strings` still stop): fixed-length answers for
    /// benchmarks, as llama-server's `ignore_eos` (which bans them the same way).
    pub ignore_eos: bool,
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
            ignore_eos: false,
        }
    }
}

impl GenerateParams {
    /// Refuses out-of-range options.
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
    /// The generated tokens (stop tokens excluded).
    pub tokens: Vec<u32>,
    /// Their text.
    pub text: String,
    /// Why generation ended.
    pub finish: FinishReason,
}

/// Picks the next token from `logits` (vocab,).
#[derive(Debug)]
pub struct Sampler {
    params: GenerateParams,
    rng: rand::rngs::StdRng,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: GenerateParams) -> Sampler {
        Sampler {
            rng: rand::rngs::StdRng::seed_from_u64(params.seed),
            params,
        }
    }

    /// The next token: the argmax at temperature 0, else a draw after top-k and top-p.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        if self.params.temperature <= 0.0 {
            return logits
                .argmax(D::Minus1)
                .and_then(|t| t.to_scalar::<u32>())
                .ctx("argmax");
        }
        self.sample_vec(logits.to_vec1().ctx("logits")?)
    }

    /// [`Sampler::sample`] of logits already in host memory (no device round trip).
    fn sample_vec(&mut self, mut l: Vec<f32>) -> Result<u32> {
        if l.is_empty() {
            return Err(Error::Input {
                why: "no logits to sample from".into(),
            });
        }
        if self.params.temperature <= 0.0 {
            // The first of the largest, as candle's argmax picks.
            let mut best = 0;
            for (i, x) in l.iter().enumerate() {
                if *x > l[best] {
                    best = i;
                }
            }
            return Ok(best as u32);
        }
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

/// What one sampled token gives: text to stream, and the token to feed the model next
/// (`None`: the sequence is finished; see [`Decoding::finish`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advance {
    /// Text that became final with this token.
    pub text: Option<String>,
    /// The token to feed next; `None`: finished.
    pub next: Option<u32>,
}

/// One sequence's decoding state, independent of how its logits are computed (alone with
/// [`generate`], or in a batch with [`Decoder::step`]): sampling, stop tokens, stop strings,
/// incremental detokenization, the token limit.
#[derive(Debug)]
pub struct Decoding<'a> {
    params: GenerateParams,
    sampler: Sampler,
    stream: TokenStream<'a>,
    eos: &'a [u32],
    out: Generation,
    done: bool,
}

impl<'a> Decoding<'a> {
    /// A sequence's decoding state (options validated).
    pub fn new(tokenizer: &'a Tokenizer, params: &GenerateParams) -> Result<Decoding<'a>> {
        params.validate()?;
        Ok(Decoding {
            params: params.clone(),
            sampler: Sampler::new(params.clone()),
            stream: TokenStream::new(tokenizer),
            eos: &tokenizer.eos,
            out: Generation {
                tokens: Vec::new(),
                text: String::new(),
                finish: FinishReason::Length,
            },
            done: false,
        })
    }

    /// Samples the next token from `logits` (vocab,) and says what to stream and feed next.
    pub fn advance(&mut self, logits: &Tensor) -> Result<Advance> {
        if self.done {
            return Err(Error::Input {
                why: "advance after the sequence finished".into(),
            });
        }
        let next = if self.params.ignore_eos && !self.eos.is_empty() {
            let mut l: Vec<f32> = logits.to_vec1().ctx("logits")?;
            for e in self.eos {
                if let Some(x) = l.get_mut(*e as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
            self.sampler.sample_vec(l)?
        } else {
            self.sampler.sample(logits)?
        };
        let out = &mut self.out;
        if self.eos.contains(&next) || self.params.stop_tokens.contains(&next) {
            return Ok(self.end(FinishReason::Stop, None));
        }
        out.tokens.push(next);
        let mut text = None;
        if let Some(piece) = self.stream.push(next)? {
            out.text.push_str(&piece);
            if let Some(cut) = self
                .params
                .stop_strings
                .iter()
                .filter_map(|s| out.text.find(s.as_str()))
                .min()
            {
                let keep = out.text.len() - piece.len();
                let shown = (cut > keep).then(|| out.text[keep..cut].to_string());
                out.text.truncate(cut);
                return Ok(self.end(FinishReason::Stop, shown));
            }
            text = Some(piece);
        }
        if out.tokens.len() >= self.params.max_tokens {
            if let Some(rest) = self.stream.finish()? {
                out.text.push_str(&rest);
                text = Some(text.unwrap_or_default() + &rest);
            }
            return Ok(self.end(FinishReason::Length, text));
        }
        Ok(Advance {
            text,
            next: Some(next),
        })
    }

    fn end(&mut self, finish: FinishReason, text: Option<String>) -> Advance {
        self.out.finish = finish;
        self.done = true;
        Advance { text, next: None }
    }

    /// The consumer went away: the sequence ends as cancelled.
    pub fn cancel(&mut self) {
        self.end(FinishReason::Cancelled, None);
    }

    /// Whether the sequence has finished (stop, length or cancel).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// What was generated.
    pub fn finish(self) -> Generation {
        self.out
    }
}

/// Generates after `prompt`, which is appended to `cache` first. `on_text` receives each new
/// piece of text; returning `false` cancels.
pub fn generate(
    model: &Decoder,
    tokenizer: &Tokenizer,
    cache: &mut KvCache,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation> {
    let mut decoding = Decoding::new(tokenizer, params)?;
    if prompt.is_empty() {
        return Err(Error::Input {
            why: "empty prompt".into(),
        });
    }
    let mut logits = model.forward(cache, prompt, Logits::Last)?;
    loop {
        let a = decoding.advance(&logits)?;
        if let Some(text) = &a.text {
            if !on_text(text) {
                decoding.cancel();
                break;
            }
        }
        match a.next {
            Some(next) => logits = model.forward(cache, &[next], Logits::Last)?,
            None => break,
        }
    }
    Ok(decoding.finish())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::{GenerateParams, Sampler};

    #[test]
    fn greedy_on_the_host_picks_what_the_tensor_argmax_picks() {
        let params = GenerateParams {
            temperature: 0.0,
            ..GenerateParams::default()
        };
        let mut s = Sampler::new(params);
        let l = vec![0.5f32, 3.0, -1.0, 3.0, 2.9];
        let t = Tensor::new(l.as_slice(), &Device::Cpu).unwrap();
        assert_eq!(s.sample_vec(l.clone()).unwrap(), s.sample(&t).unwrap());
        assert_eq!(s.sample_vec(l).unwrap(), 1, "the first of the largest");
        assert!(s.sample_vec(Vec::new()).is_err());
    }

    #[test]
    fn a_draw_from_one_kept_token_is_that_token() {
        let params = GenerateParams {
            temperature: 0.8,
            top_k: 1,
            ..GenerateParams::default()
        };
        let mut s = Sampler::new(params);
        for _ in 0..5 {
            assert_eq!(s.sample_vec(vec![0.1, 0.2, 7.0, 0.3]).unwrap(), 2);
        }
    }
}
