//! `/testkit/...` admin endpoints, for tests and benchmarks that run the server out of process.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::handle::ServerHandle;
use crate::http::Params;
use crate::resource::Verb;
use crate::shared::Shared;
use crate::status::{ApiError, json_response};

fn ok(v: Value) -> Response {
    json_response(StatusCode::OK, serde_json::to_vec(&v).unwrap_or_default())
}

fn num(params: &Params, key: &str, default: Option<u64>) -> Result<u64, ApiError> {
    match params.get(key) {
        Some(v) => v
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid value for {key}: {v:?}"))),
        None => {
            default.ok_or_else(|| ApiError::bad_request(format!("missing query parameter {key}")))
        }
    }
}

fn usize_of(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn verb_param(params: &Params) -> Result<Verb, ApiError> {
    let verb = params
        .get("verb")
        .ok_or_else(|| ApiError::bad_request("missing query parameter verb"))?;
    Verb::parse(verb).ok_or_else(|| ApiError::bad_request(format!("unknown verb {verb:?}")))
}

/// Handles one admin request.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    method: &Method,
    path: &str,
    params: &Params,
) -> Response {
    match route(shared, method, path, params).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn route(
    shared: Arc<Shared>,
    method: &Method,
    path: &str,
    params: &Params,
) -> Result<Response, ApiError> {
    let h = ServerHandle { shared };
    let f = h.faults();
    let done = || ok(json!({"ok": true}));
    Ok(match (method, path.trim_end_matches('/')) {
        (&Method::GET, "/testkit/counts") => {
            ok(serde_json::to_value(h.counts()).unwrap_or(Value::Null))
        }
        (&Method::POST, "/testkit/reset-counts") => {
            h.reset_counts();
            done()
        }
        (&Method::GET, "/testkit/revision") => ok(json!({
            "revision": h.revision(),
            "resourceVersion": h.resource_version(),
        })),
        (&Method::POST, "/testkit/compact") => {
            h.compact();
            ok(json!({"revision": h.revision()}))
        }
        (&Method::POST, "/testkit/faults/gone-next-watch") => {
            f.gone_next_watch();
            done()
        }
        (&Method::POST, "/testkit/faults/too-large-next-watch") => {
            f.too_large_next_watch();
            done()
        }
        (&Method::POST, "/testkit/faults/timeout-next") => {
            let verb = verb_param(params)?;
            f.timeout_next(verb, usize_of(num(params, "count", Some(1))?));
            done()
        }
        (&Method::POST, "/testkit/faults/drop-watch-after") => {
            f.drop_watch_after(usize_of(num(params, "events", None)?));
            done()
        }
        (&Method::POST, "/testkit/faults/fail-next") => {
            let verb = verb_param(params)?;
            let status = num(params, "status", Some(500))?;
            let status =
                u16::try_from(status).map_err(|_| ApiError::bad_request("invalid status"))?;
            f.fail_next(verb, status, usize_of(num(params, "count", Some(1))?));
            done()
        }
        (&Method::POST, "/testkit/faults/page-delay") => {
            f.page_delay(Duration::from_millis(num(params, "ms", None)?));
            done()
        }
        (&Method::POST, "/testkit/faults/malformed-next-list") => {
            f.malformed_next_list();
            done()
        }
        (&Method::POST, "/testkit/faults/malformed-next-watch") => {
            f.malformed_next_watch();
            done()
        }
        (&Method::POST, "/testkit/faults/close-watches") => {
            f.close_watches();
            done()
        }
        (&Method::POST, "/testkit/faults/clear") => {
            f.clear();
            done()
        }
        (&Method::POST, "/testkit/churn") => {
            let updates = usize_of(num(params, "updates", Some(0))?);
            let creates = usize_of(num(params, "creates", Some(0))?);
            let deletes = usize_of(num(params, "deletes", Some(0))?);
            let seed = num(params, "seed", Some(0))?;
            let rev = tokio::task::spawn_blocking(move || h.churn(updates, creates, deletes, seed))
                .await
                .map_err(|e| ApiError::new(500, "InternalError", format!("churn failed: {e}")))?;
            ok(json!({"revision": rev}))
        }
        (&Method::POST, "/testkit/seed") => {
            let pods = usize_of(num(params, "pods", None)?);
            let namespaces = usize_of(num(params, "namespaces", Some(10))?);
            let h2 = h.clone();
            tokio::task::spawn_blocking(move || h2.seed_pods(pods, namespaces))
                .await
                .map_err(|e| ApiError::new(500, "InternalError", format!("seed failed: {e}")))?;
            ok(json!({"revision": h.revision()}))
        }
        _ => {
            return Err(ApiError::new(
                404,
                "NotFound",
                format!("unknown admin endpoint {method} {path}"),
            ));
        }
    })
}
