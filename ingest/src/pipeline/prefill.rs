//! The prefill stage of [`Engine::ingest`]: the KV of every chunk not stored yet, computed in
//! groups of consecutive chunks of a document, one forward pass per group
//! (`ingest.prefill_batch_tokens`; [`prefill_groups`]).

use std::ops::Range;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::{Embedded, Engine, Shared, ToWriter};
use crate::config::{Materialize, RunOptions};
use crate::corpus::kv_doc;
use crate::report::secs;

/// One chunk's KV as the writer stores it, and its copy for the first place
/// (`ingest.exact_first`).
type Computed = (Vec<u8>, Option<Vec<u8>>);

/// Most chunks in one group (stored ones included: they ride along to keep the order).
const MAX_GROUP: usize = 64;

/// Groups of consecutive chunks, in order, given each chunk's token count and whether it still
/// needs prefill: a group's chunks to prefill add up to at most `budget` tokens (a longer chunk
/// makes a group alone), at most `MAX_GROUP` chunks. Every chunk is in exactly one group.
pub fn prefill_groups(chunks: &[(usize, bool)], budget: usize) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, &(len, needs)) in chunks.iter().enumerate() {
        let over = needs && tokens > 0 && tokens + len > budget;
        if i > start && (over || i - start >= MAX_GROUP) {
            groups.push(start..i);
            (start, tokens) = (i, 0);
        }
        if needs {
            tokens += len;
        }
    }
    if start < chunks.len() {
        groups.push(start..chunks.len());
    }
    groups
}

impl Engine {
    /// Sends each document's chunks (with their KV, `None` where stored already) to the
    /// writer, then the document; returns the busy time in seconds.
    pub(super) fn prefill_stage<'a>(
        &'a self,
        opts: &RunOptions,
        rx: Receiver<Embedded<'a>>,
        tx: Sender<ToWriter<'a>>,
        shared: &Shared<'_>,
    ) -> f64 {
        let mut busy = Duration::ZERO;
        'docs: for e in rx {
            if opts.materialize == Materialize::Eager {
                let kv_doc = kv_doc(&e.planned.doc.id, &e.planned.hash);
                let chunks = &e.planned.chunks;
                // Stored already (an identical chunk, or an interrupted earlier run)?
                let mut needs = Vec::with_capacity(chunks.len());
                for c in chunks {
                    match self.corpus.stored(&c.tokens) {
                        Ok(stored) => needs.push((c.tokens.len(), !stored)),
                        Err(err) => {
                            shared.fatal(err);
                            break 'docs;
                        }
                    }
                }
                // Prefilled after their neighbours: one chunk per pass, each with its own
                // context (the neighbours the index holds now; see `context.rs`). After the
                // prompt's start alone, grouped as plain chunks are.
                let in_context = self.corpus.config.context.neighbours() > 0;
                let batch = if in_context {
                    1
                } else {
                    self.corpus.config.prefill_batch_tokens
                };
                for group in prefill_groups(&needs, batch) {
                    if shared.stopped() {
                        break 'docs;
                    }
                    let t = Instant::now();
                    let todo: Vec<&[u32]> = group
                        .clone()
                        .filter(|&i| needs[i].1)
                        .map(|i| chunks[i].tokens.as_slice())
                        .collect();
                    let computed = if in_context {
                        self.in_context(group.clone().filter(|&i| needs[i].1), &e, shared)
                    } else {
                        self.corpus
                            .prefill_many_bytes(&todo)
                            .map(|b| b.into_iter().map(|b| (b, None)).collect())
                    };
                    let mut kvs = match computed {
                        Ok(kvs) => kvs.into_iter(),
                        Err(err) => {
                            shared.fail(e.planned.doc.id.clone(), format!("prefill failed: {err}"));
                            let _ = tx.send(ToWriter::Abandon);
                            continue 'docs;
                        }
                    };
                    busy += t.elapsed();
                    for i in group {
                        let (bytes, first) = match needs[i].1 {
                            true => kvs.next().map_or((None, None), |(b, f)| (Some(b), f)),
                            false => (None, None),
                        };
                        let msg = ToWriter::Kv {
                            kv_doc: kv_doc.clone(),
                            tokens: chunks[i].tokens.clone(),
                            bytes,
                            first,
                        };
                        if tx.send(msg).is_err() {
                            break 'docs;
                        }
                    }
                }
            }
            if tx.send(ToWriter::Doc(e)).is_err() {
                break;
            }
        }
        secs(busy)
    }
}

impl Engine {
    /// KV of the chunks `idx` of `e` under `ingest.context` (and, under `exact_first`, the
    /// first place's copy), each note recorded before its bytes go to the writer; the
    /// context's tokens counted in the report.
    fn in_context(
        &self,
        idx: impl Iterator<Item = usize>,
        e: &Embedded<'_>,
        shared: &Shared<'_>,
    ) -> crate::error::Result<Vec<Computed>> {
        idx.map(|i| {
            let tokens = &e.planned.chunks[i].tokens;
            let kv = self.corpus.chunk_kv(tokens, &e.vectors[i])?;
            self.corpus.put_note(tokens, &kv)?;
            shared.report.lock().context_tokens_prefilled += kv.context_tokens;
            Ok((kv.bytes, kv.first))
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_fill_up_to_the_budget_in_order() {
        let all = |lens: &[usize]| lens.iter().map(|&l| (l, true)).collect::<Vec<_>>();
        // Full chunks alone; short ones together while they fit.
        assert_eq!(
            prefill_groups(&all(&[512, 512, 100]), 512),
            [0..1, 1..2, 2..3]
        );
        assert_eq!(
            prefill_groups(&all(&[128, 128, 128, 128, 128, 40]), 512),
            [0..4, 4..6]
        );
        // A chunk longer than the budget makes a group alone; budget 1: one chunk per pass.
        assert_eq!(
            prefill_groups(&all(&[10, 900, 10]), 512),
            [0..1, 1..2, 2..3]
        );
        assert_eq!(prefill_groups(&all(&[3, 3, 3]), 1), [0..1, 1..2, 2..3]);
        // Stored chunks cost nothing and ride along; at most 64 chunks in a group.
        let mixed = [(500, true), (512, false), (12, true), (512, true)];
        assert_eq!(prefill_groups(&mixed, 512), [0..3, 3..4]);
        let stored = vec![(512, false); 130];
        assert_eq!(prefill_groups(&stored, 512), [0..64, 64..128, 128..130]);
        assert!(prefill_groups(&[], 512).is_empty());
    }
}
