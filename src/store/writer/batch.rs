//! Building one atomic batch from a list page or a burst of watch events: unchanged objects
//! are skipped (or marked during a relist), index entries follow their object, and the new
//! state (checkpoint) is written with the data.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use super::index::IndexEntries;
use super::{Body, Change, Op, Tally, Writer};
use crate::disk::WriteBatch;
use crate::disk::keys::{self, FETCHED_KEY, OBJECT, SEEN};
use crate::disk::record::{self, Record};
use crate::model::{Result, resource_version};
use crate::store::{Phase, State};

impl Writer {
    /// Apply `ops` and the next state in ONE atomic batch.
    pub(super) fn commit(&mut self, ops: Vec<Op>, next: State, emit: bool) -> Result<Vec<Change>> {
        self.commit_window(ops, next, emit, None)
    }

    /// [`Writer::commit`], keeping `fetched` as the new high of the delta relist window
    /// ([`Writer::fetched_through`]) in the same batch.
    pub(super) fn commit_window(
        &mut self,
        ops: Vec<Op>,
        mut next: State,
        emit: bool,
        fetched: Option<String>,
    ) -> Result<Vec<Change>> {
        // Unchanged objects of an older epoch get a mark so the sweep keeps them.
        let mark_unchanged = matches!(self.state.phase, Phase::Listing { sweep: true, .. });
        // A watch never replaces a stored version with an older one while a delta relist's
        // window is open: the store may hold bodies fetched after the list's
        // resourceVersion, and the watch from that resourceVersion replays the events that
        // led to them (KEP-5504 order). Outside the window (no delta relist, or the watch
        // past its fetches) every event applies as the server sent it.
        let newest_kept = self.replaying_fetched();
        let mut batch = WriteBatch::default();
        let window = self.window_update(&mut batch, &next, fetched);
        let epoch = next.epoch;
        // Records and marks carry the epoch of the list under way: a new epoch begins with
        // an empty batch (`begin_list`), so no object is written in a batch that changes it.
        debug_assert!(
            ops.is_empty() || epoch == self.state.epoch,
            "objects written in the batch that begins epoch {epoch}"
        );
        // A list may replace a stored version with an older one (its pages are the server's
        // state at the list's resourceVersion, older than what a delta relist fetched).
        let relisting = matches!(self.state.phase, Phase::Listing { .. });
        let mut changes = Vec::new();
        // Versions written earlier in this batch (a burst may touch one object twice).
        let mut pending: HashMap<Vec<u8>, Option<Head>> = HashMap::new();
        let mut pending_entries: HashMap<Vec<u8>, IndexEntries> = HashMap::new();
        // Objects written with their decoded form (watch events): cached once committed.
        let mut fresh: HashMap<Vec<u8>, (Arc<dyn Any + Send + Sync>, usize)> = HashMap::new();
        let (mut written, mut unchanged, mut removed, mut stale) = (0u64, 0u64, 0u64, 0u64);
        let stored = self.stored_heads(&ops)?;
        for op in ops {
            let existing = match pending.get(op.suffix()) {
                Some(p) => p.clone(),
                None => stored.get(op.suffix()).cloned(),
            };
            let key = keys::tagged(OBJECT, op.suffix());
            if newest_kept && superseded(&op, existing.as_ref()) {
                stale += 1;
                continue;
            }
            match op {
                Op::Seen {
                    suffix,
                    resource_version,
                } => {
                    if let Some(head) = &existing
                        && head.resource_version == resource_version
                    {
                        unchanged += 1;
                        if mark_unchanged && head.epoch != epoch {
                            batch.put(keys::tagged(SEEN, &suffix), epoch.to_be_bytes().to_vec());
                        }
                    }
                }
                Op::Put(o) => {
                    if let Some(head) = &existing {
                        // What the writer itself guarantees: while a delta relist's window is
                        // open, a watch never brings back a version older than the one stored
                        // (the fetched bodies are newer than the replayed events). Outside the
                        // window the server's order is authoritative, even for an event older
                        // than the stored version (`tests/it/delta_seams.rs`,
                        // `outside_the_window_an_older_event_applies`): an assertion there
                        // would panic on what a server sent.
                        debug_assert!(
                            relisting
                                || !newest_kept
                                || !matches!(
                                    resource_version::compare(
                                        &o.resource_version,
                                        &head.resource_version
                                    ),
                                    Ok(std::cmp::Ordering::Less)
                                ),
                            "in a delta relist's window, stored version {} of {} replaced by the older {}",
                            head.resource_version,
                            keys::display(&o.suffix),
                            o.resource_version
                        );
                        if head.resource_version == o.resource_version {
                            unchanged += 1;
                            if mark_unchanged && head.epoch != epoch {
                                batch.put(
                                    keys::tagged(SEEN, &o.suffix),
                                    epoch.to_be_bytes().to_vec(),
                                );
                            }
                            continue;
                        }
                    } else {
                        next.count += 1;
                    }
                    written += 1;
                    match &o.decoded {
                        Some(obj) if self.keys_only.is_none() => {
                            fresh.insert(key.clone(), (obj.clone(), o.body.len()));
                        }
                        _ => {
                            fresh.remove(&key);
                        }
                    }
                    pending.insert(
                        o.suffix.clone(),
                        Some(Head {
                            resource_version: o.resource_version.clone(),
                            epoch,
                            uid: o.uid.clone(),
                        }),
                    );
                    if self.indexed {
                        let old = self.entries(&o.suffix, &pending_entries)?;
                        let new = o.index;
                        self.reindex(&mut batch, &o.suffix, &old, &new);
                        pending_entries.insert(o.suffix.clone(), new);
                    }
                    let rec = Record::sealed(
                        &key,
                        o.resource_version,
                        o.uid,
                        epoch,
                        if self.keys_only.is_some() {
                            &[]
                        } else {
                            &o.body
                        },
                        o.packed.filter(|_| self.keys_only.is_none()),
                        self.cipher.as_deref(),
                        self.compress,
                    );
                    batch.put(key, record::encode(&rec));
                    if emit {
                        let body = Body {
                            json: o.body,
                            decoded: o.decoded,
                        };
                        changes.push(if existing.is_some() {
                            Change::Updated(body)
                        } else {
                            Change::Created(body)
                        });
                    }
                }
                removal => {
                    let Some((suffix, body)) = removal.into_removal() else {
                        continue;
                    };
                    if existing.is_none() {
                        continue; // replayed deletion, or nothing stored: already gone
                    }
                    next.count = next.count.saturating_sub(1);
                    removed += 1;
                    batch.delete(keys::tagged(SEEN, &suffix));
                    fresh.remove(&key);
                    batch.delete(key);
                    let old = self.entries(&suffix, &pending_entries)?;
                    self.reindex(&mut batch, &suffix, &old, &[]);
                    pending_entries.insert(suffix.clone(), Vec::new());
                    pending.insert(suffix, None);
                    if let (true, Some(body)) = (emit, body) {
                        changes.push(Change::Deleted(body));
                    }
                }
            }
        }
        if stale > 0 {
            tracing::debug!(
                stale,
                "watch events older than the stored versions skipped (replay after a delta relist)"
            );
        }
        let tally = Tally {
            written,
            unchanged,
            deleted: removed,
            stale,
        };
        self.write(batch, next, tally, window)?;
        // After the write's cache invalidation, before the next write: each is the newest.
        self.cache
            .put_fresh(fresh.into_iter().map(|(k, (o, n))| (k, o, n)).collect());
        Ok(changes)
    }

    /// Whether the watch is replaying past a delta relist's fetched bodies: the store is
    /// synced at a checkpoint below the highest resourceVersion its fetches answered at.
    fn replaying_fetched(&self) -> bool {
        let (Phase::Synced { resource_version }, Some(high)) =
            (&self.state.phase, self.fetched_through.as_deref())
        else {
            return false;
        };
        matches!(
            resource_version::compare(resource_version, high),
            Ok(std::cmp::Ordering::Less)
        )
    }

    /// Add the delta relist window's update to `batch` and return the window after it:
    /// `fetched` raises it; a synced checkpoint that reaches it (or cannot be compared with
    /// it) closes it. Every batch that writes a state goes through it.
    pub(super) fn window_update(
        &self,
        batch: &mut WriteBatch,
        next: &State,
        fetched: Option<String>,
    ) -> Option<String> {
        let raised = fetched.is_some();
        let window = fetched.or_else(|| self.fetched_through.clone());
        let closed = match (&next.phase, &window) {
            (Phase::Synced { resource_version }, Some(high)) => !matches!(
                resource_version::compare(resource_version, high),
                Ok(std::cmp::Ordering::Less)
            ),
            _ => false,
        };
        if closed {
            if self.fetched_through.is_some() {
                batch.delete(FETCHED_KEY.to_vec());
            }
            return None;
        }
        if let (true, Some(high)) = (raised, &window) {
            batch.put(FETCHED_KEY.to_vec(), record::encode(high));
        }
        window
    }

    /// The stored head (resourceVersion, epoch, uid) of the objects `ops` touch, read in one
    /// pass (one read transaction on redb) from the records' heads, without copying bodies.
    /// Always read, even when the count says the store is empty: what decides whether an
    /// object is new or a deletion already applied is the record, never the count.
    fn stored_heads(&self, ops: &[Op]) -> Result<HashMap<Vec<u8>, Head>> {
        let mut heads = HashMap::new();
        let keys: Vec<Vec<u8>> = ops
            .iter()
            .map(|op| keys::tagged(OBJECT, op.suffix()))
            .collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        self.backend.get_each(&refs, &mut |i, value| {
            let suffix = &keys[i][1..];
            let r =
                record::decode_head(value).map_err(|d| record::corrupt(&self.path, &keys[i], d))?;
            heads.insert(
                suffix.to_vec(),
                Head {
                    resource_version: r.resource_version,
                    epoch: r.epoch,
                    uid: r.uid,
                },
            );
            Ok(())
        })?;
        Ok(heads)
    }
}

/// What a batch needs of a stored (or earlier written) record.
#[derive(Debug, Clone)]
struct Head {
    resource_version: String,
    epoch: u64,
    uid: String,
}

/// Whether a replayed watch event is superseded by the stored version: older than it (both
/// comparable), and not the deletion of the stored object itself. A deletion of the stored
/// uid always applies: older than the stored version, it is the object leaving the
/// selection, and the event that brought it back follows in the replay; a deletion of
/// another uid is of an earlier object of the same name, which a fetched body replaced.
fn superseded(op: &Op, stored: Option<&Head>) -> bool {
    let Some(stored) = stored else {
        return false;
    };
    let incoming = match op {
        Op::Put(o) => &o.resource_version,
        Op::Delete {
            resource_version: Some(rv),
            uid,
            ..
        } => {
            if uid.as_deref().is_none_or(|u| u == stored.uid) {
                return false;
            }
            rv
        }
        Op::Reject {
            resource_version: Some(rv),
            ..
        } => rv,
        _ => return false,
    };
    matches!(
        resource_version::compare(incoming, &stored.resource_version),
        Ok(std::cmp::Ordering::Less)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Incoming;

    fn head(rv: &str, uid: &str) -> Head {
        Head {
            resource_version: rv.into(),
            epoch: 1,
            uid: uid.into(),
        }
    }

    fn delete(rv: &str, uid: Option<&str>) -> Op {
        Op::Delete {
            suffix: b"ns\0p".to_vec(),
            body: Vec::new(),
            resource_version: Some(rv.into()),
            uid: uid.map(str::to_string),
        }
    }

    fn put(rv: &str) -> Op {
        Op::Put(Incoming {
            suffix: b"ns\0p".to_vec(),
            uid: "u1".into(),
            resource_version: rv.into(),
            body: Vec::new(),
            index: Vec::new(),
            decoded: None,
            packed: None,
        })
    }

    /// In a delta relist's window: an older change or refusal is superseded by the fetched
    /// body; a deletion of the stored object never is (nor one at the stored version or
    /// without a uid); a deletion of an earlier object of the same name (another uid) is.
    #[test]
    fn what_a_fetched_body_supersedes() {
        let stored = head("10", "u1");
        assert!(superseded(&put("9"), Some(&stored)));
        assert!(!superseded(&put("10"), Some(&stored)));
        assert!(!superseded(&put("11"), Some(&stored)));
        assert!(!superseded(&put("9"), None));
        assert!(!superseded(&delete("9", Some("u1")), Some(&stored)));
        assert!(!superseded(&delete("9", None), Some(&stored)));
        assert!(superseded(&delete("9", Some("u0")), Some(&stored)));
        assert!(!superseded(&delete("10", Some("u0")), Some(&stored)));
        let reject = |rv: &str| Op::Reject {
            suffix: b"ns\0p".to_vec(),
            resource_version: Some(rv.into()),
        };
        assert!(superseded(&reject("9"), Some(&stored)));
        assert!(!superseded(&reject("12"), Some(&stored)));
    }
}
