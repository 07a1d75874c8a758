//! `POST /v1/query`: validation of the body into a [`Query`], admission, retrieval on the
//! blocking pool, hand-off to the pipeline, and the answer as SSE events or one JSON object.
//! The OpenAI route ([`super::openai`]) shares everything but the body and the answer's shape.

use super::*;

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
    /// (or `prophet[:share]`), `window[:k]` or `full` (default: `serve.assembly`; see
    /// [`crate::assembly`]).
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

pub(super) fn assembly(rag: &Rag, s: Option<&str>) -> ApiResult<Assembly> {
    s.map_or(Ok(rag.config.assembly), |s| {
        s.parse().map_err(ApiError::bad)
    })
}

pub(super) fn kv_mode(s: Option<&str>) -> ApiResult<KvMode> {
    match s {
        None | Some("on") => Ok(KvMode::On),
        Some("off") => Ok(KvMode::Off),
        Some(o) => Err(ApiError::bad(format!("kv: {o:?} (on or off)"))),
    }
}

/// Generation options as a route's body gives them.
pub(super) struct GenOptions {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    pub ignore_eos: Option<bool>,
}

pub(super) fn build_query(
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
    rag.fits_context(top_k, max_tokens)
        .map_err(|e| ApiError::bad(e.to_string()))?;
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
pub(super) struct Running {
    rx: mpsc::Receiver<Event>,
    deadline: tokio::time::Instant,
}

impl Running {
    /// The next event; an error event once the deadline passes.
    pub(super) async fn next(&mut self) -> Option<Event> {
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
pub(super) fn start(state: &AppState, q: Query) -> ApiResult<Running> {
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
            .map_err(|e| Error::Panicked {
                worker: "retrieval",
                message: e.to_string(),
            })
            .and_then(|r| r);
        let outcome =
            hits.and_then(|hits| rag.submit(ticket, q, hits, tx.clone(), arrived, t.elapsed()));
        if let Err(e) = outcome {
            let kind = e.kind();
            if kind != FailKind::Busy {
                rag.metrics.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e.chain(), ?kind, "query failed");
            }
            let _ = tx.send(Event::Error(kind, e.public_message())).await;
        }
    });
    Ok(Running { rx, deadline })
}

/// Drains a query into its final result (non-streaming responses).
pub(super) async fn collect(mut run: Running) -> ApiResult<Final> {
    while let Some(e) = run.next().await {
        match e {
            Event::Token(_) => {}
            Event::Done(f) => return Ok(*f),
            Event::Error(kind, e) => return Err(ApiError::failed(kind, e)),
        }
    }
    Err(ApiError::internal(Error::Invariant {
        what: "a query ended without a result",
    }))
}

pub(super) type UrlParams = Result<UrlQuery<KvParam>, axum::extract::rejection::QueryRejection>;
pub(super) type IdParam = Result<Path<String>, axum::extract::rejection::PathRejection>;

pub(super) async fn query(
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

pub(super) fn query_events(mut run: Running) -> impl Stream<Item = Result<SseEvent, Infallible>> {
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
