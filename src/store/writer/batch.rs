//! Building one atomic batch from a list page or a burst of watch events, in named steps:
//! each op is first checked against the delta relist's fetched bodies ([`superseded`]),
//! then applied as a mark of an unchanged object ([`Batch::seen`]), a write
//! ([`Batch::put`]) or a removal ([`Batch::remove`]); index entries follow their object, and
//! [`Batch::finish`] hands the writes, the counts and the new state (the checkpoint) to the
//! writer, which commits them together.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use super::index::{IndexEntries, reindex};
use super::keyspace::Head;
use super::{Body, Change, Incoming, Op, Tally, Writer};
use crate::disk::WriteBatch;
use crate::disk::keys::{self, OBJECT, SEEN};
use crate::disk::record::{self, Record};
use crate::model::{Result, resource_version};
use crate::store::{Phase, State};

/// Objects written with their decoded form (watch events), for the hot cache once the
/// batch is committed: key, object, JSON size.
pub(super) type Fresh = Vec<(Vec<u8>, Arc<dyn Any + Send + Sync>, usize)>;

/// One batch under construction, for `w`'s next commit.
pub(super) struct Batch<'w> {
    w: &'w Writer,
    pub(super) writes: WriteBatch,
    next: State,
    emit: bool,
    /// Unchanged objects of an older epoch get a mark so the sweep keeps them.
    mark_unchanged: bool,
    /// A list may replace a stored version with an older one (its pages are the server's
    /// state at the list's resourceVersion, older than what a delta relist fetched).
    relisting: bool,
    /// A watch never replaces a stored version with an older one while a delta relist's
    /// window is open: the store may hold bodies fetched after the list's
    /// resourceVersion, and the watch from that resourceVersion replays the events that led
    /// to them (KEP-5504 order). Outside the window (no delta relist, or the watch past its
    /// fetches) every event applies as the server sent it.
    newest_kept: bool,
    /// The stored heads of the objects the ops touch.
    stored: HashMap<Vec<u8>, Head>,
    /// Versions written earlier in this batch (a burst may touch one object twice).
    pending: HashMap<Vec<u8>, Option<Head>>,
    pending_entries: HashMap<Vec<u8>, IndexEntries>,
    fresh: HashMap<Vec<u8>, (Arc<dyn Any + Send + Sync>, usize)>,
    changes: Vec<Change>,
    tally: Tally,
}

/// What a finished batch hands to the writer.
pub(super) struct Built {
    pub(super) writes: WriteBatch,
    pub(super) next: State,
    pub(super) tally: Tally,
    pub(super) changes: Vec<Change>,
    pub(super) fresh: Fresh,
}

impl<'w> Batch<'w> {
    /// A batch of `ops` (whose stored heads it reads at once) that writes `next`.
    pub(super) fn new(w: &'w Writer, ops: &[Op], next: State, emit: bool) -> Result<Self> {
        // Records and marks carry the epoch of the list under way: a new epoch begins with
        // an empty batch (`begin_list`), so no object is written in a batch that changes it.
        debug_assert!(
            ops.is_empty() || next.epoch == w.state.epoch,
            "objects written in the batch that begins epoch {}",
            next.epoch
        );
        Ok(Batch {
            w,
            writes: WriteBatch::default(),
            emit,
            mark_unchanged: matches!(w.state.phase, Phase::Listing { sweep: true, .. }),
            relisting: matches!(w.state.phase, Phase::Listing { .. }),
            newest_kept: w.window.replaying(&w.state.phase),
            stored: w.ks.stored_heads(ops.iter().map(Op::suffix))?,
            next,
            pending: HashMap::new(),
            pending_entries: HashMap::new(),
            fresh: HashMap::new(),
            changes: Vec::new(),
            tally: Tally::default(),
        })
    }

    /// Apply one op: skipped when a fetched body supersedes it, else a mark, a write or a
    /// removal.
    pub(super) fn apply(&mut self, op: Op) -> Result<()> {
        let existing = match self.pending.get(op.suffix()) {
            Some(p) => p.clone(),
            None => self.stored.get(op.suffix()).cloned(),
        };
        if self.newest_kept && superseded(&op, existing.as_ref()) {
            self.tally.stale += 1;
            return Ok(());
        }
        match op {
            Op::Seen {
                suffix,
                resource_version,
            } => {
                if let Some(head) = &existing
                    && head.resource_version == resource_version
                {
                    self.unchanged(&suffix, head);
                }
                Ok(())
            }
            Op::Put(o) => self.put(o, existing),
            removal => match removal.into_removal() {
                Some((suffix, body)) => self.remove(suffix, body, existing.is_some()),
                None => Ok(()),
            },
        }
    }

    /// An object stored at the version the server has: counted unchanged and, during a
    /// relist that sweeps, marked seen in this epoch (unless its record already is of it).
    fn unchanged(&mut self, suffix: &[u8], head: &Head) {
        self.tally.unchanged += 1;
        if self.mark_unchanged && head.epoch != self.next.epoch {
            // Marks are bound to the epoch of the list under way (see `Batch::new`).
            self.writes.put(
                keys::tagged(SEEN, suffix),
                self.next.epoch.to_be_bytes().to_vec(),
            );
        }
    }

    /// Write an object (skipped, as unchanged, when the stored version is the same): its
    /// record, its index entries, its decoded form for the hot cache and its event.
    fn put(&mut self, o: Incoming, existing: Option<Head>) -> Result<()> {
        let key = keys::tagged(OBJECT, &o.suffix);
        if let Some(head) = &existing {
            // What the writer itself guarantees: while a delta relist's window is open, a
            // watch never brings back a version older than the one stored (the fetched
            // bodies are newer than the replayed events). Outside the window the server's
            // order is authoritative, even for an event older than the stored version
            // (`tests/it/delta_seams.rs`, `outside_the_window_an_older_event_applies`): an
            // assertion there would panic on what a server sent.
            debug_assert!(
                self.relisting
                    || !self.newest_kept
                    || !matches!(
                        resource_version::compare(&o.resource_version, &head.resource_version),
                        Ok(std::cmp::Ordering::Less)
                    ),
                "in a delta relist's window, stored version {} of {} replaced by the older {}",
                head.resource_version,
                keys::display(&o.suffix),
                o.resource_version
            );
            if head.resource_version == o.resource_version {
                self.unchanged(&o.suffix, head);
                return Ok(());
            }
        } else {
            self.next.count += 1;
        }
        self.tally.written += 1;
        let keys_only = self.w.keys_only.is_some();
        match &o.decoded {
            Some(obj) if !keys_only => {
                self.fresh.insert(key.clone(), (obj.clone(), o.body.len()));
            }
            _ => {
                self.fresh.remove(&key);
            }
        }
        let epoch = self.next.epoch;
        self.pending.insert(
            o.suffix.clone(),
            Some(Head {
                resource_version: o.resource_version.clone(),
                epoch,
                uid: o.uid.clone(),
            }),
        );
        if self.w.indexed {
            let old = self.w.ks.entries(&o.suffix, &self.pending_entries)?;
            let new = self.w.ks.stored_entries(o.index);
            let cipher = self.w.ks.cipher.as_deref();
            reindex(&mut self.writes, &o.suffix, &old, &new, cipher);
            self.pending_entries.insert(o.suffix.clone(), new);
        }
        let rec = Record::sealed(record::Sealing {
            key: &key,
            resource_version: o.resource_version,
            uid: o.uid,
            epoch,
            plain: if keys_only { &[] } else { &o.body },
            packed: o.packed.filter(|_| !keys_only),
            cipher: self.w.ks.cipher.as_deref(),
            compress: self.w.compress,
        });
        self.writes.put(key, record::encode(&rec));
        if self.emit {
            let body = Body {
                json: o.body,
                decoded: o.decoded,
            };
            self.changes.push(if existing.is_some() {
                Change::Updated(body)
            } else {
                Change::Created(body)
            });
        }
        Ok(())
    }

    /// Remove an object, its mark and its index entries (nothing when none is stored: a
    /// replayed deletion); `body`: the last state the server sent, for its event.
    fn remove(&mut self, suffix: Vec<u8>, body: Option<Vec<u8>>, stored: bool) -> Result<()> {
        if !stored {
            return Ok(()); // replayed deletion, or nothing stored: already gone
        }
        let key = keys::tagged(OBJECT, &suffix);
        self.next.count = self.next.count.saturating_sub(1);
        self.tally.deleted += 1;
        self.writes.delete(keys::tagged(SEEN, &suffix));
        self.fresh.remove(&key);
        self.writes.delete(key);
        let old = self.w.ks.entries(&suffix, &self.pending_entries)?;
        reindex(
            &mut self.writes,
            &suffix,
            &old,
            &[],
            self.w.ks.cipher.as_deref(),
        );
        self.pending_entries.insert(suffix.clone(), Vec::new());
        self.pending.insert(suffix, None);
        if let (true, Some(body)) = (self.emit, body) {
            self.changes.push(Change::Deleted(body));
        }
        Ok(())
    }

    /// The batch's writes, counts, new state, events and write-through objects.
    pub(super) fn finish(self) -> Built {
        if self.tally.stale > 0 {
            tracing::debug!(
                stale = self.tally.stale,
                "watch events older than the stored versions skipped (replay after a delta relist)"
            );
        }
        Built {
            writes: self.writes,
            next: self.next,
            tally: self.tally,
            changes: self.changes,
            fresh: self
                .fresh
                .into_iter()
                .map(|(k, (o, n))| (k, o, n))
                .collect(),
        }
    }
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
