//! How a store that holds objects lists again (after `410 Gone`, past the API server's watch
//! history): in full, or as a *delta relist* that lists metadata only and fetches the bodies
//! of only the objects that are new or changed. The mode ([`RelistMode`]), its rules, and the
//! parsing of its pages; the stage that runs it is `machine/delta.rs`, its fetches
//! `machine/fetch.rs`.
//!
//! A delta relist lists the collection as `PartialObjectMetadataList` pages (the same
//! selectors, shard and page size, the same snapshot across pages). For each page it reads the
//! stored resourceVersions of the page's objects from disk (record heads only), marks the
//! objects whose stored version is the listed one, and fetches the others with one LIST
//! narrowed to each (`list::one`: `metadata.name=<name>` within the stream's selectors, not
//! older than the page), [`FETCHES_IN_FLIGHT`] at a time: the `list` verb only, and an answer
//! within the selection. The marks and the fetched bodies are committed in one atomic batch
//! with the list's continue token, as a full page is; the sweep at the end removes what no
//! page marked. A fetched body may be newer than the list's resourceVersion; the watch from
//! that resourceVersion then replays events older than what is stored, and the writer skips
//! them (`Stats::stale_events_skipped`) while its checkpoint is below the newest answer's
//! resourceVersion (the window, kept on disk with the page): versions are ordered by
//! KEP-5504, so the mode is used only where they are comparable. A deletion of the stored
//! object itself is never skipped. An object whose fetch answers empty (deleted, or out of
//! the selection now) is left unmarked: it is swept, and the watch replays its deletion.

use serde_json::value::RawValue;

use super::parse::{Ingest, Rejected};
use super::raw::{self, BadObject, ListPage, Listed};
use crate::model::{Counters, Error, Result};
use crate::store::Incoming;

/// Bodies a delta relist of one stream fetches at once (the directory caps all its streams'
/// together, `exec::FETCHES_PER_DIRECTORY`).
pub(crate) const FETCHES_IN_FLIGHT: usize = 16;

/// The collection path of the objects of `namespace` (`None`: cluster-scoped) listed at
/// `list_url` (`/api/v1/pods`, or `/api/v1/namespaces/ns/pods` for a namespaced `Api`): an
/// object's path is this and its name.
pub(crate) fn collection_path(list_url: &str, namespace: Option<&str>) -> String {
    let list_url = list_url.trim_end_matches('/');
    match namespace {
        Some(ns) => {
            let (prefix, plural) = list_url.rsplit_once('/').unwrap_or(("", list_url));
            if prefix.ends_with(&format!("/namespaces/{ns}")) {
                list_url.to_string()
            } else {
                format!("{prefix}/namespaces/{ns}/{plural}")
            }
        }
        None => list_url.to_string(),
    }
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

impl Ingest {
    /// Parse a `PartialObjectMetadataList` page (CPU only).
    pub(crate) fn metadata_page(&self, bytes: &[u8], context: &str) -> Result<MetaPage> {
        let text = String::from_utf8_lossy(bytes);
        let page: ListPage<'_> = serde_json::from_str(&text).map_err(|e| Error::Protocol {
            context: context.to_string(),
            detail: format!("metadata list body does not decode: {e}"),
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
                        raw::snippet(&String::from_utf8_lossy(&body)),
                        format!("fetched object does not decode: {e}"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collection_paths_follow_the_list_url() {
        assert_eq!(
            collection_path("/api/v1/pods", Some("ns1")),
            "/api/v1/namespaces/ns1/pods"
        );
        assert_eq!(
            collection_path("/api/v1/namespaces/ns1/pods", Some("ns1")),
            "/api/v1/namespaces/ns1/pods"
        );
        assert_eq!(
            collection_path("/apis/apps/v1/deployments", Some("x")),
            "/apis/apps/v1/namespaces/x/deployments"
        );
        assert_eq!(collection_path("/api/v1/nodes", None), "/api/v1/nodes");
        assert_eq!(
            collection_path("/api/v1/namespaces", None),
            "/api/v1/namespaces"
        );
    }
}
