//! Sharded stores: which objects a store keeps, as ranges of the 64-bit FNV-1a hash of an
//! object's uid or namespace, in the form of kube-apiserver's `shardSelector` list option
//! (KEP-5866, Kubernetes 1.36, feature gate `ShardedListAndWatch`).
//!
//! The selector is sent on every LIST and WATCH. A server with the feature sends only the
//! shard's objects and echoes the selector in `metadata.shardInfo.selector`; one without it
//! ignores the parameter and sends everything. Either way the store hashes each object
//! itself and keeps only its shard.

use std::fmt::Write as _;

use crate::model::{Error, Result};

/// The end of the full hash range, 2^64 (exclusive).
const FULL_END: u128 = 1 << 64;

/// The object field a [`Shard`] hashes.
///
/// ```
/// use kube_persist::{Shard, ShardKey};
/// let half = Shard::even(ShardKey::Namespace, 0, 2).unwrap();
/// assert!(half.selector().starts_with("shardRange(object.metadata.namespace, "));
/// // Every object of a namespace lands in the same shard, whatever its uid ...
/// let uids: Vec<String> = (0..100).map(|i| format!("{i:03}-5e1d-4c1a")).collect();
/// let team_a = half.contains(Some(&uids[0]), Some("team-a"));
/// assert!(uids.iter().all(|uid| half.contains(Some(uid), Some("team-a")) == team_a));
/// // ... while by uid, the objects of one namespace spread over both halves.
/// let by_uid = Shard::even(ShardKey::Uid, 0, 2).unwrap();
/// let kept = uids.iter().filter(|uid| by_uid.contains(Some(uid), Some("team-a")));
/// assert!((1..100).contains(&kept.count()));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum ShardKey {
    /// `metadata.uid`: spreads the objects of one kind evenly.
    Uid,
    /// `metadata.namespace`: keeps a namespace (owners and their children) in one shard.
    Namespace,
}

impl ShardKey {
    fn field(self) -> &'static str {
        match self {
            ShardKey::Uid => "object.metadata.uid",
            ShardKey::Namespace => "object.metadata.namespace",
        }
    }
}

/// The slice of a collection a store keeps: ranges `[start, end)` over the FNV-1a 64 hash
/// of the object's uid or namespace. Objects never move between shards (uid and namespace
/// do not change).
///
/// ```
/// use kube_persist::{Shard, ShardKey};
/// // The first half of the uid hash space.
/// let half = Shard::new(ShardKey::Uid).range(0, 1 << 63);
/// assert_eq!(
///     half.selector(),
///     "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"
/// );
/// // Replica 2 of 4, split evenly by namespace.
/// let q = Shard::even(ShardKey::Namespace, 2, 4).unwrap();
/// assert!(q.contains_hash(0x8000_0000_0000_0000));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shard {
    key: ShardKey,
    /// Sorted, non-overlapping `[start, end)` ranges; `end` may be 2^64.
    ranges: Vec<(u64, u128)>,
}

impl Shard {
    /// A shard over `key` with no range yet (add them with [`Shard::range`]).
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// let shard = Shard::new(ShardKey::Uid);
    /// assert!(shard.ranges().is_empty());
    /// assert!(shard.check().is_err()); // no range yet
    /// ```
    pub fn new(key: ShardKey) -> Shard {
        Shard {
            key,
            ranges: Vec::new(),
        }
    }

    /// Add the hash range `[start, end)`; `end` may be `1 << 64` (the end of the space).
    /// Invalid or overlapping ranges are reported by [`Shard::check`] (and by the store).
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// // Two slices: the first and the last quarter of the hash space.
    /// let shard = Shard::new(ShardKey::Uid).range(3 << 62, 1 << 64).range(0, 1 << 62);
    /// assert_eq!(shard.ranges(), [(0, 1 << 62), (3 << 62, 1 << 64)]); // sorted
    /// assert!(shard.check().is_ok());
    /// ```
    pub fn range(mut self, start: u64, end: u128) -> Shard {
        self.ranges.push((start, end));
        self.ranges.sort_unstable();
        self
    }

    /// Shard `index` of `count` equal slices of the hash space of `key`.
    ///
    /// ```
    /// # fn main() -> Result<(), kube_persist::Error> {
    /// use kube_persist::{Shard, ShardKey};
    /// let second = Shard::even(ShardKey::Uid, 1, 4)?;
    /// assert_eq!(second.ranges(), [(1 << 62, 1 << 63)]);
    /// assert!(Shard::even(ShardKey::Uid, 4, 4).is_err()); // index must be below count
    /// # Ok(()) }
    /// ```
    pub fn even(key: ShardKey, index: u32, count: u32) -> Result<Shard> {
        if count == 0 || index >= count {
            return Err(Error::InvalidArgument {
                detail: format!("shard index {index} is not below the shard count {count}"),
            });
        }
        let at = |i: u32| FULL_END * u128::from(i) / u128::from(count);
        let start = u64::try_from(at(index)).expect("below 2^64");
        Ok(Shard::new(key).range(start, at(index + 1)))
    }

    /// The field this shard hashes.
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// assert_eq!(Shard::new(ShardKey::Namespace).key(), ShardKey::Namespace);
    /// ```
    pub fn key(&self) -> ShardKey {
        self.key
    }

    /// The ranges, sorted.
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// let shard = Shard::new(ShardKey::Uid).range(100, 200).range(0, 50);
    /// assert_eq!(shard.ranges(), [(0, 50), (100, 200)]);
    /// ```
    pub fn ranges(&self) -> &[(u64, u128)] {
        &self.ranges
    }

    /// Whether the ranges are valid: at least one, each non-empty, within `[0, 2^64)`,
    /// and not overlapping.
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// assert!(Shard::new(ShardKey::Uid).range(0, 1 << 63).check().is_ok());
    /// assert!(Shard::new(ShardKey::Uid).range(0, 10).range(5, 20).check().is_err()); // overlap
    /// assert!(Shard::new(ShardKey::Uid).range(7, 7).check().is_err()); // empty
    /// ```
    pub fn check(&self) -> Result<()> {
        if self.ranges.is_empty() {
            return Err(Error::InvalidArgument {
                detail: "shard has no range".into(),
            });
        }
        let mut last_end = 0u128;
        for (i, &(start, end)) in self.ranges.iter().enumerate() {
            if u128::from(start) >= end || end > FULL_END {
                return Err(Error::InvalidArgument {
                    detail: format!(
                        "shard range [{start:#018x}, {end:#x}) is empty or beyond 2^64"
                    ),
                });
            }
            if i > 0 && u128::from(start) < last_end {
                return Err(Error::InvalidArgument {
                    detail: format!("shard ranges overlap at {start:#018x}"),
                });
            }
            last_end = end;
        }
        Ok(())
    }

    /// The `shardSelector` list option: one `shardRange(field, 'start', 'end')` per range,
    /// joined with ` || `; bounds are `0x` and 16 lowercase hex digits (17 for 2^64).
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// let shard = Shard::new(ShardKey::Namespace).range(0, 16).range(1 << 63, 1 << 64);
    /// assert_eq!(
    ///     shard.selector(),
    ///     "shardRange(object.metadata.namespace, '0x0000000000000000', '0x0000000000000010') || \
    ///      shardRange(object.metadata.namespace, '0x8000000000000000', '0x10000000000000000')"
    /// );
    /// ```
    pub fn selector(&self) -> String {
        let mut out = String::new();
        for (i, (start, end)) in self.ranges.iter().enumerate() {
            if i > 0 {
                out.push_str(" || ");
            }
            let _ = write!(
                out,
                "shardRange({}, '0x{start:016x}', '0x{end:016x}')",
                self.key.field()
            );
        }
        out
    }

    /// Whether an object whose key field hashes to `hash` belongs to this shard.
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// let low_half = Shard::new(ShardKey::Uid).range(0, 1 << 63);
    /// assert!(low_half.contains_hash(0));
    /// assert!(!low_half.contains_hash(1 << 63)); // ranges end before `end`
    /// ```
    pub fn contains_hash(&self, hash: u64) -> bool {
        let h = u128::from(hash);
        self.ranges
            .iter()
            .any(|&(start, end)| u128::from(start) <= h && h < end)
    }

    /// Whether an object with this uid and namespace belongs to this shard (a missing
    /// field hashes as the empty string).
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// let shard = Shard::even(ShardKey::Uid, 0, 2).unwrap();
    /// let uid = "0b5f3c1e-7d2a-4f7e-9d1b-2f0c3a4b5c6d";
    /// let hash = Shard::hash(uid.as_bytes());
    /// assert_eq!(shard.contains(Some(uid), Some("default")), shard.contains_hash(hash));
    /// // Of the two halves, exactly one keeps the object.
    /// let other = Shard::even(ShardKey::Uid, 1, 2).unwrap();
    /// assert_ne!(shard.contains(Some(uid), None), other.contains(Some(uid), None));
    /// ```
    pub fn contains(&self, uid: Option<&str>, namespace: Option<&str>) -> bool {
        let value = match self.key {
            ShardKey::Uid => uid,
            ShardKey::Namespace => namespace,
        };
        self.contains_hash(fnv1a64(value.unwrap_or("").as_bytes()))
    }

    /// Whether every hash of `other` is in this shard (same key): a store of this shard
    /// can become one of `other` by dropping objects, without a new list.
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// let half = Shard::even(ShardKey::Uid, 0, 2).unwrap();
    /// let quarter = Shard::even(ShardKey::Uid, 0, 4).unwrap();
    /// assert!(half.covers(&quarter)); // narrowing from a half to a quarter prunes, no relist
    /// assert!(!quarter.covers(&half));
    /// assert!(!half.covers(&Shard::even(ShardKey::Namespace, 0, 4).unwrap())); // other key
    /// ```
    pub fn covers(&self, other: &Shard) -> bool {
        self.key == other.key
            && other.ranges.iter().all(|&(start, end)| {
                // Ranges are sorted and disjoint: the covering range must hold all of it,
                // or a run of adjacent ranges must.
                let mut at = u128::from(start);
                for &(s, e) in &self.ranges {
                    if u128::from(s) <= at && at < e {
                        at = e;
                    }
                    if at >= end {
                        return true;
                    }
                }
                at >= end
            })
    }

    /// The hash a shard's ranges are over: 64-bit FNV-1a, which kube-apiserver's
    /// `shardRange` applies to the field's bytes. To cut ranges where the objects are
    /// (say, at the median hash of a set of namespaces).
    ///
    /// ```
    /// use kube_persist::{Shard, ShardKey};
    /// assert_eq!(Shard::hash(b""), 0xcbf2_9ce4_8422_2325); // the FNV-1a 64 offset basis
    /// assert_eq!(Shard::hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    /// // The first half of the namespaces' hashes, by the hash of "a".
    /// let below_a = Shard::new(ShardKey::Namespace).range(0, u128::from(Shard::hash(b"a")));
    /// assert!(!below_a.contains(None, Some("a")));
    /// ```
    pub fn hash(bytes: &[u8]) -> u64 {
        fnv1a64(bytes)
    }
}

/// 64-bit FNV-1a, the hash kube-apiserver's `shardRange` applies to the field's bytes
/// (public as [`Shard::hash`]).
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_reference_vectors() {
        // From the FNV reference (draft-eastlake-fnv): "" and "a" and "foobar".
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn selectors_ranges_and_coverage() {
        let full = Shard::new(ShardKey::Uid).range(0, FULL_END);
        assert_eq!(
            full.selector(),
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x10000000000000000')"
        );
        let halves: Vec<Shard> = (0..2)
            .map(|i| Shard::even(ShardKey::Uid, i, 2).unwrap())
            .collect();
        assert_eq!(halves[1].ranges(), &[(1 << 63, FULL_END)]);
        for h in [0u64, 1, (1 << 63) - 1, 1 << 63, u64::MAX] {
            let owners = halves.iter().filter(|s| s.contains_hash(h)).count();
            assert_eq!(owners, 1, "hash {h:#x} in exactly one half");
        }
        assert!(full.covers(&halves[0]) && full.covers(&halves[1]));
        assert!(!halves[0].covers(&full) && !halves[0].covers(&halves[1]));
        let quarter = Shard::even(ShardKey::Uid, 1, 4).unwrap();
        assert!(halves[0].covers(&quarter));
        // Adjacent ranges cover a range that spans them.
        let split = Shard::new(ShardKey::Uid)
            .range(0, 1 << 62)
            .range(1 << 62, 1 << 63);
        assert!(split.covers(&halves[0]));
        assert!(split.check().is_ok());
        assert!(
            !Shard::new(ShardKey::Namespace)
                .range(0, 1 << 63)
                .covers(&quarter)
        );
        let two = Shard::new(ShardKey::Namespace)
            .range(0, 16)
            .range(1 << 63, FULL_END);
        assert_eq!(
            two.selector(),
            "shardRange(object.metadata.namespace, '0x0000000000000000', '0x0000000000000010') || \
             shardRange(object.metadata.namespace, '0x8000000000000000', '0x10000000000000000')"
        );
        assert!(Shard::new(ShardKey::Uid).check().is_err());
        assert!(Shard::new(ShardKey::Uid).range(5, 5).check().is_err());
        assert!(
            Shard::new(ShardKey::Uid)
                .range(0, FULL_END + 1)
                .check()
                .is_err()
        );
        assert!(
            Shard::new(ShardKey::Uid)
                .range(0, 10)
                .range(5, 20)
                .check()
                .is_err()
        );
        assert!(Shard::even(ShardKey::Uid, 2, 2).is_err());
    }
}
