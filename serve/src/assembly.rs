//! How a prompt's KV is put together from the system prefix and the retrieved chunks.
//!
//! Every chunk's KV is computed alone at positions `0..n` (ingest stores it so), so an
//! assembled prompt is not what a full prefill computes: no chunk attends to the chunks before
//! it, and, unless moved, every chunk claims the positions `0..n`. The strategies:
//!
//! | strategy | chunk positions | cross-chunk attention | cost at query time |
//! |---|---|---|---|
//! | `naive` (MatKV) | `0..n` each, as stored | none | load only |
//! | `reposition` (default) | consecutive after the prefix (keys rotated) | none | load + one rotation of the keys |
//! | `reposition+recompute` | consecutive | the `recompute_share` of chunk tokens whose layer-1 KV deviates most is recomputed with full attention ([`model::Model::blend`], CacheBlend's selection) | about one layer of prefill plus `share` of the rest |
//! | `full` | consecutive | full: the chunks are prefilled with the question, nothing stored is used | full prefill |
//!
//! The question always follows the last chunk's position in the cache. Chunk boundaries:
//! chunks are tokenized alone, without leading special tokens, and follow each other
//! directly after the prefix's `Context:` line, exactly as the `full` strategy sees them.
//! `ingest.chunk_preamble` can put the same text before every chunk (prefilled with it); a
//! comparison of none, `\n` and `Passage:\n` with SmolLM2 was inconclusive (docs/BENCHMARKS.md),
//! so the default is none.

use model::{Kv, Model};
use serde::{Deserialize, Serialize};

/// An assembly strategy (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Assembly {
    #[serde(rename = "naive")]
    Naive,
    #[default]
    #[serde(rename = "reposition")]
    Reposition,
    #[serde(rename = "reposition+recompute")]
    Recompute,
    #[serde(rename = "full")]
    Full,
}

impl Assembly {
    pub const ALL: [Assembly; 4] = [
        Assembly::Naive,
        Assembly::Reposition,
        Assembly::Recompute,
        Assembly::Full,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Assembly::Naive => "naive",
            Assembly::Reposition => "reposition",
            Assembly::Recompute => "reposition+recompute",
            Assembly::Full => "full",
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
            _ => model.reposition(&kv, pos as i64),
        }
    }
}

impl std::str::FromStr for Assembly {
    type Err = String;

    /// A name from the table; a space stands for `+` (an unescaped `+` in a URL query
    /// string arrives as a space).
    fn from_str(s: &str) -> Result<Assembly, String> {
        let name = s.trim().replace(' ', "+");
        Assembly::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                format!(
                    "assembly: {s:?} is not one of {}",
                    Assembly::ALL.map(Assembly::name).join(", ")
                )
            })
    }
}

impl std::fmt::Display for Assembly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The prompt's KV: `prefix` (exact, at `0..`), then the chunks' KV, each already
/// [placed](Assembly::place); with `reposition+recompute`, blended over the whole context.
/// `tokens` are the prefix's and the chunks' tokens in order. Returns the KV and how many
/// tokens were recomputed.
pub fn assemble(
    model: &Model,
    assembly: Assembly,
    recompute_share: f64,
    prefix: &Kv,
    chunks: Vec<Kv>,
    tokens: &[u32],
) -> model::Result<(Kv, usize)> {
    let mut parts = Vec::with_capacity(chunks.len() + 1);
    parts.push(prefix.clone());
    parts.extend(chunks);
    let all = Kv::concat(&parts)?;
    if assembly != Assembly::Recompute {
        return Ok((all, 0));
    }
    let (kv, recomputed) = model.blend(&all, tokens, prefix.len(), recompute_share)?;
    Ok((kv, recomputed.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_in_text_and_json() {
        for a in Assembly::ALL {
            assert_eq!(a.name().parse::<Assembly>().unwrap(), a);
            let j = serde_json::to_string(&a).unwrap();
            assert_eq!(j, format!("\"{}\"", a.name()));
            assert_eq!(serde_json::from_str::<Assembly>(&j).unwrap(), a);
        }
        assert_eq!(
            "reposition recompute".parse::<Assembly>().unwrap(),
            Assembly::Recompute
        );
        let e = "blend".parse::<Assembly>().unwrap_err();
        assert!(e.contains("reposition+recompute"), "{e}");
        assert_eq!(Assembly::default(), Assembly::Reposition);
    }
}
