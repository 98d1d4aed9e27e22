//! A delta relist's fetch window: the highest resourceVersion its fetches answered at, kept
//! on disk (`keys::FETCHED_KEY`) from its first fetched page until the watch's checkpoint
//! reaches it. While it is open the store may hold bodies newer than its checkpoint, and the
//! watch skips replayed events older than the stored versions.

use crate::disk::WriteBatch;
use crate::disk::keys::FETCHED_KEY;
use crate::disk::record;
use crate::model::resource_version;
use crate::store::{Phase, State};

/// The window's high, `None` while it is closed.
#[derive(Debug, Clone, Default)]
pub(super) struct FetchWindow(Option<String>);

impl FetchWindow {
    /// The window read from disk when the stream is opened.
    pub(super) fn new(high: Option<String>) -> Self {
        FetchWindow(high)
    }

    /// `at` if it raises the window: newer than its high (or not comparable with it), or
    /// the window is closed.
    pub(super) fn raised_by(&self, at: Option<String>) -> Option<String> {
        at.filter(|at| {
            self.0.as_deref().is_none_or(|high| {
                !matches!(
                    resource_version::compare(at, high),
                    Ok(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
                )
            })
        })
    }

    /// Whether the watch is replaying past the fetched bodies: the store is synced at a
    /// checkpoint below the window's high.
    pub(super) fn replaying(&self, phase: &Phase) -> bool {
        let (Phase::Synced { resource_version }, Some(high)) = (phase, self.0.as_deref()) else {
            return false;
        };
        matches!(
            resource_version::compare(resource_version, high),
            Ok(std::cmp::Ordering::Less)
        )
    }

    /// Add the window's update to `batch` and return the window after it: `fetched` raises
    /// it; a synced checkpoint that reaches it (or cannot be compared with it) closes it.
    /// Every batch that writes a state goes through it.
    pub(super) fn update(
        &self,
        batch: &mut WriteBatch,
        next: &State,
        fetched: Option<String>,
    ) -> FetchWindow {
        let raised = fetched.is_some();
        let window = fetched.or_else(|| self.0.clone());
        let closed = match (&next.phase, &window) {
            (Phase::Synced { resource_version }, Some(high)) => !matches!(
                resource_version::compare(resource_version, high),
                Ok(std::cmp::Ordering::Less)
            ),
            _ => false,
        };
        if closed {
            if self.0.is_some() {
                batch.delete(FETCHED_KEY.to_vec());
            }
            return FetchWindow(None);
        }
        if let (true, Some(high)) = (raised, &window) {
            batch.put(FETCHED_KEY.to_vec(), record::encode(high));
        }
        FetchWindow(window)
    }
}
