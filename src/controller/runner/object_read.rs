//! Reading scheduled objects from disk: each dispatched request's object (and, when the
//! request may be skipped, its reconcile record) is read on tokio's blocking pool, or handed
//! over from the hot cache; a failed read is retried with backoff, keeping the request.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use kube::Resource;
use kube::runtime::controller::ReconcileRequest;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use super::super::owed::skippable;
use super::super::state::effective;
use super::{Runner, suffix_of};
use crate::controller::keyspace::ReconcileRecord;

/// A scheduled object read from disk (on the blocking pool, not in `poll_next`), with its
/// reconcile record when the runner may skip it.
pub(super) struct ObjectRead<K: Resource> {
    pub(super) request: ReconcileRequest<K>,
    /// The request had to run (see `Runner::forced`): kept if the read fails.
    pub(super) forced: bool,
    pub(super) object: crate::model::Result<Option<std::sync::Arc<K>>>,
    pub(super) record: Option<ReconcileRecord>,
}
/// A read under way.
pub(super) type PendingRead<K> = BoxFuture<'static, ObjectRead<K>>;

impl<K, Ctx, E> Runner<K, Ctx, E>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync + 'static,
    Ctx: Send + Sync + 'static,
    E: Send + 'static,
{
    /// Starts reading one scheduled object from disk, off the async worker (a read may
    /// block on disk); [`Runner::start`] follows when it is read.
    pub(super) fn dispatch(&mut self, request: ReconcileRequest<K>) {
        // A request that must run may have been merged into this one (see
        // `ChangeQueue::forced`), or a pass of every object may owe it one.
        let forced =
            self.queue.take(&request.obj_ref, &self.p.stats) | self.pass_forces(&request.obj_ref);
        self.passes_heard(&request.obj_ref, super::passes::Heard::Dispatched);
        self.running_refs.insert(request.obj_ref.clone());
        let reader = self.p.reader.clone();
        // The record is read only for requests that may be skipped.
        let state = self
            .durable
            .as_ref()
            .filter(|_| !forced && skippable(&request.reason))
            .map(|d| {
                let suffix = suffix_of(&request.obj_ref);
                let ops = d.uncommitted(&suffix);
                (d.keyspace(), suffix, ops)
            });
        // An object a watch event just wrote is in the hot cache, decoded once by the
        // write path: handed over as it is, without a trip to the blocking pool.
        if state.is_none()
            && let Some(obj) = reader.cached(&request.obj_ref)
        {
            let read = ObjectRead {
                request,
                forced,
                object: Ok(Some(obj)),
                record: None,
            };
            self.reading.push(futures::future::ready(read).boxed());
            return;
        }
        self.reading.push(
            async move {
                let obj_ref = request.obj_ref.clone();
                let read = tokio::task::spawn_blocking(move || {
                    let obj = reader.get(&obj_ref);
                    let record = match (&obj, state) {
                        (Ok(Some(_)), Some((ks, suffix, ops))) => {
                            effective(&ks, &suffix, &ops).ok().flatten()
                        }
                        _ => None,
                    };
                    (obj, record)
                })
                .await;
                let (object, record) = read.unwrap_or_else(|e| {
                    let e = crate::model::Error::Storage {
                        path: Default::default(),
                        detail: format!("object read task failed: {e}"),
                    };
                    (Err(e), None)
                });
                ObjectRead {
                    request,
                    forced,
                    object,
                    record,
                }
            }
            .boxed(),
        );
    }

    /// Schedules again, with backoff, a request whose object could not be read, keeping
    /// its "must run" mark: a failed read consumes no trigger.
    pub(super) fn retry_read(&mut self, request: ReconcileRequest<K>, forced: bool) {
        let failures = self
            .read_failures
            .entry(request.obj_ref.clone())
            .or_insert(0);
        *failures = failures.saturating_add(1);
        let delay = read_retry_delay(*failures);
        tracing::warn!(object = %request.obj_ref, failures = *failures, retry_ms = delay.as_millis() as u64,
            "cannot read the object to reconcile: retried");
        if forced {
            self.queue.force(request.obj_ref.clone());
        }
        self.passes_heard(&request.obj_ref, super::passes::Heard::ReadFailed);
        self.schedule(request.obj_ref, request.reason, Instant::now() + delay);
    }
}

/// How long after its `failures`-th failed read in a row an object is read again: 200 ms,
/// doubling, at most 5 minutes.
fn read_retry_delay(failures: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(300);
    FIRST
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_retries_back_off_to_five_minutes() {
        let ms = |n| read_retry_delay(n).as_millis();
        assert_eq!((ms(1), ms(2), ms(3)), (200, 400, 800));
        assert_eq!(ms(11), 204_800);
        assert_eq!(ms(12), 300_000, "capped");
        assert_eq!(ms(u32::MAX), 300_000, "no overflow");
    }
}
