//! The one error type users of kube-persist see.

use std::path::{Path, PathBuf};

/// Everything that can go wrong in kube-persist, with the context needed to act on it:
/// which store path, which object, which resourceVersion.
///
/// ```
/// # fn demo() -> Result<(), kube_persist::Error> {
/// let dir = tempfile::tempdir().unwrap();
/// let db = kube_persist::Db::open(dir.path())?;
/// // A second handle on the same directory is refused with a clear error naming the path.
/// match kube_persist::Db::open(dir.path()) {
///     Err(kube_persist::Error::Locked { path }) => assert_eq!(path, dir.path()),
///     other => panic!("expected Locked, got {other:?}"),
/// }
/// # drop(db); Ok(()) }
/// # demo().unwrap();
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another process (or another handle in this process) holds the store's lock.
    #[error("store at {} is locked by another process (one process at a time writes a store; others may only open a redb store read-only)", path.display())]
    Locked {
        /// The store directory.
        path: PathBuf,
    },
    /// The store's files are damaged. Remove the directory to start over; the next start relists.
    #[error("store at {} is corrupt ({detail}); remove the directory to start over, the next start relists", path.display())]
    Corrupt {
        /// The store directory.
        path: PathBuf,
        /// What was found to be damaged.
        detail: String,
    },
    /// The disk holding the store is full. The watcher retries with backoff, but both
    /// engines keep the failure until the store is reopened: once space returns, drop every
    /// handle of the directory and open it again (nothing is lost).
    #[error("disk full while writing the store at {}", path.display())]
    DiskFull {
        /// The store directory.
        path: PathBuf,
    },
    /// The store directory or its files cannot be read or written.
    #[error("cannot access the store at {}: {source}", path.display())]
    Io {
        /// The store directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The storage engine reported an unexpected failure.
    #[error("storage engine failure in the store at {}: {detail}", path.display())]
    Storage {
        /// The store directory.
        path: PathBuf,
        /// The engine's message.
        detail: String,
    },
    /// A stored object's JSON body no longer decodes into the requested type.
    /// The message names the error and its position, not the object's content (see
    /// `describe`); `source`, the JSON error itself, may quote it.
    #[error("stored object {key} in {} does not decode: {}", path.display(), super::json::describe(source))]
    Decode {
        /// The store directory.
        path: PathBuf,
        /// The object's key (`namespace/name`).
        key: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A request to the Kubernetes API failed.
    #[error("{context}: {source}")]
    Kube {
        /// What was being done (request and resourceVersion).
        context: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The API server answered with something that is not a valid list or watch response.
    #[error("malformed response for {context}: {detail}")]
    Protocol {
        /// Which request.
        context: String,
        /// What is wrong with the answer.
        detail: String,
    },
    /// The watch stream reported an error `Status` (other than `410 Gone`, which triggers a relist).
    #[error(
        "watch of {url} from resourceVersion {resource_version} failed: {code} {reason}: {message}"
    )]
    WatchStatus {
        /// The watched resource URL.
        url: String,
        /// The resourceVersion the watch started from.
        resource_version: String,
        /// HTTP-style status code.
        code: u16,
        /// Status reason.
        reason: String,
        /// Status message.
        message: String,
    },
    /// The store directory or its files are accessible by group or others, and
    /// `DbConfig::strict_permissions` is set.
    #[error("store at {} is readable by group or others ({} entries, e.g. {:?}); run chmod -R go-rwx on it", path.display(), open.len(), open.first())]
    Permissions {
        /// The store directory.
        path: PathBuf,
        /// The entries that are too open.
        open: Vec<PathBuf>,
    },
    /// The store path is a symbolic link and `DbConfig::strict_permissions` is set. Without
    /// it the link is resolved, with a warning, and the store is its target: the
    /// permissions are checked and tightened there.
    #[error("store path {} is a symbolic link to {}; with strict_permissions a store is opened by its real path: give {1} instead", path.display(), target.display())]
    SymlinkedStore {
        /// The path given.
        path: PathBuf,
        /// Where the link leads (resolved), as far as it could be read.
        target: PathBuf,
    },
    /// The store directory belongs to another user than the process's (effective) one, and
    /// `DbConfig::strict_permissions` is set; without it this is a warning. Another user
    /// who owns the directory can read the store, whatever its modes.
    #[error("store directory {} belongs to uid {owner}, not to this process's uid {user}; give the store a directory of its own (chown it, or a subdirectory this user creates)", path.display())]
    NotOwner {
        /// The store directory.
        path: PathBuf,
        /// Its owner's uid.
        owner: u32,
        /// The process's effective uid.
        user: u32,
    },
    /// The directory given to `Db::open` (in any form: `open_with`, read-only, the
    /// `kube-persist` tool) or to `Db::destroy` holds entries the store did not make: it is
    /// not a store directory, and nothing in it was created, changed or removed (no
    /// permission either). A store needs a directory of its own, new or empty, where it
    /// keeps its engine's files and nothing else; on a mounted volume, a subdirectory of the
    /// volume's root (which holds `lost+found` on ext4).
    #[error("{} is not a kube-persist store directory: it holds {}, which the store did not make; nothing in it was changed. Give the store a new or empty directory of its own (on a mounted volume, a subdirectory of its root)", path.display(), names(path, found))]
    NotAStore {
        /// The directory.
        path: PathBuf,
        /// The entries in it that the store did not make, sorted (what is inside them is
        /// not read).
        found: Vec<PathBuf>,
    },
    /// An encrypted store was opened without its key, or with another key.
    #[error("cannot open the encrypted store at {}: {detail}", path.display())]
    Encryption {
        /// The store directory.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// An environment variable meant to hold an encryption key is set, but empty or blank
    /// ([`EncryptionKey::from_env_optional`](crate::EncryptionKey::from_env_optional)). Most
    /// often the command meant to generate the key failed (`$(openssl rand -hex 32)` is
    /// empty then), and taking it as no key would write the store in clear. To run without
    /// encryption on purpose, leave the variable unset.
    #[error(
        "environment variable {var} is set but empty: it must hold an encryption key (64 hexadecimal characters), or be unset to run without encryption"
    )]
    EmptyKeyVariable {
        /// The variable's name.
        var: String,
    },
    /// The store directory was written by another storage engine than the one explicitly
    /// requested with [`DbConfig::engine`](crate::DbConfig::engine). (Without that choice a
    /// store is opened with the engine recorded in it.) Nothing in the store is touched.
    #[error("store at {} was written by the {stored} engine and cannot be opened with {requested}: open it without DbConfig::engine or with DbConfig::engine(Engine::{stored:?}), or remove it with Db::destroy to start over", path.display())]
    EngineMismatch {
        /// The store directory.
        path: PathBuf,
        /// The engine that wrote the store.
        stored: crate::model::Engine,
        /// The engine the caller asked for.
        requested: crate::model::Engine,
    },
    /// An object from the API server was not stored: it does not decode into the stream's
    /// type, exceeds `StreamConfig::max_object_bytes`, or the transform failed on it. Its previous
    /// version was removed from the store in the same batch (the store never serves a
    /// version older than its checkpoint as current); the stream goes on. Yielded by
    /// `Watcher::stream` and counted in `Stats::bad_objects`.
    #[error("object {key} (resourceVersion {resource_version:?}) was not stored in {}: {reason}; its previous version was removed", path.display())]
    ObjectRejected {
        /// The store directory.
        path: PathBuf,
        /// The object's `namespace/name`.
        key: String,
        /// The refused version.
        resource_version: String,
        /// Why it was refused.
        reason: String,
    },
    /// [`Db::verify`](crate::Db::verify) cannot compare this stream with the server (no
    /// such stream, not synced, or a collection URL it cannot list).
    #[error("cannot verify stream {stream:?}: {detail}")]
    NotVerifiable {
        /// The stream.
        stream: String,
        /// Why.
        detail: String,
    },
    /// Two resourceVersions were to be ordered but at least one is not of the form
    /// KEP-5504 makes comparable (a positive decimal integer without leading zeros); see
    /// [`resource_version::compare`](crate::resource_version::compare).
    #[error("resourceVersions {a:?} and {b:?} are not comparable (KEP-5504): {reason}")]
    IncomparableResourceVersions {
        /// The first resourceVersion.
        a: String,
        /// The second resourceVersion.
        b: String,
        /// Which one is not comparable, and why.
        reason: String,
    },
    /// A wait on the store ([`Reader::wait_for_resource_version`](crate::Reader::wait_for_resource_version))
    /// did not end in time.
    #[error("timed out after {} ms waiting for {what} in the store at {} (its checkpoint: {checkpoint:?})", waited.as_millis(), path.display())]
    Timeout {
        /// What was awaited (the object and its resourceVersion).
        what: String,
        /// The store.
        path: PathBuf,
        /// The store's checkpoint when the wait gave up.
        checkpoint: Option<String>,
        /// How long it waited.
        waited: std::time::Duration,
    },
    /// The store was opened with an invalid argument (e.g. an empty stream name).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An error of a shared watch, as each of its subscribers sees it (one error, shared by
    /// them; see `Watcher::shared`).
    #[error("{0}")]
    Shared(std::sync::Arc<Error>),
}

/// Convenience alias for results in this crate.
///
/// ```
/// fn cached_streams(path: &std::path::Path) -> kube_persist::Result<usize> {
///     Ok(kube_persist::Db::open(path)?.streams()?.len())
/// }
/// let dir = tempfile::tempdir().unwrap();
/// assert_eq!(cached_streams(dir.path()).unwrap(), 0);
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Up to five of `found`, relative to `dir`, quoted, for a message.
fn names(dir: &Path, found: &[PathBuf]) -> String {
    const SHOWN: usize = 5;
    let mut names: Vec<String> = found
        .iter()
        .take(SHOWN)
        .map(|p| format!("{:?}", p.strip_prefix(dir).unwrap_or(p)))
        .collect();
    if found.len() > SHOWN {
        names.push(format!("and {} more", found.len() - SHOWN));
    }
    names.join(", ")
}

impl Error {
    /// Map an I/O error to the most specific variant.
    pub(crate) fn from_io(path: PathBuf, io: std::io::Error) -> Self {
        const ENOSPC: i32 = 28;
        const EDQUOT: i32 = 122;
        let msg = io.to_string();
        if msg.contains("could not acquire lock") || io.kind() == std::io::ErrorKind::WouldBlock {
            Error::Locked { path }
        } else if io.kind() == std::io::ErrorKind::StorageFull
            || matches!(io.raw_os_error(), Some(ENOSPC) | Some(EDQUOT))
            || msg.contains("No space left on device")
        {
            Error::DiskFull { path }
        } else if io.kind() == std::io::ErrorKind::UnexpectedEof
            || io.kind() == std::io::ErrorKind::InvalidData
        {
            Error::Corrupt { path, detail: msg }
        } else {
            Error::Io { path, source: io }
        }
    }

    /// Whether retrying later may succeed (network, server or disk-space trouble),
    /// as opposed to a configuration or corruption problem that needs a human.
    ///
    /// ```
    /// use kube_persist::Error;
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path()).unwrap();
    /// // A store locked by another handle needs that handle closed, not a retry.
    /// let locked = kube_persist::Db::open(dir.path()).unwrap_err();
    /// assert!(matches!(locked, Error::Locked { .. }) && !locked.is_transient());
    /// let full = Error::DiskFull { path: dir.path().to_path_buf() };
    /// assert!(full.is_transient());
    /// # drop(db);
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Shared(e) => e.is_transient(),
            _ => matches!(
                self,
                Error::DiskFull { .. }
                    | Error::Kube { .. }
                    | Error::Protocol { .. }
                    | Error::WatchStatus { .. }
                    | Error::Io { .. }
            ),
        }
    }
}
