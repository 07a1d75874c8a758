//! HTTP routes.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, Path, Query as UrlQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use model::GenerateParams;
use retrieval::SearchFilter;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::assembly::Assembly;
use crate::error::Error;
use crate::events::{Event, FailKind, Final};
use crate::guard::HostRule;
use crate::pipeline::{KvMode, Query};
use crate::rag::Rag;

mod admin;
mod documents;
mod error;
mod middleware;
mod openai;
mod query;

use admin::{check_admin, gc, rematerialize};
use documents::{add_documents, delete_document, get_document};
pub use error::ApiError;
use error::{blocking, rejected, ApiResult};
use openai::chat;
use query::{
    assembly, build_query, collect, kv_mode, query, start, GenOptions, IdParam, UrlParams,
};

/// Shared state of the routes.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The serving pipeline.
    pub rag: Arc<Rag>,
}

impl AppState {
    /// The routes' state around a pipeline.
    pub fn new(rag: Arc<Rag>) -> AppState {
        AppState { rag }
    }
}

/// The router: every route of the API (see the crate docs), behind the `Host`/`Origin`
/// rules of `serve/src/guard.rs`.
pub fn app(state: AppState) -> Router {
    let limit = state.rag.config.max_body_bytes;
    let body_timeout = Duration::from_millis(state.rag.config.body_timeout_ms);
    let rule = Arc::new(HostRule::new(
        &state.rag.config.bind,
        &state.rag.config.allowed_hosts,
    ));
    Router::new()
        .route("/v1/query", post(query))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/documents", post(add_documents))
        .route(
            "/v1/documents/{id}",
            get(get_document).delete(delete_document),
        )
        .route("/v1/admin/rematerialize", post(rematerialize))
        .route("/v1/admin/gc", post(gc))
        .route("/v1/stats", get(stats))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(move |req, next| {
            middleware::read_body(limit, body_timeout, req, next)
        }))
        .layer(axum::middleware::from_fn(middleware::json_errors))
        .layer(axum::middleware::from_fn(move |req, next| {
            let rule = rule.clone();
            middleware::same_site(rule, req, next)
        }))
        .with_state(state)
}

/// `GET /healthz`: `ok`, or 503 naming the pipeline workers that stopped.
async fn healthz(State(state): State<AppState>) -> Response {
    let dead = state.rag.dead_workers();
    let mut r = if dead.is_empty() {
        "ok".into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("pipeline workers stopped: {}", dead.join(", ")),
        )
        .into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&state.rag.instance) {
        r.headers_mut().insert("x-ragkv-instance", v);
    }
    r
}

async fn stats(State(state): State<AppState>) -> ApiResult<Json<Value>> {
    let corpus = state.rag.corpus().clone();
    let ns = corpus.namespace();
    let (s, info, current) = blocking(move || {
        let current = corpus.store().namespaces().into_iter().find(|n| n.id == ns);
        (corpus.store().stats(), corpus.index().info(), current)
    })
    .await?;
    let info = info.map_err(ApiError::internal)?;
    let m = &state.rag.metrics;
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    Ok(Json(json!({
        "kv": {"entries": s.entries, "live_bytes": s.live_bytes, "dead_bytes": s.dead_bytes,
               "segments": s.segments.len(), "namespace": ns.to_hex(),
               "codec": current.as_ref().map(|n| n.codec.name()),
               "tokens": current.as_ref().map(|n| n.tokens),
               "bytes_per_token": current.as_ref().map(|n| n.bytes_per_token()),
               "evicted_sequences": s.evicted_sequences, "evicted_bytes": s.evicted_bytes,
               "refused_writes": s.refused_writes, "bytes_written": s.bytes_written,
               "bytes_written_direct": s.bytes_written_direct,
               "bytes_read": s.bytes_read, "bytes_read_ahead": s.bytes_read_ahead,
               "bytes_prefetched": s.bytes_prefetched,
               "presence_filter": {"keys": s.presence.keys, "capacity": s.presence.capacity,
                                   "stale": s.presence.stale, "bytes": s.presence.bytes},
               "location_cache": {"entries": s.location_cache.entries,
                                  "capacity": s.location_cache.capacity,
                                  "hits": s.location_cache.hits, "misses": s.location_cache.misses},
               "index_tuning": {"size_ratio": s.tuning.size_ratio, "l0_trigger": s.tuning.l0_trigger,
                                "transitions": s.tuning_transitions}},
        "index": info,
        "queries": {"admitted": g(&m.requests), "rejected": g(&m.rejected), "failed": g(&m.failed),
                    "cancelled": g(&m.cancelled), "inflight": g(&m.inflight),
                    "kv_hits": g(&m.kv_hits), "kv_misses": g(&m.kv_misses),
                    "kv_bytes_loaded": g(&m.kv_bytes_loaded), "rematerialized": g(&m.rematerialized)},
        "maintenance": {"runs": g(&m.maintenance_runs), "failures": g(&m.maintenance_failures),
                        "chunks_rematerialized": g(&m.maintenance_chunks)},
        "resident": state.rag.resident_stats(),
    })))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.rag.metrics.render() + &state.rag.resident_stats().render(),
    )
}
