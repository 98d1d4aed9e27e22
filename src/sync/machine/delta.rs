//! The delta relist stage (see `sync/relist.rs` for the mode and its rules): one page per
//! step, listed as metadata (then the new or changed bodies fetched) or in full.

use futures::{AsyncReadExt, StreamExt, TryStreamExt};
use kube::core::Request;
use kube::core::params::GetParams;

use super::{Deferred, Machine, Stage};
use crate::exec::{PagePermit, compute};
use crate::model::{Counters, Error, Result, resource_version};
use crate::store::{ListProgress, Phase};
use crate::sync::list;
use crate::sync::raw::Listed;
use crate::sync::relist::{FETCHES_IN_FLIGHT, MetaPage, RelistMode, collection_path};

/// How a delta relist fetches its next page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PageShape {
    /// Metadata only; the new or changed bodies are fetched one by one.
    Metadata,
    /// Full objects: the previous page had too many changes to fetch one by one.
    Full,
}

impl Machine {
    /// Whether the list in progress (or about to begin) is a delta relist: the mode allows
    /// it, the stream lists full objects, the store held objects when it began, and the
    /// store's checkpoint is comparable (KEP-5504).
    pub(super) fn delta_relist(&self) -> bool {
        self.cfg.relist_mode != RelistMode::Full
            && !self.metadata_only
            && !self.delta_refused
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
        if shape == PageShape::Full {
            let from = continue_token
                .as_deref()
                .map_or(list::From::Now, list::From::Continue);
            return self.full_page(from, None).await;
        }
        let from = continue_token
            .as_deref()
            .map_or(list::From::Now, list::From::Continue);
        let Some((bytes, permit)) = self.lister().fetch_page(from, true).await? else {
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
            self.delta_refused = true;
            return self.full_page(from, Some(&list_rv)).await;
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
        let limit = RelistMode::AUTO_FULL_PAGE_ABOVE * page.items.len() as f64;
        if self.cfg.relist_mode == RelistMode::Auto && changed as f64 > limit {
            tracing::debug!(
                changed,
                items = page.items.len(),
                "too many changed for fetches: the page in full"
            );
            drop(permit);
            return self.full_page(from, Some(&list_rv)).await;
        }
        self.fetch_and_commit(page, stored, permit).await
    }

    /// Fetch the bodies of a metadata page's new or changed objects, and commit the page.
    async fn fetch_and_commit(
        &mut self,
        page: MetaPage,
        stored: Vec<Option<String>>,
        permit: PagePermit,
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
        let fetched = wanted.len();
        let (client, url, stream) = (&self.client, self.url(), &*self.stream);
        let requests: Vec<_> = wanted
            .iter()
            .map(|l| fetch(client, url, stream, l))
            .collect();
        let answers: Vec<Option<Vec<u8>>> = futures::stream::iter(requests)
            .buffer_unordered(FETCHES_IN_FLIGHT)
            .try_collect()
            .await?;
        let bodies: Vec<Vec<u8>> = answers.into_iter().flatten().collect();
        let gone = fetched - bodies.len();
        Counters::add(&self.stats.bodies_fetched, bodies.len() as u64);
        let ingest = self.ingest.clone();
        let (objects, mut rejected) =
            compute(move || ingest.fetched(bodies))
                .await
                .ok_or_else(|| Error::Protocol {
                    context: format!("GET {}", self.described()),
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
            fetched,
            gone,
            "delta relist page"
        );
        if let ListProgress::Done(rv) = &progress {
            tracing::info!(resource_version = %rv, "last page of a delta relist");
        }
        let emit = self.emit;
        let changes = self
            .writer
            .run(move |w| {
                let _permit = permit;
                w.delta_page(seen, objects, progress, emit)
            })
            .await?;
        self.push_changes(changes);
        self.push_rejected(rejected);
        Ok(self.after_delta_page(PageShape::Metadata))
    }

    /// One page of the list in full: from its continue token, or for a first page whose
    /// metadata was listed at `at`, exactly at that resourceVersion (the same snapshot, so
    /// the same objects). Committed as a full list's page.
    async fn full_page(&mut self, from: list::From<'_>, at: Option<&str>) -> Result<Stage> {
        let from = match (from, at) {
            (list::From::Now, Some(rv)) => list::From::Exactly(rv),
            (from, _) => from,
        };
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
        let shape = if self.cfg.relist_mode == RelistMode::Auto
            && !self.delta_refused
            && tally.written as f64 > RelistMode::AUTO_FULL_PAGE_ABOVE * listed as f64
        {
            PageShape::Full
        } else {
            PageShape::Metadata
        };
        Ok(self.after_delta_page(shape))
    }

    /// The stage after a committed page of a delta relist, from the stored phase.
    fn after_delta_page(&self, shape: PageShape) -> Stage {
        match self.writer.state.phase.clone() {
            Phase::Listing { continue_token, .. } if self.delta_refused => Stage::Listing {
                continue_token,
                committing: None,
            },
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

/// GET one object's body; `None` when it is gone (404: swept, and the watch replays its
/// deletion).
async fn fetch(
    client: &kube::Client,
    list_url: &str,
    stream: &str,
    l: &Listed,
) -> Result<Option<Vec<u8>>> {
    let path = collection_path(list_url, l.namespace.as_deref());
    let context = || format!("GET {path}/{} (stream {stream:?})", l.name);
    let req = Request::new(path.as_str())
        .get(&l.name, &GetParams::default())
        .map_err(|e| Error::Config(format!("{}: {e}", context())))?;
    let body = match client.request_stream(req).await {
        Ok(b) => b,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
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
            detail: format!("reading the object: {e}"),
        })?;
    Ok(Some(bytes))
}
