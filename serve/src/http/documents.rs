//! The document routes: add (through the ingest pipeline), get, delete; adding and deleting
//! need the admin token when one is configured ([`super::admin`]).

use super::*;

/// Body of `POST /v1/documents`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocumentsBody {
    pub documents: Vec<DocumentIn>,
    /// `eager` (default), `lazy` or `none`.
    pub materialize: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocumentIn {
    pub id: String,
    pub text: String,
    #[serde(default)]
    pub metadata: serde_json::Map<String, Value>,
}

/// `POST /v1/documents`: the ingest report, with 200 when every document was committed, 207
/// when some failed (the report's `failures` say which and why), 422 when none was.
pub(super) async fn add_documents(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Json<DocumentsBody>, axum::extract::rejection::JsonRejection>,
) -> ApiResult<Response> {
    check_admin(&state, &headers)?;
    let Json(b) = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    if b.documents.is_empty() {
        return Err(ApiError::bad("documents: empty"));
    }
    let materialize = match b.materialize.as_deref() {
        None => state.rag.corpus().config().materialize,
        Some(m) => m
            .parse::<ingest::Materialize>()
            .map_err(|e| ApiError::bad(format!("materialize: {e}")))?,
    };
    let docs: Vec<ingest::Doc> = b
        .documents
        .into_iter()
        .map(|d| ingest::Doc {
            origin: d.id.clone(),
            id: d.id,
            text: d.text,
            metadata: d.metadata,
        })
        .collect();
    let engine = state.rag.engine.clone();
    let report = blocking(move || {
        engine.ingest(
            &[ingest::Source::Docs(docs)],
            &ingest::RunOptions {
                materialize,
                prune: false,
                shard: None,
            },
            &ingest::Counters::default(),
        )
    })
    .await?
    .map_err(ApiError::internal)?;
    let committed = report.docs_new + report.docs_replaced + report.docs_unchanged;
    let status = match (report.ok(), committed) {
        (true, _) => StatusCode::OK,
        (false, 0) => StatusCode::UNPROCESSABLE_ENTITY,
        (false, _) => StatusCode::MULTI_STATUS,
    };
    let mut body = serde_json::to_value(&report).unwrap_or_default();
    if status == StatusCode::UNPROCESSABLE_ENTITY {
        // An error answer in the API's error shape, with the report beside it.
        let why = report
            .failures
            .first()
            .map_or_else(String::new, |f| format!("{}: {}", f.origin, f.reason));
        body["error"] = json!({"message": format!("no document was committed ({why})"),
                               "type": "invalid_request_error"});
    }
    Ok((status, Json(body)).into_response())
}

pub(super) async fn get_document(
    State(state): State<AppState>,
    id: IdParam,
) -> ApiResult<Json<Value>> {
    let Path(id) = id.map_err(rejected)?;
    let engine = state.rag.engine.clone();
    let id2 = id.clone();
    let chunks = blocking(move || engine.corpus().index().document(&id2))
        .await?
        .map_err(ApiError::internal)?;
    if chunks.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no document {id:?}"),
        ));
    }
    let first = &chunks[0].1;
    Ok(Json(json!({
        "id": id,
        "hash": first.doc_hash,
        "metadata": first.metadata,
        "chunks": chunks.iter().map(|(pid, p)| json!({
            "ordinal": p.ordinal, "point_id": pid, "tokens": p.tokens,
            "kv_key": p.kv_key, "text": p.text,
        })).collect::<Vec<_>>(),
    })))
}

pub(super) async fn delete_document(
    State(state): State<AppState>,
    headers: HeaderMap,
    id: IdParam,
) -> ApiResult<Json<Value>> {
    check_admin(&state, &headers)?;
    let Path(id) = id.map_err(rejected)?;
    let engine = state.rag.engine.clone();
    let id2 = id.clone();
    let existed = blocking(move || engine.delete_document(&id2))
        .await?
        .map_err(ApiError::internal)?;
    if !existed {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no document {id:?}"),
        ));
    }
    Ok(Json(json!({"id": id, "deleted": true})))
}
