//! The routes' error response: `{"error": {"message", "type"}}` with the status, and
//! `Retry-After` when the client should come back.

use super::*;

/// An error response: `{"error": {"message", "type"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            retry_after: None,
        }
    }
    /// 429 with `Retry-After: retry_after_s`.
    pub(super) fn busy(message: impl Into<String>, retry_after_s: u64) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            retry_after: Some(retry_after_s),
        }
    }
    pub(crate) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
    /// 500 for a fault of the server's own: the client gets a generic message, `e` goes to
    /// the log with every cause under it.
    pub(super) fn internal(e: impl std::error::Error) -> ApiError {
        tracing::error!(error = %crate::error::chain(&e), "internal error answering a request");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, crate::error::INTERNAL)
    }
    pub(super) fn failed(kind: FailKind, message: String) -> ApiError {
        let status = match kind {
            FailKind::Invalid => StatusCode::BAD_REQUEST,
            FailKind::Busy => StatusCode::TOO_MANY_REQUESTS,
            FailKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            FailKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            FailKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError {
            status,
            message,
            retry_after: (kind == FailKind::Busy).then_some(1),
        }
    }
    /// The `type` of the error body.
    pub(super) fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 404 | 405 | 408 | 413 | 415 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            504 => "timeout_error",
            _ => "server_error",
        }
    }
}

/// Runs blocking work (store, index, ingest) on the blocking pool, never on an async thread;
/// a panic in it is a 500 ([`ApiError::internal`]).
pub(super) async fn blocking<R: Send + 'static>(
    f: impl FnOnce() -> R + Send + 'static,
) -> ApiResult<R> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(ApiError::internal)
}

/// The JSON error of a rejected extractor (path, query string, body).
pub(super) fn rejected(e: impl IntoResponse + std::fmt::Display) -> ApiError {
    let message = e.to_string();
    let status = e.into_response().status();
    ApiError::new(status, message)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.status == StatusCode::NOT_FOUND {
            "not_found_error"
        } else {
            self.kind()
        };
        let mut r = (
            self.status,
            Json(json!({"error": {"message": self.message, "type": kind}})),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

pub(super) type ApiResult<T> = Result<T, ApiError>;
