//! Tokenizers: from `tokenizer.json`, or built from GGUF metadata (vocabulary, merges,
//! pre-tokenizer kind, special tokens), plus incremental detokenization for streaming.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};
use crate::weights::GgufMeta;

/// GPT-2's pre-tokenizer pattern.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2's pattern (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pattern (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the special tokens generation needs.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Prepended to prompts when the model expects it.
    pub bos: Option<u32>,
    /// Generation stops at any of these.
    pub eos: Vec<u32>,
    pub add_bos: bool,
    /// Jinja chat template, if the model ships one.
    pub chat_template: Option<String>,
    /// blake3 of the tokenizer definition, for the KV namespace.
    pub hash: String,
}

fn tk_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer { why: e.to_string() }
}

impl Tokenizer {
    /// Encodes `text`; special-token markup in the text (`<|im_start|>`) is recognized.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tk_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids, keeping special tokens out of the text.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tk_err)
    }

    /// The text of one token id as the vocabulary spells it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The underlying `tokenizers` tokenizer (e.g. to save it as `tokenizer.json`).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Loads `tokenizer.json` (and `tokenizer_config.json` beside it, for the chat template
    /// and special tokens) from an HF directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let bytes = fs_err::read(&path)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error::Tokenizer {
            why: format!("{}: {e}", path.display()),
        })?;
        let mut tok = Tokenizer {
            inner,
            bos: None,
            eos: Vec::new(),
            add_bos: false,
            chat_template: None,
            hash: blake3::hash(&bytes).to_hex().to_string(),
        };
        let cfg_path = dir.join("tokenizer_config.json");
        if cfg_path.exists() {
            let cfg: serde_json::Value = serde_json::from_slice(&fs_err::read(&cfg_path)?)
                .map_err(|e| Error::Tokenizer {
                    why: format!("{}: {e}", cfg_path.display()),
                })?;
            let token = |k: &str| match cfg.get(k) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Object(o)) => {
                    o.get("content").and_then(|c| c.as_str()).map(String::from)
                }
                _ => None,
            };
            tok.bos = token("bos_token").and_then(|t| tok.inner.token_to_id(&t));
            tok.eos = token("eos_token")
                .and_then(|t| tok.inner.token_to_id(&t))
                .into_iter()
                .collect();
            tok.add_bos = cfg
                .get("add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
            tok.chat_template = cfg
                .get("chat_template")
                .and_then(|v| v.as_str())
                .map(String::from);
        }
        tok.add_default_stops();
        Ok(tok)
    }

    /// The tokenizer of a model, without loading its weights (GGUF: metadata only).
    pub fn load(source: &crate::ModelSource) -> Result<Tokenizer> {
        match source {
            crate::ModelSource::Gguf(path) => {
                let mut file = fs_err::File::open(path)?;
                let content =
                    candle_core::quantized::gguf_file::Content::read(&mut file).map_err(|e| {
                        Error::Config {
                            why: format!("{} is not a readable GGUF file: {e}", path.display()),
                        }
                    })?;
                Tokenizer::from_gguf(&content.metadata)
            }
            crate::ModelSource::HfDir(dir) => Tokenizer::from_hf_dir(dir),
        }
    }

    /// Builds the tokenizer a GGUF file describes. Supports byte-level BPE vocabularies
    /// (`tokenizer.ggml.model = "gpt2"`) with the GPT-2, SmolLM/StarCoder, Qwen2 and Llama 3
    /// pre-tokenizers.
    pub(crate) fn from_gguf(md: &HashMap<String, Value>) -> Result<Tokenizer> {
        let meta = GgufMeta(md);
        let model = meta.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::Unsupported {
                what: format!("GGUF tokenizer model {model:?} (supported: gpt2 byte-level BPE); use an HF directory"),
            });
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            meta.array(key)?
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(Error::Tokenizer {
                        why: format!("{key}: non-string entry {other:?}"),
                    }),
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i64> = match meta.array("tokenizer.ggml.token_type") {
            Ok(a) => a
                .iter()
                .map(|v| match v {
                    Value::I32(x) => *x as i64,
                    Value::U32(x) => *x as i64,
                    _ => 1,
                })
                .collect(),
            Err(_) => vec![1; tokens.len()],
        };
        let pre = meta
            .str("tokenizer.ggml.pre")
            .unwrap_or("default")
            .to_string();

        let mut hasher = blake3::Hasher::new();
        hasher.update(model.as_bytes());
        hasher.update(pre.as_bytes());
        for (t, ty) in tokens.iter().zip(&types) {
            hasher.update(t.as_bytes());
            hasher.update(&[0, *ty as u8]);
        }
        for m in &merges {
            hasher.update(m.as_bytes());
            hasher.update(&[0]);
        }

        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Tokenizer {
                        why: format!("bad merge {m:?}"),
                    })
            })
            .collect::<Result<_>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tk_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
            Ok(Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tk_err)?
            .into())
        };
        let byte_level = |use_regex: bool| -> PreTokenizerWrapper {
            ByteLevel::new(false, true, use_regex).into()
        };
        let pre_tok: PreTokenizerWrapper = match pre.as_str() {
            "default" | "gpt2" | "gpt-2" => byte_level(true),
            "smollm" | "starcoder" | "refact" | "codeshell" => {
                Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into()
            }
            "qwen2" => Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]).into(),
            "llama3" | "llama-bpe" | "smaug-bpe" => {
                Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]).into()
            }
            other => {
                return Err(Error::Unsupported {
                    what: format!("GGUF pre-tokenizer {other:?}"),
                })
            }
        };
        let _ = GPT2_PATTERN; // documented for reference; ByteLevel(use_regex) applies it
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        // Control (3) and user-defined (4) tokens match as whole units before BPE.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, ty)| **ty == 3 || **ty == 4)
            .map(|(t, ty)| AddedToken::from(t.clone(), *ty == 3))
            .collect();
        inner.add_special_tokens(specials).map_err(tk_err)?;

        let id = |k: &str| meta.usize(k).ok().map(|x| x as u32);
        let add_bos = matches!(
            meta.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        let mut tok = Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
            add_bos,
            chat_template: meta.str("tokenizer.chat_template").ok().map(String::from),
            hash: hasher.finalize().to_hex().to_string(),
        };
        tok.add_default_stops();
        Ok(tok)
    }

    /// Chat models end turns with these even when the metadata names another EOS.
    fn add_default_stops(&mut self) {
        for t in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"] {
            if let Some(id) = self.inner.token_to_id(t) {
                if !self.eos.contains(&id) {
                    self.eos.push(id);
                }
            }
        }
    }
}

/// Incremental detokenization: text is emitted only once it is valid and stable, so
/// multi-byte characters split across tokens stream correctly.
#[derive(Debug)]
pub struct TokenStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    prev: usize,
    current: usize,
}

impl<'a> TokenStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        TokenStream {
            tokenizer,
            tokens: Vec::new(),
            prev: 0,
            current: 0,
        }
    }

    /// Adds a token; returns the new text it completes, if any.
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        let prev_text = if self.tokens.is_empty() {
            String::new()
        } else {
            self.tokenizer
                .decode(&self.tokens[self.prev..self.current])?
        };
        self.tokens.push(token);
        let text = self.tokenizer.decode(&self.tokens[self.prev..])?;
        if text.len() > prev_text.len() && !text.ends_with('\u{fffd}') {
            let new = text.get(prev_text.len()..).unwrap_or(&text).to_string();
            self.prev = self.current;
            self.current = self.tokens.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Whatever text is still pending.
    pub fn finish(&self) -> Result<Option<String>> {
        let prev_text = self
            .tokenizer
            .decode(&self.tokens[self.prev..self.current])?;
        let text = self.tokenizer.decode(&self.tokens[self.prev..])?;
        Ok((text.len() > prev_text.len())
            .then(|| text.get(prev_text.len()..).unwrap_or(&text).to_string()))
    }
}
