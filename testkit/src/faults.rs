//! Fault injection: failed requests, dropped and expired watches, slow and malformed pages,
//! LISTs narrowed to one name that are slow or answered as if not narrowed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::resource::Verb;
use crate::shared::Shared;
use crate::status::{ApiError, reason_for};

/// Pending faults. Each one-shot fault is consumed by the request it hits.
#[derive(Debug, Default)]
pub(crate) struct FaultState {
    drop_watch_after: Option<usize>,
    /// Like `drop_watch_after`, for every watch until cleared.
    cut_every_watch_after: Option<usize>,
    /// Every watch answers 410 until cleared.
    gone_every_watch: bool,
    /// Continue tokens expire this long after their list's first page.
    continue_ttl: Option<Duration>,
    error_watch_after: Option<usize>,
    /// Like `error_watch_after`, for every watch until cleared.
    error_every_watch_after: Option<usize>,
    fail_next: HashMap<Verb, PendingFailure>,
    /// Every n-th LIST narrowed to one object by name fails with this status.
    fail_named_lists: Option<(usize, u16)>,
    /// LISTs narrowed to one object by name seen since `fail_named_lists` was set.
    named_lists: usize,
    /// Every LIST asking for `PartialObjectMetadataList` fails with this status.
    fail_metadata_lists: Option<u16>,
    /// LISTs narrowed to one object by name are answered as if they had no field selector.
    ignore_named_field_selector: bool,
    /// Every LIST narrowed to one object by name is answered this late.
    named_list_delay: Duration,
    /// LISTs narrowed to one object by name are answered at this revision, whatever they ask.
    named_lists_at: Option<u64>,
    gone_next_watch: bool,
    too_large_next_watch: bool,
    page_delay: Duration,
    /// A LIST page with a continue token sends its head and holds its items until a LIST
    /// with that token arrives.
    pub(crate) hold_list_bodies: bool,
    /// Only pages of LISTs that ask for this `limit` are held.
    pub(crate) hold_only_limit: Option<usize>,
    /// The continue tokens LISTs have asked for (for `hold_list_bodies`).
    pub(crate) continues_asked: std::collections::HashSet<String>,
    malformed_next_list: bool,
    malformed_next_watch: bool,
    inject_list: Vec<Vec<u8>>,
    inject_watch: Vec<Vec<u8>>,
}

/// A pending `fail_next` / `timeout_next` injection.
#[derive(Debug, Clone)]
struct PendingFailure {
    code: u16,
    remaining: usize,
    /// A generic request timeout (504 without the ResourceVersionTooLarge cause).
    timeout: bool,
    /// The `Status` message, instead of the generic one.
    message: Option<String>,
}

/// Faults consumed by one WATCH request.
#[derive(Debug, Default, Clone)]
pub(crate) struct WatchFaults {
    pub drop_after: Option<usize>,
    /// End at `drop_after` with an ERROR event (500) instead of a clean end of stream.
    pub error_at_drop: bool,
    pub gone: bool,
    /// Answer with a `ResourceVersionTooLarge` ERROR event at once.
    pub too_large: bool,
    pub malformed: bool,
    /// Raw objects sent first, each as one `ADDED` event, bytes as-is.
    pub injected: Vec<Vec<u8>>,
}

impl FaultState {
    /// Whether a page of a LIST asking for `limit` items is held (`hold_list_bodies`).
    pub(crate) fn holds(&self, limit: Option<usize>) -> bool {
        self.hold_list_bodies && self.hold_only_limit.is_none_or(|l| Some(l) == limit)
    }

    /// The failure of a LIST of metadata only, while [`Faults::fail_metadata_lists`] is set.
    pub(crate) fn metadata_list_failure(&self) -> Option<ApiError> {
        let code = self.fail_metadata_lists?;
        Some(ApiError::new(
            code,
            reason_for(code),
            format!("injected failure ({code}) for a LIST of metadata only"),
        ))
    }

    /// The failure of this LIST narrowed to one object by name, if it is one that
    /// [`Faults::fail_named_lists`] fails.
    pub(crate) fn take_named_list_failure(&mut self) -> Option<ApiError> {
        let (every, code) = self.fail_named_lists?;
        self.named_lists += 1;
        if self.named_lists.checked_rem(every) != Some(0) {
            return None;
        }
        Some(ApiError::new(
            code,
            reason_for(code),
            format!("injected failure ({code}) for a LIST of one object"),
        ))
    }

    /// Whether a LIST narrowed to one object by name is answered without its field
    /// selector ([`Faults::ignore_named_field_selector`]).
    pub(crate) fn ignores_named_field_selector(&self) -> bool {
        self.ignore_named_field_selector
    }

    /// The revision a LIST narrowed to one object by name is answered at
    /// ([`Faults::answer_named_lists_at`]).
    pub(crate) fn named_lists_at(&self) -> Option<u64> {
        self.named_lists_at
    }

    /// The delay of a LIST narrowed to one object by name ([`Faults::named_list_delay`]).
    pub(crate) fn named_list_delay(&self) -> Duration {
        self.named_list_delay
    }

    /// Consumes one pending failure for `verb`, if any.
    pub(crate) fn take_failure(&mut self, verb: Verb) -> Option<ApiError> {
        let entry = self.fail_next.get_mut(&verb)?;
        let (code, timeout) = (entry.code, entry.timeout);
        let custom = entry.message.clone();
        entry.remaining -= 1;
        if entry.remaining == 0 {
            self.fail_next.remove(&verb);
        }
        if timeout {
            return Some(ApiError::request_timeout());
        }
        let message = if let Some(m) = custom {
            m
        } else if code == 504 {
            "Too large resource version".to_string()
        } else {
            format!("injected failure ({code}) for {verb:?}")
        };
        Some(ApiError::new(code, reason_for(code), message))
    }

    /// Consumes the one-shot watch faults.
    pub(crate) fn take_watch(&mut self) -> WatchFaults {
        let error_after = self
            .error_watch_after
            .take()
            .or(self.error_every_watch_after);
        WatchFaults {
            error_at_drop: error_after.is_some(),
            drop_after: error_after
                .or(self.drop_watch_after.take())
                .or(self.cut_every_watch_after),
            gone: std::mem::take(&mut self.gone_next_watch) || self.gone_every_watch,
            too_large: std::mem::take(&mut self.too_large_next_watch),
            malformed: std::mem::take(&mut self.malformed_next_watch),
            injected: std::mem::take(&mut self.inject_watch),
        }
    }

    /// Consumes the raw items to splice into the next LIST page.
    pub(crate) fn take_injected_list(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.inject_list)
    }

    /// Consumes the one-shot malformed-list fault.
    pub(crate) fn take_malformed_list(&mut self) -> bool {
        std::mem::take(&mut self.malformed_next_list)
    }

    /// Current LIST delay.
    pub(crate) fn page_delay(&self) -> Duration {
        self.page_delay
    }

    pub(crate) fn continue_ttl(&self) -> Option<Duration> {
        self.continue_ttl
    }
}

/// Handle to a server's fault injection. Cheap to clone.
#[derive(Clone)]
pub struct Faults {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults")
            .field("pending", &*self.shared.faults())
            .finish()
    }
}

impl Faults {
    /// The next WATCH stream ends (connection closed cleanly) after `events` events
    /// (ADDED/MODIFIED/DELETED; bookmarks are not counted).
    pub fn drop_watch_after(&self, events: usize) {
        self.shared.faults().drop_watch_after = Some(events);
    }

    /// The next `count` requests of `verb` fail with `status` and a `Status` body.
    /// A 504 uses reason `Timeout` with cause `ResourceVersionTooLarge` (message
    /// `Too large resource version`); see [`Faults::timeout_next`] for a plain timeout.
    /// Status codes outside 400..=599 are clamped to 500. Replaces any pending
    /// `fail_next`/`timeout_next` for `verb`; `count == 0` clears it.
    pub fn fail_next(&self, verb: Verb, status: u16, count: usize) {
        let status = if (400..=599).contains(&status) {
            status
        } else {
            500
        };
        self.set_failure(verb, status, count, false);
    }

    /// The next `count` requests of `verb` fail with HTTP 504, reason `Timeout` and
    /// kube-apiserver's request-timeout message (`Timeout: request did not complete within
    /// requested timeout - context deadline exceeded`), WITHOUT the `ResourceVersionTooLarge`
    /// cause. Replaces any pending `fail_next`/`timeout_next` for `verb`; `count == 0`
    /// clears it.
    pub fn timeout_next(&self, verb: Verb, count: usize) {
        self.set_failure(verb, 504, count, true);
    }

    /// The next `count` requests of `verb` fail with `status` and this `Status` message,
    /// e.g. 500 `invalid shard selector: ...` as kube-apiserver answers a selector it
    /// cannot parse. Replaces any pending failure for `verb`; `count == 0` clears it.
    pub fn fail_next_with_message(&self, verb: Verb, status: u16, message: &str, count: usize) {
        self.set_failure(verb, status, count, false);
        if let Some(f) = self.shared.faults().fail_next.get_mut(&verb) {
            f.message = Some(message.to_string());
        }
    }

    fn set_failure(&self, verb: Verb, code: u16, count: usize, timeout: bool) {
        let mut f = self.shared.faults();
        if count == 0 {
            f.fail_next.remove(&verb);
        } else {
            f.fail_next.insert(
                verb,
                PendingFailure {
                    code,
                    remaining: count,
                    timeout,
                    message: None,
                },
            );
        }
    }

    /// The next WATCH (that passes validation) is answered HTTP 200 with a single ERROR event
    /// whose object is the `ResourceVersionTooLarge` 504 `Status` (`Timeout: Too large resource
    /// version: <requested>, current: <current>`), then ends, without waiting
    /// [`ServerOptions::too_large_wait`](crate::ServerOptions::too_large_wait).
    pub fn too_large_next_watch(&self) {
        self.shared.faults().too_large_next_watch = true;
    }

    /// End every watch cleanly after `events` events (initial events of a streaming list
    /// included), until called with `None`: a load balancer's stream lifetime, or a
    /// `timeoutSeconds` shorter than a streaming list's initial events take.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let server = kube_persist_testkit::TestServer::start().await;
    /// server.handle().faults().cut_every_watch_after(Some(100));
    /// server.handle().faults().cut_every_watch_after(None); // back to normal
    /// # }
    /// ```
    pub fn cut_every_watch_after(&self, events: Option<usize>) {
        self.shared.faults().cut_every_watch_after = events;
    }

    /// Answer every watch with `410 Gone` (an `ERROR` event) until called with `false`:
    /// a server whose watch cache cannot serve the client's version, relist after relist.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let server = kube_persist_testkit::TestServer::start().await;
    /// server.handle().faults().gone_every_watch(true);
    /// server.handle().faults().gone_every_watch(false);
    /// # }
    /// ```
    pub fn gone_every_watch(&self, on: bool) {
        self.shared.faults().gone_every_watch = on;
    }

    /// Expire continue tokens `ttl` after the first page of their list was served (as
    /// kube-apiserver's expire once etcd compacts the list's revision), until called with
    /// `None`. A list that takes longer gets `410 Expired` for its next page.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let server = kube_persist_testkit::TestServer::start().await;
    /// server.handle().faults().continue_ttl(Some(std::time::Duration::from_millis(500)));
    /// # }
    /// ```
    pub fn continue_ttl(&self, ttl: Option<Duration>) {
        self.shared.faults().continue_ttl = ttl;
    }

    /// The next WATCH gets an immediate ERROR event with a 410 Expired `Status`, then ends.
    pub fn gone_next_watch(&self) {
        self.shared.faults().gone_next_watch = true;
    }

    /// Every LIST response is delayed by `d` (`Duration::ZERO` clears it).
    pub fn page_delay(&self, d: Duration) {
        self.shared.faults().page_delay = d;
    }

    /// While `on`, a LIST page that has a continue token is sent in two parts: its head
    /// (`apiVersion`, `kind`, `metadata`) at once, and its items only once a LIST asking for
    /// that continue token has arrived. A client that asks for the next page only after it
    /// has read the whole page never gets it; one that asks as soon as it has the token does.
    pub fn hold_list_bodies(&self, on: bool) {
        let mut f = self.shared.faults();
        f.hold_list_bodies = on;
        f.hold_only_limit = None;
    }

    /// As [`hold_list_bodies`](Self::hold_list_bodies)`(true)`, for the pages of LISTs that
    /// ask for `limit` items a page only: other clients' LISTs (a probe with `limit=1`, a
    /// verify's pages of another size) are answered whole. `hold_list_bodies(false)` ends it.
    pub fn hold_list_bodies_of_limit(&self, limit: usize) {
        let mut f = self.shared.faults();
        f.hold_list_bodies = true;
        f.hold_only_limit = Some(limit);
    }

    /// The next LIST page carries one extra item whose `metadata.name` is a number.
    pub fn malformed_next_list(&self) {
        self.shared.faults().malformed_next_list = true;
    }

    /// The next WATCH first sends one ADDED event whose object is malformed the same way.
    pub fn malformed_next_watch(&self) {
        self.shared.faults().malformed_next_watch = true;
    }

    /// The next LIST page gets `raw` spliced into its `items` array as one more item, bytes
    /// as-is: it may be any JSON (or not JSON at all, or not UTF-8). Calls before that LIST
    /// accumulate (each is one item, in call order). Use it to test how a client handles bad
    /// objects: missing fields, invalid UTF-8 in a string, malformed JSON.
    pub fn inject_next_list(&self, raw: Vec<u8>) {
        self.shared.faults().inject_list.push(raw);
    }

    /// The next WATCH stream first sends one line `{"type":"ADDED","object":<raw>}` with the
    /// bytes of `raw` as-is (before any initial event), then continues normally. Calls before
    /// that WATCH accumulate (one line each, in call order). `raw` should not contain a
    /// newline, which would split the line. Counts as an event for
    /// [`Faults::drop_watch_after`].
    pub fn inject_next_watch(&self, raw: Vec<u8>) {
        self.shared.faults().inject_watch.push(raw);
    }

    /// The next WATCH stream sends `events` events (ADDED/MODIFIED/DELETED, initial events
    /// included), then one ERROR event (500 `InternalError`, as kube-apiserver sends when a
    /// watch fails after it was accepted) and ends. Clients see an error, not a clean end.
    pub fn error_watch_after(&self, events: usize) {
        self.shared.faults().error_watch_after = Some(events);
    }

    /// [`Faults::error_watch_after`] for every watch, until called with `None`: a server
    /// that fails every watch from the client's version the same way (kube-apiserver
    /// without a watch cache answers `500 PrevKv=nil` to a watch from just below its
    /// compaction point).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let server = kube_persist_testkit::TestServer::start().await;
    /// server.handle().faults().error_every_watch_after(Some(0));
    /// server.handle().faults().error_every_watch_after(None);
    /// # }
    /// ```
    pub fn error_every_watch_after(&self, events: Option<usize>) {
        self.shared.faults().error_every_watch_after = events;
    }

    /// Ends every currently open WATCH stream cleanly (clients see end-of-stream and
    /// reconnect). Not in the original brief; added to force reconnects in tests.
    pub fn close_watches(&self) {
        self.shared.close_watches();
    }

    /// Every `every`-th LIST narrowed to one object by name (a `fieldSelector` with
    /// `metadata.name=<name>`, counted in [`RequestCounts::list_named`](crate::RequestCounts))
    /// fails with `status`, until called with `every == 0`; `every == 1` fails them all
    /// (a 403 so stands for a client allowed to list pages but refused these). Other LISTs
    /// are not affected. The count starts again at each call.
    pub fn fail_named_lists(&self, every: usize, status: u16) {
        let mut f = self.shared.faults();
        f.fail_named_lists = (every > 0).then_some((every, status));
        f.named_lists = 0;
    }

    /// Every LIST that asks for metadata only (`as=PartialObjectMetadataList`) fails with
    /// `status` until called with `None`: a server or an aggregated API that cannot serve
    /// that representation (406), or an authorizer that refuses it. Other LISTs are not
    /// affected.
    pub fn fail_metadata_lists(&self, status: Option<u16>) {
        self.shared.faults().fail_metadata_lists = status;
    }

    /// Answer every LIST narrowed to one object by name (a `fieldSelector` with
    /// `metadata.name=<name>`, counted in [`RequestCounts::list_named`](crate::RequestCounts))
    /// as if it had no field selector at all, until called with `false`: the whole
    /// collection (within the label selector, the namespace of the path and the shard, from
    /// `continue` and up to `limit` if asked), as a server or proxy does that ignores
    /// `fieldSelector` (some aggregated APIs, old servers). The request still counts as
    /// narrowed, and [`Faults::fail_named_lists`] still applies to it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let server = kube_persist_testkit::TestServer::start().await;
    /// server.handle().faults().ignore_named_field_selector(true);
    /// server.handle().faults().ignore_named_field_selector(false);
    /// # }
    /// ```
    pub fn ignore_named_field_selector(&self, on: bool) {
        self.shared.faults().ignore_named_field_selector = on;
    }

    /// Answer every LIST narrowed to one object by name `d` late (`Duration::ZERO` clears
    /// it), so that a client's fetches overlap: how many it keeps in flight is then
    /// [`RequestCounts::list_named_max_in_flight`](crate::RequestCounts). Other LISTs are
    /// not delayed (see [`Faults::page_delay`] for them).
    pub fn named_list_delay(&self, d: Duration) {
        self.shared.faults().named_list_delay = d;
    }

    /// Answer every LIST narrowed to one object by name (counted in
    /// [`RequestCounts::list_named`](crate::RequestCounts)) as the collection was at
    /// `revision` (a [`ServerHandle::revision`](crate::ServerHandle::revision)), whatever
    /// `resourceVersion` and `resourceVersionMatch` it asks for, until called with `None`:
    /// a server or proxy that ignores `resourceVersionMatch=NotOlderThan` and answers from a
    /// stale cache. A revision the history no longer holds (before a compaction) is served
    /// as now.
    pub fn answer_named_lists_at(&self, revision: Option<u64>) {
        self.shared.faults().named_lists_at = revision;
    }

    /// Clears all pending faults and the page delay.
    pub fn clear(&self) {
        *self.shared.faults() = FaultState::default();
    }
}
