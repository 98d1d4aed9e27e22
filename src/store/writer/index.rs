//! Secondary index upkeep: each object's entries are replaced in the same batch as the
//! object ([`reindex`]); indexes are built from disk in chunks ([`chunk`]) and dropped when
//! no longer configured ([`plan`], [`drop`]). In an encrypted stream the entries hold keyed
//! hashes of the values (`Keyspace::stored_entries`), and the entry lists are sealed.

use super::keyspace::Keyspace;
use crate::disk::keys::{self, ENTRIES, INDEXES_KEY, OBJECT};
use crate::disk::record;
use crate::disk::{Cipher, WriteBatch};
use crate::model::Result;

/// Index entries of one object: (index name, value). As stored, and as `reindex` takes
/// them, the values of an encrypted stream are their tokens (`Keyspace::stored_entries`).
pub(crate) type IndexEntries = Vec<(String, String)>;

/// Replace an object's index entries `old` by `new` (both as stored) in `batch`; its entry
/// list is sealed with `cipher` in an encrypted stream.
pub(super) fn reindex(
    batch: &mut WriteBatch,
    suffix: &[u8],
    old: &[(String, String)],
    new: &[(String, String)],
    cipher: Option<&Cipher>,
) {
    if old == new {
        return;
    }
    for (name, value) in old.iter().filter(|e| !new.contains(e)) {
        let mut k = keys::index_prefix(name, value);
        k.extend_from_slice(suffix);
        batch.delete(k);
    }
    for (name, value) in new.iter().filter(|e| !old.contains(e)) {
        let mut k = keys::index_prefix(name, value);
        k.extend_from_slice(suffix);
        batch.put(k, Vec::new());
    }
    let key = keys::tagged(ENTRIES, suffix);
    if new.is_empty() {
        batch.delete(key);
    } else {
        let list = record::encode_sealed(&new.to_vec(), &key, cipher);
        batch.put(key, list);
    }
}

/// What to do with the indexes built on disk, given the configured ones.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct IndexPlan {
    /// Built and no longer configured: their entries are dropped.
    pub(super) removed: Vec<String>,
    /// No index is configured any more: the objects' entry lists are dropped too.
    pub(super) drop_entry_lists: bool,
    /// Built and still configured.
    pub(super) kept: Vec<String>,
    /// Some configured index is not built: it is built from disk, page by page.
    pub(super) build: bool,
}

/// Compare the configured indexes with those built on disk.
pub(super) fn plan(built: Vec<String>, configured: &[String]) -> IndexPlan {
    let removed: Vec<String> = built
        .iter()
        .filter(|n| !configured.contains(n))
        .cloned()
        .collect();
    let drop_entry_lists = configured.is_empty() && !built.is_empty();
    let kept: Vec<String> = built
        .into_iter()
        .filter(|n| configured.contains(n))
        .collect();
    IndexPlan {
        build: kept != configured,
        removed,
        drop_entry_lists,
        kept,
    }
}

/// Remove every entry of the indexes in `names` (no longer configured), and with
/// `drop_entry_lists` every object's entry list, in chunks.
pub(super) fn drop(ks: &Keyspace, names: &[String], drop_entry_lists: bool) -> Result<()> {
    let mut ranges: Vec<(Vec<u8>, Vec<u8>)> = names.iter().map(|n| keys::index_range(n)).collect();
    if drop_entry_lists {
        ranges.push(keys::range(ENTRIES, None));
    }
    for (start, end) in ranges {
        loop {
            let mut batch = WriteBatch::default();
            for entry in ks.backend.range(&start, &end).take(10_000) {
                batch.delete(entry?.0);
            }
            if batch.is_empty() {
                break;
            }
            ks.backend.apply(batch)?;
        }
    }
    Ok(())
}

/// The entries of up to `limit` stored objects after `after`, recomputed with `inspect`
/// (which decodes the JSON body), as a batch; and the last key read, `None` when done.
pub(super) fn chunk(
    ks: &Keyspace,
    after: Option<Vec<u8>>,
    limit: usize,
    inspect: &dyn Fn(&[u8]) -> std::result::Result<IndexEntries, serde_json::Error>,
) -> Result<(WriteBatch, Option<Vec<u8>>)> {
    let mut batch = WriteBatch::default();
    let mut last = None;
    let mut n = 0;
    let none = Default::default();
    for entry in keys::chunk(&*ks.backend, OBJECT, after.as_deref(), limit) {
        let (key, value) = entry?;
        n += 1;
        let suffix = key[1..].to_vec();
        let rec = ks.decode_record(&key, &value)?;
        let body = ks.open_body(&key, rec)?;
        match inspect(&body) {
            Ok(new) => {
                let old = ks.entries(&suffix, &none)?;
                let new = ks.stored_entries(new);
                reindex(&mut batch, &suffix, &old, &new, ks.cipher.as_deref());
            }
            Err(e) => {
                tracing::warn!(object = %keys::display(&suffix), error = %e, "not indexed: does not decode")
            }
        }
        last = Some(key);
    }
    Ok((batch, if n < limit { None } else { last }))
}

/// Record that `names` are the built indexes.
pub(super) fn record_built(ks: &Keyspace, names: &[String]) -> Result<()> {
    let mut batch = WriteBatch::default();
    batch.put(INDEXES_KEY.to_vec(), record::encode(&names.to_vec()));
    ks.backend.apply(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    /// Built indexes no longer configured are dropped (with the entry lists when none is
    /// left), the others kept; a configured one not built is built.
    #[test]
    fn the_index_plan_keeps_drops_and_builds() {
        let p = plan(names(&["a", "b"]), &names(&["b", "c"]));
        assert_eq!(
            p,
            IndexPlan {
                removed: names(&["a"]),
                drop_entry_lists: false,
                kept: names(&["b"]),
                build: true,
            }
        );
        let p = plan(names(&["a"]), &[]);
        assert!(p.drop_entry_lists && !p.build && p.removed == names(&["a"]));
        let p = plan(names(&["a"]), &names(&["a"]));
        assert!(p.removed.is_empty() && !p.build && !p.drop_entry_lists);
        assert!(!plan(Vec::new(), &[]).drop_entry_lists);
    }
}
