//! The request path: retrieve → load stored KV → assemble → prefill the question → decode.
//!
//! Three named threads, joined by bounded queues:
//! - `ragkv-loader` reads each admitted query's chunk KV from the store (verified), imports
//!   it into tensors, rotates each chunk's keys to the positions it takes in the prompt
//!   (consecutive, after the system prefix), and tokenizes the question. It works ahead of
//!   the model: the queue to the model holds one loaded query, so the next query's KV is read
//!   while the batch decodes. How much of each load ran while the model was busy is measured
//!   ([`crate::overlap`]) and reported.
//! - `ragkv-model` runs the continuous-batching scheduler ([`scheduler`]): loaded queries
//!   join the batch between steps while it has room and their KV fits the budget (assembled
//!   from the system prefix, computed once, and the chunks' KV by the query's
//!   [`crate::Assembly`] strategy; a chunk whose KV is missing or fails verification is
//!   prefilled inline and queued for writing back), every query in the batch advances by one
//!   step at a time, and each streams text to its own channel.
//! - `ragkv-materialize` writes those KVs back to the store, attached to the chunk's
//!   document version, so the next query finds them.
//!
//! Retrieval (embedding the question, vector search) runs in `spawn_blocking` before a query
//! enters the loader queue. Admission is bounded by `max_inflight`: each admitted query's
//! [`crate::Ticket`] travels with its job and is given back when the job leaves the
//! pipeline, so the queues (sized to `max_inflight`) never block a sender. A panic on one
//! job fails that job only (a panic in a batch step, the queries of that step); a worker
//! that stops makes `/healthz` fail ([`crate::supervise`]). [`crate::Rag::shutdown`] drains
//! the queues and joins the threads, so pending write-backs are stored.
//!
//! | module | thread | what |
//! |---|---|---|
//! | `job` | | the jobs the queues carry and what every thread shares (a leaf) |
//! | `loader` | `ragkv-loader` | chunk reads (local store, resident tier), the question's tokens |
//! | `fanout` | `ragkv-load-N` | a query's chunks loaded side by side (`serve.load_threads`) |
//! | `tier` | `ragkv-loader` | what the local store missed, from the shared tier |
//! | `place` | `ragkv-loader`, `ragkv-model` | a chunk's stored KV imported and placed |
//! | `scheduler` | `ragkv-model` | continuous batching: join, step, sample, leave |
//! | `assemble` | `ragkv-model` | a query's prompt cache by its strategy |
//! | `writeback` | `ragkv-materialize` | stores KV prefilled for missing chunks |
//! | `warm` | `ragkv-resident-warm` | the resident tier filled with the most-read chunks at start |
//!
//! Imports run one way: `job`, `fanout`, `place` ← `tier` ← `loader`; `place` ← `assemble`
//! ← `scheduler`; `job` ← `writeback`; [`crate::rag`] starts the threads and is the only door
//! in.

mod assemble;
mod fanout;
mod job;
mod loader;
mod place;
mod scheduler;
mod tier;
mod warm;
mod writeback;

pub(crate) use assemble::{assemble, Request as AssembleRequest};
pub(crate) use fanout::{idle_load_threads, load_threads, Fanout};
pub(crate) use job::{ms, ComputeJob, LoadJob, Prefix, Worker, Writeback};
pub use job::{KvMode, Query};
pub(crate) use loader::{read_chunks, run as loader, Source};
pub(crate) use scheduler::{run as scheduler, Limits};
pub(crate) use warm::start as start_warm;
pub(crate) use writeback::run as writeback;
