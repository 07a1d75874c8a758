#![deny(missing_docs)]
//! ragkv's HTTP RAG endpoint.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/query` | `{question, top_k?, stream?, max_tokens?, temperature?, top_p?, seed?, kv?, documents?}`: SSE `token` events, then `done` (citations, KV hits, timings) or `error`; one JSON object when `stream` is false. `?kv=off` recomputes every chunk. |
//! | `POST /v1/chat/completions` | OpenAI-compatible, RAG over the last user message; streaming ends with `data: [DONE]` |
//! | `POST /v1/documents` | add or replace documents through the ingest pipeline (admin): 200, 207 when some failed, 422 when all did |
//! | `GET /v1/documents/{id}` | a document's chunks |
//! | `DELETE /v1/documents/{id}` | remove its vectors and KV references (admin) |
//! | `POST /v1/admin/rematerialize` | `{scope?: all\|stale\|hot, min_reads?, limit?, dry_run?}`: redo missing, corrupt or stale chunk KV (admin; 409 while another job runs) |
//! | `POST /v1/admin/gc` | drop namespaces past their grace, orphaned KV, dead segment bytes (admin; 409 while another job runs) |
//! | `GET /v1/stats`, `GET /metrics`, `GET /healthz` | counters (JSON), Prometheus, liveness (503 when a pipeline worker stopped) |
//!
//! Every route answers only requests whose `Host` and `Origin` name this server ([`HostRule`]):
//! a web page cannot drive it, by cross-site requests or by DNS rebinding.
//!
//! The request path and its threads are described in the private `pipeline` module's docs
//! (docs/ARCHITECTURE.md points there); [`Rag`] is its handle. Modules are private but for
//! [`client`] (the CLI's calls to a running server) and [`listen`] (the server loop); everything
//! else is re-exported here.

mod assembly;
pub mod client;
mod config;
mod error;
mod events;
mod guard;
mod http;
pub mod listen;
mod maintenance;
mod metrics;
mod overlap;
mod pipeline;
mod rag;
mod resident;
mod schedule;
mod supervise;
mod teacher;

pub use assembly::{
    assemble, assemble_into, Assembly, LinkTiming, Prompt, Ready, Repair, Share, Target,
};
pub use config::{CacheDtype, ServeConfig};
pub use error::{Error, Result};
pub use events::{Citation, Event, FailKind, Final, KvSource, Timings};
pub use guard::HostRule;
pub use http::{app, ApiError, AppState};
pub use maintenance::{JobError, Maintenance, Schedules};
pub use metrics::{Histogram, Metrics};
pub use overlap::Timeline;
pub use pipeline::{KvMode, Query};
pub use rag::Rag;
pub use resident::ResidentStats;
pub use schedule::Cron;
pub use supervise::{contain, Faults, Ticket};
pub use teacher::Reference;
