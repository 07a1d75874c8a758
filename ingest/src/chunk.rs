//! Token-aware chunking.
//!
//! A document is cut into pieces at paragraph breaks, then sentence ends, then spaces (a piece
//! longer than a chunk is cut at spaces, and as a last resort at token boundaries). Pieces are
//! packed greedily into chunks of at most `chunk_tokens` model tokens; with `overlap_tokens`,
//! each chunk starts with the trailing pieces of the previous one that fit in the overlap.
//! Every chunk is a contiguous slice of the document, its token count is measured on the final
//! text (never a sum of piece counts), and concatenating the chunks without their overlaps
//! reproduces the document exactly.

use serde::{Deserialize, Serialize};

/// Something that turns text into model tokens.
pub trait Tokenize {
    /// The text's tokens (no special tokens added).
    fn tokenize(&self, text: &str) -> Vec<u32>;
}

impl Tokenize for model::Tokenizer {
    fn tokenize(&self, text: &str) -> Vec<u32> {
        // Encoding plain text cannot fail with our tokenizers; an error would mean a broken
        // vocabulary, which loading already rejects.
        self.encode(text).unwrap_or_default()
    }
}

/// Chunker settings. They are part of the KV namespace fingerprint ([`ChunkerConfig::id`]):
/// changing them changes every chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChunkerConfig {
    /// Largest chunk, in model tokens.
    pub chunk_tokens: usize,
    /// Tokens of the previous chunk repeated at the start of the next (whole pieces only).
    pub overlap_tokens: usize,
}

impl Default for ChunkerConfig {
    fn default() -> Self {
        ChunkerConfig {
            chunk_tokens: 512,
            overlap_tokens: 0,
        }
    }
}

impl ChunkerConfig {
    /// Checks ranges; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(16..=32_768).contains(&self.chunk_tokens) {
            return Err(format!(
                "chunk_tokens: {} is outside 16..=32768",
                self.chunk_tokens
            ));
        }
        if self.overlap_tokens * 2 > self.chunk_tokens {
            return Err(format!(
                "overlap_tokens: {} is more than half of chunk_tokens ({})",
                self.overlap_tokens, self.chunk_tokens
            ));
        }
        Ok(())
    }

    /// Identifies the chunking for the namespace fingerprint.
    pub fn id(&self) -> String {
        format!(
            "para-sentence-v1:{}:{}",
            self.chunk_tokens, self.overlap_tokens
        )
    }
}

/// One chunk of a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Position in the document, from 0.
    pub ordinal: u32,
    /// Byte range of the chunk in the document.
    pub start: usize,
    /// End of that range (exclusive).
    pub end: usize,
    /// Where the new (non-overlapping) text of this chunk starts.
    pub fresh_start: usize,
    /// The chunk's text.
    pub text: String,
    /// The chunk's model tokens (what gets prefilled).
    pub tokens: Vec<u32>,
}

/// Cuts `text` into chunks (see the module documentation). Empty or whitespace-only text has
/// no chunks.
pub fn chunk_text(text: &str, tok: &dyn Tokenize, config: &ChunkerConfig) -> Vec<Chunk> {
    let max = config.chunk_tokens;
    let mut pieces: Vec<(usize, usize, usize)> = Vec::new(); // (start, end, tokens)
    for (s, e) in split(text, 0, text.len(), Level::Paragraph) {
        push_piece(text, s, e, tok, max, Level::Paragraph, &mut pieces);
    }
    let mut chunks: Vec<Chunk> = Vec::new();
    let mut i = 0;
    // First piece of the previous chunk's fresh text: overlap never reaches further back.
    let mut prev_fresh = 0;
    while i < pieces.len() {
        // Overlap: whole pieces before `i` whose tokens fit in `overlap_tokens`.
        let mut first = i;
        if !chunks.is_empty() && config.overlap_tokens > 0 {
            let mut budget = config.overlap_tokens;
            while first > prev_fresh && pieces[first - 1].2 <= budget {
                budget -= pieces[first - 1].2;
                first -= 1;
            }
        }
        // Greedy: take pieces while the estimate fits, then confirm on the real text.
        let mut last = i;
        let mut est = pieces[first..=i].iter().map(|p| p.2).sum::<usize>();
        while last + 1 < pieces.len() && est + pieces[last + 1].2 <= max {
            last += 1;
            est += pieces[last].2;
        }
        loop {
            let (start, end) = (pieces[first].0, pieces[last].1);
            let tokens = tok.tokenize(&text[start..end]);
            if tokens.len() <= max || last == i {
                if tokens.len() > max && first < i {
                    // The overlap pushed a lone piece over the limit: drop the overlap.
                    first = i;
                    continue;
                }
                let fresh_start = pieces[i].0;
                chunks.push(Chunk {
                    ordinal: chunks.len() as u32,
                    start,
                    end,
                    fresh_start,
                    text: text[start..end].to_string(),
                    tokens,
                });
                break;
            }
            last -= 1;
        }
        prev_fresh = i;
        i = last + 1;
    }
    // Whitespace-only documents and chunks carry nothing to retrieve.
    chunks.retain(|c| !c.text.trim().is_empty());
    for (n, c) in chunks.iter_mut().enumerate() {
        c.ordinal = n as u32;
    }
    chunks
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Paragraph,
    Sentence,
    Word,
}

/// Splits `text[start..end]` into consecutive ranges at `level` boundaries. The separator
/// stays with the preceding range, so ranges tile the input exactly.
fn split(text: &str, start: usize, end: usize, level: Level) -> Vec<(usize, usize)> {
    let s = &text[start..end];
    let mut out = Vec::new();
    let mut cur = 0;
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let cut = match level {
            Level::Paragraph => {
                if bytes[i] == b'\n' && bytes.get(i + 1) == Some(&b'\n') {
                    let mut j = i;
                    while j < bytes.len() && (bytes[j] == b'\n' || bytes[j] == b'\r') {
                        j += 1;
                    }
                    Some(j)
                } else {
                    None
                }
            }
            Level::Sentence => {
                let end_mark = matches!(bytes[i], b'.' | b'!' | b'?' | b'\n');
                if end_mark && bytes.get(i + 1).is_none_or(|b| b.is_ascii_whitespace()) {
                    let mut j = i + 1;
                    while j < bytes.len() && bytes[j].is_ascii_whitespace() && bytes[j] != b'\n' {
                        j += 1;
                    }
                    Some(j)
                } else {
                    None
                }
            }
            Level::Word => (bytes[i] == b' ' && i > 0).then_some(i),
        };
        match cut {
            Some(j) if j > cur && j < bytes.len() => {
                out.push((start + cur, start + j));
                cur = j;
                i = j.max(i + 1);
            }
            _ => i += 1,
        }
    }
    if cur < bytes.len() {
        out.push((start + cur, end));
    }
    out
}

/// Adds `text[s..e]` as one piece if it fits in a chunk, else splits it at the next level.
fn push_piece(
    text: &str,
    s: usize,
    e: usize,
    tok: &dyn Tokenize,
    max: usize,
    level: Level,
    out: &mut Vec<(usize, usize, usize)>,
) {
    let n = tok.tokenize(&text[s..e]).len();
    if n <= max {
        out.push((s, e, n));
        return;
    }
    let next = match level {
        Level::Paragraph => Some(Level::Sentence),
        Level::Sentence => Some(Level::Word),
        Level::Word => None,
    };
    let parts = next.map(|l| split(text, s, e, l)).unwrap_or_default();
    if parts.len() > 1 {
        for (a, b) in parts {
            push_piece(text, a, b, tok, max, next.unwrap_or(Level::Word), out);
        }
        return;
    }
    // One unbreakable run longer than a chunk: cut at character boundaries by halving.
    let mut mid = s + (e - s) / 2;
    while !text.is_char_boundary(mid) {
        mid += 1;
    }
    if mid <= s || mid >= e {
        out.push((s, e, n)); // a single character over the limit: nothing more to do
        return;
    }
    push_piece(text, s, mid, tok, max, Level::Word, out);
    push_piece(text, mid, e, tok, max, Level::Word, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One token per whitespace-separated word, plus one per punctuation mark.
    struct Words;
    impl Tokenize for Words {
        fn tokenize(&self, text: &str) -> Vec<u32> {
            let words = text.split_whitespace().count();
            let punct = text.chars().filter(|c| c.is_ascii_punctuation()).count();
            vec![0; words + punct]
        }
    }

    fn cfg(chunk_tokens: usize, overlap_tokens: usize) -> ChunkerConfig {
        ChunkerConfig {
            chunk_tokens,
            overlap_tokens,
        }
    }

    fn reassemble(text: &str, chunks: &[Chunk]) -> String {
        chunks.iter().map(|c| &text[c.fresh_start..c.end]).collect()
    }

    #[test]
    fn prefers_paragraph_then_sentence_boundaries() {
        let text = "One two three. Four five six.\n\nSeven eight nine. Ten eleven twelve.";
        let chunks = chunk_text(text, &Words, &cfg(16, 0));
        assert_eq!(chunks.len(), 1);
        let chunks = chunk_text(text, &Words, &cfg(9, 0));
        assert_eq!(
            chunks.iter().map(|c| c.text.as_str()).collect::<Vec<_>>(),
            vec![
                "One two three. Four five six.\n\n",
                "Seven eight nine. Ten eleven twelve."
            ]
        );
        let chunks = chunk_text(text, &Words, &cfg(5, 0));
        assert_eq!(chunks[0].text, "One two three. ");
        assert_eq!(chunks[1].text, "Four five six.\n\n");
        assert_eq!(reassemble(text, &chunks), text);
    }

    #[test]
    fn long_sentences_are_cut_at_spaces() {
        let text = "a b c d e f g h i j k l m n o p q r s t";
        let chunks = chunk_text(text, &Words, &cfg(16, 0));
        assert_eq!(chunks.len(), 2);
        assert!(chunks.iter().all(|c| c.tokens.len() <= 16));
        assert_eq!(reassemble(text, &chunks), text);
    }

    #[test]
    fn overlap_repeats_trailing_sentences() {
        let text = "A b c. D e f. G h i. J k l. M n o. P q r.";
        let chunks = chunk_text(text, &Words, &cfg(16, 4));
        assert!(chunks.len() >= 2);
        assert!(chunks[1].start < chunks[0].end, "no overlap");
        assert!(chunks[1]
            .text
            .starts_with(&text[chunks[1].start..chunks[0].end]));
        assert_eq!(reassemble(text, &chunks), text);
    }

    #[test]
    fn empty_and_blank_documents_have_no_chunks() {
        assert!(chunk_text("", &Words, &cfg(16, 0)).is_empty());
        assert!(chunk_text(" \n\n \n", &Words, &cfg(16, 0)).is_empty());
    }

    #[test]
    fn config_is_validated_and_identified() {
        assert!(ChunkerConfig::default().validate().is_ok());
        assert!(cfg(8, 0).validate().unwrap_err().contains("chunk_tokens"));
        assert!(cfg(64, 40)
            .validate()
            .unwrap_err()
            .contains("overlap_tokens"));
        assert_ne!(cfg(64, 0).id(), cfg(64, 8).id());
    }

    proptest! {
        #[test]
        fn chunks_tile_the_document_and_respect_the_limit(
            words in proptest::collection::vec("[a-z]{1,8}[.!?]?( |\n|\n\n)", 0..200),
            max in 16usize..64,
            overlap in 0usize..8,
        ) {
            let text: String = words.concat();
            let chunks = chunk_text(&text, &Words, &cfg(max, overlap));
            for c in &chunks {
                prop_assert!(c.tokens.len() <= max, "{} > {max}", c.tokens.len());
                prop_assert_eq!(&c.text, &text[c.start..c.end]);
                prop_assert!(c.start <= c.fresh_start && c.fresh_start < c.end);
            }
            for w in chunks.windows(2) {
                prop_assert_eq!(w[0].end, w[1].fresh_start);
            }
            if !text.trim().is_empty() {
                // Whitespace-only chunks are dropped, so compare non-blank content.
                let rebuilt = reassemble(&text, &chunks);
                prop_assert_eq!(rebuilt.split_whitespace().collect::<Vec<_>>(),
                                text.split_whitespace().collect::<Vec<_>>());
            }
        }
    }
}
