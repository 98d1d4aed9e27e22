//! Building one atomic batch from a list page or a burst of watch events: unchanged objects
//! are skipped (or marked during a relist), index entries follow their object, and the new
//! state (checkpoint) is written with the data.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use super::index::IndexEntries;
use super::{Body, Change, Op, Tally, Writer};
use crate::disk::WriteBatch;
use crate::disk::keys::{self, OBJECT, SEEN};
use crate::disk::record::{self, Record};
use crate::model::{Result, resource_version};
use crate::store::{Phase, State};

impl Writer {
    /// Apply `ops` and the next state in ONE atomic batch.
    pub(super) fn commit(
        &mut self,
        ops: Vec<Op>,
        mut next: State,
        emit: bool,
    ) -> Result<Vec<Change>> {
        // Unchanged objects of an older epoch get a mark so the sweep keeps them.
        let mark_unchanged = matches!(self.state.phase, Phase::Listing { sweep: true, .. });
        // A watch never replaces a stored version with an older one: after a delta relist,
        // the store may hold bodies fetched after the list's resourceVersion, and the watch
        // from that resourceVersion replays the events that led to them (KEP-5504 order;
        // opaque versions are not ordered, and a list's pages always write).
        let newest_kept = matches!(self.state.phase, Phase::Synced { .. });
        let epoch = next.epoch;
        let mut batch = WriteBatch::default();
        let mut changes = Vec::new();
        // Versions written earlier in this batch (a burst may touch one object twice).
        let mut pending: HashMap<Vec<u8>, Option<(String, u64)>> = HashMap::new();
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
            if newest_kept && older_than_stored(&op, existing.as_ref()) {
                stale += 1;
                continue;
            }
            match op {
                Op::Seen {
                    suffix,
                    resource_version,
                } => {
                    if let Some((rv, rec_epoch)) = &existing
                        && *rv == resource_version
                    {
                        unchanged += 1;
                        if mark_unchanged && *rec_epoch != epoch {
                            batch.put(keys::tagged(SEEN, &suffix), epoch.to_be_bytes().to_vec());
                        }
                    }
                }
                Op::Put(o) => {
                    if let Some((rv, rec_epoch)) = &existing {
                        if *rv == o.resource_version {
                            unchanged += 1;
                            if mark_unchanged && *rec_epoch != epoch {
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
                    pending.insert(o.suffix.clone(), Some((o.resource_version.clone(), epoch)));
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
        self.write(batch, next, tally)?;
        // After the write's cache invalidation, before the next write: each is the newest.
        self.cache
            .put_fresh(fresh.into_iter().map(|(k, (o, n))| (k, o, n)).collect());
        Ok(changes)
    }

    /// The stored (resourceVersion, epoch) of the objects `ops` touch, read in one pass
    /// (one read transaction on redb) from the records' heads, without copying bodies.
    /// Always read, even when the count says the store is empty: what decides whether an
    /// object is new or a deletion already applied is the record, never the count.
    fn stored_heads(&self, ops: &[Op]) -> Result<HashMap<Vec<u8>, (String, u64)>> {
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
            heads.insert(suffix.to_vec(), (r.resource_version, r.epoch));
            Ok(())
        })?;
        Ok(heads)
    }
}

/// Whether a watch event's version is older than the stored one (both comparable).
fn older_than_stored(op: &Op, stored: Option<&(String, u64)>) -> bool {
    let Some((stored, _)) = stored else {
        return false;
    };
    let incoming = match op {
        Op::Put(o) => &o.resource_version,
        Op::Delete {
            resource_version: Some(rv),
            ..
        } => rv,
        _ => return false,
    };
    matches!(
        resource_version::compare(incoming, stored),
        Ok(std::cmp::Ordering::Less)
    )
}
