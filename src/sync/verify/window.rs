//! The window of a delta relist, as a verification sees it: the bounded exception of
//! DESIGN.md's invariant 1. A delta relist lists metadata at a resourceVersion (which
//! becomes the checkpoint) and then fetches the bodies of the new or changed objects one by
//! one, so until its watch has replayed past those bodies a stored object may be newer than
//! the checkpoint, and an object deleted between the list and its fetch may already be gone.
//! The store marks that window (`keys::FETCHED_KEY`, read into `StreamInfo::fetched_through`);
//! only while it is open does a verification allow those two differences from the list at
//! the checkpoint, and only as far as the server's current list bears them out:
//!
//! - a stored object newer than the checkpoint (so newer than the server's object there),
//!   and not newer than the server's current one (or than the current list, when the server
//!   has deleted it since): a body the relist fetched;
//! - an object the server had at the checkpoint that is not stored, and that the server no
//!   longer has, or has with another uid (deleted, perhaps created again): an object whose
//!   fetch found it gone.
//!
//! Anything else (a stored object older than the server's at the checkpoint, one the
//! server did not have there, one newer than the server's current one, or a missing one the
//! server still has with the same uid) is a difference. resourceVersions are ordered only
//! through [`resource_version`](crate::model::resource_version): where they are not
//! comparable (KEP-5504) nothing is explained.
//!
//! What the current list says is taken from the comparison with it, made first: every
//! difference of the store from the current list is kept by key digest (a store that
//! differs from the current list in no other object has it there at the stored version).
//! That costs memory per difference, only while the window is open.

use std::cmp::Ordering;
use std::collections::HashMap;

use super::Difference;
use crate::model::resource_version;

/// The current list's view of an object that differs from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Now {
    /// The current list has it, at `version`, with `uid`.
    Listed {
        version: String,
        uid: Option<String>,
    },
    /// The current list does not have it (the store does).
    Absent,
}

impl Now {
    /// What a difference from the current list says of the server's object (`uid`: the
    /// listed object's).
    pub(super) fn of(difference: &Difference, uid: Option<&str>) -> Now {
        match difference {
            Difference::Missing { server, .. } | Difference::Version { server, .. } => {
                Now::Listed {
                    version: server.clone(),
                    uid: uid.map(str::to_string),
                }
            }
            Difference::Extra { .. } => Now::Absent,
        }
    }
}

/// What the comparison of a store in a delta relist's window with the list at its
/// checkpoint checks that list's differences against.
#[derive(Debug)]
pub(super) struct Window {
    /// The store's checkpoint (the relist's list).
    checkpoint: String,
    /// The resourceVersion of the current list.
    now_rv: String,
    /// Every difference of the store from the current list, by key digest.
    now: HashMap<u128, Now>,
}

impl Window {
    pub(super) fn new(checkpoint: String, now_rv: String, now: HashMap<u128, Now>) -> Window {
        Window {
            checkpoint,
            now_rv,
            now,
        }
    }

    /// Whether the window explains `difference` from the list at the checkpoint, of the
    /// object with key digest `key` (`uid`: the listed object's, at the checkpoint).
    pub(super) fn explains(&self, key: u128, uid: Option<&str>, difference: &Difference) -> bool {
        match difference {
            Difference::Version { stored, .. } => self.fetched_newer(key, stored),
            Difference::Missing { .. } => self.gone_before_fetch(key, uid),
            Difference::Extra { .. } => false,
        }
    }

    /// A stored version that a fetch after the checkpoint explains: newer than the
    /// checkpoint, and not newer than the server's current object (or, when the server no
    /// longer has it, than the current list).
    fn fetched_newer(&self, key: u128, stored: &str) -> bool {
        if !newer(stored, &self.checkpoint) {
            return false;
        }
        let ceiling = match self.now.get(&key) {
            // Not a difference from the current list: listed now at the stored version.
            None => return true,
            Some(Now::Listed { version, .. }) => version,
            Some(Now::Absent) => &self.now_rv,
        };
        resource_version::compare(stored, ceiling).is_ok_and(|o| o != Ordering::Greater)
    }

    /// An object not stored that a fetch answered empty explains: the server no longer has
    /// it, or has another object (another uid) under its name.
    fn gone_before_fetch(&self, key: u128, uid: Option<&str>) -> bool {
        match self.now.get(&key) {
            // Not a difference from the current list, and not stored: not listed now.
            None => true,
            Some(Now::Listed { uid: now, .. }) => uid.is_some() && now.as_deref() != uid,
            Some(Now::Absent) => false,
        }
    }
}

/// Whether `a` is newer than `b`; `false` when they are not comparable.
fn newer(a: &str, b: &str) -> bool {
    resource_version::compare(a, b).is_ok_and(|o| o == Ordering::Greater)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u128 = 1;

    fn window(now: Option<Now>) -> Window {
        Window::new(
            "100".into(),
            "200".into(),
            now.into_iter().map(|n| (A, n)).collect(),
        )
    }

    fn listed(version: &str, uid: &str) -> Option<Now> {
        Some(Now::Listed {
            version: version.into(),
            uid: Some(uid.into()),
        })
    }

    fn version(stored: &str) -> Difference {
        Difference::Version {
            key: "ns/a".into(),
            stored: stored.into(),
            server: "90".into(),
        }
    }

    fn missing() -> Difference {
        Difference::Missing {
            key: "ns/a".into(),
            server: "90".into(),
        }
    }

    #[test]
    fn a_stored_object_newer_than_the_checkpoint_is_explained_up_to_the_servers_current_one() {
        // Listed now at the stored version (no difference from the current list).
        assert!(window(None).explains(A, Some("u"), &version("150")));
        // The server has changed it again since: up to its current version.
        assert!(window(listed("180", "u")).explains(A, Some("u"), &version("150")));
        assert!(window(listed("150", "u")).explains(A, Some("u"), &version("150")));
        assert!(!window(listed("140", "u")).explains(A, Some("u"), &version("150")));
        // Deleted since: up to the current list.
        assert!(window(Some(Now::Absent)).explains(A, Some("u"), &version("150")));
        assert!(!window(Some(Now::Absent)).explains(A, Some("u"), &version("250")));
        // At or older than the checkpoint: never (a relist at the checkpoint listed it
        // newer, or the store is wrong).
        assert!(!window(None).explains(A, Some("u"), &version("100")));
        assert!(!window(None).explains(A, Some("u"), &version("80")));
        // Versions that are not comparable explain nothing.
        assert!(!window(None).explains(A, Some("u"), &version("opaque")));
        assert!(!window(listed("x180", "u")).explains(A, Some("u"), &version("150")));
        let opaque = Window::new("cp".into(), "now".into(), HashMap::new());
        assert!(!opaque.explains(A, Some("u"), &version("150")));
    }

    #[test]
    fn a_missing_object_is_explained_only_if_the_server_no_longer_has_it() {
        // Not listed now (no difference from the current list, and not stored).
        assert!(window(None).explains(A, Some("u"), &missing()));
        // Created again: another uid.
        assert!(window(listed("180", "v")).explains(A, Some("u"), &missing()));
        // The same object still on the server: its fetch would have found it.
        assert!(!window(listed("180", "u")).explains(A, Some("u"), &missing()));
        // No uid at the checkpoint: the replacement cannot be told.
        assert!(!window(listed("180", "v")).explains(A, None, &missing()));
    }

    #[test]
    fn an_extra_object_is_never_explained() {
        let extra = Difference::Extra {
            key: "ns/a".into(),
            stored: "150".into(),
        };
        assert!(!window(None).explains(A, None, &extra));
        assert!(!window(Some(Now::Absent)).explains(A, None, &extra));
    }

    #[test]
    fn differences_from_the_current_list_say_what_the_server_has() {
        assert_eq!(
            Now::of(&version("150"), Some("u")),
            Now::Listed {
                version: "90".into(),
                uid: Some("u".into())
            }
        );
        assert_eq!(
            Now::of(&missing(), None),
            Now::Listed {
                version: "90".into(),
                uid: None
            }
        );
        let extra = Difference::Extra {
            key: "ns/a".into(),
            stored: "150".into(),
        };
        assert_eq!(Now::of(&extra, None), Now::Absent);
    }
}
