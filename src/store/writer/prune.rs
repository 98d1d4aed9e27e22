//! Narrowing a sharded store: when a store is reopened with a shard inside its stored one,
//! the objects outside the new shard are removed chunk by chunk ([`chunk`]), each chunk one
//! atomic batch with the prune cursor, so a crash resumes the prune where it stopped. The
//! watch resumes from the same checkpoint: no paginated LIST.

use std::collections::HashMap;

use super::index::reindex;
use super::keyspace::Keyspace;
use crate::disk::WriteBatch;
use crate::disk::keys::{self, OBJECT, PRUNE_KEY, SEEN};
use crate::disk::record;
use crate::model::{Result, Shard};

/// One chunk of a prune, read and not yet written (its cursor included).
pub(super) struct Pruned {
    pub(super) writes: WriteBatch,
    pub(super) pruned: u64,
    /// The scan reached the end of the objects: the prune is complete.
    pub(super) done: bool,
}

/// The removal of the objects outside `shard` among up to `limit` objects after `after`
/// (no events: they still exist on the server, in another shard), with the prune cursor.
pub(super) fn chunk(
    ks: &Keyspace,
    shard: &Shard,
    after: Option<&[u8]>,
    limit: usize,
) -> Result<Pruned> {
    let mut writes = WriteBatch::default();
    let (mut scanned, mut pruned) = (0usize, 0u64);
    let mut last = None;
    for entry in keys::chunk(&*ks.backend, OBJECT, after, limit) {
        let (key, value) = entry?;
        scanned += 1;
        let suffix = &key[1..];
        let head = record::decode_head(&value)
            .map_err(|d| record::corrupt(&ks.path, &ks.stream, &key, d))?;
        if !shard.contains(Some(&head.uid), Some(&keys::suffix_namespace(suffix))) {
            writes.delete(keys::tagged(SEEN, suffix));
            let old = ks.entries(suffix, &HashMap::new())?;
            reindex(&mut writes, suffix, &old, &[], ks.cipher.as_deref());
            writes.delete(key.clone());
            pruned += 1;
        }
        last = Some(key);
    }
    let done = scanned < limit;
    if done {
        writes.delete(PRUNE_KEY.to_vec());
    } else {
        writes.put(PRUNE_KEY.to_vec(), record::encode(&last));
    }
    Ok(Pruned {
        writes,
        pruned,
        done,
    })
}
