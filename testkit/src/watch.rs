//! WATCH streams: initial events, history replay, live events, bookmarks and faults.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep, sleep_until};

use crate::faults::WatchFaults;
use crate::http::{Params, malformed_item, render};
use crate::object::StoredObject;
use crate::resource::ResourceType;
use crate::shared::Shared;
use crate::state::{EventKind, Filter, HistoryEvent};
use crate::status::{ApiError, status_json};

/// Events handled per lock acquisition while replaying history.
const BATCH: usize = 512;
/// Bytes buffered before a chunk is sent.
const CHUNK: usize = 256 * 1024;

/// Everything a watch task needs.
struct WatchTask {
    shared: Arc<Shared>,
    ty: usize,
    rt: ResourceType,
    filter: Filter,
    meta_only: bool,
    bookmarks: bool,
    cursor: u64,
    initial: Option<Vec<Arc<StoredObject>>>,
    initial_end_bookmark: bool,
    /// `Some(floor)` if the requested revision is already compacted.
    expired: Option<u64>,
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
}

impl Out {
    /// Queues an object event; returns false once the drop limit is reached.
    fn event(&mut self, kind: &str, object: &[u8]) -> bool {
        if self.limit.is_some_and(|l| self.events >= l) {
            return false;
        }
        self.buf.extend_from_slice(b"{\"type\":\"");
        self.buf.extend_from_slice(kind.as_bytes());
        self.buf.extend_from_slice(b"\",\"object\":");
        self.buf.extend_from_slice(object);
        self.buf.extend_from_slice(b"}\n");
        self.events += 1;
        self.limit.is_none_or(|l| self.events < l)
    }

    fn raw(&mut self, line: &serde_json::Value) {
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

fn parse_bool(params: &Params, key: &str) -> Result<Option<bool>, ApiError> {
    match params.get(key).map(String::as_str) {
        None | Some("") => Ok(None),
        Some("true" | "1") => Ok(Some(true)),
        Some("false" | "0") => Ok(Some(false)),
        Some(other) => Err(ApiError::bad_request(format!(
            "invalid value for {key}: {other:?}"
        ))),
    }
}

/// Validates a WATCH request and starts its streaming response.
pub(crate) fn start(
    shared: Arc<Shared>,
    ty: usize,
    filter: Filter,
    params: &Params,
    meta_only: bool,
) -> Result<Response, ApiError> {
    let rv = params
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or("");
    let rv = match rv {
        "" | "0" => None,
        n => Some(
            n.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {n:?}")))?,
        ),
    };
    let send_initial = parse_bool(params, "sendInitialEvents")?;
    let bookmarks = parse_bool(params, "allowWatchBookmarks")?.unwrap_or(false);
    let timeout = match params.get("timeoutSeconds").map(|t| t.parse::<u64>()) {
        None => None,
        Some(Ok(0)) => None,
        Some(Ok(t)) => Some(Duration::from_secs(t)),
        Some(Err(_)) => return Err(ApiError::bad_request("invalid value for timeoutSeconds")),
    };
    let streaming = send_initial == Some(true);
    if streaming && params.get("resourceVersionMatch").map(String::as_str) != Some("NotOlderThan") {
        return Err(ApiError::new(
            422,
            "Invalid",
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        ));
    }
    let faults = shared.faults().take_watch();
    let drop_after = faults.drop_after;
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let task = {
        let st = shared.state();
        let (cursor, initial, expired) = match (rv, send_initial.unwrap_or(rv.is_none())) {
            (Some(n), true) if n > st.revision => {
                return Err(ApiError::too_large(format!(
                    "Too large resource version: {n}, current: {}",
                    st.revision
                )));
            }
            (_, true) => (st.revision, Some(st.current(ty, &filter)), None),
            (None, false) => (st.revision, None, None),
            (Some(n), false) => (n, None, (n < st.floor).then_some(st.floor)),
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
            initial_end_bookmark: streaming,
            expired,
            faults,
            deadline: timeout.map(|t| Instant::now() + t),
            rev_rx: shared.rev_tx.subscribe(),
            close_rx: shared.close_tx.subscribe(),
            out: Out {
                tx,
                buf: Vec::new(),
                events: 0,
                limit: drop_after,
            },
        }
    };
    tokio::spawn(task.run());
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    let mut res = Response::new(Body::from_stream(stream));
    *res.status_mut() = StatusCode::OK;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(res)
}

impl WatchTask {
    fn bookmark(&mut self, initial_end: bool) {
        let mut metadata = serde_json::json!({"resourceVersion": self.cursor.to_string()});
        if initial_end {
            metadata["annotations"] = serde_json::json!({"k8s.io/initial-events-end": "true"});
        }
        let (api_version, kind) = if self.meta_only {
            (
                "meta.k8s.io/v1".to_string(),
                "PartialObjectMetadata".to_string(),
            )
        } else {
            (self.rt.api_version(), self.rt.kind.clone())
        };
        self.out.raw(&serde_json::json!({
            "type": "BOOKMARK",
            "object": {"kind": kind, "apiVersion": api_version, "metadata": metadata}
        }));
    }

    fn expired_event(&mut self, floor: u64) {
        let msg = format!("too old resource version: {} ({floor})", self.cursor);
        self.out.raw(
            &serde_json::json!({"type": "ERROR", "object": status_json(410, "Expired", &msg)}),
        );
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
        if self.faults.gone {
            let floor = self.shared.state().revision;
            self.expired_event(floor);
            self.out.flush().await;
            return;
        }
        if let Some(floor) = self.expired {
            self.expired_event(floor);
            self.out.flush().await;
            return;
        }
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
        let mut next_bookmark = Instant::now() + interval;
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
                _ = sleep(next_bookmark.saturating_duration_since(Instant::now())), if self.bookmarks => {
                    self.bookmark(false);
                    if !self.out.flush().await {
                        return;
                    }
                    next_bookmark = Instant::now() + interval;
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
