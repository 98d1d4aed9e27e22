//! From server bytes to one batch of writes: a LIST page or a burst of watch lines is parsed
//! (borrowing the response buffer), each object reduced and validated, and the result is a
//! list of [`Op`]s for the writer plus what the state machine must know (new checkpoint,
//! end of the initial events, an `ERROR` event). Runs on the process's CPU threads
//! (`exec::compute`), not on the runtime nor on the disk thread.

use std::sync::Arc;

use serde_json::value::RawValue;

use super::config::StreamConfig;
use super::conn::Line;
use super::indexers::Inspector;
use super::raw::{self, BadObject, ListPage, Listed, StatusBody, WatchLine};
use crate::disk::Compression;
use crate::disk::record::Packed;
use crate::model::Counters;
use crate::model::{Error, Result};
use crate::model::{describe, unnamed};
use crate::store::{DECODED_PER_JSON_BYTE, Incoming, Op};

/// The largest burst of watch lines whose objects are cached write-through.
const WRITE_THROUGH_MAX_BURST: usize = 128;

/// Everything needed to turn server bytes into writes. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Ingest {
    pub(crate) cfg: Arc<StreamConfig>,
    pub(crate) validate: Option<Inspector>,
    pub(crate) stats: Arc<Counters>,
    pub(crate) url: Arc<str>,
    /// Whether "the server ignores shardSelector" was logged (once per stream).
    pub(crate) shard_warned: Arc<std::sync::atomic::AtomicBool>,
    /// The store's compression: watch events are compressed here, as they are parsed.
    pub(crate) compress: Compression,
}

/// An identified object the store refused; reported to `stream()` users.
#[derive(Debug, Clone)]
pub(crate) struct Rejected {
    pub(crate) key: String,
    pub(crate) resource_version: String,
    pub(crate) reason: String,
}

/// A parsed LIST page.
#[derive(Debug)]
pub(crate) struct Page {
    pub(crate) objects: Vec<Incoming>,
    pub(crate) continue_token: Option<String>,
    pub(crate) resource_version: Option<String>,
    pub(crate) items: usize,
    pub(crate) rejected: Vec<Rejected>,
}

/// A parsed burst of watch lines.
#[derive(Debug, Default)]
pub(crate) struct Parsed {
    pub(crate) ops: Vec<Op>,
    /// The resourceVersion of the last event or bookmark applied.
    pub(crate) last_rv: Option<String>,
    /// The resourceVersion of the `k8s.io/initial-events-end` bookmark, if it came.
    pub(crate) end: Option<String>,
    /// Lines after the end bookmark (live events), to apply once the list is swept.
    pub(crate) rest: Vec<Line>,
    /// An `ERROR` event ended the burst.
    pub(crate) error: Option<StatusBody>,
    /// A bookmark without the end annotation came during the initial events: the server
    /// does not stream lists (it ignores `sendInitialEvents`).
    pub(crate) plain_bookmark_initial: bool,
    /// An event the store cannot identify was lost (unreadable line in a live watch): the
    /// only safe way on is a relist.
    pub(crate) lost: Option<String>,
    /// Events and bookmarks received (the connection is healthy).
    pub(crate) delivered: u64,
    /// Bookmarks received: the server has sent everything up to theirs.
    pub(crate) bookmarks: u64,
    pub(crate) rejected: Vec<Rejected>,
}

/// A parsed metadata-only LIST page.
#[derive(Debug)]
pub(crate) struct MetaPage {
    /// The page's objects in this stream's shard.
    pub(crate) items: Vec<Listed>,
    /// Objects in the page, in the shard or not.
    pub(crate) listed: usize,
    pub(crate) continue_token: Option<String>,
    pub(crate) resource_version: Option<String>,
    pub(crate) rejected: Vec<Rejected>,
}

/// A burst being parsed: what it gave so far.
struct BurstParse {
    p: Parsed,
    events: u64,
    bookmarks: u64,
    /// Bytes of decoded objects the hot cache may still take from this burst.
    keep_budget: usize,
    /// A streaming list's initial events.
    initial: bool,
}

/// Whether a burst's parse goes on after a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Go,
    Stop,
}

impl BurstParse {
    /// A line that cannot be read: a live watch has lost an event (the burst stops, and
    /// nothing of it is committed); a streaming list's initial events skip it (the sweep
    /// removes what it held).
    fn lose(&mut self, why: String) -> Flow {
        if self.initial {
            return Flow::Go;
        }
        self.p.lost = Some(why);
        Flow::Stop
    }

    /// A bookmark at `rv`; `end`: the streaming list's end bookmark, after which `rest` is
    /// live events.
    fn bookmark(&mut self, rv: String, end: bool, rest: &mut std::vec::IntoIter<Line>) -> Flow {
        self.p.delivered += 1;
        self.bookmarks += 1;
        if self.initial && end {
            self.p.end = Some(rv);
            self.p.rest = rest.collect();
            return Flow::Stop;
        }
        if self.initial {
            self.p.plain_bookmark_initial = true;
            return Flow::Stop;
        }
        self.p.last_rv = Some(rv);
        Flow::Go
    }
}

impl Ingest {
    /// Whether an object belongs to the stream's shard (always, unsharded). One outside it
    /// means the server ignores `shardSelector`: counted, and warned about once.
    fn in_shard(&self, o: &Incoming) -> bool {
        self.in_shard_of(&o.suffix, Some(&o.uid))
    }

    /// [`Ingest::in_shard`] of an object known by its key suffix and uid.
    pub(crate) fn in_shard_of(&self, suffix: &[u8], uid: Option<&str>) -> bool {
        let Some(shard) = self.cfg.get_shard() else {
            return true;
        };
        let ns = crate::disk::keys::suffix_namespace(suffix);
        if shard.contains(uid, Some(&ns)) {
            return true;
        }
        Counters::add(&self.stats.shard_client_filtered, 1);
        self.server_ignores_shards();
        false
    }

    fn server_ignores_shards(&self) {
        if !self
            .shard_warned
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(url = %self.url,
                "server ignores shardSelector; filtering on the client, bandwidth is not reduced");
        }
    }

    fn bad(&self, bad: &BadObject) {
        Counters::add(&self.stats.bad_objects, 1);
        tracing::warn!(object = %bad.what, resource_version = bad.resource_version.as_deref().unwrap_or(""),
            reason = %bad.why, url = %self.url, "skipping bad object from the server");
    }

    /// Reduce one object; a bad one is counted, logged, and (if identified) returned as
    /// `Err(Some(..))` so that its stored version can be removed.
    /// `keep`: keep its validation decode for the hot cache (see [`Incoming::decoded`]).
    /// `pack`: compress its body now (see [`Incoming::packed`]): a live watch event, which
    /// is written unless its version is stored already (a replay after a crash).
    fn object(
        &self,
        raw: &RawValue,
        keep: bool,
        pack: bool,
    ) -> std::result::Result<Incoming, Option<(Vec<u8>, Rejected)>> {
        let decodes = &self.stats.decodes;
        let incoming = raw::incoming(raw, &self.cfg, self.validate.as_ref(), keep, decodes);
        incoming
            .map(|mut o| {
                if pack && !self.cfg.keys_only {
                    o.packed = Some(Packed::new(&o.body, self.compress));
                }
                o
            })
            .map_err(|bad| {
                self.bad(&bad);
                bad.key.map(|key| {
                    (
                        key,
                        Rejected {
                            key: bad.what,
                            resource_version: bad.resource_version.unwrap_or_default(),
                            reason: bad.why,
                        },
                    )
                })
            })
    }

    /// Reduce one object as a list page's are; a bad one is counted, logged, and returned
    /// as its rejection when identified.
    pub(crate) fn reduce(&self, raw: &RawValue) -> std::result::Result<Incoming, Option<Rejected>> {
        self.object(raw, false, false)
            .map_err(|r| r.map(|(_, r)| r))
    }

    /// Parse one LIST response body; gives its buffer back (emptied) for the next page.
    pub(crate) fn list_page(&self, bytes: Vec<u8>, context: &str) -> Result<(Page, Vec<u8>)> {
        // A page with invalid UTF-8 (a broken object) must not block the whole list: decode
        // it lossily and skip the items that contained the invalid bytes.
        let (text, lossy) = match String::from_utf8(bytes) {
            Ok(t) => (t, false),
            Err(e) => (String::from_utf8_lossy(e.as_bytes()).into_owned(), true),
        };
        let page: ListPage<'_> = serde_json::from_str(&text).map_err(|e| Error::Protocol {
            context: context.to_string(),
            detail: format!("list body does not decode: {}", describe(&e)),
        })?;
        if let Some(shard) = self.cfg.get_shard() {
            let echoed = page
                .metadata
                .shard_info
                .as_ref()
                .and_then(|i| i.selector.as_deref());
            if echoed != Some(shard.selector().as_str()) {
                self.server_ignores_shards();
            }
        }
        let items = page.items.unwrap_or_default();
        let mut out = Page {
            objects: Vec::with_capacity(items.len()),
            continue_token: page.metadata.continue_token.filter(|t| !t.is_empty()),
            resource_version: page.metadata.resource_version.filter(|rv| !rv.is_empty()),
            items: items.len(),
            rejected: Vec::new(),
        };
        for raw in items {
            if lossy && raw.get().contains('\u{FFFD}') {
                self.bad(&BadObject::anonymous(
                    unnamed(raw.get()),
                    "object contains invalid UTF-8".into(),
                ));
                continue;
            }
            // List pages are not cached write-through: a (re)list would flush the cache.
            match self.object(raw, false, false) {
                Ok(o) if self.in_shard(&o) => out.objects.push(o),
                Ok(_) => {}
                // Not written: in a relist its old version is swept at the end of the list.
                Err(r) => out.rejected.extend(r.map(|(_, r)| r)),
            }
        }
        let mut buffer = text.into_bytes();
        buffer.clear();
        Ok((out, buffer))
    }

    /// Parse a burst of watch lines. `initial`: the lines are a streaming list's initial
    /// events (objects only, until the end bookmark).
    pub(crate) fn lines(&self, lines: Vec<Line>, initial: bool) -> Parsed {
        // Live events keep their decoded objects for the hot cache, as many as it holds.
        // Not a full burst (a replay catching up after a restart, or a flood): its objects
        // would mostly evict each other before anyone reads them, and dropping them on the
        // disk thread halves how fast it applies (measured with the lookup bench's
        // `--apply-only`: 19,200 events/s without write-through, 10,800 with).
        let replay = lines.len() > WRITE_THROUGH_MAX_BURST;
        let mut b = BurstParse {
            p: Parsed::default(),
            events: 0,
            bookmarks: 0,
            keep_budget: if initial || replay {
                0
            } else {
                self.cfg.hot_cache_bytes
            },
            initial,
        };
        let mut lines = lines.into_iter();
        while let Some(line) = lines.next() {
            if self.line(&mut b, line, &mut lines) == Flow::Stop {
                break;
            }
        }
        let BurstParse {
            mut p,
            events,
            bookmarks,
            ..
        } = b;
        Counters::add(&self.stats.watch_events, events);
        Counters::add(&self.stats.bookmarks, bookmarks);
        p.bookmarks = bookmarks;
        if events + bookmarks > 0 {
            self.stats.watch_activity();
        }
        p
    }

    /// One line of a burst; `rest`: the lines after it (the live events after a streaming
    /// list's end bookmark).
    fn line(&self, b: &mut BurstParse, line: Line, rest: &mut std::vec::IntoIter<Line>) -> Flow {
        let bytes = match line {
            Line::Data(bytes) => bytes,
            Line::TooLong => {
                let why = format!(
                    "watch event exceeds max_object_bytes {} (longer than {} bytes)",
                    self.cfg.max_object_bytes,
                    self.cfg.max_line_bytes()
                );
                self.bad(&BadObject::anonymous(String::new(), why.clone()));
                return b.lose(why);
            }
        };
        let (text, lossy) = match std::str::from_utf8(&bytes) {
            Ok(t) => (std::borrow::Cow::Borrowed(t), false),
            Err(_) => (String::from_utf8_lossy(&bytes), true),
        };
        if text.trim().is_empty() {
            return Flow::Go;
        }
        let ev: WatchLine<'_> = match serde_json::from_str(&text) {
            Ok(ev) => ev,
            Err(e) => {
                let why = format!("watch event does not decode: {}", describe(&e));
                self.bad(&BadObject::anonymous(unnamed(&text), why.clone()));
                return b.lose(why);
            }
        };
        match ev.kind.as_str() {
            "ADDED" | "MODIFIED" => self.applied(b, ev.object, lossy),
            "DELETED" => self.deleted(b, ev.object),
            "BOOKMARK" => match raw::bookmark(ev.object) {
                Some((rv, end)) => b.bookmark(rv, end, rest),
                None => {
                    self.bad(&BadObject::anonymous(
                        unnamed(&text),
                        "bookmark without resourceVersion".into(),
                    ));
                    Flow::Go
                }
            },
            "ERROR" => {
                b.p.error = Some(serde_json::from_str(ev.object.get()).unwrap_or_default());
                Flow::Stop
            }
            other => {
                self.bad(&BadObject::anonymous(
                    unnamed(&text),
                    format!("unknown watch event type {other:?}"),
                ));
                Flow::Go
            }
        }
    }

    /// An ADDED or MODIFIED event's object; `lossy`: its line was not valid UTF-8.
    fn applied(&self, b: &mut BurstParse, object: &RawValue, lossy: bool) -> Flow {
        b.p.delivered += 1;
        let res = if lossy {
            Err(self.lossy(object))
        } else {
            let cost = object.get().len().saturating_mul(DECODED_PER_JSON_BYTE);
            let keep = cost <= b.keep_budget;
            b.keep_budget = b.keep_budget.saturating_sub(cost);
            self.object(object, keep, !b.initial)
        };
        match res {
            Ok(o) => {
                b.p.last_rv = Some(o.resource_version.clone());
                b.events += 1;
                if self.in_shard(&o) {
                    b.p.ops.push(Op::Put(o));
                }
            }
            Err(Some((key, rejected))) => {
                if !rejected.resource_version.is_empty() {
                    b.p.last_rv = Some(rejected.resource_version.clone());
                }
                // The server has a newer version than the stored one, which must not be
                // served as current: remove it (a relist's sweep does the same for an
                // initial event).
                if !b.initial {
                    b.p.ops.push(Op::Reject {
                        suffix: key,
                        resource_version: Some(rejected.resource_version.clone())
                            .filter(|rv| !rv.is_empty()),
                    });
                }
                b.p.rejected.push(rejected);
            }
            Err(None) if b.initial => {}
            Err(None) => {
                b.p.lost = Some("an object without a usable name".into());
                return Flow::Stop;
            }
        }
        Flow::Go
    }

    /// The rejection of an object whose line was not valid UTF-8 (if it can be identified).
    fn lossy(&self, object: &RawValue) -> Option<(Vec<u8>, Rejected)> {
        let decodes = &self.stats.decodes;
        let o = raw::incoming(object, &self.cfg, None, false, decodes).ok()?;
        let what = unnamed(object.get());
        let bad = BadObject {
            what: what.clone(),
            why: "object contains invalid UTF-8".into(),
            key: Some(o.suffix.clone()),
            resource_version: Some(o.resource_version.clone()),
        };
        self.bad(&bad);
        Some((
            o.suffix,
            Rejected {
                key: what,
                resource_version: o.resource_version,
                reason: bad.why,
            },
        ))
    }

    /// A DELETED event's object.
    fn deleted(&self, b: &mut BurstParse, object: &RawValue) -> Flow {
        match raw::deleted(object) {
            Ok(d) if !b.initial => {
                b.p.delivered += 1;
                if let Some(rv) = &d.resource_version {
                    b.p.last_rv = Some(rv.clone());
                }
                b.events += 1;
                b.p.ops.push(Op::Delete {
                    suffix: d.suffix,
                    body: object.get().as_bytes().to_vec(),
                    resource_version: d.resource_version,
                    uid: d.uid,
                });
                Flow::Go
            }
            Ok(_) => {
                tracing::warn!(
                    url = %self.url,
                    "DELETED event during a streaming list's initial events, ignored"
                );
                Flow::Go
            }
            Err(bad) => {
                self.bad(&bad);
                b.lose(bad.why)
            }
        }
    }

    /// Parse a `PartialObjectMetadataList` page (CPU only).
    pub(crate) fn metadata_page(&self, bytes: &[u8], context: &str) -> Result<MetaPage> {
        let text = String::from_utf8_lossy(bytes);
        let page: ListPage<'_> = serde_json::from_str(&text).map_err(|e| Error::Protocol {
            context: context.to_string(),
            detail: format!("metadata list body does not decode: {}", describe(&e)),
        })?;
        let items = page.items.unwrap_or_default();
        let mut out = MetaPage {
            items: Vec::with_capacity(items.len()),
            listed: items.len(),
            continue_token: page.metadata.continue_token.filter(|t| !t.is_empty()),
            resource_version: page.metadata.resource_version.filter(|rv| !rv.is_empty()),
            rejected: Vec::new(),
        };
        for item in items {
            match raw::listed(item) {
                Ok(l) if self.in_shard_of(&l.suffix, l.uid.as_deref()) => out.items.push(l),
                Ok(_) => {}
                Err(bad) => out.rejected.extend(self.refused(bad)),
            }
        }
        Ok(out)
    }

    /// Reduce fetched bodies as a list page's objects are (transform, validation, indexes,
    /// shard); the refused ones are reported (and, unmarked, swept).
    pub(crate) fn fetched(&self, bodies: Vec<Vec<u8>>) -> (Vec<Incoming>, Vec<Rejected>) {
        let (mut objects, mut rejected) = (Vec::with_capacity(bodies.len()), Vec::new());
        for body in bodies {
            let raw: &RawValue = match serde_json::from_slice(&body) {
                Ok(r) => r,
                Err(e) => {
                    let bad = BadObject::anonymous(
                        unnamed(&String::from_utf8_lossy(&body)),
                        format!("fetched object does not decode: {}", describe(&e)),
                    );
                    rejected.extend(self.refused(bad));
                    continue;
                }
            };
            match self.reduce(raw) {
                Ok(o) if self.in_shard_of(&o.suffix, Some(&o.uid)) => objects.push(o),
                Ok(_) => {}
                Err(r) => rejected.extend(r),
            }
        }
        (objects, rejected)
    }

    /// Count and log a bad object; the rejection to report when it is identified.
    fn refused(&self, bad: BadObject) -> Option<Rejected> {
        Counters::add(&self.stats.bad_objects, 1);
        tracing::warn!(object = %bad.what, reason = %bad.why, url = %self.url,
            "skipping bad object from the server");
        bad.key.map(|_| Rejected {
            key: bad.what,
            resource_version: bad.resource_version.unwrap_or_default(),
            reason: bad.why,
        })
    }
}
