#![deny(missing_docs)]
//! Benchmarks. Each one runs ragkv and a baseline in the same process, on the same data, and
//! returns [`Line`]s that the CLI prints as JSON:
//! `{"bench", "ours", "baseline", "ratio", "unit", ...}` where `ratio` says how many times better
//! ours is (throughput: ours / baseline; latency and counts: baseline / ours).

pub mod chaos;
pub mod compaction;
pub mod dataset;
pub mod engine;
pub mod eviction;
pub mod fuzz;
pub mod index_server;
pub mod ingest;
pub mod kvstore;
pub mod llama;
pub mod load;
pub mod model;
pub mod peer;
mod progress;
pub mod qa;
pub mod remote_tier;
pub mod retrieval;
pub mod scaleout;
pub mod score;
mod sse;
pub mod ttft;

use serde::Serialize;

/// One compared figure.
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    /// What is measured.
    pub bench: String,
    /// ragkv's figure.
    pub ours: f64,
    /// The baseline's figure.
    pub baseline: f64,
    /// How many times better ours is; above 1 means ours wins.
    pub ratio: f64,
    /// Unit of both figures.
    pub unit: String,
    /// What the baseline is.
    pub baseline_name: String,
    /// The bar the issue sets, if any, and whether this run met it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bar: Option<f64>,
    /// Whether `ratio` reached `bar`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub meets_bar: Option<bool>,
    /// Supporting figures of the same run (counts, per-stage times).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<serde_json::Value>,
}

impl Line {
    /// A figure where higher is better (throughput, bandwidth).
    pub fn higher(bench: &str, ours: f64, baseline: f64, unit: &str, baseline_name: &str) -> Line {
        Line::new(bench, ours, baseline, ours / baseline, unit, baseline_name)
    }

    /// A figure where lower is better (latency, file count).
    pub fn lower(bench: &str, ours: f64, baseline: f64, unit: &str, baseline_name: &str) -> Line {
        Line::new(bench, ours, baseline, baseline / ours, unit, baseline_name)
    }

    fn new(
        bench: &str,
        ours: f64,
        baseline: f64,
        ratio: f64,
        unit: &str,
        baseline_name: &str,
    ) -> Line {
        Line {
            bench: bench.into(),
            ours,
            baseline,
            // Equal figures (0 and 0 included) are a tie, not a division by zero.
            ratio: if ours == baseline { 1.0 } else { ratio },
            unit: unit.into(),
            baseline_name: baseline_name.into(),
            bar: None,
            meets_bar: None,
            detail: None,
        }
    }

    /// Attaches supporting figures.
    pub fn detail(mut self, detail: serde_json::Value) -> Line {
        self.detail = Some(detail);
        self
    }

    /// Records the bar on `ratio` and whether it is met.
    pub fn bar(mut self, bar: f64) -> Line {
        self.bar = Some(bar);
        self.meets_bar = Some(self.ratio >= bar);
        self
    }
}

/// Errors of the benchmark harness.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// File-system I/O failed.
    #[error("{what}: {cause}")]
    Io {
        /// What was being read or written.
        what: String,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The KV store failed.
    #[error(transparent)]
    Store(#[from] ::kvstore::Error),
    /// A baseline's RocksDB failed.
    #[error("rocksdb ({what}): {cause}")]
    Rocks {
        /// The operation.
        what: &'static str,
        /// RocksDB's error.
        cause: rocksdb::Error,
    },
    /// A bad argument.
    #[error("invalid argument {what}: {why}")]
    Invalid {
        /// The argument.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A benchmark's own check failed (wrong answers, missing output, a baseline that did not run).
    #[error("benchmark check failed: {0}")]
    Check(String),
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |cause| Error::Io { what, cause }
}

/// A benchmark's working directory: the one given (`--dir`), or a fresh temporary one that
/// is removed when this is dropped.
#[derive(Debug)]
pub(crate) struct WorkDir {
    path: std::path::PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl WorkDir {
    pub(crate) fn new(given: Option<&std::path::Path>) -> Result<WorkDir, Error> {
        Ok(match given {
            Some(d) => WorkDir {
                path: d.to_path_buf(),
                _tmp: None,
            },
            None => {
                let tmp = tempfile::tempdir().map_err(io("creating a temporary directory"))?;
                WorkDir {
                    path: tmp.path().to_path_buf(),
                    _tmp: Some(tmp),
                }
            }
        })
    }

    pub(crate) fn path(&self) -> &std::path::Path {
        &self.path
    }
}

/// Seconds since the Unix epoch: names a run's scratch collections and bucket prefixes on
/// shared servers.
pub(crate) fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Percentile of sorted samples.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Median of unsorted samples (the upper one of an even count; NaN for none).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}
