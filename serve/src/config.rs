//! `[serve]` configuration.

use serde::{Deserialize, Serialize};

use crate::assembly::Assembly;
use crate::error::{Error, Result};
use crate::maintenance::Schedules;
use crate::schedule::Cron;

/// `serve.cache_dtype`: what a decoding query's KV cache keeps its keys and values in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheDtype {
    /// Half precision (default).
    #[default]
    F16,
    /// Single precision.
    F32,
    /// 8-bit rows with a scale each ([`model::Q8_CACHE`]; llama.cpp's `q8_0` cache): about
    /// half the bytes of f16 per decoding step, CPU only.
    Q8,
}

impl CacheDtype {
    /// The tensor dtype (`model::Q8_CACHE` for `q8`).
    pub fn dtype(self) -> model::DType {
        match self {
            CacheDtype::F16 => model::DType::F16,
            CacheDtype::F32 => model::DType::F32,
            CacheDtype::Q8 => model::Q8_CACHE,
        }
    }
}

/// Server settings; validated before binding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Address to listen on. A non-loopback address requires `admin_token`.
    pub bind: String,
    /// Bearer token for document add/delete. Empty: admin routes are open (loopback only).
    pub admin_token: String,
    /// Requests admitted at once (retrieving, loading, queued or generating); more get 429.
    pub max_inflight: usize,
    /// Queries the model decodes together in one batch (continuous batching); more wait.
    pub max_batch: usize,
    /// KV cache the batch's queries may hold together, in MiB (each reserves its prompt and
    /// `max_tokens` when it joins); past it, queries wait for room.
    pub kv_budget_mb: usize,
    /// Prompt tokens a joining query feeds per batch step (a longer question, or a `full`
    /// assembly's whole context, is prefilled over several steps so that the others' next
    /// tokens are not held up for long).
    pub prefill_chunk: usize,
    /// A request is cancelled after this long.
    pub request_timeout_ms: u64,
    /// Longest question accepted.
    pub max_question_chars: usize,
    /// Chunks retrieved when a request does not say.
    pub default_top_k: usize,
    /// Most chunks a request may ask for.
    pub max_top_k: usize,
    /// Answer length when a request does not say.
    pub default_max_tokens: usize,
    /// Longest answer a request may ask for.
    pub max_tokens_limit: usize,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// System prompt placed before the retrieved chunks.
    pub system_prompt: String,
    /// How chunk KV is assembled when a request does not say (see [`crate::Assembly`]).
    pub assembly: Assembly,
    /// Share of chunk tokens `reposition+recompute`, `query-aware` and `window` recompute, in
    /// (0, 1].
    pub recompute_share: f64,
    /// Tokens at the start of every chunk `link` recomputes (1..=4096).
    pub link_tokens: usize,
    /// Dtype of a query's KV cache while the batch decodes it: `f16` (default: half the
    /// memory per query under `kv_budget_mb`, half the bytes each decode step's attention
    /// reads; llama.cpp's default too) or `f32`. Stored chunk KV goes into it as read (keys
    /// turned to their prompt positions in f32, rounded once); `link` writes its recomputed
    /// rows there, and the question's and answer's rows are rounded as they are appended
    /// (`reposition+recompute`, `query-aware` and `window` score and repair in the compute dtype
    /// first). Stored KV's own dtype is `model.kv_dtype`.
    pub cache_dtype: CacheDtype,
    /// Threads that load a query's chunks side by side (read, verify, import; on a GPU the
    /// upload and placement too, each on its own stream); 0: on a GPU half the CPUs (at most
    /// 8); on the CPU 1 while the model decodes (the loader's work then never takes a core
    /// from the decoding threads), and every CPU (at most 8) for a query loaded while the
    /// model computes nothing.
    pub load_threads: usize,
    /// Chunk KV kept imported on the model's device between queries, in MiB (0: none): a
    /// chunk found there skips the store's read, verification, decoding and (on a GPU) the
    /// host-to-device copy; least recently used out first, dropped when blocks leave the
    /// store. Outside `kv_budget_mb`.
    pub resident_mb: usize,
    /// With `resident_mb`: at start, fill the tier in the background with the chunks read
    /// most often (the store's access statistics, kept across restarts), hottest first.
    pub resident_warm: bool,
    /// Built-in schedule of `rematerialize` (cron syntax, UTC, 5 fields or 6 with seconds;
    /// empty: none), and what it redoes: `all`, `stale` or `hot:N`, at most
    /// `rematerialize_limit` chunks per run (0: no limit).
    pub rematerialize_cron: String,
    /// What the scheduled `rematerialize` redoes: `all`, `stale` or `hot:N`.
    pub rematerialize_scope: String,
    /// Most chunks per scheduled run (0: no limit).
    pub rematerialize_limit: usize,
    /// Built-in schedule of `gc` (namespaces past their grace, orphaned KV, dead segment
    /// bytes); empty: none.
    pub gc_cron: String,
    /// Host names the server answers to besides loopback names and the bound address (for a
    /// server reached through a name, e.g. behind a proxy); every other `Host` or `Origin`
    /// is refused with 403 (see `guard.rs`).
    pub allowed_hosts: Vec<String>,
    /// Open connections at most; past it, new connections wait in the listen backlog.
    pub max_connections: usize,
    /// A client must send a request's headers within this (also while a kept-alive
    /// connection idles), and its body within `body_timeout_ms`; else the connection closes
    /// (408 for a body).
    pub header_timeout_ms: u64,
    /// A request's body must arrive within this.
    pub body_timeout_ms: u64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            bind: "127.0.0.1:8080".into(),
            admin_token: String::new(),
            max_inflight: 16,
            max_batch: 8,
            kv_budget_mb: 2048,
            prefill_chunk: 256,
            request_timeout_ms: 120_000,
            max_question_chars: 4_000,
            default_top_k: 4,
            max_top_k: 16,
            default_max_tokens: 128,
            max_tokens_limit: 1_024,
            max_body_bytes: 8 << 20,
            system_prompt: ingest::DEFAULT_SYSTEM_PROMPT.into(),
            assembly: Assembly::default(),
            recompute_share: 0.15,
            link_tokens: 2,
            cache_dtype: CacheDtype::default(),
            load_threads: 0,
            resident_mb: 0,
            resident_warm: true,
            rematerialize_cron: String::new(),
            rematerialize_scope: "all".into(),
            rematerialize_limit: 0,
            gc_cron: String::new(),
            allowed_hosts: Vec::new(),
            max_connections: 256,
            header_timeout_ms: 10_000,
            body_timeout_ms: 30_000,
        }
    }
}

impl ServeConfig {
    /// Checks ranges and the bind/token rule; the message names the field.
    pub fn validate(&self) -> Result<()> {
        let addr: std::net::SocketAddr = self
            .bind
            .parse()
            .map_err(|e| bad("serve.bind", format!("{:?}: {e}", self.bind)))?;
        if !addr.ip().is_loopback() && self.admin_token.is_empty() {
            return Err(bad(
                "serve.bind",
                format!("refusing to listen on non-loopback {addr} without serve.admin_token"),
            ));
        }
        if self.max_inflight == 0 || self.max_inflight > 4096 {
            return Err(bad("serve.max_inflight", "must be in 1..=4096"));
        }
        if self.max_batch == 0 || self.max_batch > 256 {
            return Err(bad("serve.max_batch", "must be in 1..=256"));
        }
        if self.kv_budget_mb == 0 || self.kv_budget_mb > (1 << 24) {
            return Err(bad("serve.kv_budget_mb", "must be in 1..=16777216"));
        }
        if self.prefill_chunk == 0 {
            return Err(bad("serve.prefill_chunk", "must be positive"));
        }
        if self.default_top_k == 0 || self.default_top_k > self.max_top_k || self.max_top_k > 256 {
            return Err(bad(
                "serve.default_top_k/max_top_k",
                "need 1 <= default <= max <= 256",
            ));
        }
        if self.default_max_tokens == 0 || self.default_max_tokens > self.max_tokens_limit {
            return Err(bad(
                "serve.default_max_tokens",
                "need 1 <= default <= max_tokens_limit",
            ));
        }
        if self.request_timeout_ms == 0
            || self.max_question_chars == 0
            || self.max_body_bytes == 0
            || self.max_connections == 0
            || self.header_timeout_ms == 0
            || self.body_timeout_ms == 0
        {
            return Err(bad("serve", "timeouts and limits must be positive"));
        }
        if self.max_connections < self.max_inflight {
            return Err(bad(
                "serve.max_connections",
                format!(
                    "{} must be at least serve.max_inflight ({})",
                    self.max_connections, self.max_inflight
                ),
            ));
        }
        if !(self.recompute_share > 0.0 && self.recompute_share <= 1.0) {
            return Err(bad(
                "serve.recompute_share",
                format!("{} is outside (0, 1]", self.recompute_share),
            ));
        }
        if self.link_tokens == 0 || self.link_tokens > 4096 {
            return Err(bad(
                "serve.link_tokens",
                format!("{} is outside 1..=4096", self.link_tokens),
            ));
        }
        if self.load_threads > 64 {
            return Err(bad(
                "serve.load_threads",
                format!(
                    "{} is outside 0..=64 (0: chosen by the device)",
                    self.load_threads
                ),
            ));
        }
        if self.resident_mb > (1 << 24) {
            return Err(bad(
                "serve.resident_mb",
                format!("{} is outside 0..=16777216", self.resident_mb),
            ));
        }
        for h in &self.allowed_hosts {
            let h = h.trim();
            if h.is_empty() || (h.contains([':', '/', '@', ' ']) && !h.starts_with('[')) {
                return Err(bad(
                    "serve.allowed_hosts",
                    format!("{h:?} is not a host name (no scheme, port or path)"),
                ));
            }
        }
        self.schedules()?;
        Ok(())
    }

    /// The model thread's batch limits.
    pub(crate) fn limits(&self) -> crate::pipeline::Limits {
        crate::pipeline::Limits {
            max_batch: self.max_batch,
            kv_budget: (self.kv_budget_mb as u64) << 20,
            prefill_chunk: self.prefill_chunk,
            repair: self.repair(),
            cache_dtype: self.cache_dtype.dtype(),
        }
    }

    /// `load_threads` resolved for a model on a GPU or not.
    pub(crate) fn load_threads(&self, gpu: bool) -> usize {
        crate::pipeline::load_threads(self.load_threads, gpu)
    }

    /// `load_threads` resolved for a query loaded while the model is idle.
    pub(crate) fn idle_load_threads(&self, gpu: bool) -> usize {
        crate::pipeline::idle_load_threads(self.load_threads, gpu)
    }

    /// The repair parameters of strategies named without one.
    pub fn repair(&self) -> crate::assembly::Repair {
        crate::assembly::Repair {
            recompute_share: self.recompute_share,
            link_tokens: self.link_tokens,
        }
    }

    /// The parsed maintenance schedules.
    pub fn schedules(&self) -> Result<Schedules> {
        let cron = |key: &'static str, s: &str| -> Result<Option<Cron>> {
            if s.trim().is_empty() {
                return Ok(None);
            }
            s.parse().map(Some).map_err(|e: String| bad(key, e))
        };
        let scope: ingest::Scope = self
            .rematerialize_scope
            .parse()
            .map_err(|e: ingest::Error| bad("serve.rematerialize_scope", e.to_string()))?;
        let opts = ingest::RematOptions {
            scope,
            limit: (self.rematerialize_limit > 0).then_some(self.rematerialize_limit),
            dry_run: false,
        };
        Ok(Schedules {
            rematerialize: cron("serve.rematerialize_cron", &self.rematerialize_cron)?
                .map(|c| (c, opts)),
            gc: cron("serve.gc_cron", &self.gc_cron)?,
        })
    }
}

/// A `[serve]` setting's error.
fn bad(key: &'static str, why: impl Into<String>) -> Error {
    Error::Config {
        key,
        why: why.into(),
    }
}
