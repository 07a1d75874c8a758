//! How a prompt's KV is put together from the system prefix and the retrieved chunks.
//!
//! Every chunk's KV is computed alone at positions `0..n` (ingest stores it so), so an
//! assembled prompt is not what a full prefill computes: no chunk attends to the chunks before
//! it, and, unless moved, every chunk claims the positions `0..n`. The strategies (a request
//! names one, optionally with its parameter after a colon: `link:8`, `query-aware:0.2`):
//!
//! | strategy | chunk positions | cross-chunk attention | cost at query time |
//! |---|---|---|---|
//! | `naive` (MatKV) | `0..n` each, as stored | none | load only |
//! | `reposition` | consecutive after the prefix (keys rotated) | none | load + one rotation of the keys |
//! | `reposition+recompute[:share]` | consecutive | the `share` (`serve.recompute_share`) of chunk tokens whose layer-1 KV deviates most is recomputed with full attention ([`model::Decoder::blend`], CacheBlend's selection) | layer 0 of every chunk token plus `share` of the tokens through every layer |
//! | `link[:k]` (EPIC; the default, `k` = 2) | consecutive | the first `k` (`serve.link_tokens`) tokens of every chunk are recomputed with full attention: a chunk computed alone makes its first tokens an attention sink, which the others' tokens then over-attend | `k` × chunks tokens through every layer |
//! | `sensitive[:k]` | consecutive | `k` (`serve.link_tokens`) tokens of every chunk are recomputed: those whose rows moved most between the contexts ingest prefilled the chunk in (`ingest.context = "[prompt+]mean:N"` ranks them in the chunk's note, [`model::Kv::drift`]); a chunk without that ranking gets its first `k`, as `link` | `k` × chunks tokens through every layer, one note read per chunk |
//! | `query-aware[:share]` (ProphetKV's stage I, QCFuse; also named `prophet[:share]`) | consecutive | the `share` (`serve.recompute_share`) of chunk tokens the question attends to most (its attention to the *stored* keys, summed over heads on the first quarter of the layers, at least 2), is recomputed with full attention | the question through those layers, plus `share` of the tokens through every layer |
//! | `window[:k]` (arXiv 2609.17983, MEPIC) | consecutive | contiguous windows of `k` tokens (32 by default) are recomputed: the first `k` of every chunk, then one around each position the question attends to most (scored as `query-aware` does), until `serve.recompute_share` of the chunk tokens is covered | as `query-aware`, with at least `k` × chunks tokens |
//! | `full` | consecutive | full: the chunks are prefilled with the question, nothing stored is used | full prefill |
//!
//! Measured (`ragkv eval qa`, Qwen2.5-Coder-0.5B Q4_K_M quantized, all 100 LongBench-HotpotQA
//! dev questions over the whole corpus, top-5; agreement: share of full prefill's greedy answer
//! tokens each strategy also predicts when teacher-forced; TTFT relative to `reposition`'s
//! median, 171 ms on a 2-core VM; docs/BENCHMARKS.md, repair):
//!
//! | strategy | F1 (full 21.3) | token agreement | KL/token | TTFT |
//! |---|---:|---:|---:|---:|
//! | `naive` | 16.5 | 85.6 % | 0.238 | 0.98× |
//! | `reposition` | 20.9 | 86.8 % | 0.202 | 1× |
//! | `reposition+recompute:0.15` | 18.7 | 90.5 % | 0.103 | 8.9× |
//! | `link:2` (default) | 18.6 | 88.4 % | 0.179 | 1.19× |
//! | `link:8` | 18.1 | 89.5 % | 0.156 | 1.51× |
//! | `link:32` | 22.2 | 90.5 % | 0.118 | 2.96× |
//! | `query-aware:0.05` | 17.2 | 89.6 % | 0.161 | 3.11× |
//! | `query-aware:0.15` | 16.4 | 90.0 % | 0.151 | 5.64× |
//! | `full` | 21.3 | 100 % | 0 | 26.9× |
//!
//! (Measured with f32 decoding caches. With f16 ones, the default since: `reposition` 86.8 %,
//! `link:2` 87.7 % and KL 0.187 at 0.98× `reposition`'s TTFT, `link:32` 90.1 % at 3.1×, full
//! prefill's answers unchanged; docs/BENCHMARKS.md.)
//!
//! What more recomputation buys (same index and questions, f16 caches, one later run):
//! `link:32` 90.3 % at 3.1× `reposition`'s TTFT, `query-aware:0.3` 91.3 % at 10.9×, `link:128`
//! 92.8 % at 10×, `reposition+recompute:0.5` 94.5 % at 21× (69 % of full prefill's); the
//! heavy ones lose F1 (−5 to −6 points against full, intervals excluding zero).
//!
//! `link:2` is the default: the only repair within 1.5× `reposition`'s time to first token,
//! and measurably closer to full prefill than it (F1 differences of a few points are within
//! the run's ±7-point intervals). `link:32` where three times the TTFT is affordable.
//!
//! Every strategy reads chunk KV as it is stored, whatever context ingest prefilled it in
//! (`ingest.context`: after its nearest chunks, after the prompt's start, or the mean of its
//! rows over several such contexts), which no strategy needs to know. What each mode buys
//! `link:2` (share of `naive`'s gap to full prefill closed, same setting): plain 15 %,
//! `neighbours:1` 33 %, `prompt` 22 %, `prompt+neighbours:1` 37 %, `prompt+mean:2` 43 %, and
//! with `ingest.exact_first` (the first chunk's copy after the prompt's start alone) 50 %;
//! their ingest cost and every other strategy on them: docs/BENCHMARKS.md, "Spending the work
//! at ingestion". `bench ttft --strategy` times one.
//!
//! A first chunk whose KV is what full prefill computes at its place (its copy after the
//! prompt's start alone under `ingest.exact_first`, or its own KV under `ingest.context =
//! "prompt"`) is not repaired: `link`, `sensitive` and `window` start at the second chunk
//! ([`Prompt::exact_chunks`]), so `link:k` over five chunks recomputes `4k` tokens.
//!
//! Recomputed tokens attend to the whole context (prefix and every chunk, causally), with
//! their own rows replaced layer by layer ([`model::Decoder::recompute`]); `link` with `k` at
//! least the longest chunk recomputes every chunk token, which is full prefill of the context.
//! Measured quality and time to first token of each: docs/BENCHMARKS.md, quality.
//!
//! The question always follows the last chunk's position in the cache. Chunk boundaries:
//! chunks are tokenized alone, without leading special tokens, and follow each other
//! directly after the prefix's `Context:` line, exactly as the `full` strategy sees them.
//! `ingest.chunk_preamble` can put the same text before every chunk (prefilled with it); a
//! comparison of none, `\n` and `Passage:\n` with SmolLM2 was inconclusive (docs/BENCHMARKS.md),
//! so the default is none.

use model::{DType, Kv, KvCache, Model, Repaired, Tensor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A share of the chunk tokens, in thousandths (`0.001..=1`): exact to compare and to name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Share(u16);

impl Share {
    /// `f` in `(0, 1]`, rounded to thousandths (at least one).
    pub fn new(f: f64) -> Result<Share, String> {
        if !(f > 0.0 && f <= 1.0) {
            return Err(format!("share {f} is outside (0, 1]"));
        }
        Ok(Share(((f * 1000.0).round() as u16).max(1)))
    }

    /// The share as a fraction in (0, 1].
    pub fn get(self) -> f64 {
        f64::from(self.0) / 1000.0
    }
}

/// The repair parameters a strategy's name leaves out (`[serve]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Repair {
    /// `serve.recompute_share`: for `reposition+recompute` and `query-aware`.
    pub recompute_share: f64,
    /// `serve.link_tokens`: for `link`.
    pub link_tokens: usize,
}

/// An assembly strategy (see the module table); a parameter left out comes from [`Repair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Assembly {
    /// `naive`: each chunk at positions `0..n`, as stored.
    Naive,
    /// `reposition`: chunks consecutive after the prefix, keys rotated.
    Reposition,
    /// `reposition+recompute[:share]`: the most deviating tokens recomputed.
    Recompute(Option<Share>),
    /// `link[:k]`: the first `k` tokens of every chunk recomputed.
    Link(Option<u32>),
    /// `sensitive[:k]`: the `k` tokens of every chunk whose rows moved most between the
    /// contexts ingest prefilled it in recomputed (its first `k` where none are ranked).
    Sensitive(Option<u32>),
    /// `query-aware[:share]` (or `prophet[:share]`): the tokens the question attends to most
    /// recomputed.
    QueryAware(Option<Share>),
    /// `window[:k]`: contiguous `k`-token windows at the chunk boundaries and around the
    /// tokens the question attends to most recomputed.
    Window(Option<u32>),
    /// `full`: the chunks prefilled with the question, nothing stored used.
    Full,
}

/// `link` (with `serve.link_tokens`, 2 by default): chosen by the whole-corpus evaluation
/// (docs/BENCHMARKS.md, repair).
impl Default for Assembly {
    fn default() -> Self {
        Assembly::Link(None)
    }
}

impl Assembly {
    /// Every strategy, with its configured parameter.
    pub const ALL: [Assembly; 8] = [
        Assembly::Naive,
        Assembly::Reposition,
        Assembly::Recompute(None),
        Assembly::Link(None),
        Assembly::Sensitive(None),
        Assembly::QueryAware(None),
        Assembly::Window(None),
        Assembly::Full,
    ];

    /// The strategy's name, without its parameter.
    pub fn name(self) -> &'static str {
        match self {
            Assembly::Naive => "naive",
            Assembly::Reposition => "reposition",
            Assembly::Recompute(_) => "reposition+recompute",
            Assembly::Link(_) => "link",
            Assembly::Sensitive(_) => "sensitive",
            Assembly::QueryAware(_) => "query-aware",
            Assembly::Window(_) => "window",
            Assembly::Full => "full",
        }
    }

    /// The strategy with its parameter filled in from `repair` where its name leaves it out
    /// (`link` with `serve.link_tokens` 2 is `link:2`): the strategy a query actually runs.
    pub fn resolved(self, repair: &Repair) -> Assembly {
        let share = || Share::new(repair.recompute_share).ok();
        match self {
            Assembly::Link(None) => Assembly::Link(u32::try_from(repair.link_tokens).ok()),
            Assembly::Sensitive(None) => {
                Assembly::Sensitive(u32::try_from(repair.link_tokens).ok())
            }
            Assembly::Recompute(None) => Assembly::Recompute(share()),
            Assembly::QueryAware(None) => Assembly::QueryAware(share()),
            Assembly::Window(None) => Assembly::Window(Some(WINDOW_TOKENS)),
            a => a,
        }
    }

    /// The same strategy, whatever its parameter.
    pub fn same_kind(self, other: Assembly) -> bool {
        self.name() == other.name()
    }

    /// The dtype a chunk's placed KV is best delivered in: the decoding cache's (`cache`)
    /// where chunks go into the cache as they are (`naive`, `reposition`, `link`: the loader
    /// thread converts them, the model thread only copies), the compute dtype where the
    /// whole context is scored first (`reposition+recompute`, `query-aware`).
    pub fn chunk_dtype(self, compute: DType, cache: DType) -> DType {
        match self {
            Assembly::Naive | Assembly::Reposition | Assembly::Link(_) | Assembly::Sensitive(_) => {
                cache
            }
            Assembly::Recompute(_)
            | Assembly::QueryAware(_)
            | Assembly::Window(_)
            | Assembly::Full => compute,
        }
    }

    /// Whether stored chunk KV is used at all.
    pub fn uses_stored_kv(self) -> bool {
        self != Assembly::Full
    }

    /// A chunk's KV (computed at `0..n`) placed for a prompt where its first token sits at
    /// `pos`: rotated there, except for `naive`.
    pub fn place(self, model: &Model, kv: Kv, pos: usize) -> model::Result<Kv> {
        match self {
            Assembly::Naive => Ok(kv),
            _ => model.decoder().reposition(&kv, pos as i64),
        }
    }

    /// [`Assembly::place`] of one layer's keys (values stay where they are).
    pub fn place_keys(
        self,
        model: &Model,
        layer: usize,
        k: Tensor,
        pos: usize,
    ) -> model::Result<Tensor> {
        match self {
            Assembly::Naive => Ok(k),
            _ => model.decoder().reposition_keys(layer, &k, pos as i64),
        }
    }
}

impl std::str::FromStr for Assembly {
    type Err = String;

    /// A name from the table, optionally `:parameter`; a space stands for `+` (an unescaped
    /// `+` in a URL query string arrives as a space).
    fn from_str(s: &str) -> Result<Assembly, String> {
        let text = s.trim().replace(' ', "+");
        let (name, param) = match text.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (text.as_str(), None),
        };
        // ProphetKV's stage I is what `query-aware` does.
        let name = if name == "prophet" {
            "query-aware"
        } else {
            name
        };
        let base = Assembly::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                format!(
                    "assembly: {s:?} is not one of {}",
                    Assembly::ALL.map(Assembly::name).join(", ")
                )
            })?;
        let Some(p) = param else { return Ok(base) };
        let share = || {
            p.parse::<f64>()
                .map_err(|e| e.to_string())
                .and_then(Share::new)
                .map(Some)
                .map_err(|e| format!("assembly: {s:?}: the share {p:?}: {e}"))
        };
        match base {
            Assembly::Recompute(_) => Ok(Assembly::Recompute(share()?)),
            Assembly::QueryAware(_) => Ok(Assembly::QueryAware(share()?)),
            Assembly::Link(_) | Assembly::Sensitive(_) | Assembly::Window(_) => {
                let window = base == Assembly::Window(None);
                match p.parse::<u32>() {
                    Ok(k) if k > 0 => Ok(match base {
                        Assembly::Link(_) => Assembly::Link(Some(k)),
                        Assembly::Sensitive(_) => Assembly::Sensitive(Some(k)),
                        _ => Assembly::Window(Some(k)),
                    }),
                    _ => Err(format!(
                        "assembly: {s:?}: the tokens per {} {p:?} must be a positive integer",
                        if window { "window" } else { "chunk" }
                    )),
                }
            }
            _ => Err(format!("assembly: {name} takes no parameter ({s:?})")),
        }
    }
}

impl std::fmt::Display for Assembly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())?;
        match self {
            Assembly::Recompute(Some(s)) | Assembly::QueryAware(Some(s)) => {
                write!(f, ":{}", s.get())
            }
            Assembly::Link(Some(k)) | Assembly::Sensitive(Some(k)) | Assembly::Window(Some(k)) => {
                write!(f, ":{k}")
            }
            _ => Ok(()),
        }
    }
}

impl Serialize for Assembly {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Assembly {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Assembly, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Tokens per window of `window` without a parameter (the window arXiv 2609.17983 measured).
pub const WINDOW_TOKENS: u32 = 32;

/// Layers on which `query-aware` measures the question's attention: the first quarter (at
/// least 2).
fn score_layers(model: &Model) -> usize {
    (model.config().layers / 4).max(2)
}

/// One prompt to assemble: the system prefix's KV (exact, at `0..`), then the chunks' KV,
/// each already [placed](Assembly::place); `tokens` are the prefix's and the chunks' tokens
/// in order, `question` the tokens that follow them.
#[derive(Debug)]
pub struct Prompt<'a> {
    /// The system prefix's KV.
    pub prefix: &'a Kv,
    /// Each chunk's KV, placed at its prompt positions.
    pub chunks: Vec<Kv>,
    /// The prefix's and the chunks' tokens.
    pub tokens: &'a [u32],
    /// The question's tokens.
    pub question: &'a [u32],
    /// Each chunk's token offsets, the most moved between its ingest contexts first
    /// ([`ingest::Corpus::ranked_offsets`]); only `sensitive` reads them (empty: none).
    pub ranked: Vec<Vec<u16>>,
    /// How many chunks, from the first, hold what full prefill computes at their place (the
    /// first place's copy, `ingest.exact_first`): `link`, `sensitive` and `window` recompute
    /// none of their tokens.
    pub exact_chunks: usize,
}

/// When a `link` repair recomputes its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkTiming {
    /// During assembly, in one pass with the question.
    Now,
    /// Later, by the caller: [`assemble_into`] only chooses the rows.
    Deferred,
}

/// The decoding cache a prompt is assembled into.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// Tokens of room after the prompt (and the question's rows).
    pub room: usize,
    /// The cache's dtype.
    pub dtype: DType,
    /// When a `link` repair runs.
    pub link: LinkTiming,
}

/// The prompt's KV, repaired as the strategy says.
///
/// A repair runs the question in the same pass as the recomputed tokens (one pass's fixed
/// cost instead of two): its KV is then appended and the logits after it returned. Without
/// a repair (`naive`, `reposition`) nothing runs: `logits` is `None` and the question is
/// still to be fed (by the batch, which shares that prefill's steps with other queries'
/// decoding). [`assemble_into`] in the model's dtype, exported.
pub fn assemble(
    model: &Model,
    assembly: Assembly,
    repair: &Repair,
    prompt: Prompt<'_>,
) -> model::Result<Repaired> {
    let target = Target {
        room: 0,
        dtype: model.dtype(),
        link: LinkTiming::Now,
    };
    let r = assemble_into(model, assembly, repair, prompt, target)?;
    Ok(Repaired {
        kv: r.cache.to_kv()?,
        positions: r.positions,
        logits: r.logits,
    })
}

/// An assembled prompt in the cache that decodes it.
#[derive(Debug)]
pub struct Ready {
    /// The context (prefix and chunks, repaired), then the question's rows if a repair ran it.
    pub cache: KvCache,
    /// The context positions recomputed, ascending.
    pub positions: Vec<usize>,
    /// Logits `(vocab,)` after the question when a repair ran it.
    pub logits: Option<Tensor>,
    /// The recompute of `positions` and the question is left to the caller
    /// ([`LinkTiming::Deferred`]).
    pub deferred: bool,
}

/// [`assemble`] straight into a decoding cache (`target`: its dtype, with room for the
/// question and `target.room` more tokens): the parts are copied into it once (converted as
/// they go) and `link` repairs them there ([`model::Decoder::recompute_in`]), where a
/// concatenated copy, a repaired copy and the cache's own copy were made before.
/// `reposition+recompute` and `query-aware` score the whole context first, so they still
/// assemble it once in the compute dtype.
///
/// With [`LinkTiming::Deferred`], `link` only chooses its rows: the cache holds the context
/// unrepaired, `positions` the rows to recompute, and the caller feeds their tokens, then the
/// question, through [`model::Decoder::step`] (`StepSeq::redo`) (the batch does, in a step beside the
/// other queries' decoding tokens: one read of the weights for both).
pub fn assemble_into(
    model: &Model,
    assembly: Assembly,
    repair: &Repair,
    prompt: Prompt<'_>,
    target: Target,
) -> model::Result<Ready> {
    let Prompt {
        prefix,
        chunks,
        tokens,
        question,
        ranked,
        exact_chunks,
    } = prompt;
    let Target { room, dtype, link } = target;
    let exact = prefix.len();
    let lens: Vec<usize> = chunks.iter().map(Kv::len).collect();
    // Where the boundary repairs start: after the prefix and the chunks already exact.
    let skip = exact_chunks.min(lens.len());
    let repaired_from = exact + lens[..skip].iter().sum::<usize>();
    let mut parts = Vec::with_capacity(chunks.len() + 1);
    parts.push(prefix.clone());
    parts.extend(chunks);
    let share = |s: Option<Share>| s.map_or(repair.recompute_share, Share::get);
    let extra = question.len() + room;
    let positions = match assembly {
        Assembly::Naive | Assembly::Reposition | Assembly::Full => {
            return Ok(Ready {
                cache: KvCache::from_parts_in(&parts, extra, dtype)?,
                positions: Vec::new(),
                logits: None,
                deferred: false,
            })
        }
        Assembly::Recompute(s) => {
            let all = Kv::concat(&parts)?;
            let r = model
                .decoder()
                .blend(&all, tokens, exact, share(s), question)?;
            return Ok(Ready {
                cache: KvCache::from_kv_in(&r.kv, room, dtype)?,
                positions: r.positions,
                logits: r.logits,
                deferred: false,
            });
        }
        Assembly::Link(k) => {
            let k = k.map_or(repair.link_tokens, |k| k as usize);
            model::link_positions(repaired_from, &lens[skip..], k)
        }
        Assembly::Sensitive(k) => {
            let k = k.map_or(repair.link_tokens, |k| k as usize);
            let ranked = ranked.get(skip..).unwrap_or_default();
            model::sensitive_positions(repaired_from, &lens[skip..], ranked, k)
        }
        Assembly::QueryAware(s) => {
            let all = Kv::concat(&parts)?;
            let scores = model
                .decoder()
                .question_attention(&all, question, score_layers(model))?;
            model::top_share(&scores[exact..], exact, share(s))
        }
        Assembly::Window(k) => {
            let all = Kv::concat(&parts)?;
            let scores = model
                .decoder()
                .question_attention(&all, question, score_layers(model))?;
            let k = k.unwrap_or(WINDOW_TOKENS) as usize;
            let (from, lens) = (repaired_from, &lens[skip..]);
            model::window_positions(from, lens, &scores[from..], k, share(None))
        }
    };
    let mut cache = KvCache::from_parts_in(&parts, extra, dtype)?;
    let deferred = link == LinkTiming::Deferred
        && matches!(assembly, Assembly::Link(_) | Assembly::Sensitive(_))
        && !positions.is_empty();
    let logits = if deferred {
        None
    } else {
        model
            .decoder()
            .recompute_in(&mut cache, tokens, &positions, question)?
    };
    Ok(Ready {
        cache,
        positions,
        logits,
        deferred,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_in_text_and_json() {
        let with = [
            Assembly::Recompute(Some(Share::new(0.15).unwrap())),
            Assembly::Link(Some(8)),
            Assembly::QueryAware(Some(Share::new(0.2).unwrap())),
            Assembly::Window(Some(16)),
            Assembly::Sensitive(Some(4)),
        ];
        for a in Assembly::ALL.into_iter().chain(with) {
            let text = a.to_string();
            assert_eq!(text.parse::<Assembly>().unwrap(), a, "{text}");
            let j = serde_json::to_string(&a).unwrap();
            assert_eq!(j, format!("\"{text}\""));
            assert_eq!(serde_json::from_str::<Assembly>(&j).unwrap(), a);
        }
        assert_eq!(
            with.map(|a| a.to_string()),
            [
                "reposition+recompute:0.15",
                "link:8",
                "query-aware:0.2",
                "window:16",
                "sensitive:4"
            ]
        );
        assert_eq!(
            "prophet:0.1".parse::<Assembly>().unwrap(),
            Assembly::QueryAware(Some(Share::new(0.1).unwrap()))
        );
        assert_eq!(
            "reposition recompute".parse::<Assembly>().unwrap(),
            Assembly::Recompute(None)
        );
        assert!(Assembly::Link(Some(2)).same_kind(Assembly::Link(None)));
        let e = "blend".parse::<Assembly>().unwrap_err();
        assert!(
            e.contains("reposition+recompute") && e.contains("query-aware"),
            "{e}"
        );
        for bad in [
            "link:0",
            "link:x",
            "link:-1",
            "query-aware:0",
            "query-aware:1.5",
            "reposition:2",
            "full:1",
            "reposition+recompute:nan",
            "window:0",
            "prophet:2",
            "sensitive:0",
            "sensitive:0.5",
        ] {
            assert!(bad.parse::<Assembly>().is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<Assembly>("\"link:0\"").is_err());
        assert_eq!(Assembly::default(), Assembly::Link(None));
        assert_eq!(Share::new(0.0004).unwrap().get(), 0.001);
    }

    #[test]
    fn a_strategy_without_its_parameter_resolves_to_the_configured_one() {
        let repair = Repair {
            recompute_share: 0.2,
            link_tokens: 2,
        };
        assert_eq!(Assembly::Link(None).resolved(&repair).to_string(), "link:2");
        assert_eq!(
            Assembly::Link(Some(8)).resolved(&repair).to_string(),
            "link:8"
        );
        assert_eq!(
            Assembly::QueryAware(None).resolved(&repair).to_string(),
            "query-aware:0.2"
        );
        assert_eq!(
            Assembly::Recompute(None).resolved(&repair).to_string(),
            "reposition+recompute:0.2"
        );
        assert_eq!(
            Assembly::Sensitive(None).resolved(&repair).to_string(),
            "sensitive:2"
        );
        assert_eq!(Assembly::Naive.resolved(&repair), Assembly::Naive);
    }
}
