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
    /// same but written by an older format this version reads ([`READABLE_FORMATS`]).
    pub(crate) fn resumes_as(&self, current: &Identity) -> bool {
        self == current
            || (READABLE_FORMATS.contains(&self.format_version)
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
