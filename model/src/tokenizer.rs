//! Tokenizers: from `tokenizer.json`, or built from GGUF metadata (vocabulary, merges,
//! pre-tokenizer kind, special tokens), plus incremental detokenization for streaming.
//!
//! Text from outside is always plain text: [`Tokenizer::encode`] never turns a special
//! token's spelling (`<|im_start|>`) into its control id. Only a chat template's own markup
//! does, through [`Tokenizer::encode_pieces`]. A prompt tokenized in pieces gets the same ids
//! as the whole string tokenized with special tokens recognized, as long as its text holds no
//! special-token spelling: special tokens cut the text the same way in both.

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
use crate::gguf::GgufMeta;
use crate::template::Piece;

mod spm;

/// GPT-2's pre-tokenizer pattern.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2's pattern (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pattern (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mixed into [`Tokenizer::hash`]: how outside text is tokenized (special tokens as plain
/// text since this version), which changes chunk tokens and so the KV namespace.
const ENCODING: &[u8] = b"ragkv encoding 2: outside text never spells special tokens";

/// A tokenizer with the special tokens generation needs.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    /// Encodes special-token spellings as plain text (outside text); markup's special tokens
    /// are found by [`Tokenizer::encode_pieces`] itself. One copy: a 262k-token vocabulary
    /// (Gemma) takes tens of MB.
    inner: tokenizers::Tokenizer,
    /// Special tokens by spelling, longest first (leftmost-longest matching in markup).
    specials: Vec<(String, u32)>,
    /// Prepended to prompts when the model expects it.
    pub bos: Option<u32>,
    /// Generation stops at any of these.
    pub eos: Vec<u32>,
    /// Whether prompts start with `bos`.
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
    fn new(mut inner: tokenizers::Tokenizer, hash: blake3::Hasher) -> Tokenizer {
        let mut hash = hash;
        hash.update(ENCODING);
        inner.set_encode_special_tokens(true);
        let mut specials: Vec<(String, u32)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| (t.content, id))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Tokenizer {
            inner,
            specials,
            bos: None,
            eos: Vec::new(),
            add_bos: false,
            chat_template: None,
            hash: hash.finalize().to_hex().to_string(),
        }
    }

    /// Encodes text from outside (a document, a question, a message): special-token
    /// spellings in it stay plain text and never become control tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tk_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes trusted markup (a chat template's rendering): special-token spellings become
    /// control tokens.
    pub fn encode_markup(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_pieces(&[Piece::Markup(text.into())])
    }

    /// Encodes a prompt made of template markup and outside text: only special-token
    /// spellings inside [`Piece::Markup`] become control tokens. Text between control tokens
    /// is encoded as one string, across piece boundaries, so the ids equal those of the whole
    /// prompt tokenized with special tokens recognized whenever the outside text spells none.
    pub fn encode_pieces(&self, pieces: &[Piece]) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut run = String::new();
        let flush = |run: &mut String, ids: &mut Vec<u32>| -> Result<()> {
            if !run.is_empty() {
                ids.extend(self.encode(run)?);
                run.clear();
            }
            Ok(())
        };
        for piece in pieces {
            match piece {
                Piece::Text(t) => run.push_str(t),
                Piece::Markup(m) => {
                    let mut rest = m.as_str();
                    while let Some((at, text, id)) = self.next_special(rest) {
                        run.push_str(&rest[..at]);
                        flush(&mut run, &mut ids)?;
                        ids.push(id);
                        rest = &rest[at + text.len()..];
                    }
                    run.push_str(rest);
                }
            }
        }
        flush(&mut run, &mut ids)?;
        Ok(ids)
    }

    /// The leftmost special token in `s` (the longest at that place): offset, spelling, id.
    fn next_special<'s>(&'s self, s: &str) -> Option<(usize, &'s str, u32)> {
        let mut best: Option<(usize, &str, u32)> = None;
        for (text, id) in &self.specials {
            if let Some(at) = s.find(text.as_str()) {
                // Longest first: an equal offset keeps the longer one found before.
                if best.is_none_or(|(b, _, _)| at < b) {
                    best = Some((at, text, *id));
                }
            }
        }
        best
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.specials.iter().any(|(_, i)| *i == id)
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
        let mut hasher = blake3::Hasher::new();
        hasher.update(&bytes);
        let mut tok = Tokenizer::new(inner, hasher);
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
        for name in ["generation_config.json", "config.json"] {
            tok.add_stops_from_config(&dir.join(name))?;
        }
        tok.add_default_stops();
        Ok(tok)
    }

    /// `eos_token_id` (one id or a list) of an HF `config.json` / `generation_config.json`.
    fn add_stops_from_config(&mut self, path: &Path) -> Result<()> {
        if !path.exists() {
            return Ok(());
        }
        let v: serde_json::Value =
            serde_json::from_slice(&fs_err::read(path)?).map_err(|e| Error::Tokenizer {
                why: format!("{}: {e}", path.display()),
            })?;
        let ids: Vec<u32> = match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().into_iter().map(|x| x as u32).collect()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            _ => Vec::new(),
        };
        for id in ids {
            if !self.eos.contains(&id) {
                self.eos.push(id);
            }
        }
        Ok(())
    }

    /// The tokenizer of a model, without loading its weights (GGUF: metadata only).
    pub fn load(source: &crate::ModelSource) -> Result<Tokenizer> {
        match source {
            crate::ModelSource::Gguf(path) => {
                let (content, _) = crate::gguf_reader::GgufFile::open(path)?;
                Tokenizer::from_gguf(&content.metadata)
            }
            crate::ModelSource::HfDir(dir) => Tokenizer::from_hf_dir(dir),
        }
    }

    /// Builds the tokenizer a GGUF file describes. Supports byte-level BPE vocabularies
    /// (`tokenizer.ggml.model = "gpt2"`) with the GPT-2, SmolLM/StarCoder, Qwen2 and Llama 3
    /// pre-tokenizers, and SentencePiece BPE ones (`"llama"`: Gemma, Llama 2, Mistral; see
    /// [`spm`]).
    pub(crate) fn from_gguf(md: &HashMap<String, Value>) -> Result<Tokenizer> {
        let meta = GgufMeta(md);
        let model = meta.str("tokenizer.ggml.model")?;
        if model != "gpt2" && model != "llama" {
            return Err(Error::Unsupported {
                what: format!("GGUF tokenizer model {model:?} (supported: gpt2 byte-level BPE, llama SentencePiece); use an HF directory"),
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
        let mut inner = if model == "llama" {
            let scores: Vec<f32> = meta
                .array("tokenizer.ggml.scores")?
                .iter()
                .map(|v| match v {
                    Value::F32(x) => Ok(*x),
                    other => Err(Error::Tokenizer {
                        why: format!("tokenizer.ggml.scores: non-float entry {other:?}"),
                    }),
                })
                .collect::<Result<_>>()?;
            for x in &scores {
                hasher.update(&x.to_le_bytes());
            }
            // llama.cpp's default for SentencePiece vocabularies is a space prefix.
            let space_prefix = !matches!(
                meta.get("tokenizer.ggml.add_space_prefix"),
                Some(Value::Bool(false))
            );
            hasher.update(&[space_prefix as u8]);
            let unk = meta.usize("tokenizer.ggml.unknown_token_id").ok();
            spm::build(&tokens, &scores, &types, unk, space_prefix)?
        } else {
            Self::byte_level(
                &tokens,
                &strings("tokenizer.ggml.merges")?,
                &pre,
                &mut hasher,
            )?
        };
        // Control (3) and user-defined (4) tokens match as whole units before BPE.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, ty)| **ty == 3 || **ty == 4)
            .map(|(t, ty)| AddedToken::from(t.clone(), *ty == 3))
            .collect();
        inner.add_special_tokens(specials).map_err(tk_err)?;

        let id = |k: &str| meta.usize(k).ok().map(|x| x as u32);
        let mut tok = Tokenizer::new(inner, hasher);
        tok.bos = id("tokenizer.ggml.bos_token_id");
        tok.eos = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        if let Some(eot) = id("tokenizer.ggml.eot_token_id") {
            if !tok.eos.contains(&eot) {
                tok.eos.push(eot);
            }
        }
        tok.add_bos = matches!(
            meta.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        tok.chat_template = meta.str("tokenizer.chat_template").ok().map(String::from);
        // Gemma 3 files converted without a template get the family's own (llama.cpp picks
        // its built-in Gemma template by architecture the same way).
        if tok.chat_template.is_none() && meta.str("general.architecture").ok() == Some("gemma3") {
            tok.chat_template = Some(crate::template::GEMMA3_TEMPLATE.to_string());
        }
        tok.add_default_stops();
        Ok(tok)
    }

    /// A byte-level BPE (GPT-2's scheme) with the pre-tokenizer GGUF names `pre`; the merges
    /// go into `hasher`.
    fn byte_level(
        tokens: &[String],
        merges: &[String],
        pre: &str,
        hasher: &mut blake3::Hasher,
    ) -> Result<tokenizers::Tokenizer> {
        for m in merges {
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
        let pre_tok: PreTokenizerWrapper = match pre {
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
        Ok(inner)
    }

    /// Chat models end turns with these even when the metadata names another EOS; and the
    /// chat template's own end of turn (the first special token after an assistant's answer).
    fn add_default_stops(&mut self) {
        let name = |id: Option<u32>| id.and_then(|i| self.id_to_token(i)).unwrap_or_default();
        let (bos, eos) = (name(self.bos), name(self.eos.first().copied()));
        if let Some(end) = crate::template::turn_end(self.chat_template.as_deref(), &bos, &eos) {
            if let Some((at, _, id)) = self.next_special(&end) {
                if end[..at].trim().is_empty() && !self.eos.contains(&id) {
                    self.eos.push(id);
                }
            }
        }
        for t in [
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "</s>",
            "<end_of_turn>",
        ] {
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
    /// An empty stream.
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
