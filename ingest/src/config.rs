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

/// `[ingest]` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IngestConfig {
    pub chunk_tokens: usize,
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
        }
    }
}

impl IngestConfig {
    pub fn chunker(&self) -> ChunkerConfig {
        ChunkerConfig {
            chunk_tokens: self.chunk_tokens,
            overlap_tokens: self.overlap_tokens,
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
        if !(self.namespace_grace_hours >= 0.0 && self.namespace_grace_hours.is_finite()) {
            return Err(Error::Invalid {
                what: "ingest.namespace_grace_hours",
                why: format!("{} (must be ≥ 0)", self.namespace_grace_hours),
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
    pub materialize: Materialize,
    /// Delete indexed documents that none of the sources yielded.
    pub prune: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn materialize_parses() {
        assert_eq!("lazy".parse::<Materialize>().unwrap(), Materialize::Lazy);
        assert!("sometimes".parse::<Materialize>().is_err());
    }
}
