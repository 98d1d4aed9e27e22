//! A delta relist's fetch of one new or changed object: a LIST narrowed to it
//! (`params::one`: its namespace, `metadata.name=<name>` joined to the stream's field
//! selector, the stream's label and shard selectors, not older than the metadata page).
//! It needs only the `list` verb, answers within the stream's selection (an empty answer:
//! the object left it or was deleted, and is swept), and is never older than the page.
//!
//! Each fetch is retried on its own after a transient failure (429, 5xx, a timeout, a
//! connection error), with a backoff, so one failure does not discard the page's other
//! fetches; an answer that says fetching cannot work for this stream (401, 403, 405, 406,
//! 415, 400, 422: a verb or a request the server refuses; 404, which a LIST of a collection
//! says nothing of one object with) is [`Fetch::Unusable`], and the relist lists in full
//! from that page on. So is an answer that is not what was asked for (`answer_of`): more
//! than one object, a continue token, another object, more bytes than one object can be
//! ([`FETCH_ANSWER_ENVELOPE_BYTES`]), or an answer older than the page: a server or proxy
//! that ignores the field selector or the resourceVersion (an aggregated API, an old
//! server) cannot be fetched from, and nothing it answered is taken.

use std::cmp::Ordering;

use futures::AsyncReadExt;
use kube::core::Request;

use crate::exec::DiskWorker;
use crate::model::{Counters, Error, RequestKind, Result, resource_version};
use crate::sync::backoff::{Backoff, jitter};
use crate::sync::config::StreamConfig;
use crate::sync::conn::with_shard;
use crate::sync::params;
use crate::sync::params::collection_path;
use crate::sync::raw::{ListPage, Listed, StatusKind, too_large};

/// Bodies a delta relist of one stream fetches at once (the directory caps all its streams'
/// together, `exec::FETCHES_PER_DIRECTORY`).
pub(crate) const FETCHES_IN_FLIGHT: usize = 16;

/// Room for the list envelope around the one object of a fetch's answer: the answer is read
/// up to the stream's largest object ([`StreamConfig::get_max_object_bytes`]) plus this, and
/// one past it is [`Fetch::Unusable`]. A LIST narrowed to one name answers at most that
/// object, in a `List` whose own fields (apiVersion, kind, metadata.resourceVersion) take
/// a few hundred bytes; an answer past the bound is a server that ignored the field
/// selector and answers the whole collection, unpaginated, which is not read into memory
/// (up to [`FETCHES_IN_FLIGHT`] answers are held at once) but listed page by page in full.
pub(crate) const FETCH_ANSWER_ENVELOPE_BYTES: usize = 64 << 10;

/// Attempts of one object's fetch before the page fails (and is retried from the stored
/// phase after the stream's backoff).
pub(crate) const FETCH_ATTEMPTS: u32 = 6;

/// What fetching one object gave.
#[derive(Debug)]
pub(crate) enum Fetch {
    /// The object as the server has it, at `at` or later, within the selection: its JSON
    /// (a list item) and the resourceVersion the answer was listed at.
    Body { json: Vec<u8>, answered_at: String },
    /// Not in the selection now (deleted, or moved out of it); the answer's resourceVersion.
    Gone { answered_at: Option<String> },
    /// Fetching cannot work for this stream: the rest of the relist lists in full.
    Unusable(Unusable),
}

/// Why a delta relist cannot fetch (or list metadata) for this stream.
#[derive(Debug, Clone)]
pub(crate) struct Unusable {
    /// A short reason, for the log line and the metric's description.
    pub(crate) reason: &'static str,
    /// What the server said.
    pub(crate) detail: String,
}

impl Unusable {
    /// The refusal of a request that `code` says cannot work as it is (a verb the client
    /// may not use, a representation or a parameter the server refuses), or `None` for a
    /// failure worth retrying.
    pub(crate) fn of_status(code: u16, too_large: bool, message: &str) -> Option<Unusable> {
        let reason = match StatusKind::of(code, too_large) {
            StatusKind::Refused if matches!(code, 401 | 403) => {
                "the `list` verb is refused (401/403)"
            }
            StatusKind::Refused => "the server refuses the request's method or representation",
            StatusKind::Invalid => "the server refuses the request's parameters (400/422)",
            StatusKind::Gone | StatusKind::TooLarge | StatusKind::Other => return None,
        };
        Some(Unusable {
            reason,
            detail: format!("{code}: {message}"),
        })
    }

    /// [`Unusable::of_status`] of a failed request's error.
    pub(crate) fn of_error(e: &Error) -> Option<Unusable> {
        match e {
            Error::Kube {
                source: kube::Error::Api(s),
                ..
            } => Unusable::of_status(
                s.code,
                too_large(s.code, &s.message, std::iter::empty()),
                &s.message,
            ),
            _ => None,
        }
    }
}

/// What one stream's fetches need; borrowed from the machine.
pub(crate) struct Fetcher<'a> {
    pub(crate) stream: &'a str,
    pub(crate) client: &'a kube::Client,
    /// The stream's collection URL.
    pub(crate) url: &'a str,
    pub(crate) cfg: &'a StreamConfig,
    pub(crate) worker: &'a DiskWorker,
    pub(crate) stats: &'a Counters,
}

impl Fetcher<'_> {
    /// Fetch `l`'s body as the server has it at `at` or later, within the selection,
    /// retrying transient failures ([`FETCH_ATTEMPTS`] in all); each attempt holds one of
    /// the directory's fetch permits.
    pub(crate) async fn fetch(&self, l: &Listed, at: &str) -> Result<Fetch> {
        let path = collection_path(self.url, l.namespace.as_deref());
        let context = || {
            format!(
                "LIST {path} fieldSelector metadata.name={:?} (a delta relist's fetch, stream {:?})",
                l.name, self.stream
            )
        };
        let mut backoff = Backoff::new(self.cfg.min_backoff, self.cfg.max_backoff);
        let mut attempt = 1;
        loop {
            let outcome = {
                let _permit = self.worker.fetch_permit().await;
                self.attempt(&path, l, at).await
            };
            let failure = match outcome {
                Ok(fetch) => return Ok(fetch),
                Err(Attempt::Unusable(u)) => return Ok(Fetch::Unusable(u)),
                Err(Attempt::Failed(f)) => f,
            };
            if attempt >= FETCH_ATTEMPTS {
                return Err(failure.into_error(context()));
            }
            let delay = backoff.next_delay() + jitter(self.cfg.min_backoff);
            Counters::add(&self.stats.fetch_retries, 1);
            tracing::debug!(stream = %self.stream, object = %l.name, attempt, error = %failure,
                retry_in_ms = delay.as_millis() as u64, "a delta relist's fetch failed, retrying");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// One attempt of [`Fetcher::fetch`].
    async fn attempt(&self, path: &str, l: &Listed, at: &str) -> Result<Fetch, Attempt> {
        let lp = params::one(params::Selectors::of(self.cfg), &l.name, at);
        let req = Request::new(path)
            .list(&lp)
            .map_err(|e| Attempt::unusable("the fetch cannot be built", e.to_string()))?;
        let req = with_shard(req, self.cfg)
            .map_err(|e| Attempt::unusable("the fetch cannot be built", e.to_string()))?;
        let body = match self.client.request_stream(req).await {
            Ok(b) => b,
            // A LIST of a collection answered 404 says nothing of one object (a removed
            // kind, a proxy or an aggregated API that does not serve the path): not "gone".
            // Every other LIST of the stream retries it; here the rest of the relist lists
            // in full, and the page's LIST tells what it means.
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Err(Attempt::unusable(
                    "a LIST narrowed to one object answered 404",
                    format!("404: {}", s.message),
                ));
            }
            Err(kube::Error::Api(s)) => {
                let large = too_large(s.code, &s.message, std::iter::empty());
                if let Some(u) = Unusable::of_status(s.code, large, &s.message) {
                    return Err(Attempt::Unusable(u));
                }
                return Err(Attempt::Failed(Failure::Kube(kube::Error::Api(s))));
            }
            Err(e) => return Err(Attempt::Failed(Failure::Kube(e))),
        };
        let bound = self
            .cfg
            .get_max_object_bytes()
            .saturating_add(FETCH_ANSWER_ENVELOPE_BYTES);
        let bytes = read_answer(body, bound).await?;
        answer_of(&bytes, l, at).map_err(|(reason, detail)| Attempt::unusable(reason, detail))
    }
}

/// A fetch's answer, read up to `bound` bytes: one past it is unusable (not read further).
async fn read_answer(
    body: impl futures::AsyncRead,
    bound: usize,
) -> std::result::Result<Vec<u8>, Attempt> {
    let mut bytes = Vec::new();
    Box::pin(body)
        .take(bound as u64 + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| Attempt::Failed(Failure::Read(e.to_string())))?;
    if bytes.len() > bound {
        return Err(Attempt::unusable(
            "the answer to a LIST narrowed to one object is larger than one object (the server ignores the field selector)",
            format!("more than {bound} bytes"),
        ));
    }
    Ok(bytes)
}

/// What a narrowed LIST's answer says of `l`, listed at `at` in its metadata page: its
/// body, or gone (an empty answer); or why the answer is unusable, as `(reason, detail)`:
/// it does not decode, or it is not the answer to what was asked (more than one item, a
/// continue token, an item that is not `l`: a server that ignores the field selector;
/// an answer older than `at` or an item older than the page's version of it, where
/// versions are comparable: a server that ignores `resourceVersionMatch=NotOlderThan`).
fn answer_of(
    bytes: &[u8],
    l: &Listed,
    at: &str,
) -> std::result::Result<Fetch, (&'static str, String)> {
    const UNDECODED: &str = "the answer does not decode";
    const IGNORED: &str = "the answer to a LIST narrowed to one object is not that object alone (the server ignores the field selector)";
    const OLDER: &str = "the answer to a LIST narrowed to one object is older than its metadata page (the server ignores resourceVersionMatch=NotOlderThan)";
    let text = std::str::from_utf8(bytes).map_err(|e| (UNDECODED, format!("not UTF-8: {e}")))?;
    let page: ListPage<'_> = serde_json::from_str(text)
        .map_err(|e| (UNDECODED, format!("list body does not decode: {e}")))?;
    if let Some(token) = page.metadata.continue_token.filter(|t| !t.is_empty()) {
        return Err((IGNORED, format!("a continue token ({} bytes)", token.len())));
    }
    let answered_at = page.metadata.resource_version.filter(|rv| !rv.is_empty());
    if let Some(answered) = &answered_at
        && older(answered, at)
    {
        return Err((
            OLDER,
            format!("listed at {answered}, its metadata page at {at}"),
        ));
    }
    let mut items = page.items.unwrap_or_default();
    if items.len() > 1 {
        return Err((IGNORED, format!("{} items", items.len())));
    }
    let Some(item) = items.pop() else {
        return Ok(Fetch::Gone { answered_at });
    };
    let found = crate::sync::raw::listed(item)
        .map_err(|e| (UNDECODED, format!("{}: {}", e.what, e.why)))?;
    if found.suffix != l.suffix {
        let ns = found.namespace.as_deref().unwrap_or("");
        return Err((
            IGNORED,
            format!("asked for {:?}, answered {ns:?}/{:?}", l.name, found.name),
        ));
    }
    if older(&found.resource_version, &l.resource_version) {
        return Err((
            OLDER,
            format!(
                "{:?} answered at version {}, its metadata page lists {}",
                l.name, found.resource_version, l.resource_version
            ),
        ));
    }
    let Some(answered_at) = answered_at else {
        return Err((
            UNDECODED,
            "list answer has no metadata.resourceVersion".into(),
        ));
    };
    Ok(Fetch::Body {
        json: item.get().as_bytes().to_vec(),
        answered_at,
    })
}

/// Whether `a` is older than `b`, both comparable (KEP-5504); `false` where they are not.
fn older(a: &str, b: &str) -> bool {
    matches!(resource_version::compare(a, b), Ok(Ordering::Less))
}

/// A failed attempt.
enum Attempt {
    Unusable(Unusable),
    Failed(Failure),
}

impl Attempt {
    fn unusable(reason: &'static str, detail: String) -> Attempt {
        Attempt::Unusable(Unusable { reason, detail })
    }
}

/// A transient failure of an attempt.
enum Failure {
    Kube(kube::Error),
    Read(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Kube(e) => write!(f, "{e}"),
            Failure::Read(e) => write!(f, "reading the answer: {e}"),
        }
    }
}

impl Failure {
    fn into_error(self, context: String) -> Error {
        match self {
            Failure::Kube(source) => Error::Kube {
                request: RequestKind::List,
                context,
                source,
            },
            Failure::Read(e) => Error::Protocol {
                context,
                detail: format!("reading the answer: {e}"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(ns: &str, name: &str) -> Listed {
        Listed {
            suffix: crate::disk::keys::object_suffix(Some(ns), name),
            namespace: Some(ns.into()),
            name: name.into(),
            uid: None,
            resource_version: "1".into(),
        }
    }

    /// A list answer listed at `at` with `items` (and a continue token, if any).
    fn answer(at: &str, items: &[(&str, &str, &str)], token: Option<&str>) -> Vec<u8> {
        let items: Vec<serde_json::Value> = items
            .iter()
            .map(|(ns, name, rv)| {
                serde_json::json!({"metadata": {"namespace": ns, "name": name, "resourceVersion": rv}})
            })
            .collect();
        let mut meta = serde_json::json!({"resourceVersion": at});
        if let Some(t) = token {
            meta["continue"] = t.into();
        }
        serde_json::to_vec(&serde_json::json!({"metadata": meta, "items": items})).unwrap()
    }

    fn unusable(bytes: &[u8], l: &Listed, at: &str) -> &'static str {
        match answer_of(bytes, l, at) {
            Err((reason, _)) => reason,
            Ok(other) => panic!("{other:?} taken from {}", String::from_utf8_lossy(bytes)),
        }
    }

    #[test]
    fn an_answer_is_the_named_item_or_gone() {
        let l = listed("ns", "a");
        match answer_of(&answer("9", &[("ns", "a", "8")], None), &l, "7").unwrap() {
            Fetch::Body { json, answered_at } => {
                assert_eq!(answered_at, "9");
                assert!(
                    String::from_utf8(json)
                        .unwrap()
                        .contains(r#""resourceVersion":"8""#)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            answer_of(&answer("9", &[], None), &l, "7").unwrap(),
            Fetch::Gone { answered_at: Some(rv) } if rv == "9"
        ));
        // Opaque versions are not ordered: taken as they are.
        assert!(matches!(
            answer_of(&answer("tkab", &[("ns", "a", "tkaa")], None), &l, "tkac").unwrap(),
            Fetch::Body { .. }
        ));
        assert_eq!(unusable(b"{", &l, "7"), "the answer does not decode");
        assert_eq!(
            unusable(&answer("", &[("ns", "a", "8")], None), &l, "7"),
            "the answer does not decode"
        );
    }

    /// Issue 56 (5): a server that ignores the field selector (the whole collection, a
    /// page of it, another object) or the resourceVersion (an answer older than the page)
    /// gives an answer that is not taken: the relist lists in full.
    #[test]
    fn an_answer_that_is_not_the_one_object_asked_for_is_unusable() {
        let l = Listed {
            resource_version: "8".into(),
            ..listed("ns", "a")
        };
        let ignored = |bytes: Vec<u8>| {
            let reason = unusable(&bytes, &l, "7");
            assert!(reason.contains("ignores the field selector"), "{reason}");
        };
        ignored(answer("9", &[("ns", "b", "3"), ("ns", "a", "8")], None));
        ignored(answer("9", &[("ns", "a", "8"), ("ns", "b", "3")], None));
        ignored(answer("9", &[("ns", "a", "8")], Some("next")));
        ignored(answer("9", &[], Some("next")));
        ignored(answer("9", &[("elsewhere", "a", "8")], None));
        ignored(answer("9", &[("ns", "b", "8")], None));
        let stale = |bytes: Vec<u8>| {
            let reason = unusable(&bytes, &l, "7");
            assert!(reason.contains("older than its metadata page"), "{reason}");
        };
        stale(answer("6", &[("ns", "a", "8")], None));
        stale(answer("6", &[], None));
        stale(answer("9", &[("ns", "a", "5")], None));
        // The same version as the page's, and an answer at the page's version, are taken.
        assert!(matches!(
            answer_of(&answer("7", &[("ns", "a", "8")], None), &l, "7").unwrap(),
            Fetch::Body { .. }
        ));
    }

    /// Issue 56 (5): an answer is read up to its bound, and one past it is unusable.
    #[test]
    fn an_answer_past_its_bound_is_unusable_and_not_read_further() {
        let read = |len: usize, bound: usize| {
            futures::executor::block_on(read_answer(
                futures::io::Cursor::new(vec![b' '; len]),
                bound,
            ))
        };
        assert_eq!(read(100, 100).ok().map(|b| b.len()), Some(100));
        match read(101, 100) {
            Err(Attempt::Unusable(u)) => assert!(u.reason.contains("larger than one object")),
            _ => panic!("an answer past its bound is unusable"),
        }
    }

    #[test]
    fn refusals_are_unusable_and_transient_failures_are_not() {
        for code in [401, 403, 405, 406, 415, 400, 422] {
            assert!(Unusable::of_status(code, false, "no").is_some(), "{code}");
        }
        for code in [429, 500, 502, 503, 504, 410] {
            assert!(Unusable::of_status(code, false, "busy").is_none(), "{code}");
        }
        assert!(Unusable::of_status(504, true, "Too large resource version").is_none());
        let refused = Unusable::of_status(403, false, "pods is forbidden").unwrap();
        assert!(refused.reason.contains("list"));
    }
}
