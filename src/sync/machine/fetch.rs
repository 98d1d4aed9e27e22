//! A delta relist's fetch of one new or changed object: a LIST narrowed to it
//! (`params::one`: its namespace, `metadata.name=<name>` joined to the stream's field
//! selector, the stream's label and shard selectors, not older than the metadata page).
//! It needs only the `list` verb, answers within the stream's selection (an empty answer:
//! the object left it or was deleted, and is swept), and is never older than the page.
//!
//! Each fetch is retried on its own after a transient failure (429, 5xx, a timeout, a
//! connection error), with a backoff, so one failure does not discard the page's other
//! fetches; an answer that says fetching cannot work for this stream (401, 403, 405, 406,
//! 415, 400, 422: a verb or a request the server refuses) is [`Fetch::Unusable`], and the
//! relist lists in full from that page on.

use futures::AsyncReadExt;
use kube::core::Request;
use serde_json::value::RawValue;

use crate::exec::DiskWorker;
use crate::model::{Counters, Error, Result};
use crate::sync::backoff::{Backoff, jitter};
use crate::sync::config::StreamConfig;
use crate::sync::conn::with_shard;
use crate::sync::params;
use crate::sync::params::collection_path;
use crate::sync::raw::{ListPage, Listed, StatusKind, too_large};

/// Bodies a delta relist of one stream fetches at once (the directory caps all its streams'
/// together, `exec::FETCHES_PER_DIRECTORY`).
pub(crate) const FETCHES_IN_FLIGHT: usize = 16;

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
            // The collection itself is not there (its namespace path, a removed kind).
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Ok(Fetch::Gone { answered_at: None });
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
        let mut bytes = Vec::new();
        Box::pin(body)
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| Attempt::Failed(Failure::Read(e.to_string())))?;
        item_of(&bytes, l).map_err(|detail| Attempt::unusable("the answer does not decode", detail))
    }
}

/// The item of a narrowed LIST's answer that is `l` (by namespace and name; a server that
/// ignored the name would answer more).
fn item_of(bytes: &[u8], l: &Listed) -> std::result::Result<Fetch, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
    let page: ListPage<'_> =
        serde_json::from_str(text).map_err(|e| format!("list body does not decode: {e}"))?;
    let answered_at = page.metadata.resource_version.filter(|rv| !rv.is_empty());
    let item = page
        .items
        .unwrap_or_default()
        .into_iter()
        .find(|item| is(item, l));
    Ok(match (item, answered_at) {
        (Some(item), Some(answered_at)) => Fetch::Body {
            json: item.get().as_bytes().to_vec(),
            answered_at,
        },
        (Some(_), None) => return Err("list answer has no metadata.resourceVersion".into()),
        (None, answered_at) => Fetch::Gone { answered_at },
    })
}

/// Whether a list item is the object `l` (its namespace and name).
fn is(item: &RawValue, l: &Listed) -> bool {
    crate::sync::raw::listed(item).is_ok_and(|i| i.suffix == l.suffix)
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
            Failure::Kube(source) => Error::Kube { context, source },
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

    #[test]
    fn an_answer_is_the_named_item_or_gone() {
        let l = listed("ns", "a");
        let page = br#"{"metadata":{"resourceVersion":"9"},"items":[
            {"metadata":{"name":"b","namespace":"ns","resourceVersion":"3"}},
            {"metadata":{"name":"a","namespace":"ns","resourceVersion":"8"}}]}"#;
        match item_of(page, &l).unwrap() {
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
        let empty = br#"{"metadata":{"resourceVersion":"9"},"items":[]}"#;
        assert!(matches!(
            item_of(empty, &l).unwrap(),
            Fetch::Gone { answered_at: Some(rv) } if rv == "9"
        ));
        let other = br#"{"metadata":{"resourceVersion":"9"},"items":[
            {"metadata":{"name":"a","namespace":"elsewhere","resourceVersion":"3"}}]}"#;
        assert!(matches!(item_of(other, &l).unwrap(), Fetch::Gone { .. }));
        assert!(item_of(b"{", &l).is_err());
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
