//! A stream's stored state, as the store layer keeps it: where it is in its list/watch cycle
//! (the checkpoint and a list's continue token, [`Phase`] in [`State`]), and what it caches
//! ([`Identity`]), which decides whether it resumes. Encoded by `disk::record`'s codec
//! under the `m` keys of `disk::keys`; the disk layer knows only the bytes.

use serde::{Deserialize, Serialize};

use crate::disk::record::READABLE_FORMATS;

/// Where the stream is in its list/watch cycle. Written in the same atomic batch
/// as the objects it covers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Phase {
    /// Nothing listed yet.
    Empty,
    /// A (re)list is writing pages. `continue_token` resumes it after a restart.
    Listing {
        continue_token: Option<String>,
        /// Whether objects from earlier epochs may remain and must be swept.
        sweep: bool,
    },
    /// The list of `resource_version` is complete; objects not seen in this epoch are being removed.
    Sweeping {
        resource_version: String,
        /// The last object key already swept (the sweep resumes after it).
        after: Option<Vec<u8>>,
    },
    /// The store equals the server at `resource_version`; watch from there.
    Synced { resource_version: String },
}

/// The stream's persistent state, one record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    pub(crate) phase: Phase,
    /// Current list epoch; bumped by every (re)list.
    pub(crate) epoch: u64,
    /// Number of stored objects.
    pub(crate) count: u64,
    /// The last resourceVersion at which the store was complete, if ever.
    pub(crate) last_synced: Option<String>,
}

impl Default for State {
    fn default() -> Self {
        State {
            phase: Phase::Empty,
            epoch: 0,
            count: 0,
            last_synced: None,
        }
    }
}

impl State {
    /// Which invariant of a stream's state `next` would break if a batch wrote it after
    /// `self`, if any. The writer asserts `None` for every batch (`debug_assert!`, on in
    /// the test command): a cheap check of values it already holds.
    ///
    /// - The epoch only grows, one list at a time, and a new epoch begins only with the
    ///   first batch of a new list (no continue token yet): the relist marks and object
    ///   records a batch writes carry its epoch, so they stay bound to the list that wrote
    ///   them.
    /// - The checkpoint readers see (`last_synced`) is never ahead of the data: it moves
    ///   only with the batch that makes the store synced at it (the end of a list, of a
    ///   sweep, or a watch burst), and a synced state's checkpoint is its phase's.
    pub(crate) fn violation(&self, next: &State) -> Option<&'static str> {
        if next.epoch < self.epoch {
            return Some("the epoch went back");
        }
        if next.epoch > self.epoch {
            if next.epoch != self.epoch + 1 {
                return Some("the epoch skipped a list");
            }
            if !matches!(
                next.phase,
                Phase::Listing {
                    continue_token: None,
                    ..
                }
            ) {
                return Some("a new epoch began without a new list");
            }
        }
        if let Phase::Synced { resource_version } = &next.phase
            && next.last_synced.as_ref() != Some(resource_version)
        {
            return Some("a synced state's checkpoint is not its phase's");
        }
        if next.last_synced != self.last_synced && !matches!(next.phase, Phase::Synced { .. }) {
            return Some("the checkpoint moved while the store was not synced at it");
        }
        None
    }
}

/// What a store caches. Opening a store with another identity does not resume it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Identity {
    pub(crate) format_version: u32,
    pub(crate) api_version: String,
    pub(crate) kind: String,
    /// The collection URL: group, version, plural and namespace scope.
    pub(crate) url: String,
    pub(crate) label_selector: Option<String>,
    pub(crate) field_selector: Option<String>,
    pub(crate) metadata_only: bool,
    /// Only keys, uids and resourceVersions are stored (no bodies).
    pub(crate) keys_only: bool,
    /// Name of the transform applied before writing, if any.
    pub(crate) transform: Option<String>,
    /// Fingerprint of the encryption key, for encrypted stores.
    pub(crate) encryption: Option<String>,
}

impl Identity {
    /// Whether a stream stored with this identity resumes as `current`: the same, or the
    /// same but unencrypted and written by an older format this version reads
    /// ([`READABLE_FORMATS`]; an encrypted stream of an older format is rebuilt).
    pub(crate) fn resumes_as(&self, current: &Identity) -> bool {
        self == current
            || (READABLE_FORMATS.contains(&self.format_version)
                && self.encryption.is_none()
                && Identity {
                    format_version: current.format_version,
                    ..self.clone()
                } == *current)
    }

    /// A short description of the first difference, for the log line that explains a reset.
    pub(crate) fn difference(&self, other: &Identity) -> String {
        let mut diffs = Vec::new();
        macro_rules! cmp {
            ($f:ident) => {
                if self.$f != other.$f {
                    diffs.push(format!(
                        "{}: {:?} -> {:?}",
                        stringify!($f),
                        self.$f,
                        other.$f
                    ));
                }
            };
        }
        cmp!(format_version);
        cmp!(api_version);
        cmp!(kind);
        cmp!(url);
        cmp!(label_selector);
        cmp!(field_selector);
        cmp!(metadata_only);
        cmp!(keys_only);
        cmp!(transform);
        cmp!(encryption);
        diffs.join(", ")
    }
}

/// Every decoder of the stream's own records (state, identity, an object's index entries)
/// on arbitrary bytes: for the fuzz targets (`fuzz/`).
#[cfg(any(fuzzing, test))]
pub(crate) fn fuzz_decode(bytes: &[u8]) {
    let _ = crate::disk::record::decode::<State>(bytes);
    let _ = crate::disk::record::decode::<Identity>(bytes);
    let _ = crate::disk::record::decode::<super::IndexEntries>(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synced(rv: &str, epoch: u64) -> State {
        State {
            phase: Phase::Synced {
                resource_version: rv.into(),
            },
            epoch,
            count: 1,
            last_synced: Some(rv.into()),
        }
    }

    fn listing(token: Option<&str>, epoch: u64, last_synced: Option<&str>) -> State {
        State {
            phase: Phase::Listing {
                continue_token: token.map(str::to_string),
                sweep: true,
            },
            epoch,
            count: 1,
            last_synced: last_synced.map(str::to_string),
        }
    }

    /// The writer's own transitions pass; each broken invariant is named.
    #[test]
    fn the_state_invariants_name_what_a_batch_broke() {
        let at5 = synced("5", 1);
        // Watch bursts, a relist begun, its pages, its end.
        assert_eq!(at5.violation(&synced("6", 1)), None);
        let begun = listing(None, 2, Some("5"));
        assert_eq!(at5.violation(&begun), None);
        let page = listing(Some("t"), 2, Some("5"));
        assert_eq!(begun.violation(&page), None);
        assert_eq!(page.violation(&synced("9", 2)), None);
        assert_eq!(State::default().violation(&listing(None, 1, None)), None);
        // What no batch may do.
        assert_eq!(
            synced("9", 2).violation(&synced("9", 1)),
            Some("the epoch went back")
        );
        assert_eq!(
            at5.violation(&listing(None, 3, Some("5"))),
            Some("the epoch skipped a list")
        );
        assert_eq!(
            at5.violation(&synced("6", 2)),
            Some("a new epoch began without a new list")
        );
        assert_eq!(
            at5.violation(&listing(Some("t"), 2, Some("5"))),
            Some("a new epoch began without a new list")
        );
        let mut torn = synced("6", 1);
        torn.last_synced = Some("5".into());
        assert_eq!(
            at5.violation(&torn),
            Some("a synced state's checkpoint is not its phase's")
        );
        assert_eq!(
            begun.violation(&listing(Some("t"), 2, Some("9"))),
            Some("the checkpoint moved while the store was not synced at it")
        );
    }
}
