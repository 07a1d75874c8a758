//! Layers in front of every route: the same-site rule ([`crate::guard`]), the request body
//! read with a size and time limit, and JSON bodies for every error answer.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::guard::HostRule;

/// Refuses requests from other sites (foreign `Host`, `Origin` or `Sec-Fetch-Site`) before
/// they reach a route.
pub(crate) async fn same_site(
    rule: Arc<HostRule>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let h = req.headers();
    let text = |name: header::HeaderName| -> Result<Option<&str>, ()> {
        match h.get(name) {
            None => Ok(None),
            Some(v) => v.to_str().map(Some).map_err(|_| ()),
        }
    };
    let verdict = match (
        text(header::HOST),
        text(header::ORIGIN),
        text(header::HeaderName::from_static("sec-fetch-site")),
    ) {
        (Ok(host), Ok(origin), Ok(site)) => rule.refuse(host, origin, site),
        _ => Some("Host, Origin or Sec-Fetch-Site is not visible ASCII".into()),
    };
    match verdict {
        Some(why) => {
            tracing::warn!(%why, "request refused");
            ApiError::new(StatusCode::FORBIDDEN, why).into_response()
        }
        None => next.run(req).await,
    }
}

/// Turns every error response that is not JSON already (the framework's own: 405, 413, 415,
/// ...) into the API's JSON error shape, keeping its status.
pub(crate) async fn json_errors(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let r = next.run(req).await;
    let status = r.status();
    let is_json = r
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return r;
    }
    let (parts, body) = r.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let mut out = ApiError::new(status, message).into_response();
    for name in [header::ALLOW, header::RETRY_AFTER] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

/// Reads the whole request body (at most `limit` bytes) within `timeout` before the route
/// runs: a client that trickles its body is answered 408 instead of holding a task.
pub(crate) async fn read_body(
    limit: usize,
    timeout: Duration,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body larger than serve.max_body_bytes ({limit})"),
        )
        .into_response()
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large();
    }
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "request body not received within {} ms",
                timeout.as_millis()
            ),
        )
        .into_response(),
        Ok(Err(e)) if over_limit(&e) => too_large(),
        Ok(Err(e)) => ApiError::bad(format!("reading the request body: {e}")).into_response(),
        Ok(Ok(bytes)) => {
            next.run(axum::extract::Request::from_parts(parts, bytes.into()))
                .await
        }
    }
}

/// Whether reading a body failed because it passed the size limit (not a broken connection).
fn over_limit(e: &axum::Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if c.downcast_ref::<http_body_util::LengthLimitError>()
            .is_some()
        {
            return true;
        }
        cause = c.source();
    }
    false
}
