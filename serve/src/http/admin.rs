//! Admin: the bearer-token check of every admin route, and the maintenance jobs
//! (`POST /v1/admin/rematerialize`, `POST /v1/admin/gc`).

use super::*;

/// Admin routes need `Authorization: Bearer <serve.admin_token>` when a token is set.
pub(super) fn check_admin(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    let token = &state.rag.config.admin_token;
    if token.is_empty() {
        return Ok(());
    }
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "admin routes need Authorization: Bearer <serve.admin_token>",
        ))
    }
}

/// Equality in time independent of where the inputs differ (token comparison).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A maintenance job's error as a response: 409 while another runs, 503 when closing.
fn job_error(e: crate::maintenance::JobError) -> ApiError {
    match e {
        crate::maintenance::JobError::Busy => ApiError::new(StatusCode::CONFLICT, e.to_string()),
        crate::maintenance::JobError::Closing => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        e => ApiError::internal(e),
    }
}

/// `POST /v1/admin/rematerialize`: the body (optional) is `ingest::RematOptions`.
pub(super) async fn rematerialize(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult<Json<Value>> {
    check_admin(&state, &headers)?;
    let opts: ingest::RematOptions = if body.iter().all(u8::is_ascii_whitespace) {
        ingest::RematOptions::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("body: {e}")))?
    };
    let m = state.rag.maintenance.clone();
    let report = blocking(move || m.rematerialize(&opts, false))
        .await?
        .map_err(job_error)?;
    Ok(Json(serde_json::to_value(report).unwrap_or_default()))
}

/// `POST /v1/admin/gc`.
pub(super) async fn gc(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> ApiResult<Json<Value>> {
    check_admin(&state, &headers)?;
    let m = state.rag.maintenance.clone();
    let report = blocking(move || m.gc(false)).await?.map_err(job_error)?;
    Ok(Json(serde_json::to_value(report).unwrap_or_default()))
}
