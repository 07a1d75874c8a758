//! Configuration of the ingest pipeline ([`IngestConfig`]) and of one run ([`RunOptions`]).

use serde::{Deserialize, Serialize};

use crate::chunk::ChunkerConfig;
use crate::error::{Error, Result};

/// When chunk KV is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Materialize {
    /// Prefill every chunk during ingest.
    Eager,
    /// Leave it to the first query that retrieves the chunk.
    Lazy,
    /// Index vectors only.
    None,
}

impl std::str::FromStr for Materialize {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "eager" => Ok(Materialize::Eager),
            "lazy" => Ok(Materialize::Lazy),
            "none" => Ok(Materialize::None),
            other => Err(format!("{other:?} (expected eager, lazy or none)")),
        }
    }
}

/// The system prompt ingest prefills chunks after under `ingest.context = "prompt..."` when
/// the binary says no other: the server's default (`serve.system_prompt`).
pub const DEFAULT_SYSTEM_PROMPT: &str = "Answer the question using the context. Be brief.";

/// What each chunk is prefilled after (`ingest.context`); only the chunk's own rows are stored.
///
/// A chunk prefilled alone never attends to anything before it: its first tokens become an
/// attention sink, and every later token lacks the context it is usually retrieved with.
/// `neighbours:N` (FusionRAG's offline step) prefills a chunk after the `N` chunks of the
/// corpus most similar to it (the vector index's nearest, itself excluded; the nearest one
/// last, next to the chunk), stores the chunk's rows with their keys rotated back to
/// positions `0..n`, and records the neighbours' keys: a neighbour deleted or changed makes
/// the chunk stale for `ragkv rematerialize`. Costs `N + 1` times the plain prefill at
/// ingest; nothing at query time.
///
/// `prompt` (APE's shared prefix) prefills every chunk after the RAG prompt's own start (the
/// model's chat template around the system prompt, up to the `Context:` line, as the server
/// builds it from [`IngestConfig::system_prompt`]): the prompt's first token, not the
/// chunk's, is then the sink, and the chunk retrieved first is stored exactly as a full
/// prefill computes it. `prompt+neighbours:N` puts the neighbours between that start and the
/// chunk. The start's KV is computed once; each chunk costs the attention over it (1.1× the
/// plain ingest prefill measured with SmolLM2), nothing at query time.
///
/// `mean:N` (and `prompt+mean:N`) prefills a chunk after each of its `N` nearest neighbours
/// alone, once per neighbour (in one batched pass), and stores the element-wise mean of the
/// chunk's rows over those contexts (keys rotated back to `0..n` before they are averaged:
/// RoPE is linear, so the mean of rotated keys is the rotated mean). At query time a chunk
/// follows whichever chunks retrieval put before it, not one known neighbour: the mean is
/// an estimate of its rows' expectation over such contexts. Costs `2N` times the plain
/// prefill at ingest (each pass the chunk and one neighbour); same bytes and note as
/// `neighbours:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Context {
    /// Each chunk alone at positions `0..n`.
    #[default]
    None,
    /// After its `N` most similar chunks (`1..=8`).
    Neighbours(u8),
    /// After the RAG prompt's start.
    Prompt,
    /// After the RAG prompt's start and then its `N` most similar chunks (`1..=8`).
    PromptNeighbours(u8),
    /// The mean of its rows after each of its `N` most similar chunks alone (`1..=8`).
    Mean(u8),
    /// [`Context::Mean`], each context after the RAG prompt's start.
    PromptMean(u8),
}

impl Context {
    /// Neighbours each chunk is prefilled after (0 for `none` and `prompt`).
    pub fn neighbours(self) -> usize {
        match self {
            Context::None | Context::Prompt => 0,
            Context::Neighbours(n)
            | Context::PromptNeighbours(n)
            | Context::Mean(n)
            | Context::PromptMean(n) => usize::from(n),
        }
    }

    /// Whether each chunk is prefilled after the RAG prompt's start.
    pub fn prompt(self) -> bool {
        matches!(
            self,
            Context::Prompt | Context::PromptNeighbours(_) | Context::PromptMean(_)
        )
    }

    /// Whether `ingest.exact_first` can apply (without a passage): neighbours after the
    /// prompt's start.
    pub fn takes_exact_first(self) -> bool {
        self.neighbours() > 0 && self.prompt()
    }

    /// Whether the stored rows are the mean over one context per neighbour (`mean:N`), not
    /// one prefill after all of them.
    pub fn averaged(self) -> bool {
        matches!(self, Context::Mean(_) | Context::PromptMean(_))
    }
}

impl std::fmt::Display for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Context::None => f.write_str("none"),
            Context::Neighbours(n) => write!(f, "neighbours:{n}"),
            Context::Prompt => f.write_str("prompt"),
            Context::PromptNeighbours(n) => write!(f, "prompt+neighbours:{n}"),
            Context::Mean(n) => write!(f, "mean:{n}"),
            Context::PromptMean(n) => write!(f, "prompt+mean:{n}"),
        }
    }
}

impl std::str::FromStr for Context {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || {
            format!(
                "{s:?} (expected none, prompt, neighbours:N, mean:N, prompt+neighbours:N or \
                 prompt+mean:N with N in 1..=8)"
            )
        };
        let (prompt, rest) = match s.strip_prefix("prompt") {
            Some("") => return Ok(Context::Prompt),
            Some(rest) => (true, rest.strip_prefix('+').ok_or_else(bad)?),
            None => (false, s),
        };
        let (mean, n) = match rest.split_once(':') {
            None if rest == "none" && !prompt => return Ok(Context::None),
            Some((kind @ ("neighbours" | "neighbors" | "mean"), n)) => match n.parse::<u8>() {
                Ok(n @ 1..=8) => (kind == "mean", n),
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        };
        Ok(match (prompt, mean) {
            (true, false) => Context::PromptNeighbours(n),
            (false, false) => Context::Neighbours(n),
            (true, true) => Context::PromptMean(n),
            (false, true) => Context::Mean(n),
        })
    }
}

impl Serialize for Context {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Context {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `[ingest]` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IngestConfig {
    /// Model tokens per chunk, at most.
    pub chunk_tokens: usize,
    /// Tokens a chunk repeats from the end of the previous one.
    pub overlap_tokens: usize,
    /// Documents larger than this are skipped with a reason.
    pub max_doc_bytes: u64,
    /// Capacity of each queue between stages (documents).
    pub queue_depth: usize,
    /// Default materialization (`eager`, `lazy`, `none`).
    pub materialize: Materialize,
    /// Text placed before every chunk: prefilled with it (part of its stored KV) and so part
    /// of every assembled prompt, and of the KV namespace. Empty (the default): chunks alone.
    pub chunk_preamble: String,
    /// `gc` drops a KV namespace other than the current one once no process has used it for
    /// this long (after a model change: time for a rollback, or for `rematerialize` to
    /// migrate). Default one week.
    pub namespace_grace_hours: f64,
    /// Eager prefill runs consecutive chunks of a document in one forward pass while their
    /// tokens add up to at most this many (a chunk longer than this runs alone; 1: one chunk
    /// per pass). Short chunks then share the weights' reads.
    pub prefill_batch_tokens: usize,
    /// What each chunk is prefilled after: `none` (alone; this default), `prompt`,
    /// `neighbours:N`, `prompt+neighbours:N`, `mean:N` or `prompt+mean:N` ([`Context`]; the
    /// `ragkv` binary's default is [`IngestConfig::recommended`]'s). Part of the KV namespace.
    pub context: Context,
    /// Under `context = "prompt"` (or `"prompt+neighbours:N"`): text placed after the prompt's
    /// start and before every chunk (and its neighbours) when its KV is prefilled, never
    /// stored or served. Gives every chunk's KV a context of the length retrieval usually puts
    /// before it, prefilled once per process: each chunk costs only the attention over it
    /// (1.5× the plain ingest prefill with SmolLM2 and a 2,000-byte passage; docs/BENCHMARKS.md,
    /// "After the prompt's start"). Part of the KV namespace. Empty (the default): none.
    pub context_passage: String,
    /// Under `context = "prompt+neighbours:N"` or `"prompt+mean:N"`: each chunk's KV is also
    /// prefilled after the prompt's start alone (in the same forward pass as its contexts) and
    /// stored in the namespace `context = "prompt"` uses. The server reads that copy for the
    /// chunk it places first, where it is exactly what full prefill computes; the chunks
    /// after it read the neighbour-materialized KV. Doubles the stored bytes; not part of
    /// the main namespace (turning it on re-materializes none of the main KV: `ragkv
    /// rematerialize` prefills only the missing copies, and a first chunk whose copy is
    /// missing is read from the main namespace meanwhile). Default `false`.
    pub exact_first: bool,
    /// The system prompt of the RAG prompt chunks are prefilled after under `context =
    /// "prompt..."`; not read from `[ingest]`: the binary sets it to `serve.system_prompt`,
    /// so both sides build the same prompt. Part of the KV namespace under `prompt`.
    #[serde(skip)]
    pub system_prompt: String,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            chunk_tokens: 512,
            overlap_tokens: 0,
            max_doc_bytes: 16 << 20,
            queue_depth: 4,
            materialize: Materialize::Eager,
            chunk_preamble: String::new(),
            namespace_grace_hours: 168.0,
            prefill_batch_tokens: 512,
            context: Context::None,
            context_passage: String::new(),
            exact_first: false,
            system_prompt: DEFAULT_SYSTEM_PROMPT.into(),
        }
    }
}

impl IngestConfig {
    /// The chunker's settings.
    pub fn chunker(&self) -> ChunkerConfig {
        ChunkerConfig {
            chunk_tokens: self.chunk_tokens,
            overlap_tokens: self.overlap_tokens,
        }
    }

    /// Whether `exact_first` can apply to this materialization: a mode with neighbours after
    /// the prompt's start (`prompt+neighbours:N`, `prompt+mean:N`) and no
    /// `context_passage`. Elsewhere the chunk's KV already is what full prefill computes in
    /// the first place (`prompt`), or no copy can be (no prompt's start, or a passage).
    pub fn exact_first_applies(&self) -> bool {
        self.context.takes_exact_first() && self.context_passage.is_empty()
    }

    /// The materialization the `ragkv` binary uses unless configured otherwise: each chunk's
    /// rows averaged over two neighbour contexts after the prompt's start, and its copy
    /// after the prompt's start alone for the first place (`prompt+mean:2`, `exact_first`;
    /// docs/BENCHMARKS.md, "The first chunk exact"). [`IngestConfig::default`] keeps each
    /// chunk alone (`none`), the cheapest, for library users and tests.
    pub fn recommended() -> IngestConfig {
        IngestConfig {
            context: Context::PromptMean(2),
            exact_first: true,
            ..IngestConfig::default()
        }
    }

    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        self.chunker().validate().map_err(|why| Error::Invalid {
            what: "ingest",
            why,
        })?;
        if self.chunk_preamble.len() > 1024 {
            return Err(Error::Invalid {
                what: "ingest.chunk_preamble",
                why: "longer than 1024 bytes".into(),
            });
        }
        if !self.context_passage.is_empty() && !self.context.prompt() {
            return Err(Error::Invalid {
                what: "ingest.context_passage",
                why: format!(
                    "set, but ingest.context = \"{}\" places nothing before chunks (use \
                     \"prompt\", \"prompt+neighbours:N\" or \"prompt+mean:N\")",
                    self.context
                ),
            });
        }
        if self.exact_first && !self.context.takes_exact_first() {
            return Err(Error::Invalid {
                what: "ingest.exact_first",
                why: format!(
                    "set, but ingest.context = \"{}\" (use \"prompt+neighbours:N\" or \
                     \"prompt+mean:N\"; under \"prompt\" every chunk's KV is exact in the \
                     first place already)",
                    self.context
                ),
            });
        }
        if self.exact_first && !self.context_passage.is_empty() {
            return Err(Error::Invalid {
                what: "ingest.exact_first",
                why: "set with ingest.context_passage: a chunk after the passage is not \
                      what full prefill computes in the first place"
                    .into(),
            });
        }
        if self.context_passage.len() > 64 << 10 {
            return Err(Error::Invalid {
                what: "ingest.context_passage",
                why: "longer than 64 KiB".into(),
            });
        }
        if !(self.namespace_grace_hours >= 0.0 && self.namespace_grace_hours.is_finite()) {
            return Err(Error::Invalid {
                what: "ingest.namespace_grace_hours",
                why: format!("{} (must be ≥ 0)", self.namespace_grace_hours),
            });
        }
        if !(1..=1 << 20).contains(&self.prefill_batch_tokens) {
            return Err(Error::Invalid {
                what: "ingest.prefill_batch_tokens",
                why: format!("{} (must be in 1..=1048576)", self.prefill_batch_tokens),
            });
        }
        if self.max_doc_bytes == 0 || !(1..=1024).contains(&self.queue_depth) {
            return Err(Error::Invalid {
                what: "ingest",
                why: "max_doc_bytes must be positive and queue_depth in 1..=1024".into(),
            });
        }
        Ok(())
    }
}

/// Options of one run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// When chunk KV is computed.
    pub materialize: Materialize,
    /// Delete indexed documents that none of the sources yielded (of this run's shard only).
    pub prune: bool,
    /// Ingest only the documents of one shard (`--shard I/N`): N workers, one shard each, can
    /// ingest one corpus into one index and one shared KV tier.
    pub shard: Option<Shard>,
}

/// One of `count` disjoint parts of a corpus: the documents whose id hashes to `index`
/// (the first 8 bytes of blake3 of the id, little endian, modulo `count`), so every worker
/// given the same sources and `count` agrees on who owns what, whatever order it reads in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This shard, `0..count`.
    pub index: u32,
    /// Shards in all.
    pub count: u32,
}

impl Shard {
    /// Whether `doc` belongs to this shard.
    pub fn contains(&self, doc: &str) -> bool {
        let h = blake3::hash(doc.as_bytes());
        let x = u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"));
        x % u64::from(self.count) == u64::from(self.index)
    }
}

impl std::str::FromStr for Shard {
    type Err = Error;
    /// `I/N` with `0 <= I < N`.
    fn from_str(s: &str) -> Result<Shard> {
        let bad = || Error::Invalid {
            what: "shard",
            why: format!("{s:?} (expected I/N with 0 <= I < N, e.g. 0/2)"),
        };
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count): (u32, u32) = (
            i.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_parse_print_and_deserialize() {
        assert_eq!("none".parse::<Context>().unwrap(), Context::None);
        assert_eq!(
            "neighbours:2".parse::<Context>().unwrap(),
            Context::Neighbours(2)
        );
        assert_eq!(
            "neighbors:1".parse::<Context>().unwrap(),
            Context::Neighbours(1)
        );
        for bad in [
            "neighbours:0",
            "neighbours:9",
            "neighbours",
            "neighbours:x",
            "all",
            "prompt+",
            "prompt+none",
            "prompt+neighbours:0",
            "promptneighbours:1",
            "prompts",
        ] {
            assert!(bad.parse::<Context>().is_err(), "{bad}");
        }
        assert_eq!(Context::Neighbours(3).to_string(), "neighbours:3");
        assert_eq!(Context::Neighbours(3).neighbours(), 3);
        assert_eq!(Context::None.neighbours(), 0);
        for (s, c) in [
            ("prompt", Context::Prompt),
            ("prompt+neighbours:2", Context::PromptNeighbours(2)),
            ("prompt+mean:3", Context::PromptMean(3)),
        ] {
            assert_eq!(s.parse::<Context>().unwrap(), c);
            assert_eq!(c.to_string(), s);
            assert!(c.prompt());
        }
        assert_eq!("mean:2".parse::<Context>().unwrap(), Context::Mean(2));
        assert_eq!(Context::Mean(2).to_string(), "mean:2");
        assert!(Context::Mean(2).averaged() && Context::PromptMean(1).averaged());
        assert!(!Context::PromptNeighbours(2).averaged() && !Context::Prompt.averaged());
        assert_eq!(Context::PromptMean(3).neighbours(), 3);
        assert!(!Context::Mean(1).prompt());
        for bad in [
            "mean:0",
            "mean:9",
            "mean",
            "prompt+mean",
            "meanneighbours:1",
        ] {
            assert!(bad.parse::<Context>().is_err(), "{bad}");
        }
        assert_eq!(Context::PromptNeighbours(2).neighbours(), 2);
        assert_eq!(Context::Prompt.neighbours(), 0);
        assert!(!Context::Neighbours(1).prompt() && !Context::None.prompt());
        let c: IngestConfig = serde_json::from_str(r#"{"context": "neighbours:2"}"#).unwrap();
        assert_eq!(c.context, Context::Neighbours(2));
        assert!(serde_json::from_str::<IngestConfig>(r#"{"context": "neighbours:12"}"#).is_err());
        assert_eq!(IngestConfig::default().context, Context::None);
        // A passage needs the prompt's start to follow.
        let with_passage = |context: &str| IngestConfig {
            context: context.parse().unwrap(),
            context_passage: "Some passage.".into(),
            ..IngestConfig::default()
        };
        assert!(with_passage("none").validate().is_err());
        assert!(with_passage("neighbours:1").validate().is_err());
        assert!(with_passage("prompt").validate().is_ok());
        assert!(with_passage("prompt+neighbours:1").validate().is_ok());
        // The first place's copy: only behind the prompt's start and neighbours, no passage.
        let exact_first = |context: &str| IngestConfig {
            context: context.parse().unwrap(),
            exact_first: true,
            ..IngestConfig::default()
        };
        for bad in ["none", "prompt", "neighbours:1", "mean:2"] {
            assert!(exact_first(bad).validate().is_err(), "{bad}");
        }
        for good in ["prompt+neighbours:1", "prompt+mean:2"] {
            assert!(exact_first(good).validate().is_ok(), "{good}");
        }
        let passage = IngestConfig {
            context_passage: "Some passage.".into(),
            ..exact_first("prompt+mean:2")
        };
        assert!(passage.validate().is_err());
    }

    #[test]
    fn shards_partition_documents() {
        let two: Vec<Shard> = ["0/2", "1/2"].iter().map(|s| s.parse().unwrap()).collect();
        let ids: Vec<String> = (0..200).map(|i| format!("doc-{i}.txt")).collect();
        for id in &ids {
            assert_eq!(two.iter().filter(|s| s.contains(id)).count(), 1, "{id}");
        }
        let first = ids.iter().filter(|d| two[0].contains(d)).count();
        assert!((70..130).contains(&first), "{first} of 200 in shard 0");
        assert!("0/1".parse::<Shard>().unwrap().contains("anything"));
        for bad in ["2/2", "1/0", "1", "a/b", "-1/2"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
    }

    #[test]
    fn materialize_parses() {
        assert_eq!("lazy".parse::<Materialize>().unwrap(), Materialize::Lazy);
        assert!("sometimes".parse::<Materialize>().is_err());
    }
}
