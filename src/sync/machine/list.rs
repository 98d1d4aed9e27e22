//! The list actions: paginated LIST pages (read ahead while the previous one commits) and
//! streaming lists (`sendInitialEvents=true`) up to their end bookmark.

use std::sync::atomic::{AtomicUsize, Ordering};

use futures::AsyncBufReadExt;
use kube::core::Request;

use super::ahead::{Ahead, Body};
use super::core::{Core, Done};
use super::transition::{InitialBurst, Returned, Status};
use super::{Deferred, Held, INITIAL_LINGER};
use crate::exec::{DiskWorker, PagePermit, compute};
use crate::model::{Counters, Error, RequestKind, Result};
use crate::store::{Change, ListProgress, Op};
use crate::sync::config::StreamConfig;
use crate::sync::conn::{WatchConn, invalid_shard, with_shard};
use crate::sync::list_head::{self, Head};
use crate::sync::params;
use crate::sync::parse::{Ingest, Page, Rejected};
use crate::sync::raw::StatusKind;

/// A LIST page's commit, submitted to the disk thread by one step and taken in by the next
/// (see [`page`]). The page and its permit are in the disk job, which ends whether or not
/// the watcher is polled.
pub(crate) struct Committing {
    done: CommitDone,
}

/// A page's commit on the disk thread: its events and the objects the store refused.
type CommitDone =
    std::pin::Pin<Box<dyn std::future::Future<Output = Done<(Vec<Change>, Vec<Rejected>)>> + Send>>;

impl Core {
    /// What a LIST needs, borrowed from the stream.
    pub(super) fn lister(&self) -> Lister<'_> {
        Lister {
            stream: &self.stream,
            client: &self.client,
            request: &self.request,
            metadata_only: self.metadata_only,
            cfg: &self.cfg,
            stats: &self.stats,
            worker: &self.writer.worker,
            last_page_bytes: &self.last_page_bytes,
            ahead: &self.ahead,
            page_size: self
                .pacing
                .page_size(self.cfg.page_size, StreamConfig::MAX_PAGE_SIZE),
        }
    }
}

/// Parse a LIST page on the CPU threads (CPU only, no disk).
/// Its buffer goes back to `worker` for the next page.
pub(super) async fn parse_page(
    ingest: Ingest,
    worker: DiskWorker,
    bytes: Vec<u8>,
    context: String,
) -> Result<Page> {
    compute(move || {
        let (page, buffer) = ingest.list_page(bytes, &context)?;
        worker.give_page_buffer(buffer);
        Ok(page)
    })
    .await
    .ok_or_else(|| Error::Protocol {
        context: "LIST".into(),
        detail: "parsing a list page panicked".into(),
    })?
}

/// One step of a paginated LIST: read and parse the next page (at `continue_token`, if
/// `read`) while the page before (`committing`, submitted by the previous step) is committed
/// on the disk thread, take in that commit's events, then submit this page's commit and
/// carry it to the next step (at most two pages in memory, three while one is parsed).
///
/// A page holds a permit of the directory's page budget from when its response arrives
/// until it is committed. The permit travels with the page into its disk job, never in
/// the stage: a watcher whose consumer stops polling between steps gives its place back
/// once its commit ends, so it cannot starve the other streams' lists.
pub(super) async fn page(
    core: &mut Core,
    committing: &mut Option<Committing>,
    continue_token: Option<String>,
    read: bool,
) -> Result<Returned> {
    let url = core.described();
    let context = |continued: bool| format!("LIST {url} (continue: {continued})");
    let (lister, ingest, worker) = (
        core.lister(),
        core.ingest.clone(),
        core.writer.worker.clone(),
    );
    let page_context = context(continue_token.is_some());
    let read_page = async {
        if !read {
            return Ok(None);
        }
        let from = continue_token
            .as_deref()
            .map_or(params::From::Now, params::From::Continue);
        match lister.read_page(from, lister.metadata_only).await? {
            Some((bytes, permit)) => {
                let page = parse_page(ingest, worker, bytes, page_context).await?;
                Ok(Some(Some((page, permit))))
            }
            // The continue token expired (410).
            None => Ok(Some(None)),
        }
    };
    let commit = async {
        match committing.take() {
            Some(c) => Some(c.done.await),
            None => None,
        }
    };
    let (committed, read) = tokio::join!(commit, read_page);
    // The commit first: its events are emitted, and a failed commit drops the page
    // read after it (the retry resumes from the persisted phase).
    if let Some(done) = committed {
        let (changes, rejected) = core.writer.finish(done)?;
        core.push_changes(changes);
        core.push_rejected(rejected);
    }
    let (page, permit) = match read? {
        Some(Some(read)) => read,
        Some(None) => return Ok(Returned::Expired),
        None => {
            return Ok(Returned::Committed {
                written: 0,
                unchanged: 0,
            });
        }
    };
    let next_token = page.continue_token.clone();
    let emit = core.emit;
    let last_page_context = context(continue_token.is_some());
    let done = core.writer.start(move |w| {
        // The page's place in the budget is given back once it is committed.
        let _permit = permit;
        let progress = match page.continue_token {
            Some(t) => ListProgress::More(Some(t)),
            None => ListProgress::Done(page.resource_version.ok_or_else(|| Error::Protocol {
                context: last_page_context,
                detail: "last page has no metadata.resourceVersion".into(),
            })?),
        };
        match &progress {
            ListProgress::Done(rv) => {
                tracing::info!(items = page.items, resource_version = %rv, "last list page")
            }
            ListProgress::More(_) => tracing::debug!(items = page.items, "list page"),
        }
        Ok((w.list_page(page.objects, progress, emit)?, page.rejected))
    });
    *committing = Some(Committing {
        done: Box::pin(done),
    });
    Ok(Returned::PageRead { next_token })
}

/// Connect a streaming list.
pub(super) async fn connect_initial(
    core: &mut Core,
    conn: &mut Option<WatchConn>,
) -> Result<Returned> {
    match WatchConn::connect(&core.client, core.target(None), "", true).await {
        Ok(c) => {
            *conn = Some(c);
            Ok(Returned::Connected)
        }
        Err(failure) => Ok(super::watch::connect_failed(core, failure)),
    }
}

/// Read, parse and commit a burst of a streaming list's initial events; the connection and
/// the live events after the end bookmark stay in `held` for the watch.
pub(super) async fn read_initial(core: &mut Core, held: &mut Held) -> Result<Returned> {
    let Some(conn) = held.conn.as_mut() else {
        return Err(Error::Protocol {
            context: format!("WATCH {} (sendInitialEvents=true)", core.described()),
            detail: "no connection to read from".into(),
        });
    };
    let timeout = core.cfg.initial_events_timeout;
    let burst = match conn
        .burst(core.cfg.page_size as usize, Some(timeout), INITIAL_LINGER)
        .await
    {
        Ok(b) => b,
        Err(e) => {
            let broke = Some(e.to_string());
            core.error = Some(e);
            return Ok(Returned::Initial(InitialBurst {
                broke,
                ..InitialBurst::default()
            }));
        }
    };
    if burst.idle {
        return Ok(Returned::Initial(InitialBurst {
            idle: true,
            ..InitialBurst::default()
        }));
    }
    let ended = burst.ended;
    // A burst of initial events is a list page: parsed on the CPU threads and committed
    // on the disk thread under a permit of the directory's page budget, taken once the
    // burst is read (a stream waiting for its server holds none).
    let permit = core.writer.worker.page_permit().await;
    let ingest = core.ingest.clone();
    let mut parsed = compute(move || ingest.lines(burst.lines, true))
        .await
        .ok_or_else(|| Error::Protocol {
            context: format!("WATCH {} (sendInitialEvents=true)", core.described()),
            detail: "parsing a burst of initial events panicked".into(),
        })?;
    let objects: Vec<_> = std::mem::take(&mut parsed.ops)
        .into_iter()
        .filter_map(|op| match op {
            Op::Put(o) => Some(o),
            _ => None,
        })
        .collect();
    let (end, emit) = (parsed.end.clone(), core.emit);
    let changes = core
        .writer
        .run(move |w| {
            let _permit = permit;
            match end {
                Some(rv) => w.list_page(objects, ListProgress::Done(rv), emit),
                None if !objects.is_empty() => w.list_page(objects, ListProgress::More(None), emit),
                None => Ok(Vec::new()),
            }
        })
        .await?;
    core.push_changes(changes);
    core.push_rejected(std::mem::take(&mut parsed.rejected));
    let mut out = InitialBurst {
        end: parsed.end.is_some(),
        plain_bookmark: parsed.plain_bookmark_initial,
        ended,
        delivered: parsed.delivered,
        ..InitialBurst::default()
    };
    if let Some(rv) = &parsed.end {
        tracing::info!(stream = %core.stream, url = %core.url(), resource_version = %rv, "streaming list complete");
        held.deferred = Deferred::Lines(std::mem::take(&mut parsed.rest));
    } else if let Some(status) = parsed.error {
        out.status = Some(Status {
            kind: status.kind(),
            detail: format!("{} {}: {}", status.code, status.reason, status.message),
        });
        core.error = Some(super::watch::watch_status(core, status));
    } else if ended {
        core.error = Some(Error::Protocol {
            context: format!("WATCH {} (sendInitialEvents=true)", core.described()),
            detail: format!(
                "the stream ended after {} initial events of this burst, before the end bookmark",
                parsed.delivered
            ),
        });
    }
    Ok(Returned::Initial(out))
}

/// What a LIST needs, borrowed from the stream (without the watch connection, which is not
/// `Sync`), so that a page can be read while another is being committed.
pub(super) struct Lister<'a> {
    /// The stream's name, for errors.
    stream: &'a str,
    client: &'a kube::Client,
    request: &'a Request,
    metadata_only: bool,
    cfg: &'a StreamConfig,
    stats: &'a Counters,
    /// The configured page size, or more after continue tokens expired (see `Pacing`).
    page_size: u32,
    /// The size of the last page's body: the next body's buffer is allocated at about that
    /// size at once, not grown by doubling (which copies it and leaves freed blocks of
    /// every size behind, and the allocator keeps those).
    last_page_bytes: &'a AtomicUsize,
    /// The directory's page budget, and where page buffers are reused from.
    worker: &'a DiskWorker,
    /// The next page's request, sent once this page's head named its continue token.
    ahead: &'a std::sync::Mutex<Option<Ahead>>,
}

impl Lister<'_> {
    fn url(&self) -> &str {
        &self.request.url_path
    }

    /// The LIST request of `lp` (as metadata only if `metadata`), narrowed to the shard.
    fn request_for(
        &self,
        lp: &kube::api::ListParams,
        metadata: bool,
        context: &(dyn Fn() -> String + Sync),
    ) -> Result<http::Request<Vec<u8>>> {
        let req = if metadata {
            self.request.list_metadata(lp)
        } else {
            self.request.list(lp)
        }
        .map_err(|e| Error::InvalidArgument {
            detail: format!("{}: {e}", context()),
        })?;
        with_shard(req, self.cfg)
    }

    /// Read a page's body into `bytes` (at most `bound` bytes). As soon as its head names
    /// the next page's continue token, that page's request is sent ahead.
    async fn read_body(
        &self,
        mut body: Body,
        bytes: &mut Vec<u8>,
        bound: usize,
        metadata: bool,
        context: &(dyn Fn() -> String + Sync),
    ) -> Result<()> {
        /// A head not found in this many bytes is not looked for further.
        const HEAD_MAX: usize = 64 << 10;
        let mut head_read = false;
        loop {
            let chunk = body.fill_buf().await.map_err(|e| Error::Protocol {
                context: context(),
                detail: format!("reading the list body: {e}"),
            })?;
            if chunk.is_empty() {
                return Ok(());
            }
            let n = chunk.len();
            if bytes.len() + n > bound {
                return Err(Error::Protocol {
                    context: context(),
                    detail: format!(
                        "the page is larger than StreamConfig::max_page_bytes ({bound} bytes); \
                         not read further (lower page_size, or raise max_page_bytes)"
                    ),
                });
            }
            bytes.extend_from_slice(chunk);
            body.as_mut().consume(n);
            if head_read {
                continue;
            }
            match list_head::head(bytes) {
                Head::More if bytes.len() < HEAD_MAX => {}
                Head::Meta(meta) => {
                    head_read = true;
                    if let Some(token) = meta.continue_token.filter(|t| !t.is_empty()) {
                        self.send_ahead(token, metadata, context)?;
                    }
                }
                Head::More | Head::Unknown => head_read = true,
            }
        }
    }

    /// Send the request of the page at `token` now, for the next read to take.
    fn send_ahead(
        &self,
        token: String,
        metadata: bool,
        context: &(dyn Fn() -> String + Sync),
    ) -> Result<()> {
        let lp = params::list(
            params::Selectors::of(self.cfg),
            self.page_size,
            params::From::Continue(&token),
        );
        let req = self.request_for(&lp, metadata, context)?;
        let ahead = Ahead::send(self.client, req, token, metadata);
        *self.ahead.lock().unwrap_or_else(|p| p.into_inner()) = Some(ahead);
        Ok(())
    }

    fn described(&self) -> String {
        format!("{} (stream {:?})", self.url(), self.stream)
    }

    /// Read one LIST page (network only) with its place in the directory's page budget,
    /// taken once the response arrives (a LIST the server has not answered holds none);
    /// `None` when its continue token expired (410). `metadata`: as a
    /// `PartialObjectMetadataList`.
    pub(super) async fn read_page(
        &self,
        from: params::From<'_>,
        metadata: bool,
    ) -> Result<Option<(Vec<u8>, PagePermit)>> {
        let lp = params::list(params::Selectors::of(self.cfg), self.page_size, from);
        let context = || {
            let at = match from {
                params::From::Now => "continue: false".to_string(),
                params::From::Continue(_) => "continue: true".to_string(),
                params::From::Exactly(rv) => format!("resourceVersion {rv}"),
            };
            let shape = if metadata { ", metadata only" } else { "" };
            format!("LIST {} ({at}{shape})", self.described())
        };
        // A request sent ahead is for exactly one page; any other read drops (aborts) it.
        let ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner()).take();
        let sent = match (from, ahead) {
            (params::From::Continue(token), Some(a)) if a.is_for(token, metadata) => {
                a.response().await
            }
            _ => None,
        };
        let response = match sent {
            Some(response) => response,
            None => {
                let req = self.request_for(&lp, metadata, &context)?;
                self.client
                    .request_stream(req)
                    .await
                    .map(|b| Box::pin(b) as Body)
            }
        };
        let body = match response {
            Ok(b) => b,
            Err(kube::Error::Api(s)) if StatusKind::of(s.code, false) == StatusKind::Gone => {
                return Ok(None);
            }
            Err(source) => {
                if let Some(e) = invalid_shard(&source) {
                    return Err(e);
                }
                return Err(Error::Kube {
                    request: RequestKind::List,
                    context: context(),
                    source,
                });
            }
        };
        let permit = self.worker.page_permit().await;
        /// Never reserve more than this ahead of the body.
        const MAX_HINT: usize = 64 << 20;
        let hint = self.last_page_bytes.load(Ordering::Relaxed).min(MAX_HINT);
        let bound = self.cfg.get_max_page_bytes();
        let mut bytes = self.worker.page_buffer((hint + hint / 16).min(bound));
        self.read_body(body, &mut bytes, bound, metadata, &context)
            .await?;
        Counters::add(&self.stats.list_pages, 1);
        if metadata && !self.metadata_only {
            Counters::add(&self.stats.metadata_pages, 1);
        }
        self.last_page_bytes.store(bytes.len(), Ordering::Relaxed);
        Ok(Some((bytes, permit)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use k8s_openapi::api::core::v1::Pod;

    use crate::exec::pages_in_flight;

    /// Issue 59: the next page's LIST is sent as soon as a page's head names its continue
    /// token, while that page's items are still being read: against a server that sends a
    /// page's items only once the next page is asked for, a paged sync completes, and so
    /// does a delta relist's metadata listing. (When the next page was asked for only after
    /// a page was read and parsed, the first held page never ended.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_next_page_is_asked_for_while_a_page_is_read() {
        let server = kube_persist_testkit::TestServer::start().await;
        server.handle().seed_pods(300, 3);
        let faults = server.handle().faults();
        faults.hold_list_bodies(true);
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::Dir::open(dir.path(), Default::default()).unwrap();
        let cfg = crate::sync::StreamConfig::default()
            .page_size(50)
            .relist_mode(crate::sync::RelistMode::Delta)
            .relist_jitter(Duration::ZERO);
        let api = kube::Api::<Pod>::all(server.client());
        let (reader, watcher) = crate::sync::open_store(&store, "pods", api, cfg, &()).unwrap();
        let task = tokio::spawn(watcher.run());
        tokio::time::timeout(Duration::from_secs(60), reader.wait_until_ready())
            .await
            .expect("the held pages were read: each next page was asked for early")
            .unwrap();
        assert_eq!(reader.len(), 300);
        assert_eq!(reader.stats().list_pages, 6);
        // A relist after a 410, by metadata pages (the delta relist). Exactly one: the
        // injected 410 is the only one (a compaction as well could answer the resume with a
        // 410 of its own when the churn was not yet seen, and then the armed one a second
        // time, after the first relist).
        server.handle().churn(10, 0, 0, 7);
        faults.gone_next_watch();
        faults.close_watches();
        tokio::time::timeout(Duration::from_secs(60), async {
            while reader.stats().metadata_pages < 6 || !reader.is_caught_up() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the delta relist's held metadata pages were read");
        let stats = reader.stats();
        assert_eq!(stats.relists, 1, "{stats:?}");
        assert_eq!(stats.metadata_pages, 6, "{stats:?}");
        assert_eq!(stats.delta_fallbacks, 0, "{stats:?}");
        task.abort();
        let _ = task.await;
    }

    /// Every list page, a paginated LIST's or a streaming list's burst of initial events, is
    /// parsed on the CPU threads while it holds a place in its directory's page budget.
    /// (Streaming lists' bursts were parsed on the disk thread, outside the budget.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn list_pages_are_parsed_on_the_cpu_threads_within_the_page_budget() {
        let server = kube_persist_testkit::TestServer::start().await;
        server.handle().seed_pods(300, 3);
        for streaming in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let store = crate::store::Dir::open(dir.path(), Default::default()).unwrap();
            // Where each object is parsed (its transform runs in the parse), and the places
            // left in the budget meanwhile.
            let seen = Arc::new(Mutex::new(Vec::new()));
            let probe = {
                let (seen, worker) = (seen.clone(), store.worker());
                move |_: &mut serde_json::Value| {
                    let thread = std::thread::current().name().unwrap_or("").to_string();
                    let free = worker.free_page_permits();
                    seen.lock().unwrap().push((thread, free));
                }
            };
            let mut cfg = crate::sync::StreamConfig::default()
                .page_size(50)
                .transform("probe", probe);
            if streaming {
                cfg = cfg.streaming_lists();
            }
            let api = kube::Api::<Pod>::all(server.client());
            let (reader, watcher) = crate::sync::open_store(&store, "pods", api, cfg, &()).unwrap();
            let task = tokio::spawn(watcher.run());
            tokio::time::timeout(Duration::from_secs(60), reader.wait_until_ready())
                .await
                .expect("the list completed")
                .unwrap();
            task.abort();
            let _ = task.await;
            let seen = seen.lock().unwrap();
            assert!(
                seen.len() >= 300,
                "streaming {streaming}: {} parsed",
                seen.len()
            );
            for (thread, free) in seen.iter() {
                assert_eq!(thread, "kube-persist-cpu", "streaming {streaming}");
                assert!(
                    *free < pages_in_flight(),
                    "streaming {streaming}: a page parsed without a permit"
                );
            }
        }
    }
}
