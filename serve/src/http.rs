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
use crate::guard::HostRule;
use crate::rag::{Event, FailKind, Final, KvMode, Query, Rag};

mod documents;
mod error;
mod middleware;
mod openai;

use documents::{add_documents, delete_document, gc, get_document, rematerialize};
pub use error::ApiError;
use error::{rejected, ApiResult};
use openai::chat;

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
/// rules of [`crate::guard`].
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

/// Body of `POST /v1/query`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryBody {
    /// The question.
    pub question: String,
    /// Chunks to retrieve (default `serve.default_top_k`).
    pub top_k: Option<usize>,
    /// Stream SSE events (default) or answer with one JSON object.
    pub stream: Option<bool>,
    /// Longest answer (default `serve.default_max_tokens`).
    pub max_tokens: Option<usize>,
    /// Sampling temperature (default 0: greedy).
    pub temperature: Option<f64>,
    /// Nucleus sampling threshold (default 1: off).
    pub top_p: Option<f64>,
    /// Sampler seed.
    pub seed: Option<u64>,
    /// `on` (default) or `off` (recompute every chunk's KV).
    pub kv: Option<String>,
    /// `naive`, `reposition`, `reposition+recompute[:share]`, `link[:k]`, `query-aware[:share]`
    /// or `full` (default: `serve.assembly`; see [`crate::assembly`]).
    pub assembly: Option<String>,
    /// Only retrieve from these documents.
    pub documents: Option<Vec<String>>,
    /// Generate `max_tokens`, never sampling the end-of-turn token (fixed-length answers, for
    /// benchmarks; llama-server's `ignore_eos`).
    pub ignore_eos: Option<bool>,
}

/// `?kv=off`, `?assembly=...`.
#[derive(Debug, Deserialize)]
pub struct KvParam {
    /// `on` or `off`.
    pub kv: Option<String>,
    /// An assembly strategy (as in the body).
    pub assembly: Option<String>,
}

fn assembly(rag: &Rag, s: Option<&str>) -> ApiResult<Assembly> {
    s.map_or(Ok(rag.config.assembly), |s| {
        s.parse().map_err(ApiError::bad)
    })
}

fn kv_mode(s: Option<&str>) -> ApiResult<KvMode> {
    match s {
        None | Some("on") => Ok(KvMode::On),
        Some("off") => Ok(KvMode::Off),
        Some(o) => Err(ApiError::bad(format!("kv: {o:?} (on or off)"))),
    }
}

struct GenOptions {
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    ignore_eos: Option<bool>,
}

fn build_query(
    rag: &Rag,
    question: String,
    top_k: Option<usize>,
    gen: GenOptions,
    kv: KvMode,
    assembly: Assembly,
    documents: Option<Vec<String>>,
) -> ApiResult<Query> {
    let c = &rag.config;
    let question = question.trim().to_string();
    if question.is_empty() {
        return Err(ApiError::bad("question: empty"));
    }
    if question.chars().count() > c.max_question_chars {
        return Err(ApiError::bad(format!(
            "question: longer than {} characters",
            c.max_question_chars
        )));
    }
    let top_k = top_k.unwrap_or(c.default_top_k);
    if top_k == 0 || top_k > c.max_top_k {
        return Err(ApiError::bad(format!(
            "top_k: {top_k} is outside 1..={}",
            c.max_top_k
        )));
    }
    let max_tokens = gen.max_tokens.unwrap_or(c.default_max_tokens);
    if max_tokens == 0 || max_tokens > c.max_tokens_limit {
        return Err(ApiError::bad(format!(
            "max_tokens: {max_tokens} is outside 1..={}",
            c.max_tokens_limit
        )));
    }
    let params = GenerateParams {
        max_tokens,
        temperature: gen.temperature.unwrap_or(0.0),
        top_p: gen.top_p.unwrap_or(1.0),
        seed: gen.seed.unwrap_or(0),
        ignore_eos: gen.ignore_eos.unwrap_or(false),
        ..GenerateParams::default()
    };
    params
        .validate()
        .map_err(|e| ApiError::bad(e.to_string()))?;
    rag.fits_context(top_k, max_tokens).map_err(ApiError::bad)?;
    let documents = documents.unwrap_or_default();
    if documents.len() > 1024 {
        return Err(ApiError::bad("documents: at most 1024 ids"));
    }
    Ok(Query {
        question,
        top_k,
        filter: SearchFilter {
            doc_ids: documents,
            metadata: Vec::new(),
        },
        params,
        kv,
        assembly,
    })
}

/// An admitted query's event channel (its admission ticket travels with the job).
struct Running {
    rx: mpsc::Receiver<Event>,
    deadline: tokio::time::Instant,
}

impl Running {
    /// The next event; an error event once the deadline passes.
    async fn next(&mut self) -> Option<Event> {
        match tokio::time::timeout_at(self.deadline, self.rx.recv()).await {
            Ok(e) => e,
            Err(_) => {
                self.rx.close();
                Some(Event::Error(FailKind::Timeout, "request timed out".into()))
            }
        }
    }
}

/// Admission, retrieval (blocking pool), hand-off to the loader.
fn start(state: &AppState, q: Query) -> ApiResult<Running> {
    let rag = state.rag.clone();
    let m = &rag.metrics;
    let ticket = rag.admit().ok_or_else(|| {
        m.rejected.fetch_add(1, Ordering::Relaxed);
        ApiError::busy(
            format!(
                "server at capacity ({} queries in flight)",
                rag.config.max_inflight
            ),
            1,
        )
    })?;
    m.requests.fetch_add(1, Ordering::Relaxed);
    let arrived = Instant::now();
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(rag.config.request_timeout_ms);
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let t = Instant::now();
        let r2 = rag.clone();
        let q2 = q.clone();
        let hits = tokio::task::spawn_blocking(move || r2.retrieve(&q2))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|e| (FailKind::Internal, e));
        let outcome =
            hits.and_then(|hits| rag.submit(ticket, q, hits, tx.clone(), arrived, t.elapsed()));
        if let Err((kind, e)) = outcome {
            if kind != FailKind::Busy {
                rag.metrics.failed.fetch_add(1, Ordering::Relaxed);
            }
            let _ = tx.send(Event::Error(kind, e)).await;
        }
    });
    Ok(Running { rx, deadline })
}

/// Drains a query into its final result (non-streaming responses).
async fn collect(mut run: Running) -> ApiResult<Final> {
    while let Some(e) = run.next().await {
        match e {
            Event::Token(_) => {}
            Event::Done(f) => return Ok(*f),
            Event::Error(kind, e) => return Err(ApiError::failed(kind, e)),
        }
    }
    Err(ApiError::internal("the query ended without a result"))
}

type UrlParams = Result<UrlQuery<KvParam>, axum::extract::rejection::QueryRejection>;
type IdParam = Result<Path<String>, axum::extract::rejection::PathRejection>;

async fn query(
    State(state): State<AppState>,
    p: UrlParams,
    body: Result<Json<QueryBody>, axum::extract::rejection::JsonRejection>,
) -> ApiResult<Response> {
    let UrlQuery(p) = p.map_err(rejected)?;
    let Json(b) = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let kv = kv_mode(p.kv.as_deref().or(b.kv.as_deref()))?;
    let asm = assembly(&state.rag, p.assembly.as_deref().or(b.assembly.as_deref()))?;
    let q = build_query(
        &state.rag,
        b.question,
        b.top_k,
        GenOptions {
            max_tokens: b.max_tokens,
            temperature: b.temperature,
            top_p: b.top_p,
            seed: b.seed,
            ignore_eos: b.ignore_eos,
        },
        kv,
        asm,
        b.documents,
    )?;
    let run = start(&state, q)?;
    if b.stream == Some(false) {
        return Ok(Json(collect(run).await?).into_response());
    }
    Ok(Sse::new(query_events(run))
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn query_events(mut run: Running) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    async_stream::stream! {
        while let Some(e) = run.next().await {
            match e {
                Event::Token(t) => {
                    yield Ok(SseEvent::default().event("token").data(json!({"text": t}).to_string()));
                }
                Event::Done(f) => {
                    yield Ok(SseEvent::default().event("done").data(serde_json::to_string(&*f).unwrap_or_default()));
                    break;
                }
                Event::Error(kind, e) => {
                    let kind = ApiError::failed(kind, String::new()).kind();
                    yield Ok(SseEvent::default().event("error").data(json!({"error": {"message": e, "type": kind}}).to_string()));
                    break;
                }
            }
        }
    }
}

async fn stats(State(state): State<AppState>) -> ApiResult<Json<Value>> {
    let engine = state.rag.engine.clone();
    let (s, info, current) = tokio::task::spawn_blocking(move || {
        let ns = engine.namespace();
        let current = engine.store.namespaces().into_iter().find(|n| n.id == ns);
        (engine.store.stats(), engine.index.info(), current)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let info = info.map_err(|e| ApiError::internal(e.to_string()))?;
    let m = &state.rag.metrics;
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    Ok(Json(json!({
        "kv": {"entries": s.entries, "live_bytes": s.live_bytes, "dead_bytes": s.dead_bytes,
               "segments": s.segments.len(), "namespace": state.rag.engine.namespace().to_hex(),
               "codec": current.as_ref().map(|n| n.codec.name()),
               "tokens": current.as_ref().map(|n| n.tokens),
               "bytes_per_token": current.as_ref().map(|n| n.bytes_per_token()),
               "evicted_sequences": s.evicted_sequences, "evicted_bytes": s.evicted_bytes,
               "refused_writes": s.refused_writes, "bytes_written": s.bytes_written,
               "bytes_written_direct": s.bytes_written_direct,
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
    })))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.rag.metrics.render(),
    )
}
