//! Neighbour materialization (`ingest.context = "neighbours:N"`, [`crate::Context`]): a chunk
//! prefilled after the `N` chunks of the corpus most similar to it, only its own rows stored;
//! under `prompt` (and `prompt+neighbours:N`) after the RAG prompt's start (and then its
//! neighbours); under `mean:N` (`prompt+mean:N`) after each neighbour alone, its rows the mean
//! over those contexts.
//!
//! The neighbours are the vector index's nearest points to the chunk's embedding, the chunk
//! itself (and any chunk with the same tokens) left out, in order of decreasing similarity;
//! they are placed farthest first, so the nearest one sits right before the chunk. The chunk's
//! rows are cut out of the joint prefill and their keys rotated back by the context's length:
//! stored KV always sits at positions `0..n`, whatever it attended to, so every assembly
//! strategy reads it unchanged.
//!
//! Which neighbours a chunk's KV attended to is recorded beside it in the store
//! ([`kvstore::Store::put_note`], written before the KV, so stored KV always has its note).
//! Under `mean:N` the note also ranks the chunk's tokens whose rows moved most between its
//! contexts ([`model::Kv::drift`]): the tokens its stored mean is least sure of, which the
//! `sensitive` assembly strategy recomputes. Version 1 (no ranking) or 2:
//!
//! | bytes       | field                                            |
//! |-------------|--------------------------------------------------|
//! | 0           | version, `1` or `2`                              |
//! | 1           | neighbours `m` (fewer than `N` when the index had fewer) |
//! | 2..2+16·m   | each neighbour's token digest (`schema::TokenDigest`), farthest first |
//! | 2+16·m      | version 2 only: ranked offsets `r` (at most [`RANKED_MAX`]) |
//! | 3+16·m..+2·r | version 2 only: chunk token offsets, u16 little-endian, the most moved first |
//!
//! A chunk whose note is missing, names fewer than `N` neighbours or a neighbour no longer
//! indexed (deleted, or its document changed) is stale for `ragkv rematerialize`
//! ([`crate::Reason::Neighbours`]).
//!
//! Under `ingest.exact_first` each chunk is also prefilled after the prompt's start alone, in
//! the same batched pass as its contexts ([`ChunkKv::first`]), and that copy is stored in
//! [`Corpus::first_namespace`] (`context = "prompt"`'s namespace): what full prefill computes
//! for the chunk a prompt places first, which the server reads there. It carries no note.

use std::collections::HashSet;

use retrieval::SearchFilter;
use schema::TokenDigest;

use crate::corpus::Corpus;
use crate::error::{Error, Result};

/// Version of the neighbour note (table above) without a ranking, and with one.
const NOTE_VERSION: u8 = 1;
const NOTE_VERSION_RANKED: u8 = 2;

/// What [`Corpus::prefill_after_each`] computes: the mean's stored bytes, the tokens ranked
/// by how far they moved, and the first place's copy.
type Averaged = (Vec<u8>, Vec<u16>, Option<Vec<u8>>);

/// Chunk tokens a version-2 note ranks at most.
pub const RANKED_MAX: usize = 32;

/// A chunk's KV computed under the corpus's `ingest.context`.
#[derive(Debug, Clone)]
pub struct ChunkKv {
    /// The chunk's own rows in the stored layout, at positions `0..n`.
    pub bytes: Vec<u8>,
    /// The note to record with it (`None` under `context = "none"`).
    pub note: Option<Vec<u8>>,
    /// Tokens prefilled beside the chunk's own for its context (not stored): its neighbours'
    /// (the prompt's start is prefilled once per corpus), and under `mean:N` the chunk's
    /// own again in each context after the first.
    pub context_tokens: usize,
    /// Under `mean:N`, the chunk's token offsets by how far their rows moved between the
    /// contexts, the most first (the note records them too); empty otherwise.
    pub ranked: Vec<u16>,
    /// Under `ingest.exact_first`: the chunk's rows after the prompt's start alone, stored in
    /// [`Corpus::first_namespace`] for the chunk a prompt places first.
    pub first: Option<Vec<u8>>,
}

/// Encodes the note naming `neighbours` and, if any, the `ranked` token offsets (the first
/// [`RANKED_MAX`]; table above).
pub fn encode_note(neighbours: &[TokenDigest], ranked: &[u16]) -> Vec<u8> {
    let version = if ranked.is_empty() {
        NOTE_VERSION
    } else {
        NOTE_VERSION_RANKED
    };
    let mut v = vec![version, neighbours.len() as u8];
    for d in neighbours {
        v.extend_from_slice(&d.0);
    }
    if !ranked.is_empty() {
        let r = &ranked[..ranked.len().min(RANKED_MAX)];
        v.push(r.len() as u8);
        for o in r {
            v.extend_from_slice(&o.to_le_bytes());
        }
    }
    v
}

/// A note's neighbours and ranked offsets (none in version 1).
fn decode(note: &[u8]) -> Result<(Vec<TokenDigest>, Vec<u16>)> {
    let bad = |why: String| Error::Invalid {
        what: "neighbour note",
        why,
    };
    let (version, m, rest) = match note {
        [v @ (NOTE_VERSION | NOTE_VERSION_RANKED), m, rest @ ..] => (*v, usize::from(*m), rest),
        _ => return Err(bad(format!("unknown version or {} bytes", note.len()))),
    };
    let Some((digests, tail)) = rest.split_at_checked(m * 16) else {
        return Err(bad(format!("{m} neighbours in {} bytes", rest.len())));
    };
    let neighbours = digests
        .chunks_exact(16)
        .map(|c| TokenDigest(c.try_into().expect("16 bytes")))
        .collect();
    let ranked = match (version, tail) {
        (NOTE_VERSION, []) => Vec::new(),
        (NOTE_VERSION_RANKED, [r, offsets @ ..]) if offsets.len() == usize::from(*r) * 2 => offsets
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect(),
        _ => {
            return Err(bad(format!(
                "{} bytes after {m} neighbours (version {version})",
                tail.len()
            )))
        }
    };
    Ok((neighbours, ranked))
}

/// The neighbours named by a note written by [`encode_note`].
pub fn decode_note(note: &[u8]) -> Result<Vec<TokenDigest>> {
    Ok(decode(note)?.0)
}

/// The token offsets a note written by [`encode_note`] ranks, the most moved first (none in a
/// version-1 note).
pub fn decode_ranked(note: &[u8]) -> Result<Vec<u16>> {
    Ok(decode(note)?.1)
}

/// The offsets of the `RANKED_MAX` highest of `drift` (one score per chunk token), highest
/// first, ties to the earlier token.
fn rank(drift: &[f32]) -> Vec<u16> {
    let mut order: Vec<usize> = (0..drift.len().min(usize::from(u16::MAX) + 1)).collect();
    order.sort_by(|&a, &b| drift[b].total_cmp(&drift[a]).then(a.cmp(&b)));
    order.truncate(RANKED_MAX);
    order.into_iter().map(|o| o as u16).collect()
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

    /// KV of `tokens` prefilled after `context` (concatenated, from position 0, after the
    /// prompt's start under `ingest.context = "prompt..."`): only the rows of `tokens`, keys
    /// rotated back to positions `0..n`, in the stored layout. With nothing before it,
    /// [`Corpus::prefill_bytes`].
    pub fn prefill_after(&self, context: &[Vec<u32>], tokens: &[u32]) -> Result<Vec<u8>> {
        let mut all: Vec<u32> = context.concat();
        all.extend_from_slice(tokens);
        let kv = match &self.prompt_kv {
            Some(start) => self.continue_start(start, &[&all])?.remove(0),
            None if context.is_empty() => return self.prefill_bytes(tokens),
            None => self.model.decoder().prefill(&all, 0)?.0,
        };
        self.own_rows(&kv, kv.len() - tokens.len(), tokens.len())
    }

    /// The KV of each of `rests` prefilled after the prompt's start `start`: its KV (computed
    /// once) continued, as the server's full prefill continues it, all of them in one batched
    /// forward pass ([`model::Decoder::step`]); each result holds the start's rows too.
    fn continue_start(&self, start: &model::Kv, rests: &[&[u32]]) -> Result<Vec<model::Kv>> {
        let mut caches = rests
            .iter()
            .map(|r| model::KvCache::from_kv(start, r.len()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut seqs: Vec<model::StepSeq<'_>> = caches
            .iter_mut()
            .zip(rests.iter().copied())
            .map(|(cache, tokens)| model::StepSeq::new(cache, tokens))
            .collect();
        self.model.decoder().step(&mut seqs)?;
        Ok(caches
            .iter()
            .map(model::KvCache::to_kv)
            .collect::<std::result::Result<Vec<_>, _>>()?)
    }

    /// The stored KV of each of `chunks` under `ingest.context = "prompt"` (no neighbours),
    /// in one batched forward pass: short chunks share the weights' reads as plain ones do.
    pub(crate) fn prefill_many_after_start(
        &self,
        start: &model::Kv,
        chunks: &[&[u32]],
    ) -> Result<Vec<Vec<u8>>> {
        self.continue_start(start, chunks)?
            .iter()
            .zip(chunks)
            .map(|(kv, c)| self.own_rows(kv, start.len(), c.len()))
            .collect()
    }

    /// KV of `tokens` prefilled after each of `context` alone (all in one batched pass, each
    /// after the prompt's start under `prompt+mean:N`): the mean of the chunk's rows over those
    /// contexts, keys rotated back to `0..n` before they are averaged, in the stored layout.
    /// Also returns the chunk's tokens ranked by how far their rows moved between the
    /// contexts ([`model::Kv::drift`]; the first [`RANKED_MAX`]) and, when `first` (it needs
    /// the prompt's start), its rows after the prompt's start alone, from the same pass.
    fn prefill_after_each(
        &self,
        context: &[Vec<u32>],
        tokens: &[u32],
        first: bool,
    ) -> Result<Averaged> {
        let mut own = self.own_in_each(context, tokens, first)?;
        let first = match first {
            true => Some(
                own.pop()
                    .expect("the first place's rows")
                    .to_bytes(self.kv_dtype)?,
            ),
            false => None,
        };
        let ranked = if own.len() > 1 {
            rank(&model::Kv::drift(&own)?)
        } else {
            Vec::new()
        };
        Ok((
            model::Kv::mean(&own)?.to_bytes(self.kv_dtype)?,
            ranked,
            first,
        ))
    }

    /// The rows of `tokens` prefilled after each of `context` (after the prompt's start, if
    /// any), keys rotated back to `0..n`, all in one batched pass; with `first`, then its rows
    /// after the prompt's start alone (refused without one).
    fn own_in_each(
        &self,
        context: &[Vec<u32>],
        tokens: &[u32],
        first: bool,
    ) -> Result<Vec<model::Kv>> {
        let mut alls: Vec<Vec<u32>> = context.iter().map(|c| [c, tokens].concat()).collect();
        let kvs = match &self.prompt_kv {
            Some(start) => {
                if first {
                    alls.push(tokens.to_vec());
                }
                let rests: Vec<&[u32]> = alls.iter().map(Vec::as_slice).collect();
                self.continue_start(start, &rests)?
            }
            None if first => {
                return Err(Error::Invalid {
                    what: "ingest.exact_first",
                    why: "no prompt's start to prefill the first place's copy after".into(),
                })
            }
            None => alls
                .iter()
                .map(|all| Ok(self.model.decoder().prefill(all, 0)?.0))
                .collect::<Result<Vec<_>>>()?,
        };
        kvs.iter()
            .map(|kv| self.own_kv(kv, kv.len() - tokens.len(), tokens.len()))
            .collect()
    }

    /// The `n` rows of `kv` from `offset`, keys rotated back to `0..n`, in the stored layout.
    fn own_rows(&self, kv: &model::Kv, offset: usize, n: usize) -> Result<Vec<u8>> {
        Ok(self.own_kv(kv, offset, n)?.to_bytes(self.kv_dtype)?)
    }

    /// The `n` rows of `kv` from `offset`, keys rotated back to `0..n`.
    fn own_kv(&self, kv: &model::Kv, offset: usize, n: usize) -> Result<model::Kv> {
        let own = kv.narrow(offset, n)?;
        Ok(self.model.decoder().reposition(&own, -(offset as i64))?)
    }

    /// The KV of chunk `tokens` (embedded as `vector`) as this corpus stores it: alone, after
    /// the prompt's start, and/or after its neighbours with the note naming them.
    pub fn chunk_kv(&self, tokens: &[u32], vector: &[f32]) -> Result<ChunkKv> {
        let context = self.neighbours(tokens, vector)?;
        let mut context_tokens: usize = context.iter().map(Vec::len).sum();
        let first = self.first_ns.is_some();
        let (bytes, ranked, first) = if self.config.context.averaged() && !context.is_empty() {
            // The chunk itself once more per context beyond the first (and for the first
            // place's copy).
            context_tokens += (context.len() - 1 + usize::from(first)) * tokens.len();
            self.prefill_after_each(&context, tokens, first)?
        } else if first && !context.is_empty() {
            // After all the neighbours, and after the prompt's start alone, in one pass.
            context_tokens += tokens.len();
            let mut own = self.own_in_each(&[context.concat()], tokens, true)?;
            let first = own.pop().map(|kv| kv.to_bytes(self.kv_dtype)).transpose()?;
            (own[0].to_bytes(self.kv_dtype)?, Vec::new(), first)
        } else {
            let bytes = self.prefill_after(&context, tokens)?;
            // No neighbours: the chunk is already after the prompt's start alone.
            let first = first.then(|| bytes.clone());
            (bytes, Vec::new(), first)
        };
        let note = (self.config.context.neighbours() > 0).then(|| {
            let digests: Vec<TokenDigest> = context.iter().map(|t| TokenDigest::of(t)).collect();
            encode_note(&digests, &ranked)
        });
        Ok(ChunkKv {
            bytes,
            note,
            context_tokens,
            ranked,
            first,
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

    /// Under `ingest.exact_first`, chunk `tokens`' copy for the first place alone
    /// ([`ChunkKv::first`], without the contexts' prefill); `None` otherwise.
    pub fn first_kv(&self, tokens: &[u32]) -> Result<Option<Vec<u8>>> {
        if self.first_ns.is_none() {
            return Ok(None);
        }
        Ok(Some(self.prefill_after(&[], tokens)?))
    }

    /// Whether chunk `tokens` is stored whole: in the corpus's namespace and, under
    /// `ingest.exact_first`, its copy for the first place too.
    pub fn stored(&self, tokens: &[u32]) -> Result<bool> {
        for ns in std::iter::once(self.ns).chain(self.first_ns) {
            if self.store.probe(ns, tokens)? != tokens.len() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Under `ingest.exact_first`, stores chunk `tokens`' copy for the first place (`first`,
    /// [`ChunkKv::first`]) for KV document `kv_doc`, or with `None` attaches the stored one to
    /// it; call before storing the chunk's own bytes. Returns the bytes written (none
    /// otherwise).
    pub fn put_first(&self, kv_doc: &str, tokens: &[u32], first: Option<&[u8]>) -> Result<u64> {
        let Some(ns) = self.first_ns else {
            return Ok(0);
        };
        let item = kvstore::PutItem {
            tokens,
            kv: first.unwrap_or(&[]),
            doc: Some(kv_doc),
        };
        Ok(self
            .store
            .put_batch(ns, self.layout, &[item])?
            .bytes_written)
    }

    /// Records `kv`'s note (if any) with `tokens`; call before storing its bytes.
    pub fn put_note(&self, tokens: &[u32], kv: &ChunkKv) -> Result<()> {
        if let Some(note) = &kv.note {
            self.store.put_note(self.ns, tokens, note)?;
        }
        Ok(())
    }

    /// The token offsets of stored chunk `tokens` its note ranks as the most moved between
    /// its contexts (under `mean:N`, most first): none without a note, with a version-1 note,
    /// or with an unreadable one (which [`Corpus::context_changed`] reports).
    pub fn ranked_offsets(&self, tokens: &[u32]) -> Result<Vec<u16>> {
        if self.config.context.neighbours() == 0 {
            return Ok(Vec::new());
        }
        let note = self.store.note(self.ns, tokens)?;
        Ok(note
            .and_then(|n| decode_ranked(&n).ok())
            .unwrap_or_default())
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

    /// An order for retrieved chunks `chunks` (best first) that puts a chunk right after the
    /// neighbour its stored KV attended to, where both were retrieved: that chunk's KV then
    /// sees at its place in the prompt the context it was computed in (`neighbours:1`
    /// exactly; under `N > 1` the nearest neighbour, and the farther ones where they chain).
    /// Returns indices into `chunks`; the identity under `context = "none"` or when no
    /// chunk's note names another retrieved chunk ([`chain_order`]). Measured by `ragkv eval
    /// qa --chunk-order neighbours`; `ragkv serve` keeps the retrieval order (no gain measured).
    pub fn neighbour_order(&self, chunks: &[Vec<u32>]) -> Result<Vec<usize>> {
        if self.config.context.neighbours() == 0 {
            return Ok((0..chunks.len()).collect());
        }
        let digests: Vec<TokenDigest> = chunks.iter().map(|t| TokenDigest::of(t)).collect();
        let mut after = Vec::with_capacity(chunks.len());
        for (i, tokens) in chunks.iter().enumerate() {
            let named = match self.store.note(self.ns, tokens)? {
                Some(note) => decode_note(&note).unwrap_or_default(),
                None => Vec::new(),
            };
            // Nearest first; only other retrieved chunks.
            after.push(
                named
                    .iter()
                    .rev()
                    .filter_map(|d| digests.iter().position(|x| x == d))
                    .filter(|&j| j != i)
                    .collect::<Vec<_>>(),
            );
        }
        Ok(chain_order(&after))
    }
}

/// The order [`Corpus::neighbour_order`] gives: `after[i]` lists the chunks chunk `i` would
/// like to follow, most wanted first. Taking chunks best first, each is linked after the first
/// of its wanted chunks that has no follower yet (unless that closes a loop); the chains are
/// then laid out in the order of their best chunk, each from its head. A chunk that wants none
/// keeps its rank among the chains.
fn chain_order(after: &[Vec<usize>]) -> Vec<usize> {
    let n = after.len();
    let (mut pred, mut succ) = (vec![None; n], vec![None::<usize>; n]);
    let head = |pred: &[Option<usize>], mut x: usize| {
        while let Some(p) = pred[x] {
            x = p;
        }
        x
    };
    for i in 0..n {
        for &b in &after[i] {
            if b < n && b != i && succ[b].is_none() && head(&pred, b) != i {
                succ[b] = Some(i);
                pred[i] = Some(b);
                break;
            }
        }
    }
    // Chains by their best (lowest-index) member.
    let mut heads: Vec<(usize, usize)> = Vec::new();
    for i in 0..n {
        let h = head(&pred, i);
        if !heads.iter().any(|&(hh, _)| hh == h) {
            heads.push((h, i));
        }
    }
    let mut out = Vec::with_capacity(n);
    for (h, _) in heads {
        let mut x = Some(h);
        while let Some(c) = x {
            out.push(c);
            x = succ[c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_round_trips_and_rejects_bad_bytes() {
        let ds = [TokenDigest::of(&[1, 2]), TokenDigest::of(&[3])];
        let note = encode_note(&ds, &[]);
        assert_eq!(note.len(), 2 + 32);
        assert_eq!(note[0], 1, "without a ranking: version 1, as before");
        assert_eq!(decode_note(&note).unwrap(), ds);
        assert!(decode_ranked(&note).unwrap().is_empty());
        assert_eq!(decode_note(&encode_note(&[], &[])).unwrap(), []);
        assert!(decode_note(&note[..note.len() - 1]).is_err());
        assert!(decode_note(&[2, 0]).is_err());
        assert!(decode_note(&[3, 0]).is_err());
        assert!(decode_note(&[]).is_err());
        // Version 2: the ranking after the neighbours, cut to RANKED_MAX.
        let ranked: Vec<u16> = (0..40).rev().collect();
        let note = encode_note(&ds, &ranked);
        assert_eq!((note[0], note.len()), (2, 2 + 32 + 1 + 2 * RANKED_MAX));
        assert_eq!(decode_note(&note).unwrap(), ds);
        assert_eq!(decode_ranked(&note).unwrap(), ranked[..RANKED_MAX]);
        assert!(decode_ranked(&note[..note.len() - 1]).is_err());
        assert!(
            decode_ranked(&[1, 0, 1, 0, 0]).is_err(),
            "a version-1 note ends after its digests"
        );
        assert_eq!(
            decode_ranked(&encode_note(&[], &[7, 300])).unwrap(),
            [7, 300]
        );
    }

    #[test]
    fn rank_orders_the_most_moved_first() {
        assert_eq!(rank(&[0.1, 3.0, 0.5, 3.0]), [1, 3, 2, 0]);
        assert!(rank(&[]).is_empty());
        assert_eq!(rank(&[1.0; 100]).len(), RANKED_MAX);
    }

    #[test]
    fn chains_put_a_chunk_after_its_neighbour() {
        // Nothing wanted: the identity.
        assert_eq!(chain_order(&[vec![], vec![], vec![]]), [0, 1, 2]);
        // 0 wants to follow 2: 2's chain (2, 0) comes first, by 0's rank.
        assert_eq!(chain_order(&[vec![2], vec![], vec![]]), [2, 0, 1]);
        // 1 and 2 both want 0; 1 is better and gets it, 2 takes its second wish, 1.
        assert_eq!(chain_order(&[vec![], vec![0], vec![0, 1]]), [0, 1, 2]);
        // A loop is not closed: 0 follows 1, so 1 cannot follow 0.
        assert_eq!(chain_order(&[vec![1], vec![0], vec![]]), [1, 0, 2]);
        // Out-of-range and self wishes are ignored; every index once.
        let o = chain_order(&[vec![0, 9], vec![3], vec![1], vec![]]);
        let mut s = o.clone();
        s.sort();
        assert_eq!(s, [0, 1, 2, 3]);
        assert_eq!(o, [0, 3, 1, 2]);
    }
}
