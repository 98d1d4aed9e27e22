//! The one rule for "is a reconcile owed": whether the durable reconcile state shows an
//! object's current version handled, and whether a request may be skipped for it. Pure
//! functions, asked by the runner before a reconcile starts and by the startup pass over
//! the store.

use kube::runtime::controller::ReconcileReason;

use super::keyspace::ReconcileRecord;
use super::scan::{CHANGED, DUE};

/// A requeue due within this many milliseconds counts as due now: run, not put back.
const DUE_SLACK_MS: u64 = 100;

/// Whether `rec` shows the object `uid` handled at resourceVersion `rv`: the record is of
/// this object (the same uid: an object created again under the name is new, and a create
/// is never filtered, as controller-runtime's `GenerationChangedPredicate` never filters
/// one), and the last reconcile (that succeeded or failed) saw this version, or, with
/// `filter` (a predicate is set), the last successful one saw the predicate's value the
/// object has now (`value`: e.g. the same `metadata.generation`, a change of status or
/// metadata only) and no failure came since. `value` is asked only then (it may read the
/// object).
pub(crate) fn handled(
    rec: &ReconcileRecord,
    uid: Option<&str>,
    rv: Option<&str>,
    filter: bool,
    value: impl FnOnce() -> Option<u64>,
) -> bool {
    if !rec.is_of(uid) {
        return false;
    }
    if rv.is_some() && rec.handled_rv() == rv {
        return true;
    }
    filter && rec.failed_rv.is_none() && rec.ok_predicate.is_some() && value() == rec.ok_predicate
}

/// Requests that need not run if the reconcile state shows their version handled: changes
/// of the object itself and the startup pass's, and requeues or retries that fire before
/// their due time (merged requests, see [`may_skip`]); not related triggers.
pub(crate) fn skippable(reason: &ReconcileReason) -> bool {
    match reason {
        ReconcileReason::ObjectUpdated
        | ReconcileReason::ReconcilerRequestedRetry
        | ReconcileReason::ErrorPolicyRequestedRetry => true,
        ReconcileReason::Custom { reason } => reason == CHANGED || reason == DUE,
        _ => false,
    }
}

/// Whether a request for `reason` may be skipped, given whether the object's version is
/// `handled` and the record's pending requeue (`due_ms`, unix ms) at `now_ms`.
///
/// A requeue runs when it is due. One that comes early is a requeue an earlier reconcile
/// asked for, still queued after a later reconcile asked for a later one (kube-runtime
/// 5.0's scheduler keeps one request per object: a new one due no later replaces the
/// queued one, reason included; one due later, or one for an object already due and held
/// back, is dropped): skipped when the version is handled (the caller then schedules the
/// recorded requeue again at its time).
pub(crate) fn may_skip(
    reason: &ReconcileReason,
    handled: bool,
    due_ms: Option<u64>,
    now_ms: u64,
) -> bool {
    let early = |due: u64| due > now_ms + DUE_SLACK_MS;
    match reason {
        ReconcileReason::Custom { reason } if reason == DUE => handled && due_ms.is_none_or(early),
        ReconcileReason::ReconcilerRequestedRetry | ReconcileReason::ErrorPolicyRequestedRetry => {
            handled && due_ms.is_some_and(early)
        }
        _ => handled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(
        ok_rv: Option<&str>,
        failed_rv: Option<&str>,
        ok_predicate: Option<u64>,
    ) -> ReconcileRecord {
        ReconcileRecord {
            uid: Some(U.to_string()),
            ok_rv: ok_rv.map(str::to_string),
            failed_rv: failed_rv.map(str::to_string),
            ok_predicate,
            ..Default::default()
        }
    }

    const U: &str = "uid-1";

    /// `handled` of the object with uid [`U`].
    fn handled(
        rec: &ReconcileRecord,
        rv: Option<&str>,
        filter: bool,
        value: impl FnOnce() -> Option<u64>,
    ) -> bool {
        super::handled(rec, Some(U), rv, filter, value)
    }

    #[test]
    fn an_object_created_again_is_never_handled_by_the_record_of_the_one_it_replaced() {
        let never = || -> Option<u64> { panic!("another uid is decided before the generation") };
        let ok7 = rec(Some("7"), None, Some(1));
        // The same version, or the same generation (a new object starts at 1), of another
        // object of the name: not handled.
        assert!(!super::handled(&ok7, Some("uid-2"), Some("7"), true, never));
        assert!(!super::handled(&ok7, Some("uid-2"), Some("9"), true, never));
        assert!(!super::handled(&ok7, None, Some("9"), true, never));
        assert!(super::handled(&ok7, Some(U), Some("9"), true, || Some(1)));
        // A record without a uid is of an object without one (a kind or transform without
        // uids): compared by name alone.
        let bare = ReconcileRecord {
            uid: None,
            ..ok7.clone()
        };
        assert!(super::handled(&bare, None, Some("7"), false, never));
        assert!(super::handled(&bare, Some(""), Some("7"), false, never));
        assert!(!super::handled(&bare, Some(U), Some("7"), false, never));
    }

    #[test]
    fn a_version_is_handled_by_the_last_reconcile_or_its_predicate_value() {
        let never = || -> Option<u64> { panic!("the generation is read only when it matters") };
        let ok7 = rec(Some("7"), None, Some(2));
        assert!(handled(&ok7, Some("7"), false, never));
        assert!(handled(&ok7, Some("7"), true, never));
        assert!(!handled(&ok7, Some("8"), false, never));
        assert!(!handled(&ok7, None, false, never));
        // A status change: same generation, handled only with the filter.
        assert!(handled(&ok7, Some("8"), true, || Some(2)));
        assert!(!handled(&ok7, Some("8"), true, || Some(3)));
        assert!(!handled(&ok7, Some("8"), true, || None));
        // A failure is retried: the generation does not excuse it, the failed version does.
        let failed8 = rec(Some("7"), Some("8"), Some(2));
        assert!(handled(&failed8, Some("8"), true, never));
        assert!(!handled(&failed8, Some("9"), true, never));
        assert!(!handled(&rec(None, None, None), Some("1"), true, never));
    }

    #[test]
    fn early_requeues_and_handled_changes_are_skipped() {
        let custom = |r: &str| ReconcileReason::Custom {
            reason: r.to_string(),
        };
        let now = 1_000_000;
        // A change: skipped when handled, whatever is due.
        assert!(may_skip(
            &ReconcileReason::ObjectUpdated,
            true,
            Some(now),
            now
        ));
        assert!(!may_skip(&ReconcileReason::ObjectUpdated, false, None, now));
        // A requeue read back from disk: runs when due, skipped when early and handled.
        assert!(!may_skip(&custom(DUE), true, Some(now + 50), now));
        assert!(may_skip(&custom(DUE), true, Some(now + 5_000), now));
        assert!(may_skip(&custom(DUE), true, None, now));
        assert!(!may_skip(&custom(DUE), false, Some(now + 5_000), now));
        // A retry: runs unless a later requeue is pending for a handled version.
        for retry in [
            ReconcileReason::ReconcilerRequestedRetry,
            ReconcileReason::ErrorPolicyRequestedRetry,
        ] {
            assert!(!may_skip(&retry, true, None, now));
            assert!(!may_skip(&retry, true, Some(now), now));
            assert!(may_skip(&retry, true, Some(now + 5_000), now));
            assert!(!may_skip(&retry, false, Some(now + 5_000), now));
        }
        // What may be skipped at all: not related triggers.
        assert!(skippable(&custom(CHANGED)) && skippable(&custom(DUE)));
        assert!(!skippable(&custom("reconcile_all_on")));
        assert!(!skippable(&ReconcileReason::Unknown));
    }
}
