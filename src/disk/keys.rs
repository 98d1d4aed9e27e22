//! Key layout inside one stream's keyspace.
//!
//! ```text
//! o<namespace>\0<name>   object record (namespace is empty for cluster-scoped kinds)
//! s<namespace>\0<name>   "seen unchanged" mark, only while a relist is in progress
//! i<index>\0<value>\0<namespace>\0<name>   secondary index entry (empty value)
//! x<namespace>\0<name>   the object's index entries, to remove them on update/delete
//! m<name>                store metadata (state, identity, built indexes, the stream's id)
//! ```
//! In an encrypted stream an index entry's `<value>` is a keyed hash of the value
//! (`Cipher::index_token`, 32 hex characters), never the value, and the `x` entry lists
//! (which hold those hashes) are sealed.
//! Keys order by namespace, then name, so one namespace is one prefix scan.
//!
//! A durable controller's reconcile state has a keyspace of its own (`controller/<name>`),
//! whose layout `controller/keyspace.rs` owns; it shares only the suffix `namespace \0
//! name`, [`tagged`] keys and [`range`] scans with this one.

use std::borrow::Cow;

use super::{Backend, Entry};
use crate::model::Result;

pub(crate) const OBJECT: u8 = b'o';
pub(crate) const SEEN: u8 = b's';
pub(crate) const INDEX: u8 = b'i';
pub(crate) const ENTRIES: u8 = b'x';
pub(crate) const STATE_KEY: &[u8] = b"mstate";
pub(crate) const INDEXES_KEY: &[u8] = b"mindexes";
pub(crate) const IDENTITY_KEY: &[u8] = b"midentity";
/// A random id (16 bytes, `record::encode`d) given to the keyspace whenever it is started
/// clean (a new stream, or one wiped for another identity). An encrypted stream's keys are
/// derived from it (`StoreKey::stream_cipher`), so that its records open in this keyspace
/// only.
pub(crate) const STREAM_ID_KEY: &[u8] = b"mstreamid";
/// The shard a sharded stream keeps (absent: the whole collection).
pub(crate) const SHARD_KEY: &[u8] = b"mshard";
/// Present while objects outside a narrowed shard are being pruned: the last key pruned.
pub(crate) const PRUNE_KEY: &[u8] = b"mprune";
/// Present while a delta relist's fetched bodies may be newer than the checkpoint: the
/// highest resourceVersion fetched (a `String`, `record::encode`d). The watch skips replayed
/// events older than a stored version only while the checkpoint is below it, and it is
/// removed in the batch whose checkpoint reaches it.
pub(crate) const FETCHED_KEY: &[u8] = b"mfetched";

/// The suffix shared by an object's record and mark: `namespace \0 name`.
pub(crate) fn object_suffix(namespace: Option<&str>, name: &str) -> Vec<u8> {
    let ns = namespace.unwrap_or("");
    let mut k = Vec::with_capacity(ns.len() + name.len() + 1);
    k.extend_from_slice(ns.as_bytes());
    k.push(0);
    k.extend_from_slice(name.as_bytes());
    k
}

/// The namespace (`""` for a cluster-scoped object) and name of an object key suffix
/// (`namespace \0 name`): the one parser of [`object_suffix`]'s layout. Borrows unless a part
/// is not UTF-8 (never written by this crate), which is replaced lossily.
pub(crate) fn split_suffix(suffix: &[u8]) -> (Cow<'_, str>, Cow<'_, str>) {
    match suffix.iter().position(|&b| b == 0) {
        Some(i) => (
            String::from_utf8_lossy(&suffix[..i]),
            String::from_utf8_lossy(&suffix[i + 1..]),
        ),
        None => (Cow::Borrowed(""), String::from_utf8_lossy(suffix)),
    }
}

/// The namespace of an object key suffix (`""` for a cluster-scoped object).
pub(crate) fn suffix_namespace(suffix: &[u8]) -> Cow<'_, str> {
    split_suffix(suffix).0
}

/// One chunk of the chunked scan of every key with `tag`: at most `limit` entries after
/// `after` (the last key of the chunk before, tag included), or from the first. The one
/// cursor scan: relist sweeps, index builds, shard prunes and startup passes all resume so.
pub(crate) fn chunk(
    backend: &dyn Backend,
    tag: u8,
    after: Option<&[u8]>,
    limit: usize,
) -> std::iter::Take<Box<dyn Iterator<Item = Result<Entry>> + Send>> {
    // A cursor is the last key of a chunk of this same scan: one of another tag (or
    // none at all, an empty key) would resume another scan, or start this one over.
    debug_assert!(
        after.is_none_or(|k| k.first() == Some(&tag)),
        "a cursor of another scan: {after:?} for tag {tag}"
    );
    let (start, end) = range(tag, None);
    let from = match after {
        Some(last) => {
            let mut k = last.to_vec();
            k.push(0);
            k
        }
        None => start,
    };
    backend.range(&from, &end).take(limit)
}

/// Prefix `tag` to a suffix.
pub(crate) fn tagged(tag: u8, suffix: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(suffix.len() + 1);
    k.push(tag);
    k.extend_from_slice(suffix);
    k
}

/// The `[start, end)` range of all keys with `tag`, optionally within one namespace.
pub(crate) fn range(tag: u8, namespace: Option<&str>) -> (Vec<u8>, Vec<u8>) {
    match namespace {
        None => (vec![tag], vec![tag + 1]),
        Some(ns) => {
            let mut start = vec![tag];
            start.extend_from_slice(ns.as_bytes());
            start.push(0);
            let mut end = start.clone();
            *end.last_mut().expect("non-empty") = 1;
            (start, end)
        }
    }
}

/// `i<index>\0<value>\0`: the prefix of all entries of one index value.
pub(crate) fn index_prefix(index: &str, value: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(index.len() + value.len() + 3);
    k.push(INDEX);
    k.extend_from_slice(index.as_bytes());
    k.push(0);
    k.extend_from_slice(value.as_bytes());
    k.push(0);
    k
}

/// The `[start, end)` range of every entry of one index.
pub(crate) fn index_range(index: &str) -> (Vec<u8>, Vec<u8>) {
    let mut start = vec![INDEX];
    start.extend_from_slice(index.as_bytes());
    start.push(0);
    let mut end = start.clone();
    *end.last_mut().expect("non-empty") = 1;
    (start, end)
}

/// The end of a prefix range: the prefix with its last byte incremented past any suffix.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    end.push(0xff);
    end
}

/// Human-readable `namespace/name` (or `name`) for a key suffix, for logs and errors.
pub(crate) fn display(suffix: &[u8]) -> String {
    match split_suffix(suffix) {
        (ns, name) if ns.is_empty() => name.into_owned(),
        (ns, name) => format!("{ns}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_range_contains_only_that_namespace() {
        let (start, end) = range(OBJECT, Some("a"));
        let inside = tagged(OBJECT, &object_suffix(Some("a"), "zzz"));
        let other = tagged(OBJECT, &object_suffix(Some("a-b"), "x"));
        let other2 = tagged(OBJECT, &object_suffix(Some("ab"), "x"));
        assert!(start <= inside && inside < end);
        assert!(!(start <= other && other < end));
        assert!(!(start <= other2 && other2 < end));
    }

    #[test]
    fn display_names_objects() {
        assert_eq!(display(&object_suffix(Some("ns"), "a")), "ns/a");
        assert_eq!(display(&object_suffix(None, "node-1")), "node-1");
        let suffix = object_suffix(Some("ns"), "a");
        assert_eq!(split_suffix(&suffix), ("ns".into(), "a".into()));
        assert_eq!(split_suffix(b"bare"), ("".into(), "bare".into()));
    }
}
