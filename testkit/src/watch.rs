//! WATCH streams: initial events, history replay, live events, bookmarks and faults.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep_until};

use serde_json::{Value, json};

use crate::StreamingLists;
use crate::faults::WatchFaults;
use crate::http::{Params, malformed_item, parse_bool, render};
use crate::object::StoredObject;
use crate::resource::ResourceType;
use crate::rv::{self, RvParam};
use crate::shared::Shared;
use crate::state::{EventKind, Filter, HistoryEvent};
use crate::status::{ApiError, FieldError, invalid_list_options, status_json};

/// Events handled per lock acquisition while replaying history.
const BATCH: usize = 512;
/// Bytes buffered before a chunk is sent.
const CHUNK: usize = 256 * 1024;

/// Marks a WATCH stream response (never gzip-compressed).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WatchStream;

/// Everything a watch task needs.
struct WatchTask {
    shared: Arc<Shared>,
    ty: usize,
    rt: ResourceType,
    filter: Filter,
    meta_only: bool,
    bookmarks: bool,
    /// The revision the watch has delivered up to (for a watch from a future revision with
    /// [`crate::ServerOptions::future_watch_waits`], the requested one).
    cursor: u64,
    initial: Option<Vec<Arc<StoredObject>>>,
    initial_end_bookmark: bool,
    faults: WatchFaults,
    deadline: Option<Instant>,
    rev_rx: watch::Receiver<u64>,
    close_rx: watch::Receiver<u64>,
    out: Out,
}

/// Buffered writer to the response body, counting object events for `drop_watch_after`.
struct Out {
    tx: mpsc::Sender<Bytes>,
    buf: Vec<u8>,
    events: usize,
    limit: Option<usize>,
    /// Send an ERROR event when the limit is reached.
    error_at_limit: bool,
}

impl Out {
    /// Queues an object event; returns false once the drop limit is reached.
    fn event(&mut self, kind: &str, object: &[u8]) -> bool {
        if self.limit.is_some_and(|l| self.events >= l) {
            // A limit of 0 events: the ERROR takes the place of the first event.
            if std::mem::take(&mut self.error_at_limit) {
                self.error();
            }
            return false;
        }
        self.buf.extend_from_slice(b"{\"type\":\"");
        self.buf.extend_from_slice(kind.as_bytes());
        self.buf.extend_from_slice(b"\",\"object\":");
        self.buf.extend_from_slice(object);
        self.buf.extend_from_slice(b"}\n");
        self.events += 1;
        let more = self.limit.is_none_or(|l| self.events < l);
        if !more && std::mem::take(&mut self.error_at_limit) {
            self.error();
        }
        more
    }

    /// The injected ERROR event (500 `InternalError`).
    fn error(&mut self) {
        let status = crate::status::status_json(
            500,
            "InternalError",
            "Internal error occurred: injected watch failure",
        );
        self.raw(&serde_json::json!({"type": "ERROR", "object": status}));
    }

    fn raw(&mut self, line: &Value) {
        self.buf
            .extend_from_slice(&serde_json::to_vec(line).unwrap_or_default());
        self.buf.push(b'\n');
    }

    /// Sends buffered bytes; false if the client is gone.
    async fn flush(&mut self) -> bool {
        if self.buf.is_empty() {
            return true;
        }
        let chunk = Bytes::from(std::mem::take(&mut self.buf));
        self.tx.send(chunk).await.is_ok()
    }

    async fn maybe_flush(&mut self) -> bool {
        if self.buf.len() >= CHUNK {
            self.flush().await
        } else {
            true
        }
    }
}

/// A `200 OK` watch response with headers for a JSON event stream.
fn stream_response(body: Body) -> Response {
    let mut res = Response::new(body);
    *res.status_mut() = StatusCode::OK;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res.extensions_mut().insert(WatchStream);
    res
}

/// A watch that was accepted but fails at once: one ERROR event carrying `status`, then the
/// end of the stream (kube-apiserver's cacher `newErrWatcher`).
fn error_stream(status: Value) -> Response {
    let mut line =
        serde_json::to_vec(&json!({"type": "ERROR", "object": status})).unwrap_or_default();
    line.push(b'\n');
    stream_response(Body::from(line))
}

/// The 410 `Status` for a watch from a compacted revision.
fn expired_status(requested: u64, floor: u64, opaque: bool) -> Value {
    let msg = format!(
        "too old resource version: {} ({})",
        rv::render(requested, opaque),
        rv::render(floor, opaque)
    );
    status_json(410, "Expired", &msg)
}

/// `apimachinery`'s `validateWatchOptions` (ValidateListOptions for `watch=true`).
fn validate(params: &Params, send_initial: Option<bool>, mode: StreamingLists) -> Vec<FieldError> {
    let rv_match = params
        .get("resourceVersionMatch")
        .map(String::as_str)
        .unwrap_or("");
    let cont = params.get("continue").map(String::as_str).unwrap_or("");
    let mut errs = Vec::new();
    if send_initial.is_some() {
        if rv_match != "NotOlderThan" {
            errs.push(FieldError::forbidden(
                "resourceVersionMatch",
                "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
        if mode == StreamingLists::Forbidden {
            errs.push(FieldError::forbidden(
                "sendInitialEvents",
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
            ));
        }
    }
    if !rv_match.is_empty() {
        if send_initial.is_none() {
            errs.push(FieldError::forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
            ));
        }
        if rv_match != "NotOlderThan" {
            errs.push(FieldError::not_supported(
                "resourceVersionMatch",
                rv_match,
                &["NotOlderThan"],
            ));
        }
        if !cont.is_empty() {
            errs.push(FieldError::forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden when continue is provided",
            ));
        }
    }
    errs
}

/// Validates a WATCH request and starts its streaming response.
///
/// Errors found before the watch is accepted (bad parameters, validation) are HTTP errors;
/// later ones (too old or too large resourceVersion, storage without watch-list support)
/// are one ERROR event on an HTTP 200 stream, as kube-apiserver's watch cache answers.
pub(crate) async fn start(
    shared: Arc<Shared>,
    ty: usize,
    filter: Filter,
    params: &Params,
    meta_only: bool,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let opts = &shared.opts;
    let opaque = opts.opaque_resource_versions;
    let mode = opts.streaming_lists;
    let bookmarks = parse_bool(params, "allowWatchBookmarks")?.unwrap_or(false);
    let timeout = match params.get("timeoutSeconds").map(|t| t.parse::<u64>()) {
        None => None,
        Some(Ok(0)) => None,
        Some(Ok(t)) => Some(Duration::from_secs(t)),
        Some(Err(_)) => return Err(ApiError::bad_request("invalid value for timeoutSeconds")),
    };
    // An older server does not know sendInitialEvents / resourceVersionMatch on watches.
    let send_initial = if mode == StreamingLists::Ignored {
        None
    } else {
        let send_initial = parse_bool(params, "sendInitialEvents")?;
        let errs = validate(params, send_initial, mode);
        if !errs.is_empty() {
            return Ok(invalid_list_options(&errs));
        }
        send_initial
    };
    let rv = rv::parse_param(
        params
            .get("resourceVersion")
            .map(String::as_str)
            .unwrap_or(""),
        opaque,
    )?;
    let streaming = send_initial == Some(true);
    if streaming && bookmarks && mode == StreamingLists::Rejected {
        return Ok(error_stream(status_json(
            500,
            "InternalError",
            "a watch stream was requested by the client but the required storage feature \
             RequestWatchProgress is disabled",
        )));
    }
    let faults = shared.faults().take_watch();
    let render = |n: u64| rv::render(n, opaque);
    if faults.too_large {
        let current = shared.state().revision;
        let requested = match rv {
            RvParam::Rev(n) => n,
            _ => current + 1,
        };
        let err = ApiError::too_large_resource_version(&render(requested), &render(current));
        return Ok(error_stream(err.to_status()));
    }
    if faults.gone {
        let current = shared.state().revision;
        let requested = match rv {
            RvParam::Rev(n) => n,
            _ => current,
        };
        return Ok(error_stream(expired_status(requested, current, opaque)));
    }
    if let RvParam::Rev(n) = rv
        && (streaming || !opts.future_watch_waits)
        && let Err(current) = shared.wait_for_revision(n).await
    {
        let err = ApiError::too_large_resource_version(&render(n), &render(current));
        return Ok(error_stream(err.to_status()));
    }
    let (drop_after, error_at_limit) = (faults.drop_after, faults.error_at_drop);
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let task = {
        let st = shared.state();
        let (cursor, initial) = match (rv, send_initial) {
            // Streaming list: the current state, at least as fresh as the requested revision
            // (waited for above), then events after it.
            (_, Some(true)) => (st.revision, Some(st.current(ty, &filter))),
            // Legacy "get state and start at most recent / any".
            (RvParam::Unset | RvParam::Any, None) => (st.revision, Some(st.current(ty, &filter))),
            (RvParam::Unset | RvParam::Any, Some(false)) => (st.revision, None),
            (RvParam::Rev(n), _) => {
                if n < st.floor {
                    return Ok(error_stream(expired_status(n, st.floor, opaque)));
                }
                (n, None)
            }
        };
        WatchTask {
            shared: shared.clone(),
            ty,
            rt: st.resource_type(ty).clone(),
            filter,
            meta_only,
            bookmarks,
            cursor,
            initial,
            initial_end_bookmark: streaming && bookmarks,
            faults,
            deadline: timeout.map(|t| started + t),
            rev_rx: shared.rev_tx.subscribe(),
            close_rx: shared.close_tx.subscribe(),
            out: Out {
                tx,
                buf: Vec::new(),
                events: 0,
                limit: drop_after,
                error_at_limit,
            },
        }
    };
    tokio::spawn(task.run());
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Ok(stream_response(Body::from_stream(stream)))
}

/// When the next periodic bookmark is due: `interval` from now, or (like kube-apiserver's
/// `cacheWatcher.nextBookmarkTime`) 2 s before the watch's deadline if that comes first and
/// is still ahead.
fn next_bookmark_time(now: Instant, interval: Duration, deadline: Option<Instant>) -> Instant {
    let periodic = now + interval;
    match deadline.and_then(|d| d.checked_sub(Duration::from_secs(2))) {
        Some(pre) if pre > now && pre < periodic => pre,
        _ => periodic,
    }
}

impl WatchTask {
    fn bookmark(&mut self, initial_end: bool) {
        let rv = rv::render(self.cursor, self.shared.opts.opaque_resource_versions);
        let mut metadata = json!({"resourceVersion": rv});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        let (api_version, kind) = if self.meta_only {
            (
                "meta.k8s.io/v1".to_string(),
                "PartialObjectMetadata".to_string(),
            )
        } else {
            (self.rt.api_version(), self.rt.kind.clone())
        };
        self.out.raw(&json!({
            "type": "BOOKMARK",
            "object": {"kind": kind, "apiVersion": api_version, "metadata": metadata}
        }));
    }

    fn expired_event(&mut self, floor: u64) {
        let status = expired_status(
            self.cursor,
            floor,
            self.shared.opts.opaque_resource_versions,
        );
        self.out.raw(&json!({"type": "ERROR", "object": status}));
    }

    /// Translates one history event through the selectors; false once the stream must end.
    fn apply(&mut self, ev: &HistoryEvent) -> bool {
        if ev.ty != self.ty {
            return true;
        }
        let now = self.filter.matches(&ev.obj);
        let before = ev.prev.as_ref().is_some_and(|p| self.filter.matches(p));
        let kind = match ev.kind {
            EventKind::Added if now => "ADDED",
            EventKind::Deleted if now => "DELETED",
            EventKind::Modified if now && before => "MODIFIED",
            EventKind::Modified if now => "ADDED",
            EventKind::Modified if before => "DELETED",
            _ => return true,
        };
        let body = render(&ev.obj, self.meta_only);
        self.out.event(kind, &body)
    }

    async fn run(mut self) {
        if self.faults.malformed {
            let item = malformed_item(&self.rt, self.meta_only);
            if !self.out.event("ADDED", &item) {
                self.out.flush().await;
                return;
            }
        }
        for raw in std::mem::take(&mut self.faults.injected) {
            if !self.out.event("ADDED", &raw) {
                self.out.flush().await;
                return;
            }
        }
        if let Some(initial) = self.initial.take() {
            for obj in &initial {
                if !self.out.event("ADDED", &render(obj, self.meta_only))
                    || !self.out.maybe_flush().await
                {
                    self.out.flush().await;
                    return;
                }
            }
        }
        if self.initial_end_bookmark {
            self.bookmark(true);
        }
        if !self.out.flush().await {
            return;
        }
        let interval = self
            .shared
            .opts
            .bookmark_interval
            .max(Duration::from_millis(10));
        let mut next_bookmark = next_bookmark_time(Instant::now(), interval, self.deadline);
        loop {
            if !self.drain().await {
                return;
            }
            let deadline = self.deadline;
            tokio::select! {
                changed = self.rev_rx.changed() => if changed.is_err() { return },
                _ = self.close_rx.changed() => return,
                _ = self.out.tx.closed() => return,
                _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => return,
                _ = sleep_until(next_bookmark), if self.bookmarks => {
                    // A watch from a future revision (future_watch_waits) stays silent until
                    // the revision catches up, like kube-apiserver's cache watcher.
                    if self.cursor <= self.shared.state().revision {
                        self.bookmark(false);
                        if !self.out.flush().await {
                            return;
                        }
                    }
                    next_bookmark = next_bookmark_time(Instant::now(), interval, self.deadline);
                }
            }
        }
    }

    /// Sends every retained event after the cursor; false once the stream must end.
    async fn drain(&mut self) -> bool {
        loop {
            let batch = self.shared.state().events_after(self.cursor, BATCH);
            match batch {
                Err(floor) => {
                    self.expired_event(floor);
                    self.out.flush().await;
                    return false;
                }
                Ok(events) if events.is_empty() => return self.out.flush().await,
                Ok(events) => {
                    for ev in &events {
                        self.cursor = ev.rev;
                        if !self.apply(ev) {
                            self.out.flush().await;
                            return false;
                        }
                    }
                    if !self.out.maybe_flush().await {
                        return false;
                    }
                }
            }
        }
    }
}
