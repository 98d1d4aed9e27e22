//! Kubernetes `Status` error bodies and the [`ApiError`] type.

use std::fmt;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// An API error as the server reports it: HTTP code, Kubernetes `reason` and message.
///
/// Returned by the [`ServerHandle`](crate::ServerHandle) write methods and rendered as a
/// Kubernetes `Status` body over HTTP.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status code (e.g. 404, 409, 410).
    pub code: u16,
    /// Machine-readable Kubernetes reason (e.g. `NotFound`, `AlreadyExists`, `Expired`).
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    /// Builds an error from its parts.
    pub fn new(code: u16, reason: &str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.to_string(),
            message: message.into(),
        }
    }

    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 404 NotFound for a named object.
    pub fn not_found(resource: &str, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
    }

    /// 409 AlreadyExists.
    pub fn already_exists(resource: &str, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{resource} \"{name}\" already exists"),
        )
    }

    /// 409 Conflict (stale resourceVersion).
    pub fn conflict(resource: &str, name: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {resource} \"{name}\": the object has been \
                 modified; please apply your changes to the latest version and try again"
            ),
        )
    }

    /// 410 Expired (too old resource version / continue token).
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 504 Timeout with cause `ResourceVersionTooLarge`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(504, "Timeout", message)
    }

    /// The Kubernetes `Status` JSON for this error.
    pub fn to_status(&self) -> Value {
        status_json(self.code, &self.reason, &self.message)
    }
}

/// The default Kubernetes reason for an HTTP status code.
pub(crate) fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Expired",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "Unknown",
    }
}

/// Builds a `Status` object. A 504 `Timeout` carries the `ResourceVersionTooLarge` cause.
pub(crate) fn status_json(code: u16, reason: &str, message: &str) -> Value {
    let mut status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    });
    if code == 504 && reason == "Timeout" {
        status["details"] = json!({
            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            "retryAfterSeconds": 1
        });
    } else if code == 429 || code == 503 {
        status["details"] = json!({"retryAfterSeconds": 1});
    }
    status
}

/// A JSON response with the given status code.
pub(crate) fn json_response(code: StatusCode, body: Vec<u8>) -> Response {
    let mut res = (code, body).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self.to_status()).unwrap_or_default();
        json_response(code, body)
    }
}
