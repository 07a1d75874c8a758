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
//! Every route answers only requests whose `Host` and `Origin` name this server ([`guard`]):
//! a web page cannot drive it, by cross-site requests or by DNS rebinding.
//!
//! The request path and its threads are described in [`rag`].

pub mod assembly;
mod batch;
pub mod client;
pub mod config;
mod context;
pub mod events;
pub mod guard;
pub mod http;
pub mod listen;
pub mod maintenance;
pub mod metrics;
pub mod overlap;
pub mod rag;
pub mod schedule;
pub mod supervise;
mod teacher;

pub use assembly::Assembly;
pub use config::{CacheDtype, ServeConfig};
pub use http::{app, AppState};
pub use maintenance::Maintenance;
pub use rag::{Citation, Event, FailKind, Final, KvMode, KvSource, Query, Rag, Timings};
pub use teacher::Reference;
