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

    /// 504 Timeout with cause `ResourceVersionTooLarge` (the `Status` carries
    /// `details.causes[0].reason = "ResourceVersionTooLarge"`). The cause is recognised by the
    /// message, so a message without `Too large resource version` gets that text prefixed.
    pub fn too_large(message: impl Into<String>) -> Self {
        let message = message.into();
        if message.contains(TOO_LARGE) {
            Self::new(504, "Timeout", message)
        } else {
            Self::new(504, "Timeout", format!("{TOO_LARGE}: {message}"))
        }
    }

    /// 504 Timeout with cause `ResourceVersionTooLarge`, worded like kube-apiserver's
    /// `storage.NewTooLargeResourceVersionError`:
    /// `Timeout: Too large resource version: <requested>, current: <current>`.
    pub fn too_large_resource_version(requested: &str, current: &str) -> Self {
        Self::new(
            504,
            "Timeout",
            format!("Timeout: {TOO_LARGE}: {requested}, current: {current}"),
        )
    }

    /// A generic 504 Timeout without the `ResourceVersionTooLarge` cause, worded like
    /// kube-apiserver's request-timeout filter:
    /// `Timeout: request did not complete within requested timeout - context deadline exceeded`.
    pub fn request_timeout() -> Self {
        Self::new(504, "Timeout", REQUEST_TIMEOUT)
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

/// The text that marks a `ResourceVersionTooLarge` 504 (the cause's message in kube-apiserver).
pub(crate) const TOO_LARGE: &str = "Too large resource version";

/// kube-apiserver's request-timeout message (`apierrors.NewTimeoutError` adds `Timeout: `).
pub(crate) const REQUEST_TIMEOUT: &str =
    "Timeout: request did not complete within requested timeout - context deadline exceeded";

/// Builds a `Status` object. A 504 `Timeout` whose message mentions a too large resource
/// version carries the `ResourceVersionTooLarge` cause (like
/// `storage.NewTooLargeResourceVersionError`); other 504s carry no cause.
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
    if code == 504 && reason == "Timeout" && message.contains(TOO_LARGE) {
        status["details"] = json!({
            "causes": [{"reason": "ResourceVersionTooLarge", "message": TOO_LARGE}],
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

/// One field error of a validation failure (apimachinery's `field.Error`).
#[derive(Debug, Clone)]
pub(crate) struct FieldError {
    /// `FieldValueForbidden`, `FieldValueNotSupported`, ...
    pub cause: &'static str,
    pub field: &'static str,
    /// The error without the field path, e.g. `Forbidden: ...`.
    pub body: String,
}

impl FieldError {
    /// `field.Forbidden(path, detail)`.
    pub(crate) fn forbidden(field: &'static str, detail: &str) -> Self {
        Self {
            cause: "FieldValueForbidden",
            field,
            body: format!("Forbidden: {detail}"),
        }
    }

    /// `field.NotSupported(path, value, supported)`.
    pub(crate) fn not_supported(field: &'static str, value: &str, supported: &[&str]) -> Self {
        let supported: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
        Self {
            cause: "FieldValueNotSupported",
            field,
            body: format!(
                "Unsupported value: {value:?}: supported values: {}",
                supported.join(", ")
            ),
        }
    }
}

/// The 422 `Invalid` answer kube-apiserver gives when `ValidateListOptions` fails:
/// `errors.NewInvalid(meta.k8s.io/ListOptions, "", errs)`.
pub(crate) fn invalid_list_options(errs: &[FieldError]) -> Response {
    let each: Vec<String> = errs
        .iter()
        .map(|e| format!("{}: {}", e.field, e.body))
        .collect();
    let aggregate = if each.len() == 1 {
        each[0].clone()
    } else {
        format!("[{}]", each.join(", "))
    };
    let mut status = status_json(
        422,
        "Invalid",
        &format!("ListOptions.meta.k8s.io \"\" is invalid: {aggregate}"),
    );
    let causes: Vec<Value> = errs
        .iter()
        .map(|e| json!({"reason": e.cause, "message": e.body, "field": e.field}))
        .collect();
    status["details"] = json!({"group": "meta.k8s.io", "kind": "ListOptions", "causes": causes});
    json_response(
        StatusCode::UNPROCESSABLE_ENTITY,
        serde_json::to_vec(&status).unwrap_or_default(),
    )
}
