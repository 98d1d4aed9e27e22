//! A durable controller's reconcile state: one keyspace per controller (`controller/<name>`)
//! in the store's database, written in batches on the disk thread (its layout is below; the
//! suffix and scans are `disk/keys.rs`'s). The controller runtime (`controller/state.rs`) decides what to write; this
//! module only stores, scans and describes it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::scan::PassRecord;
use crate::disk::keys;
use crate::disk::{Backend, CONTROLLERS, WriteBatch};
use crate::disk::{LeaseCloser, StreamLease, record};
use crate::model::{Error, Result};
use crate::store::Dir;

// The keyspace's layout (`controller/<name>`), beside the stream keyspaces of `disk::keys`:
//
// r<namespace>\0<name>                                  the object's reconcile record
// d<due: u64 unix ms, big-endian><namespace>\0<name>    a pending requeue, by due time
// mcontroller   mcounts                                 identity; objects and requeues
// mpass-ticks   mpass-merge                             passes under way (scan::PassRecord)

/// A controller's reconcile record of one object.
pub(crate) const RECONCILED: u8 = b'r';
/// A controller's pending requeue, ordered by due time.
pub(crate) const DUE: u8 = b'd';
/// A controller state's identity (name and watched kinds).
pub(crate) const CONTROLLER_KEY: &[u8] = b"mcontroller";
/// A controller state's counts (objects tracked, pending requeues).
pub(crate) const COUNTS_KEY: &[u8] = b"mcounts";
/// The pass over every object (`reconcile_all_on` ticks): how far it is done.
pub(crate) const TICKS_PASS_KEY: &[u8] = b"mpass-ticks";
/// The merge pass (startup, lag): how far it is done.
pub(crate) const MERGE_PASS_KEY: &[u8] = b"mpass-merge";

/// `d<due_ms><suffix>`: the due-time index entry of a pending requeue.
pub(crate) fn due_key(due_ms: u64, suffix: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(9 + suffix.len());
    k.push(DUE);
    k.extend_from_slice(&due_ms.to_be_bytes());
    k.extend_from_slice(suffix);
    k
}

/// The due time and object suffix of a `d` key.
pub(crate) fn parse_due_key(key: &[u8]) -> Option<(u64, &[u8])> {
    let rest = key.strip_prefix(&[DUE])?;
    let (due, suffix) = rest.split_at_checked(8)?;
    Some((u64::from_be_bytes(due.try_into().ok()?), suffix))
}

/// Version of the controller state's format; part of its identity (a state of another
/// format starts fresh: every object is reconciled once). 2: records carry the uid of the
/// object they were written for. 3: the value of the controller's predicate instead of the
/// generation.
const STATE_FORMAT: u32 = 3;

/// What one object's last reconciles left behind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ReconcileRecord {
    /// `metadata.uid` of the object the record was written for: an object deleted and
    /// created again under its name (another uid) is a new object that no reconcile has
    /// seen, whatever its version or generation.
    pub(crate) uid: Option<String>,
    /// The resourceVersion at which the last reconcile returned `Ok`.
    pub(crate) ok_rv: Option<String>,
    /// The value of the controller's predicate for that version, if it has one and a
    /// predicate is set ([`Controller::predicate_filter`](super::Controller::predicate_filter)).
    pub(crate) ok_predicate: Option<u64>,
    /// The resourceVersion of the last reconcile if it failed (`None` after an `Ok`).
    pub(crate) failed_rv: Option<String>,
    /// When the requeue the reconcile (or the error policy) asked for is due, unix ms.
    pub(crate) due_ms: Option<u64>,
}

impl ReconcileRecord {
    /// The version the last reconcile handled (successfully or not): a different current
    /// version is a change the controller has not seen.
    pub(crate) fn handled_rv(&self) -> Option<&str> {
        self.failed_rv.as_deref().or(self.ok_rv.as_deref())
    }

    /// Whether the record was written for the object with `uid` (an empty or absent uid is
    /// none: a kind, or a transform, without uids compares by name alone).
    pub(crate) fn is_of(&self, uid: Option<&str>) -> bool {
        self.uid.as_deref().filter(|u| !u.is_empty()) == uid.filter(|u| !u.is_empty())
    }
}

/// How a finished reconcile ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// `Ok(action)`, of an object with this value of the controller's predicate.
    Ok { predicate: Option<u64> },
    /// `Err(..)`: the error policy chose the requeue.
    Failed,
}

/// One change of the reconcile state.
#[derive(Debug, Clone)]
pub(crate) enum StateOp {
    /// A reconcile of the object `uid` at `rv` returned; `due_ms`: its next requeue, if
    /// any. A record of another uid (an earlier object of the same name) is replaced whole.
    Done {
        suffix: Vec<u8>,
        uid: Option<String>,
        rv: String,
        outcome: Outcome,
        due_ms: Option<u64>,
    },
    /// The object is gone: forget it. With `only_if`, only while the record is still the
    /// one the startup pass read: a reconcile that recorded the object since (it was
    /// created again) keeps its record.
    Forget {
        suffix: Vec<u8>,
        only_if: Option<ReconcileRecord>,
    },
}

impl StateOp {
    pub(crate) fn suffix(&self) -> &[u8] {
        match self {
            StateOp::Done { suffix, .. } | StateOp::Forget { suffix, .. } => suffix,
        }
    }

    /// The record after this op, from the one before.
    pub(crate) fn apply_to(&self, old: Option<ReconcileRecord>) -> Option<ReconcileRecord> {
        match self {
            StateOp::Forget {
                only_if: Some(seen),
                ..
            } if old.as_ref() != Some(seen) => old,
            StateOp::Forget { .. } => None,
            StateOp::Done {
                uid,
                rv,
                outcome,
                due_ms,
                ..
            } => {
                let mut rec = old
                    .filter(|old| old.is_of(uid.as_deref()))
                    .unwrap_or_default();
                rec.uid = uid.clone();
                match outcome {
                    Outcome::Ok { predicate } => {
                        rec.ok_rv = Some(rv.clone());
                        rec.ok_predicate = *predicate;
                        rec.failed_rv = None;
                    }
                    Outcome::Failed => rec.failed_rv = Some(rv.clone()),
                }
                rec.due_ms = *due_ms;
                debug_assert!(
                    rec.is_of(uid.as_deref()) && rec.handled_rv() == Some(rv.as_str()),
                    "a record written for an object carries that object's uid and version"
                );
                Some(rec)
            }
        }
    }
}

/// Who a controller state belongs to: a different identity starts fresh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ControllerIdentity {
    pub(crate) format: u32,
    pub(crate) name: String,
    /// `apiVersion/kind` of the controlled kind first, then the related kinds, sorted.
    pub(crate) kinds: Vec<String>,
}

impl ControllerIdentity {
    pub(crate) fn new(name: &str, main: String, mut related: Vec<String>) -> Self {
        related.sort();
        related.dedup();
        let mut kinds = vec![main];
        kinds.extend(related);
        ControllerIdentity {
            format: STATE_FORMAT,
            name: name.to_string(),
            kinds,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct Counts {
    objects: u64,
    pending: u64,
}

/// The reconcile state keyspace of one controller, held open (one writer per process).
pub(crate) struct ControllerKeyspace {
    backend: Arc<dyn Backend>,
    path: std::path::PathBuf,
    name: String,
    lease: StreamLease,
}

impl ControllerKeyspace {
    /// For the controller that owns this keyspace: dropped, it marks the keyspace closing
    /// (a controller of the same name then waits for the batches still queued).
    pub(crate) fn closer(&self) -> LeaseCloser {
        self.lease.closer()
    }
}

impl std::fmt::Debug for ControllerKeyspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerKeyspace")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn corrupt(path: &std::path::Path, name: &str, key: &[u8], detail: String) -> Error {
    let key = match key.split_first() {
        Some((&RECONCILED, suffix)) => format!("record {}", keys::display(suffix)),
        Some((&DUE, _)) => match parse_due_key(key) {
            Some((_, suffix)) => format!("requeue of {}", keys::display(suffix)),
            None => "a requeue".to_string(),
        },
        _ => record::describe(key),
    };
    record::corrupt_named(path, &format!("controller state {name:?}"), &key, detail)
}

/// Unix milliseconds of `t` (0 before the epoch).
pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis().min(u64::MAX as u128) as u64)
}

fn from_unix_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

impl ControllerKeyspace {
    fn decode(&self, key: &[u8], bytes: &[u8]) -> Result<ReconcileRecord> {
        record::decode(bytes).map_err(|d| corrupt(&self.path, &self.name, key, d))
    }

    /// Compare the stored identity with `identity`: the same keeps the state (`true` if
    /// it holds any object), another one clears it and writes `identity` (`false`).
    /// Blocking: run it on the disk thread.
    pub(crate) fn check_identity(&self, identity: &ControllerIdentity) -> Result<bool> {
        let stored = match self.backend.get(CONTROLLER_KEY)? {
            Some(b) => record::decode::<ControllerIdentity>(&b).ok(),
            None => None,
        };
        if stored.as_ref() == Some(identity) {
            let counts = self.counts()?;
            return Ok(counts.objects > 0);
        }
        if let Some(stored) = stored {
            tracing::warn!(controller = %self.name, from = ?stored.kinds, to = ?identity.kinds,
                "controller identity changed: its reconcile state starts fresh");
        }
        self.backend.clear()?;
        let mut b = WriteBatch::default();
        b.put(CONTROLLER_KEY.to_vec(), record::encode(identity));
        b.put(COUNTS_KEY.to_vec(), record::encode(&Counts::default()));
        self.backend.apply(b)?;
        Ok(false)
    }

    fn counts(&self) -> Result<Counts> {
        match self.backend.get(COUNTS_KEY)? {
            Some(b) => {
                record::decode(&b).map_err(|d| corrupt(&self.path, &self.name, COUNTS_KEY, d))
            }
            None => Ok(Counts::default()),
        }
    }

    /// The record of one object. Blocking (a point read).
    pub(crate) fn get(&self, suffix: &[u8]) -> Result<Option<ReconcileRecord>> {
        let key = keys::tagged(RECONCILED, suffix);
        match self.backend.get(&key)? {
            Some(b) => self.decode(&key, &b).map(Some),
            None => Ok(None),
        }
    }

    /// A pass's record (`TICKS_PASS_KEY` or `MERGE_PASS_KEY`). Blocking (a point read).
    pub(crate) fn pass(&self, key: &[u8]) -> Result<Option<PassRecord>> {
        match self.backend.get(key)? {
            Some(b) => record::decode(&b)
                .map(Some)
                .map_err(|d| corrupt(&self.path, &self.name, key, d)),
            None => Ok(None),
        }
    }

    /// Apply `ops` (in order) in one atomic batch, with the due-time index, the counts and
    /// the passes' records. Blocking: run it on the disk thread.
    pub(crate) fn apply(
        &self,
        ops: &[StateOp],
        passes: &[(&'static [u8], PassRecord)],
    ) -> Result<()> {
        if ops.is_empty() && passes.is_empty() {
            return Ok(());
        }
        let mut order: Vec<&[u8]> = Vec::new();
        let mut finals: HashMap<&[u8], Option<ReconcileRecord>> = HashMap::new();
        let mut before: HashMap<&[u8], Option<ReconcileRecord>> = HashMap::new();
        let rkeys: Vec<Vec<u8>> = ops
            .iter()
            .map(|op| keys::tagged(RECONCILED, op.suffix()))
            .collect();
        let refs: Vec<&[u8]> = rkeys.iter().map(Vec::as_slice).collect();
        let mut found: Vec<Option<ReconcileRecord>> = vec![None; ops.len()];
        self.backend.get_each(&refs, &mut |i, v| {
            found[i] = Some(self.decode(&rkeys[i], v)?);
            Ok(())
        })?;
        for (op, disk) in ops.iter().zip(found) {
            let suffix = op.suffix();
            if !before.contains_key(suffix) {
                before.insert(suffix, disk.clone());
                order.push(suffix);
            }
            let prev = finals
                .remove(suffix)
                .unwrap_or_else(|| before[suffix].clone());
            finals.insert(suffix, op.apply_to(prev));
        }
        let mut counts = self.counts()?;
        let mut b = WriteBatch::default();
        for suffix in order {
            let (old, new) = (&before[suffix], &finals[suffix]);
            let rkey = keys::tagged(RECONCILED, suffix);
            match new {
                Some(rec) => b.put(rkey, record::encode(rec)),
                None if old.is_some() => b.delete(rkey),
                None => {}
            }
            let old_due = old.as_ref().and_then(|r| r.due_ms);
            let new_due = new.as_ref().and_then(|r| r.due_ms);
            if old_due != new_due {
                if let Some(d) = old_due {
                    b.delete(due_key(d, suffix));
                }
                if let Some(d) = new_due {
                    b.put(due_key(d, suffix), Vec::new());
                }
            }
            let delta = |o: bool, n: bool, c: &mut u64| match (o, n) {
                (false, true) => *c += 1,
                (true, false) => *c = c.saturating_sub(1),
                _ => {}
            };
            delta(old.is_some(), new.is_some(), &mut counts.objects);
            delta(old_due.is_some(), new_due.is_some(), &mut counts.pending);
        }
        b.put(COUNTS_KEY.to_vec(), record::encode(&counts));
        for (key, pass) in passes {
            b.put(key.to_vec(), record::encode(pass));
        }
        self.backend.apply(b)
    }

    /// Up to `limit` records after `cursor` (the last suffix read), in key order. Blocking.
    pub(crate) fn records_after(
        &self,
        cursor: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, ReconcileRecord)>> {
        let after = cursor.map(|c| keys::tagged(RECONCILED, c));
        let mut out = Vec::new();
        for entry in keys::chunk(&*self.backend, RECONCILED, after.as_deref(), limit) {
            let (k, v) = entry?;
            let rec = self.decode(&k, &v)?;
            out.push((k[1..].to_vec(), rec));
        }
        Ok(out)
    }

    /// The pending requeues due in `[from_ms, to_ms)`: (object suffix, due ms). Blocking.
    pub(crate) fn due_between(&self, from_ms: u64, to_ms: u64) -> Result<Vec<(Vec<u8>, u64)>> {
        let start = due_key(from_ms, &[]);
        let end = due_key(to_ms, &[]);
        let mut out = Vec::new();
        for entry in self.backend.range(&start, &end) {
            let (k, _) = entry?;
            if let Some((due, suffix)) = parse_due_key(&k) {
                out.push((suffix.to_vec(), due));
            }
        }
        Ok(out)
    }
}

/// A durable controller's reconcile state, as [`Db::controller_states`](crate::Db::controller_states) describes it.
///
/// ```
/// # fn main() -> Result<(), kube_persist::Error> {
/// let dir = tempfile::tempdir().unwrap();
/// let db = kube_persist::Db::open(dir.path())?;
/// // No durable controller has run on this store yet.
/// let states: Vec<kube_persist::ControllerStateInfo> = db.controller_states()?;
/// assert!(states.is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ControllerStateInfo {
    /// The name the controller was given
    /// ([`Controller::durable_state`](crate::Controller::durable_state)).
    pub name: String,
    /// `apiVersion/kind` of the controlled kind, then of the related kinds it watches.
    pub kinds: Vec<String>,
    /// Objects with a reconcile record.
    pub objects: u64,
    /// Requeues (and error-policy retries) pending.
    pub pending_requeues: u64,
    /// When the earliest pending requeue is (or was) due.
    pub oldest_due: Option<SystemTime>,
}

/// One object's reconcile record, as [`Db::reconcile_states`](crate::Db::reconcile_states) yields it.
///
/// ```no_run
/// # fn main() -> Result<(), kube_persist::Error> {
/// let db = kube_persist::Db::open("/var/lib/my-controller/cache")?;
/// for record in db.reconcile_states("labeler")? {
///     let r: kube_persist::ReconcileStateInfo = record?;
///     println!("{:?}/{} reconciled at {:?}, due {:?}", r.namespace, r.name, r.resource_version, r.due);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconcileStateInfo {
    /// The object's namespace (`None` for cluster-scoped kinds).
    pub namespace: Option<String>,
    /// The object's name.
    pub name: String,
    /// The `metadata.uid` of the object the record is of (an object of the same name
    /// created again has another uid, and is reconciled as new).
    pub uid: Option<String>,
    /// The resourceVersion at which the last reconcile returned `Ok`.
    pub resource_version: Option<String>,
    /// The value of the controller's predicate for that version
    /// ([`Controller::predicate_filter`](crate::Controller::predicate_filter)), if one is
    /// set and it has a value.
    pub predicate: Option<u64>,
    /// The resourceVersion of the last reconcile, if it failed.
    pub failed_resource_version: Option<String>,
    /// When the pending requeue (or retry) is due, if any.
    pub due: Option<SystemTime>,
}

/// Records of one controller, read lazily from disk; see [`Db::reconcile_states`](crate::Db::reconcile_states).
///
/// ```no_run
/// # fn main() -> Result<(), kube_persist::Error> {
/// let db = kube_persist::Db::open("/var/lib/my-controller/cache")?;
/// let records: kube_persist::ReconcileStates = db.reconcile_states("labeler")?;
/// let pending = records.filter_map(Result::ok).filter(|r| r.due.is_some()).count();
/// println!("{pending} requeues pending");
/// # Ok(()) }
/// ```
pub type ReconcileStates = Box<dyn Iterator<Item = Result<ReconcileStateInfo>> + Send>;

/// Open the reconcile state keyspace of controller `name` in `dir` (one per process).
pub(crate) fn open(dir: &Dir, name: &str) -> Result<ControllerKeyspace> {
    if name.is_empty() {
        return Err(Error::InvalidArgument {
            detail: "controller name must not be empty".into(),
        });
    }
    let lease = dir.lease(&format!("{CONTROLLERS}{name}"), "controller")?;
    Ok(ControllerKeyspace {
        backend: dir.storage().keyspace_of(CONTROLLERS, name)?,
        path: dir.path().to_path_buf(),
        name: name.to_string(),
        lease,
    })
}

/// The stored reconcile state keyspace of controller `name`, [`Error::NoSuchController`] if none.
fn stored(dir: &Dir, name: &str) -> Result<Arc<dyn Backend>> {
    dir.require_keyspace(CONTROLLERS, name)?;
    dir.storage().keyspace_of(CONTROLLERS, name)
}

/// The work of [`Db::controller_states`](crate::Db::controller_states).
pub(crate) fn controller_states(dir: &Dir) -> Result<Vec<ControllerStateInfo>> {
    let mut names = dir.storage().keyspaces_of(CONTROLLERS)?;
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let backend = dir.storage().keyspace_of(CONTROLLERS, &name)?;
        let path = dir.path();
        let Some(id) = backend.get(CONTROLLER_KEY)? else {
            continue;
        };
        let id: ControllerIdentity =
            record::decode(&id).map_err(|d| corrupt(path, &name, CONTROLLER_KEY, d))?;
        let counts: Counts = match backend.get(COUNTS_KEY)? {
            Some(b) => record::decode(&b).map_err(|d| corrupt(path, &name, COUNTS_KEY, d))?,
            None => Counts::default(),
        };
        let (start, end) = keys::range(DUE, None);
        let oldest_due = match backend.range(&start, &end).next() {
            Some(entry) => parse_due_key(&entry?.0).map(|(ms, _)| from_unix_ms(ms)),
            None => None,
        };
        out.push(ControllerStateInfo {
            name,
            kinds: id.kinds,
            objects: counts.objects,
            pending_requeues: counts.pending,
            oldest_due,
        });
    }
    Ok(out)
}

/// The work of [`Db::reconcile_states`](crate::Db::reconcile_states).
pub(crate) fn reconcile_states(dir: &Dir, name: &str) -> Result<ReconcileStates> {
    let backend = stored(dir, name)?;
    let (start, end) = keys::range(RECONCILED, None);
    let path = dir.path().to_path_buf();
    let name = name.to_string();
    Ok(Box::new(backend.range(&start, &end).map(move |entry| {
        let (k, v) = entry?;
        let rec: ReconcileRecord = record::decode(&v).map_err(|d| corrupt(&path, &name, &k, d))?;
        let suffix = &k[1..];
        let (ns, obj_name) = keys::split_suffix(suffix);
        Ok(ReconcileStateInfo {
            namespace: (!ns.is_empty()).then(|| ns.to_string()),
            name: obj_name.into_owned(),
            uid: rec.uid,
            resource_version: rec.ok_rv,
            predicate: rec.ok_predicate,
            failed_resource_version: rec.failed_rv,
            due: rec.due_ms.map(from_unix_ms),
        })
    })))
}

/// Every decoder of a controller's records (identity, counts, object records, passes) on
/// arbitrary bytes: for the fuzz targets (`fuzz/`).
#[cfg(any(fuzzing, test))]
pub(crate) fn fuzz_decode(bytes: &[u8]) {
    let _ = record::decode::<ReconcileRecord>(bytes);
    let _ = record::decode::<ControllerIdentity>(bytes);
    let _ = record::decode::<Counts>(bytes);
    let _ = record::decode::<PassRecord>(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_keys_order_by_time_then_object() {
        let a = due_key(5, &keys::object_suffix(Some("z"), "z"));
        let b = due_key(6, &keys::object_suffix(Some("a"), "a"));
        let c = due_key(256, &keys::object_suffix(Some("a"), "a"));
        assert!(a < b && b < c);
        assert_eq!(
            parse_due_key(&c),
            Some((256, &keys::object_suffix(Some("a"), "a")[..]))
        );
        assert_eq!(parse_due_key(b"d12"), None);
    }
}
