//! The delta relist stage (see `sync/relist.rs` for the mode and its rules): one page per
//! step, listed as metadata (then the new or changed bodies fetched, `machine/fetch.rs`)
//! or in full.

use futures::StreamExt;

use super::fetch::{Fetch, Fetcher, Unusable};
use super::{Deferred, Machine, Stage};
use crate::exec::{PagePermit, compute};
use crate::model::{Counters, Error, Result, resource_version};
use crate::store::{ListProgress, Phase};
use crate::sync::list;
use crate::sync::raw::Listed;
use crate::sync::relist::{FETCHES_IN_FLIGHT, MetaPage, RelistMode};

/// How a delta relist fetches its next page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PageShape {
    /// Metadata only; the new or changed bodies are fetched one by one.
    Metadata,
    /// Full objects: the previous page had too many changes to fetch one by one.
    Full,
}

/// Whether delta relists may run in this stream (besides the mode and the store's state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeltaGate {
    /// They may.
    Open,
    /// The server refused a metadata page or a fetch of the relist in progress: it lists
    /// in full to its end; the next relist tries again.
    ClosedForThisRelist,
    /// The server's resourceVersions are not comparable (KEP-5504): full relists for the
    /// life of the process.
    Closed,
}

/// The `Auto` rule, for a page (or the page before) with `changed` of `listed` objects new
/// or changed: above [`RelistMode::AUTO_FULL_PAGE_ABOVE`] of them, the page is listed in
/// full. `Delta` always fetches; `Full` never gets here.
pub(crate) fn page_shape(mode: RelistMode, changed: usize, listed: usize) -> PageShape {
    let limit = RelistMode::AUTO_FULL_PAGE_ABOVE * listed as f64;
    if mode == RelistMode::Auto && changed as f64 > limit {
        PageShape::Full
    } else {
        PageShape::Metadata
    }
}

impl Machine {
    /// Whether the list in progress (or about to begin) is a delta relist: the mode allows
    /// it, the stream lists full objects, the store held objects when it began, the server
    /// has not refused it, and the store's checkpoint is comparable (KEP-5504).
    pub(super) fn delta_relist(&self) -> bool {
        self.cfg.relist_mode != RelistMode::Full
            && !self.metadata_only
            && self.delta == DeltaGate::Open
            && matches!(self.writer.state.phase, Phase::Listing { sweep: true, .. })
            && self
                .writer
                .state
                .last_synced
                .as_deref()
                .is_some_and(resource_version::is_comparable)
    }

    /// One page of a delta relist, continuing from `continue_token`.
    pub(super) async fn delta_page(
        &mut self,
        continue_token: Option<String>,
        shape: PageShape,
    ) -> Result<Stage> {
        let token = continue_token.as_deref();
        if shape == PageShape::Full {
            return self.full_page(token, None).await;
        }
        let from = token.map_or(list::From::Now, list::From::Continue);
        let listed = match self.lister().fetch_page(from, true).await {
            Ok(listed) => listed,
            Err(e) => match Unusable::of_error(&e) {
                Some(refused) => {
                    self.delta_unusable(&refused, "a metadata-only LIST page");
                    return self.full_page(token, None).await;
                }
                None => return Err(e),
            },
        };
        let Some((bytes, permit)) = listed else {
            self.pacing.token_expired();
            return self.relist("continue token expired (410)").await;
        };
        let context = format!("LIST {} (metadata only)", self.described());
        let ingest = self.ingest.clone();
        let page = compute(move || ingest.metadata_page(&bytes, &context))
            .await
            .ok_or_else(|| Error::Protocol {
                context: format!("LIST {}", self.described()),
                detail: "parsing a metadata list page panicked".into(),
            })??;
        let Some(list_rv) = page.resource_version.clone() else {
            return Err(Error::Protocol {
                context: format!("LIST {} (metadata only)", self.described()),
                detail: "list page has no metadata.resourceVersion".into(),
            });
        };
        if !resource_version::is_comparable(&list_rv) {
            // Opaque versions cannot tell a fetched body from an older replayed event.
            tracing::warn!(stream = %self.stream, url = %self.url(), resource_version = %list_rv,
                "the server's resourceVersions are not comparable (KEP-5504): full relists for this process");
            self.delta = DeltaGate::Closed;
            drop(permit);
            return self.full_page(token, Some(&list_rv)).await;
        }
        let suffixes: Vec<Vec<u8>> = page.items.iter().map(|l| l.suffix.clone()).collect();
        let stored = self
            .writer
            .run(move |w| w.stored_versions(&suffixes))
            .await?;
        let changed = page
            .items
            .iter()
            .zip(&stored)
            .filter(|(l, s)| s.as_deref() != Some(l.resource_version.as_str()))
            .count();
        if page_shape(self.cfg.relist_mode, changed, page.items.len()) == PageShape::Full {
            tracing::debug!(
                changed,
                items = page.items.len(),
                "too many changed for fetches: the page in full"
            );
            drop(permit);
            return self.full_page(token, Some(&list_rv)).await;
        }
        self.fetch_and_commit(page, stored, permit, token, &list_rv)
            .await
    }

    /// The server refused a delta relist's request: warn (naming what it refused), count
    /// it, and list the rest of this relist in full.
    fn delta_unusable(&mut self, refused: &Unusable, what: &str) {
        Counters::add(&self.stats.delta_fallbacks, 1);
        tracing::warn!(stream = %self.stream, url = %self.url(), refused = what, reason = refused.reason,
            detail = %refused.detail,
            "a delta relist cannot run here: this relist lists in full from this page on (grant the store `list` on its kind, or choose RelistMode::Full)");
        self.delta = DeltaGate::ClosedForThisRelist;
    }

    /// Fetch the bodies of a metadata page's new or changed objects (listed at `list_rv`),
    /// and commit the page. A fetch the server refuses lists the page in full instead.
    async fn fetch_and_commit(
        &mut self,
        page: MetaPage,
        stored: Vec<Option<String>>,
        permit: PagePermit,
        token: Option<&str>,
        list_rv: &str,
    ) -> Result<Stage> {
        let mut seen = Vec::new();
        let mut wanted: Vec<Listed> = Vec::new();
        for (l, s) in page.items.into_iter().zip(stored) {
            if s.as_deref() == Some(l.resource_version.as_str()) {
                seen.push((l.suffix, l.resource_version));
            } else {
                wanted.push(l);
            }
        }
        let fetched = match fetch_all(self.fetcher(), &wanted, list_rv).await? {
            Ok(fetched) => fetched,
            Err(refused) => {
                self.delta_unusable(&refused, "a LIST narrowed to one object");
                drop(permit);
                return self.full_page(token, Some(list_rv)).await;
            }
        };
        let gone = wanted.len() - fetched.bodies.len();
        Counters::add(&self.stats.bodies_fetched, fetched.bodies.len() as u64);
        let ingest = self.ingest.clone();
        let bodies = fetched.bodies;
        let (objects, mut rejected) =
            compute(move || ingest.fetched(bodies))
                .await
                .ok_or_else(|| Error::Protocol {
                    context: format!("LIST {} (a delta relist's fetches)", self.described()),
                    detail: "parsing fetched objects panicked".into(),
                })?;
        rejected.extend(page.rejected);
        let progress = match page.continue_token.clone() {
            Some(t) => ListProgress::More(Some(t)),
            None => ListProgress::Done(page.resource_version.clone().unwrap_or_default()),
        };
        tracing::debug!(
            listed = page.listed,
            unchanged = seen.len(),
            fetched = wanted.len(),
            gone,
            "delta relist page"
        );
        if let ListProgress::Done(rv) = &progress {
            tracing::info!(resource_version = %rv, "last page of a delta relist");
        }
        let (emit, answered_at) = (self.emit, fetched.answered_at);
        let changes = self
            .writer
            .run(move |w| {
                let _permit = permit;
                w.delta_page(seen, objects, answered_at, progress, emit)
            })
            .await?;
        self.push_changes(changes);
        self.push_rejected(rejected);
        Ok(self.after_delta_page(PageShape::Metadata))
    }

    /// What the fetches of this stream need, borrowed from the machine.
    fn fetcher(&self) -> Fetcher<'_> {
        Fetcher {
            stream: &self.stream,
            client: &self.client,
            url: self.url(),
            cfg: &self.cfg,
            worker: &self.writer.worker,
            stats: &self.stats,
        }
    }

    /// One page of the list in full: from its continue token, or for a first page whose
    /// metadata was listed at `at`, exactly at that resourceVersion (the same snapshot, so
    /// the same objects). Committed as a full list's page.
    async fn full_page(&mut self, token: Option<&str>, at: Option<&str>) -> Result<Stage> {
        let from = full_page_from(token, at);
        let Some((bytes, permit)) = self.lister().fetch_page(from, false).await? else {
            self.pacing.token_expired();
            return self
                .relist("continue token or resourceVersion expired (410)")
                .await;
        };
        let context = format!("LIST {} (a delta relist's page in full)", self.described());
        let page = Self::parse_page(
            self.ingest.clone(),
            self.writer.worker.clone(),
            bytes,
            context.clone(),
        )
        .await?;
        let progress = match page.continue_token {
            Some(t) => ListProgress::More(Some(t)),
            None => ListProgress::Done(page.resource_version.ok_or_else(|| Error::Protocol {
                context,
                detail: "last page has no metadata.resourceVersion".into(),
            })?),
        };
        let emit = self.emit;
        let objects = page.objects;
        let (changes, tally) = self
            .writer
            .run(move |w| {
                let _permit = permit;
                let changes = w.list_page(objects, progress, emit)?;
                Ok((changes, w.last_tally()))
            })
            .await?;
        self.push_changes(changes);
        self.push_rejected(page.rejected);
        let listed = tally.written + tally.unchanged;
        let shape = page_shape(
            self.cfg.relist_mode,
            tally.written as usize,
            listed as usize,
        );
        Ok(self.after_delta_page(shape))
    }

    /// The stage after a committed page of a delta relist, from the stored phase.
    fn after_delta_page(&self, shape: PageShape) -> Stage {
        match self.writer.state.phase.clone() {
            Phase::Listing { continue_token, .. } if self.delta != DeltaGate::Open => {
                Stage::Listing {
                    continue_token,
                    committing: None,
                }
            }
            Phase::Listing { continue_token, .. } => Stage::DeltaListing {
                continue_token,
                shape,
            },
            Phase::Sweeping { .. } => Stage::Sweeping { then: None },
            _ => Stage::Watching {
                conn: None,
                deferred: Deferred::Nothing,
            },
        }
    }
}

/// Fetch every object of `wanted` not older than `list_rv`, [`FETCHES_IN_FLIGHT`] at a
/// time: their bodies (the gone ones have none) and the highest resourceVersion the answers
/// were listed at; or why fetching cannot work (the first refusal). An error is a fetch
/// that kept failing.
async fn fetch_all(
    fetcher: Fetcher<'_>,
    wanted: &[Listed],
    list_rv: &str,
) -> Result<std::result::Result<Fetched, Unusable>> {
    let fetcher = &fetcher;
    // Collected first: a stream of a closure's futures is not `Send` (its lifetimes).
    let requests: Vec<_> = wanted.iter().map(|l| fetcher.fetch(l, list_rv)).collect();
    let mut answers = futures::stream::iter(requests).buffer_unordered(FETCHES_IN_FLIGHT);
    let mut out = Fetched {
        bodies: Vec::with_capacity(wanted.len()),
        answered_at: None,
    };
    while let Some(answer) = answers.next().await {
        let at = match answer? {
            Fetch::Body { json, answered_at } => {
                out.bodies.push(json);
                Some(answered_at)
            }
            Fetch::Gone { answered_at } => answered_at,
            // Dropping the stream cancels the fetches in flight.
            Fetch::Unusable(refused) => return Ok(Err(refused)),
        };
        out.answered_at = newest(out.answered_at.take(), at);
    }
    Ok(Ok(out))
}

/// Where a page listed in full instead of by metadata starts: from the list's continue
/// token, or, for the first page, exactly at the resourceVersion its metadata page was
/// listed at (the same snapshot: the same objects, and the next pages follow on from it);
/// without either, a new snapshot (its metadata page was refused).
fn full_page_from<'a>(token: Option<&'a str>, at: Option<&'a str>) -> list::From<'a> {
    match (token, at) {
        (Some(t), _) => list::From::Continue(t),
        (None, Some(rv)) => list::From::Exactly(rv),
        (None, None) => list::From::Now,
    }
}

/// What a page's fetches gave.
struct Fetched {
    /// The bodies of the objects still in the selection.
    bodies: Vec<Vec<u8>>,
    /// The highest resourceVersion an answer was listed at.
    answered_at: Option<String>,
}

/// The newer of two comparable resourceVersions (either may be absent).
fn newest(a: Option<String>, b: Option<String>) -> Option<String> {
    match (a, b) {
        (Some(a), Some(b)) => Some(
            if matches!(
                resource_version::compare(&a, &b),
                Ok(std::cmp::Ordering::Less)
            ) {
                b
            } else {
                a
            },
        ),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_lists_a_page_in_full_above_its_share_of_changes() {
        assert_eq!(page_shape(RelistMode::Auto, 6, 100), PageShape::Metadata);
        assert_eq!(page_shape(RelistMode::Auto, 7, 100), PageShape::Full);
        assert_eq!(page_shape(RelistMode::Auto, 0, 0), PageShape::Metadata);
        assert_eq!(page_shape(RelistMode::Delta, 100, 100), PageShape::Metadata);
    }

    /// (8) The first page's fallback lists exactly the metadata page's snapshot; a later
    /// page continues its token (the snapshot the token carries).
    #[test]
    fn a_page_in_full_lists_the_same_snapshot() {
        assert!(matches!(
            full_page_from(None, Some("41")),
            list::From::Exactly("41")
        ));
        assert!(matches!(
            full_page_from(Some("t"), Some("41")),
            list::From::Continue("t")
        ));
        assert!(matches!(full_page_from(None, None), list::From::Now));
    }

    #[test]
    fn the_newest_answer_wins() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(newest(s("9"), s("10")), s("10"));
        assert_eq!(newest(s("10"), s("9")), s("10"));
        assert_eq!(newest(None, s("3")), s("3"));
        assert_eq!(newest(s("3"), None), s("3"));
        assert_eq!(newest(None, None), None);
    }
}
