//! The list/watch/relist state machine. Each `step` does one unit of work (one LIST page,
//! one burst of watch events, one sweep chunk, one reconnect) and commits it through the
//! [`Writer`] in one atomic batch together with the new checkpoint.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{AsyncBufReadExt, AsyncReadExt, FutureExt, Stream, StreamExt};
use kube::core::Request;
use kube::core::params::{ListParams, WatchParams};
use serde_json::value::RawValue;
use tracing::Instrument;

use super::backoff::{Backoff, jitter};
use super::config::Config;
use super::index::Inspector;
use super::raw::{self, BadObject, ListPage, StatusBody, WatchLine};
use crate::error::{Error, Result};
use crate::stats::Counters;
use crate::store::record::Phase;
use crate::store::writer::{Change, Incoming, ListProgress, Op, Writer};

/// An event before it is decoded into the user's type.
#[derive(Debug)]
pub(crate) enum RawEvent {
    Resumed(String),
    Init,
    InitApply(Vec<u8>),
    InitDone,
    Apply(Vec<u8>),
    Delete(Vec<u8>),
}

type Lines = Pin<Box<dyn Stream<Item = std::io::Result<Vec<u8>>> + Send>>;

/// Split a response body into lines of bytes. Unlike `AsyncBufReadExt::lines`, a line that
/// is not UTF-8 does not break the stream: it is skipped (and counted) by the caller.
fn byte_lines(body: impl futures::AsyncBufRead + Send + 'static) -> Lines {
    Box::pin(futures::stream::unfold(
        Box::pin(body),
        |mut body| async move {
            let mut line = Vec::new();
            match body.read_until(b'\n', &mut line).await {
                Ok(0) => None,
                Ok(_) => Some((Ok(line), body)),
                Err(e) => Some((Err(e), body)),
            }
        },
    ))
}

struct WatchConn {
    lines: Lines,
    /// Still receiving a streaming list's initial events.
    initial: bool,
}

pub(crate) struct Machine {
    client: kube::Client,
    request: Request,
    metadata_only: bool,
    cfg: Config,
    validate: Option<Inspector>,
    writer: Writer,
    stats: Arc<Counters>,
    backoff: Backoff,
    delay: Option<Duration>,
    watch: Option<WatchConn>,
    /// Whether to produce events (a stream consumer exists).
    emit: bool,
    pub(crate) pending: VecDeque<RawEvent>,
    /// The current list is the first complete one (`Init*` events, not `Apply`).
    cold: bool,
    started: bool,
    too_large: u32,
    /// Watch events received after a streaming list ended, held until its sweep is done.
    deferred: Vec<Vec<u8>>,
    /// An index build in progress: the last object key indexed so far.
    index_build: Option<Option<Vec<u8>>>,
}

impl Machine {
    pub(crate) fn new(
        client: kube::Client,
        url: String,
        metadata_only: bool,
        cfg: Config,
        validate: Option<Inspector>,
        writer: Writer,
        stats: Arc<Counters>,
    ) -> Self {
        let backoff = Backoff::new(cfg.min_backoff, cfg.max_backoff);
        Machine {
            client,
            request: Request::new(url),
            metadata_only,
            cfg,
            validate,
            writer,
            stats,
            backoff,
            delay: None,
            watch: None,
            emit: true,
            pending: VecDeque::new(),
            cold: true,
            started: false,
            too_large: 0,
            deferred: Vec::new(),
            index_build: None,
        }
    }

    pub(crate) fn writer_mut(&mut self) -> &mut Writer {
        &mut self.writer
    }

    pub(crate) fn set_emit(&mut self, emit: bool) {
        self.emit = emit;
    }

    fn url(&self) -> &str {
        &self.request.url_path
    }

    /// Do one unit of work. On error, the next step waits a jittered backoff first.
    pub(crate) async fn step(&mut self) -> Result<()> {
        if let Some(d) = self.delay.take() {
            tracing::debug!(
                delay_ms = d.as_millis() as u64,
                "waiting before the next attempt"
            );
            tokio::time::sleep(d).await;
        }
        let span = tracing::debug_span!("kube_persist", url = %self.request.url_path);
        let res = self.step_inner().instrument(span).await;
        if let Err(e) = &res {
            Counters::add(&self.stats.errors, 1);
            let delay = self.backoff.next_delay();
            tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "list/watch error, backing off");
            self.delay = Some(delay);
            self.drop_watch();
        }
        res
    }

    async fn step_inner(&mut self) -> Result<()> {
        if !self.started {
            self.prepare_indexes()?;
            self.started = true;
            return self.start();
        }
        if let Some(after) = self.index_build.take() {
            return self.build_index_chunk(after);
        }
        let was_synced = matches!(self.writer.state().phase, Phase::Synced { .. });
        match self.writer.state().phase.clone() {
            Phase::Empty => self.begin_list()?,
            Phase::Listing { continue_token, .. } => {
                if self.cfg.streaming_lists {
                    self.streaming_step().await?
                } else {
                    self.list_page(continue_token).await?
                }
            }
            Phase::Sweeping { .. } => {
                let (page, emit) = (self.cfg.page_size as usize, self.emit);
                let (changes, _) = self.writer.sweep_step(page, emit)?;
                self.push_changes(changes);
            }
            Phase::Synced { resource_version } => self.watch_step(resource_version).await?,
        }
        if !was_synced && matches!(self.writer.state().phase, Phase::Synced { .. }) {
            self.backoff.reset();
            if self.cold {
                self.cold = false;
                self.push(RawEvent::InitDone);
            }
        }
        Ok(())
    }

    /// Compare the configured indexes with those built on disk: drop the ones no longer
    /// configured, and schedule a build (page by page, from disk) for new ones.
    fn prepare_indexes(&mut self) -> Result<()> {
        let configured = self.cfg.index_names();
        let built = self.writer.built_indexes()?;
        self.writer.set_indexed(!configured.is_empty());
        let removed: Vec<String> = built
            .iter()
            .filter(|n| !configured.contains(n))
            .cloned()
            .collect();
        if !removed.is_empty() || (configured.is_empty() && !built.is_empty()) {
            tracing::info!(indexes = ?removed, "dropping indexes no longer configured");
            self.writer.drop_indexes(&removed, configured.is_empty())?;
        }
        let kept: Vec<String> = built
            .into_iter()
            .filter(|n| configured.contains(n))
            .collect();
        self.writer.set_built_indexes(&kept)?;
        if kept != configured {
            tracing::info!(indexes = ?configured, "building indexes from disk");
            self.index_build = Some(None);
        }
        Ok(())
    }

    fn build_index_chunk(&mut self, after: Option<Vec<u8>>) -> Result<()> {
        let Some(inspect) = self.validate.clone() else {
            return Ok(());
        };
        let page = self.cfg.page_size as usize;
        match self.writer.index_chunk(after.clone(), page, &*inspect) {
            Ok(Some(last)) => self.index_build = Some(Some(last)),
            Ok(None) => {
                let names = self.cfg.index_names();
                tracing::info!(indexes = ?names, "indexes built");
                self.writer.set_built_indexes(&names)?;
            }
            Err(e) => {
                self.index_build = Some(after);
                return Err(e);
            }
        }
        Ok(())
    }

    fn start(&mut self) -> Result<()> {
        let state = self.writer.state().clone();
        self.cold = state.last_synced.is_none();
        match state.phase {
            Phase::Synced { resource_version } => {
                Counters::add(&self.stats.resumes, 1);
                tracing::info!(resource_version = %resource_version, objects = state.count,
                    "resuming from checkpoint without LIST");
                self.push(RawEvent::Resumed(resource_version));
            }
            Phase::Listing {
                continue_token: Some(t),
                ..
            } if !self.cfg.streaming_lists => {
                tracing::info!(epoch = state.epoch, "continuing an interrupted list");
                let _ = t;
                if self.cold {
                    self.push(RawEvent::Init);
                }
            }
            Phase::Sweeping { .. } => tracing::info!("continuing an interrupted sweep"),
            Phase::Empty | Phase::Listing { .. } => self.begin_list()?,
        }
        Ok(())
    }

    fn begin_list(&mut self) -> Result<()> {
        self.drop_watch();
        self.deferred.clear();
        self.writer.begin_list()?;
        if self.cold {
            self.push(RawEvent::Init);
        }
        Ok(())
    }

    /// The server said our version is gone: list again, after a random delay.
    fn relist(&mut self, why: &str) -> Result<()> {
        let d = jitter(self.cfg.relist_jitter);
        tracing::info!(reason = why, delay_ms = d.as_millis() as u64, "relisting");
        self.delay = Some(d);
        self.too_large = 0;
        self.begin_list()
    }

    async fn list_page(&mut self, continue_token: Option<String>) -> Result<()> {
        let lp = ListParams {
            label_selector: self.cfg.label_selector.clone(),
            field_selector: self.cfg.field_selector.clone(),
            limit: Some(self.cfg.page_size),
            continue_token: continue_token.clone(),
            ..ListParams::default()
        };
        let url = self.url().to_string();
        let context = || format!("LIST {url} (continue: {})", continue_token.is_some());
        let req = if self.metadata_only {
            self.request.list_metadata(&lp)
        } else {
            self.request.list(&lp)
        }
        .map_err(|e| Error::Config(format!("{}: {e}", context())))?;
        let body = match self.client.request_stream(req).await {
            Ok(b) => b,
            Err(kube::Error::Api(s)) if s.code == 410 => {
                return self.relist("continue token expired (410)");
            }
            Err(source) => {
                return Err(Error::Kube {
                    context: context(),
                    source,
                });
            }
        };
        let mut bytes = Vec::new();
        Box::pin(body)
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| Error::Protocol {
                context: context(),
                detail: format!("reading the list body: {e}"),
            })?;
        // A page with invalid UTF-8 (a broken object) must not block the whole list: decode
        // it lossily and skip the items that contained the invalid bytes.
        let (text, lossy) = match String::from_utf8(bytes) {
            Ok(t) => (t, false),
            Err(e) => (String::from_utf8_lossy(e.as_bytes()).into_owned(), true),
        };
        let page: ListPage<'_> = serde_json::from_str(&text).map_err(|e| Error::Protocol {
            context: context(),
            detail: format!("list body does not decode: {e}"),
        })?;
        Counters::add(&self.stats.list_pages, 1);
        let items = page.items.unwrap_or_default();
        let n = items.len();
        let objects: Vec<Incoming> = items
            .into_iter()
            .filter_map(|raw| {
                if lossy && raw.get().contains('\u{FFFD}') {
                    self.bad(BadObject {
                        what: raw::snippet(raw.get()),
                        why: "object contains invalid UTF-8".into(),
                    });
                    return None;
                }
                self.incoming(raw)
            })
            .collect();
        let progress = match page.metadata.continue_token.filter(|t| !t.is_empty()) {
            Some(t) => ListProgress::More(Some(t)),
            None => ListProgress::Done(
                page.metadata
                    .resource_version
                    .filter(|rv| !rv.is_empty())
                    .ok_or_else(|| Error::Protocol {
                        context: context(),
                        detail: "last page has no metadata.resourceVersion".into(),
                    })?,
            ),
        };
        if let ListProgress::Done(rv) = &progress {
            tracing::info!(items = n, resource_version = %rv, "last list page");
        } else {
            tracing::debug!(items = n, "list page");
        }
        drop(text);
        let changes = self.writer.list_page(objects, progress, self.emit)?;
        self.push_changes(changes);
        Ok(())
    }

    async fn streaming_step(&mut self) -> Result<()> {
        if self.watch.is_none() {
            return self.connect_watch(String::new(), true).await;
        }
        self.read_burst().await
    }

    async fn watch_step(&mut self, resource_version: String) -> Result<()> {
        if !self.deferred.is_empty() {
            let lines = std::mem::take(&mut self.deferred);
            return self.apply_lines(lines, false);
        }
        if self.watch.is_none() {
            return self.connect_watch(resource_version, false).await;
        }
        self.read_burst().await
    }

    async fn connect_watch(&mut self, resource_version: String, initial: bool) -> Result<()> {
        let wp = WatchParams {
            label_selector: self.cfg.label_selector.clone(),
            field_selector: self.cfg.field_selector.clone(),
            timeout: Some(self.cfg.timeout),
            bookmarks: true,
            send_initial_events: initial,
        };
        let url = self.url().to_string();
        let context = || format!("WATCH {url} from resourceVersion {resource_version:?}");
        let mut req = if self.metadata_only {
            self.request.watch_metadata(&wp, &resource_version)
        } else {
            self.request.watch(&wp, &resource_version)
        }
        .map_err(|e| Error::Config(format!("{}: {e}", context())))?;
        req.headers_mut().insert(
            http::header::ACCEPT_ENCODING,
            http::HeaderValue::from_static("identity"),
        );
        match self.client.request_stream(req).await {
            Ok(body) => {
                tracing::debug!(resource_version = %resource_version, initial, "watch connected");
                self.watch = Some(WatchConn {
                    lines: byte_lines(body),
                    initial,
                });
                if !initial {
                    self.too_large = 0;
                    self.writer.set_live(true);
                }
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 410 => {
                self.relist("watch resourceVersion expired (410)")
            }
            Err(kube::Error::Api(s)) if is_too_large(&s) => {
                self.too_large += 1;
                if self.too_large > self.cfg.too_large_retries {
                    return self.relist("resourceVersion too large, retries exhausted");
                }
                Err(Error::Kube {
                    context: context(),
                    source: kube::Error::Api(s),
                })
            }
            Err(source) => Err(Error::Kube {
                context: context(),
                source,
            }),
        }
    }

    /// Read the next watch event, plus every event already buffered (up to a page), and
    /// apply them in one batch.
    async fn read_burst(&mut self) -> Result<()> {
        let Some(conn) = self.watch.as_mut() else {
            return Ok(());
        };
        let mut lines = Vec::new();
        let mut ended = false;
        match conn.lines.next().await {
            None => ended = true,
            Some(Err(e)) => {
                return Err(Error::Protocol {
                    context: format!("WATCH {}", self.request.url_path),
                    detail: format!("stream broke: {e}"),
                });
            }
            Some(Ok(l)) => lines.push(l),
        }
        while !ended && lines.len() < self.cfg.page_size as usize {
            match conn.lines.next().now_or_never() {
                Some(Some(Ok(l))) => lines.push(l),
                Some(None) => ended = true,
                Some(Some(Err(_))) | None => break,
            }
        }
        let initial = conn.initial;
        self.apply_lines(lines, initial)?;
        if ended && self.watch.is_some() {
            tracing::debug!("watch stream ended; reconnecting from the checkpoint");
            self.drop_watch();
        }
        Ok(())
    }

    fn apply_lines(&mut self, lines: Vec<Vec<u8>>, initial: bool) -> Result<()> {
        let mut ops = Vec::with_capacity(lines.len());
        let mut last_rv = None;
        let mut list_done = None;
        let mut gone = None;
        let mut rest = Vec::new();
        let (mut events, mut bookmarks) = (0u64, 0u64);
        let mut lines = lines.into_iter();
        while let Some(bytes) = lines.next() {
            let line = match std::str::from_utf8(&bytes) {
                Ok(l) => l,
                Err(e) => {
                    self.bad(BadObject {
                        what: String::from_utf8_lossy(&bytes[..bytes.len().min(120)]).into_owned(),
                        why: format!("watch event is not UTF-8: {e}"),
                    });
                    continue;
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            let ev: WatchLine<'_> = match serde_json::from_str(line) {
                Ok(ev) => ev,
                Err(e) => {
                    self.bad(BadObject {
                        what: raw::snippet(line),
                        why: format!("watch event does not decode: {e}"),
                    });
                    continue;
                }
            };
            match ev.kind.as_str() {
                "ADDED" | "MODIFIED" => {
                    if let Some(o) = self.incoming(ev.object) {
                        last_rv = Some(o.resource_version.clone());
                        events += 1;
                        ops.push(Op::Put(o));
                    }
                }
                "DELETED" => match raw::deleted_suffix(ev.object) {
                    Ok(suffix) if !initial => {
                        if let Some((rv, _)) = raw::bookmark(ev.object) {
                            last_rv = Some(rv);
                        }
                        events += 1;
                        ops.push(Op::Delete {
                            suffix,
                            body: ev.object.get().as_bytes().to_vec(),
                        });
                    }
                    Ok(_) => tracing::warn!(
                        "DELETED event during a streaming list's initial events, ignored"
                    ),
                    Err(bad) => self.bad(bad),
                },
                "BOOKMARK" => match raw::bookmark(ev.object) {
                    Some((rv, end)) => {
                        bookmarks += 1;
                        if initial && end {
                            list_done = Some(rv);
                            rest = lines.collect();
                            break;
                        }
                        last_rv = Some(rv);
                    }
                    None => self.bad(BadObject {
                        what: raw::snippet(line),
                        why: "bookmark without resourceVersion".into(),
                    }),
                },
                "ERROR" => {
                    let status: StatusBody =
                        serde_json::from_str(ev.object.get()).unwrap_or_default();
                    gone = Some(status);
                    break;
                }
                other => self.bad(BadObject {
                    what: raw::snippet(line),
                    why: format!("unknown watch event type {other:?}"),
                }),
            }
        }
        Counters::add(&self.stats.watch_events, events);
        Counters::add(&self.stats.bookmarks, bookmarks);
        if initial {
            let objects = ops.into_iter().filter_map(|op| match op {
                Op::Put(o) => Some(o),
                Op::Delete { .. } => None,
            });
            let progress = match list_done.clone() {
                Some(rv) => ListProgress::Done(rv),
                None => ListProgress::More(None),
            };
            let changes = self
                .writer
                .list_page(objects.collect(), progress, self.emit)?;
            self.push_changes(changes);
            if let Some(rv) = list_done {
                tracing::info!(resource_version = %rv, "streaming list complete");
                if let Some(c) = self.watch.as_mut() {
                    c.initial = false;
                }
                self.writer.set_live(true);
                // Events after the end of the initial events are live watch events; apply
                // them once the sweep (if any) has completed.
                self.deferred = rest;
            }
        } else if let Some(rv) = last_rv {
            let changes = self.writer.watch_burst(ops, rv, self.emit)?;
            self.push_changes(changes);
        }
        if let Some(status) = gone {
            if status.code == 410 {
                return self.relist("watch ERROR 410 Gone");
            }
            let err = Error::WatchStatus {
                url: self.url().to_string(),
                resource_version: self.writer.state().last_synced.clone().unwrap_or_default(),
                code: status.code,
                reason: status.reason,
                message: status.message,
            };
            self.drop_watch();
            return Err(err);
        }
        Ok(())
    }

    fn incoming(&self, raw: &RawValue) -> Option<Incoming> {
        match raw::incoming(raw, &self.cfg, self.validate.as_ref()) {
            Ok(o) => Some(o),
            Err(bad) => {
                self.bad(bad);
                None
            }
        }
    }

    fn bad(&self, bad: BadObject) {
        Counters::add(&self.stats.bad_objects, 1);
        tracing::warn!(object = %bad.what, reason = %bad.why, url = %self.url(), "skipping bad object from the server");
    }

    fn push(&mut self, ev: RawEvent) {
        if self.emit {
            self.pending.push_back(ev);
        }
    }

    fn push_changes(&mut self, changes: Vec<Change>) {
        for c in changes {
            let ev = match c {
                Change::Created(b) | Change::Updated(b) if self.cold => RawEvent::InitApply(b),
                Change::Created(b) | Change::Updated(b) => RawEvent::Apply(b),
                Change::Deleted(b) => RawEvent::Delete(b),
            };
            self.push(ev);
        }
    }

    fn drop_watch(&mut self) {
        if self.watch.take().is_some() {
            self.writer.set_live(false);
        }
    }
}

fn is_too_large(s: &kube::core::Status) -> bool {
    let causes = s
        .details
        .as_ref()
        .map(|d| {
            d.causes
                .iter()
                .any(|c| c.reason == "ResourceVersionTooLarge")
        })
        .unwrap_or(false);
    causes || (s.code == 504 && s.message.contains("Too large resource version"))
}
