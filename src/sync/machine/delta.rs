//! The delta relist's actions: a page listed as metadata (and the stored versions of its
//! objects read), the fetches of its new or changed bodies (`fetch.rs`) committed with it,
//! or a page listed in full. Which of them runs, page by page, is the transition's
//! (`transition.rs`: `page_shape`, `DeltaGate`); the mode is `RelistMode` (`sync/config.rs`).
//!
//! A delta relist lists the collection as `PartialObjectMetadataList` pages (the same
//! selectors, shard and page size, the same snapshot across pages). For each page it reads the
//! stored resourceVersions of the page's objects from disk (record heads only), marks the
//! objects whose stored version is the listed one, and fetches the others with one LIST
//! narrowed to each (`params::one`: `metadata.name=<name>` within the stream's selectors, not
//! older than the page), `FETCHES_IN_FLIGHT` at a time: the `list` verb only, and an answer
//! within the selection. The marks and the fetched bodies are committed in one atomic batch
//! with the list's continue token, as a full page is; the sweep at the end removes what no
//! page marked. A fetched body may be newer than the list's resourceVersion; the watch from
//! that resourceVersion then replays events older than what is stored, and the writer skips
//! them (`Stats::stale_events_skipped`) while its checkpoint is below the newest answer's
//! resourceVersion (the window, kept on disk with the page): versions are ordered by
//! KEP-5504, so the mode is used only where they are comparable. A deletion of the stored
//! object itself is never skipped. An object whose fetch answers empty (deleted, or out of
//! the selection now) is left unmarked: it is swept, and the watch replays its deletion.

use futures::StreamExt;

use super::core::Core;
use super::fetch::{FETCHES_IN_FLIGHT, Fetch, Fetcher, Unusable};
use super::transition::Returned;
use crate::exec::{PagePermit, compute};
use crate::model::{Counters, Error, Result, resource_version};
use crate::store::ListProgress;
use crate::sync::params;
use crate::sync::parse::MetaPage;
use crate::sync::raw::Listed;

/// A metadata page waiting for its fetches: its objects with their stored versions, and
/// its place in the page budget.
pub(crate) struct ListedPage {
    page: MetaPage,
    stored: Vec<Option<String>>,
    permit: PagePermit,
    /// The resourceVersion it was listed at.
    at: String,
}

/// List a page as metadata (at `continue_token`), and read the stored versions of its
/// objects; the page waits in `held` for its fetches.
pub(super) async fn metadata_page(
    core: &mut Core,
    held: &mut Option<ListedPage>,
    continue_token: Option<String>,
) -> Result<Returned> {
    let from = continue_token
        .as_deref()
        .map_or(params::From::Now, params::From::Continue);
    let read = match core.lister().read_page(from, true).await {
        Ok(read) => read,
        Err(e) => {
            return match Unusable::of_error(&e) {
                Some(refused) => Ok(Returned::Refused {
                    reason: refused.reason.to_string(),
                    detail: refused.detail,
                }),
                None => Err(e),
            };
        }
    };
    let Some((bytes, permit)) = read else {
        return Ok(Returned::Expired);
    };
    let context = format!("LIST {} (metadata only)", core.described());
    let ingest = core.ingest.clone();
    let parse_context = context.clone();
    let page = compute(move || ingest.metadata_page(&bytes, &parse_context))
        .await
        .ok_or_else(|| Error::Protocol {
            context: context.clone(),
            detail: "parsing a metadata list page panicked".into(),
        })??;
    let Some(at) = page.resource_version.clone() else {
        return Err(Error::Protocol {
            context,
            detail: "list page has no metadata.resourceVersion".into(),
        });
    };
    if !resource_version::is_comparable(&at) {
        return Ok(Returned::MetadataListed {
            at,
            comparable: false,
            changed: 0,
            listed: page.items.len(),
        });
    }
    let suffixes: Vec<Vec<u8>> = page.items.iter().map(|l| l.suffix.clone()).collect();
    let stored = core
        .writer
        .run(move |w| w.stored_versions(&suffixes))
        .await?;
    let changed = page
        .items
        .iter()
        .zip(&stored)
        .filter(|(l, s)| s.as_deref() != Some(l.resource_version.as_str()))
        .count();
    let listed = page.items.len();
    *held = Some(ListedPage {
        page,
        stored,
        permit,
        at: at.clone(),
    });
    Ok(Returned::MetadataListed {
        at,
        comparable: true,
        changed,
        listed,
    })
}

/// Fetch the bodies of the held metadata page's new or changed objects, and commit the
/// page. A fetch the server refuses is [`Returned::Refused`].
pub(super) async fn fetch(core: &mut Core, held: Option<ListedPage>) -> Result<Returned> {
    let Some(ListedPage {
        page,
        stored,
        permit,
        at,
    }) = held
    else {
        return Err(Error::Protocol {
            context: format!("LIST {} (a delta relist's fetches)", core.described()),
            detail: "no metadata page to fetch for".into(),
        });
    };
    let mut seen = Vec::new();
    let mut wanted: Vec<Listed> = Vec::new();
    for (l, s) in page.items.into_iter().zip(stored) {
        if s.as_deref() == Some(l.resource_version.as_str()) {
            seen.push((l.suffix, l.resource_version));
        } else {
            wanted.push(l);
        }
    }
    let fetched = match fetch_all(core.fetcher(), &wanted, &at).await? {
        Ok(fetched) => fetched,
        Err(refused) => {
            return Ok(Returned::Refused {
                reason: refused.reason.to_string(),
                detail: refused.detail,
            });
        }
    };
    let gone = wanted.len() - fetched.bodies.len();
    Counters::add(&core.stats.bodies_fetched, fetched.bodies.len() as u64);
    let ingest = core.ingest.clone();
    let bodies = fetched.bodies;
    let (objects, mut rejected) =
        compute(move || ingest.fetched(bodies))
            .await
            .ok_or_else(|| Error::Protocol {
                context: format!("LIST {} (a delta relist's fetches)", core.described()),
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
    let (emit, answered_at) = (core.emit, fetched.answered_at);
    let written = objects.len() as u64;
    let unchanged = seen.len() as u64;
    let changes = core
        .writer
        .run(move |w| {
            let _permit = permit;
            w.delta_page(seen, objects, answered_at, progress, emit)
        })
        .await?;
    core.push_changes(changes);
    core.push_rejected(rejected);
    Ok(Returned::Committed { written, unchanged })
}

impl Core {
    /// What the fetches of this stream need, borrowed from it.
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
}

/// One page of the list in full: from its continue token, or for a first page whose
/// metadata was listed at `at`, exactly at that resourceVersion (the same snapshot, so
/// the same objects). Committed as a full list's page.
pub(super) async fn full_page(
    core: &mut Core,
    continue_token: Option<String>,
    at: Option<String>,
) -> Result<Returned> {
    let from = full_page_from(continue_token.as_deref(), at.as_deref());
    let Some((bytes, permit)) = core.lister().read_page(from, false).await? else {
        return Ok(Returned::Expired);
    };
    let context = format!("LIST {} (a delta relist's page in full)", core.described());
    let page = super::list::parse_page(
        core.ingest.clone(),
        core.writer.worker.clone(),
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
    let emit = core.emit;
    let objects = page.objects;
    let (changes, tally) = core
        .writer
        .run(move |w| {
            let _permit = permit;
            let changes = w.list_page(objects, progress, emit)?;
            Ok((changes, w.last_tally()))
        })
        .await?;
    core.push_changes(changes);
    core.push_rejected(page.rejected);
    Ok(Returned::Committed {
        written: tally.written,
        unchanged: tally.unchanged,
    })
}

/// Fetch every object of `wanted` not older than `at`, [`FETCHES_IN_FLIGHT`] at a time:
/// their bodies (the gone ones have none) and the highest resourceVersion the answers were
/// listed at; or why fetching cannot work (the first refusal). An error is a fetch
/// that kept failing.
async fn fetch_all(
    fetcher: Fetcher<'_>,
    wanted: &[Listed],
    at: &str,
) -> Result<std::result::Result<Fetched, Unusable>> {
    let fetcher = &fetcher;
    // Collected first: a stream of a closure's futures is not `Send` (its lifetimes).
    let requests: Vec<_> = wanted.iter().map(|l| fetcher.fetch(l, at)).collect();
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
fn full_page_from<'a>(token: Option<&'a str>, at: Option<&'a str>) -> params::From<'a> {
    match (token, at) {
        (Some(t), _) => params::From::Continue(t),
        (None, Some(rv)) => params::From::Exactly(rv),
        (None, None) => params::From::Now,
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

    /// (8) The first page's fallback lists exactly the metadata page's snapshot; a later
    /// page continues its token (the snapshot the token carries).
    #[test]
    fn a_page_in_full_lists_the_same_snapshot() {
        assert!(matches!(
            full_page_from(None, Some("41")),
            params::From::Exactly("41")
        ));
        assert!(matches!(
            full_page_from(Some("t"), Some("41")),
            params::From::Continue("t")
        ));
        assert!(matches!(full_page_from(None, None), params::From::Now));
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
