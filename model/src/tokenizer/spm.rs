//! SentencePiece BPE vocabularies from GGUF metadata (`tokenizer.ggml.model = "llama"`:
//! Gemma, Llama 2, Mistral), as the `tokenizers` crate's BPE with byte fallback.
//!
//! llama.cpp's SentencePiece tokenizer writes spaces as `▁`, starts from single characters
//! and repeatedly joins the adjacent pair whose concatenation is in the vocabulary with the
//! highest score; characters outside the vocabulary become byte tokens (`<0x41>`). A BPE
//! whose merges are every split `(a, b)` of a vocabulary entry into two entries, ranked by
//! the entry's score, joins the same pairs in the same order (HF's GGUF converter and its
//! `SentencePieceExtractor` build Gemma's and Llama 2's `tokenizer.json` this way). Two
//! candidate joins of equal score may be taken in another order than llama.cpp's leftmost
//! first.

use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::Sequence as NormalizerSequence;
use tokenizers::{DecoderWrapper, NormalizerWrapper};

use crate::error::{Error, Result};

/// SentencePiece's space.
const SPACE: &str = "\u{2581}";
/// llama.cpp's token type of a normal piece (the others are control, byte, unused, ...).
const NORMAL: i64 = 1;

fn tk_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer { why: e.to_string() }
}

/// Every split of a normal vocabulary entry into two entries, highest-scored entry first
/// (ties: lower id first, then shorter left part).
pub(super) fn merges(tokens: &[String], scores: &[f32], types: &[i64]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut found: Vec<(f32, usize, usize)> = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if types.get(id).copied().unwrap_or(NORMAL) != NORMAL {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            if ids.contains_key(&t[..at]) && ids.contains_key(&t[at..]) {
                found.push((scores.get(id).copied().unwrap_or(0.0), id, at));
            }
        }
    }
    found.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    found
        .into_iter()
        .map(|(_, id, at)| (tokens[id][..at].to_string(), tokens[id][at..].to_string()))
        .collect()
}

/// The tokenizer of a SentencePiece vocabulary: `tokens` with their `scores` and types;
/// `space_prefix`: a `▁` goes in front of the text (llama.cpp's `add_space_prefix`).
pub(super) fn build(
    tokens: &[String],
    scores: &[f32],
    types: &[i64],
    unk: Option<usize>,
    space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    if scores.len() != tokens.len() {
        return Err(Error::Tokenizer {
            why: format!("{} scores for {} tokens", scores.len(), tokens.len()),
        });
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges(tokens, scores, types))
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk.and_then(|i| tokens.get(i)) {
        bpe = bpe.unk_token(unk.clone());
    }
    let mut inner = tokenizers::Tokenizer::new(bpe.build().map_err(tk_err)?);
    let replace: NormalizerWrapper = Replace::new(" ", SPACE).map_err(tk_err)?.into();
    let normalizer: NormalizerWrapper = if space_prefix {
        NormalizerSequence::new(vec![Prepend::new(SPACE.into()).into(), replace]).into()
    } else {
        replace
    };
    inner.with_normalizer(Some(normalizer)).map_err(tk_err)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE, " ").map_err(tk_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small vocabulary: bytes for what is missing, pieces joined by score.
    fn vocab() -> (Vec<String>, Vec<f32>, Vec<i64>) {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into()];
        let mut types = vec![2, 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        let pieces = [
            ("h", -1.0),
            ("e", -1.0),
            ("l", -1.0),
            ("o", -1.0),
            ("▁", -1.0),
            ("w", -1.0),
            ("r", -1.0),
            ("d", -1.0),
            ("he", -2.0),
            ("ll", -3.0),
            ("hell", -4.0),
            ("hello", -5.0),
            ("▁w", -6.0),
            ("or", -7.0),
            ("▁wor", -8.0),
            ("ld", -9.0),
            ("▁world", -10.0),
        ];
        let mut scores = vec![0.0; tokens.len()];
        for (p, s) in pieces {
            tokens.push(p.into());
            types.push(NORMAL);
            scores.push(s);
        }
        (tokens, scores, types)
    }

    #[test]
    fn joins_by_score_and_falls_back_to_bytes() {
        let (tokens, scores, types) = vocab();
        let t = build(&tokens, &scores, &types, Some(0), false).unwrap();
        let ids = t.encode("hello world!", false).unwrap().get_ids().to_vec();
        let pieces: Vec<&str> = ids.iter().map(|&i| tokens[i as usize].as_str()).collect();
        assert_eq!(pieces, ["hello", "▁world", "<0x21>"]);
        assert_eq!(t.decode(&ids, false).unwrap(), "hello world!");
        // Multi-byte characters outside the vocabulary: their UTF-8 bytes, decoded back.
        let ids = t.encode("hé", false).unwrap().get_ids().to_vec();
        let pieces: Vec<&str> = ids.iter().map(|&i| tokens[i as usize].as_str()).collect();
        assert_eq!(pieces, ["h", "<0xC3>", "<0xA9>"]);
        assert_eq!(t.decode(&ids, false).unwrap(), "hé");
        // With a space prefix the first word gets its `▁`, which decoding strips.
        let t = build(&tokens, &scores, &types, Some(0), true).unwrap();
        let ids = t.encode("world", false).unwrap().get_ids().to_vec();
        assert_eq!(tokens[ids[0] as usize], "▁world");
        assert_eq!(t.decode(&ids, false).unwrap(), "world");
    }

    #[test]
    fn merges_come_from_splits_into_known_pieces_by_score() {
        let (tokens, scores, types) = vocab();
        let m = merges(&tokens, &scores, &types);
        let pos = |a: &str, b: &str| m.iter().position(|x| x.0 == a && x.1 == b);
        assert!(pos("h", "e").unwrap() < pos("l", "l").unwrap());
        assert!(pos("he", "ll").unwrap() < pos("hell", "o").unwrap());
        // "▁world" splits as "▁wor"+"ld" (both known), never as "▁wo"+"rld" (unknown).
        assert!(pos("▁wor", "ld").is_some());
        assert!(pos("▁wo", "rld").is_none());
        // Byte and control tokens are never merge results.
        assert!(m.iter().all(|(a, b)| !format!("{a}{b}").starts_with("<0x")));
    }
}
