//! Neighbour materialization (`ingest.context = "neighbours:N"`, [`crate::Context`]): a chunk
//! prefilled after the `N` chunks of the corpus most similar to it, only its own rows stored.
//!
//! The neighbours are the vector index's nearest points to the chunk's embedding, the chunk
//! itself (and any chunk with the same tokens) left out, in order of decreasing similarity;
//! they are placed farthest first, so the nearest one sits right before the chunk. The chunk's
//! rows are cut out of the joint prefill and their keys rotated back by the context's length:
//! stored KV always sits at positions `0..n`, whatever it attended to, so every assembly
//! strategy reads it unchanged.
//!
//! Which neighbours a chunk's KV attended to is recorded beside it in the store
//! ([`kvstore::Store::put_note`], written before the KV, so stored KV always has its note),
//! version 1:
//!
//! | bytes       | field                                            |
//! |-------------|--------------------------------------------------|
//! | 0           | version, `1`                                     |
//! | 1           | neighbours `m` (fewer than `N` when the index had fewer) |
//! | 2..2+16·m   | each neighbour's token digest (`schema::TokenDigest`), farthest first |
//!
//! A chunk whose note is missing, names fewer than `N` neighbours or a neighbour no longer
//! indexed (deleted, or its document changed) is stale for `ragkv rematerialize`
//! ([`crate::Reason::Neighbours`]).

use std::collections::HashSet;

use retrieval::SearchFilter;
use schema::TokenDigest;

use crate::corpus::Corpus;
use crate::error::{Error, Result};

/// Version of the neighbour note (table above).
const NOTE_VERSION: u8 = 1;

/// A chunk's KV computed under the corpus's `ingest.context`.
#[derive(Debug, Clone)]
pub struct ChunkKv {
    /// The chunk's own rows in the stored layout, at positions `0..n`.
    pub bytes: Vec<u8>,
    /// The note to record with it (`None` under `context = "none"`).
    pub note: Option<Vec<u8>>,
    /// Tokens prefilled before the chunk's own as its context (not stored).
    pub context_tokens: usize,
}

/// Encodes the note naming `neighbours` (table above).
pub fn encode_note(neighbours: &[TokenDigest]) -> Vec<u8> {
    let mut v = vec![NOTE_VERSION, neighbours.len() as u8];
    for d in neighbours {
        v.extend_from_slice(&d.0);
    }
    v
}

/// Decodes a note written by [`encode_note`].
pub fn decode_note(note: &[u8]) -> Result<Vec<TokenDigest>> {
    let bad = |why: String| Error::Invalid {
        what: "neighbour note",
        why,
    };
    match note {
        [NOTE_VERSION, m, rest @ ..] if rest.len() == usize::from(*m) * 16 => Ok(rest
            .chunks_exact(16)
            .map(|c| TokenDigest(c.try_into().expect("16 bytes")))
            .collect()),
        [NOTE_VERSION, m, rest @ ..] => Err(bad(format!("{m} neighbours in {} bytes", rest.len()))),
        _ => Err(bad(format!("unknown version or {} bytes", note.len()))),
    }
}

impl Corpus {
    /// The tokens of the chunks `tokens` (embedded as `vector`) is prefilled after, farthest
    /// first: its `ingest.context` nearest neighbours in the vector index, itself and
    /// duplicates of any left out (none under `context = "none"`; fewer when the index holds
    /// fewer other chunks).
    pub fn neighbours(&self, tokens: &[u32], vector: &[f32]) -> Result<Vec<Vec<u32>>> {
        let n = self.config.context.neighbours();
        if n == 0 {
            return Ok(Vec::new());
        }
        // A few more than asked for: the chunk itself and identical chunks come back too.
        let hits = self.index.search(vector, n + 4, &SearchFilter::default())?;
        let mut seen: HashSet<TokenDigest> = HashSet::from([TokenDigest::of(tokens)]);
        let mut out = Vec::with_capacity(n);
        for h in hits {
            let t = self.chunk_tokens(&h.payload.text)?;
            if !t.is_empty() && seen.insert(TokenDigest::of(&t)) {
                out.push(t);
                if out.len() == n {
                    break;
                }
            }
        }
        out.reverse();
        Ok(out)
    }

    /// KV of `tokens` prefilled after `context` (concatenated, from position 0): only the
    /// rows of `tokens`, keys rotated back to positions `0..n`, in the stored layout. With no
    /// context, [`Corpus::prefill_bytes`].
    pub fn prefill_after(&self, context: &[Vec<u32>], tokens: &[u32]) -> Result<Vec<u8>> {
        if context.is_empty() {
            return self.prefill_bytes(tokens);
        }
        let mut all: Vec<u32> = context.concat();
        let offset = all.len();
        all.extend_from_slice(tokens);
        let decoder = self.model.decoder();
        let (kv, _) = decoder.prefill(&all, 0)?;
        let own = kv.narrow(offset, tokens.len())?;
        let own = decoder.reposition(&own, -(offset as i64))?;
        Ok(own.to_bytes(self.kv_dtype)?)
    }

    /// The KV of chunk `tokens` (embedded as `vector`) as this corpus stores it: alone, or
    /// after its neighbours with the note naming them.
    pub fn chunk_kv(&self, tokens: &[u32], vector: &[f32]) -> Result<ChunkKv> {
        if self.config.context.neighbours() == 0 {
            return Ok(ChunkKv {
                bytes: self.prefill_bytes(tokens)?,
                note: None,
                context_tokens: 0,
            });
        }
        let context = self.neighbours(tokens, vector)?;
        let digests: Vec<TokenDigest> = context.iter().map(|t| TokenDigest::of(t)).collect();
        Ok(ChunkKv {
            bytes: self.prefill_after(&context, tokens)?,
            note: Some(encode_note(&digests)),
            context_tokens: context.iter().map(Vec::len).sum(),
        })
    }

    /// [`Corpus::chunk_kv`] of a chunk's text (embedded here).
    pub fn chunk_kv_of_text(&self, tokens: &[u32], text: &str) -> Result<ChunkKv> {
        let vector = if self.config.context.neighbours() == 0 {
            Vec::new()
        } else {
            self.embedder.embed_one(text)?
        };
        self.chunk_kv(tokens, &vector)
    }

    /// Records `kv`'s note (if any) with `tokens`; call before storing its bytes.
    pub fn put_note(&self, tokens: &[u32], kv: &ChunkKv) -> Result<()> {
        if let Some(note) = &kv.note {
            self.store.put_note(self.ns, tokens, note)?;
        }
        Ok(())
    }

    /// Whether the stored chunk `tokens` must be prefilled again because of its context:
    /// under `neighbours:N`, its note is missing or unreadable, names fewer than `N`
    /// neighbours while the index holds more chunks, or names one not in `live` (the token
    /// digests of every indexed chunk). Always `false` under `context = "none"`.
    pub fn context_changed(&self, tokens: &[u32], live: &HashSet<TokenDigest>) -> Result<bool> {
        if self.config.context.neighbours() == 0 {
            return Ok(false);
        }
        let note = self.store.note(self.ns, tokens)?;
        Ok(!self.note_current(note.as_deref(), tokens, live))
    }

    /// Whether `note` (of chunk `tokens`) names `N` neighbours (or every other chunk of
    /// `live`, if fewer) that are all in `live`.
    pub(crate) fn note_current(
        &self,
        note: Option<&[u8]>,
        tokens: &[u32],
        live: &HashSet<TokenDigest>,
    ) -> bool {
        let Some(Ok(named)) = note.map(decode_note) else {
            return false;
        };
        let n = self.config.context.neighbours();
        let others = live.len() - usize::from(live.contains(&TokenDigest::of(tokens)));
        named.len() >= n.min(others) && named.iter().all(|d| live.contains(d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_round_trips_and_rejects_bad_bytes() {
        let ds = [TokenDigest::of(&[1, 2]), TokenDigest::of(&[3])];
        let note = encode_note(&ds);
        assert_eq!(note.len(), 2 + 32);
        assert_eq!(decode_note(&note).unwrap(), ds);
        assert_eq!(decode_note(&encode_note(&[])).unwrap(), []);
        assert!(decode_note(&note[..note.len() - 1]).is_err());
        assert!(decode_note(&[2, 0]).is_err());
        assert!(decode_note(&[]).is_err());
    }
}
