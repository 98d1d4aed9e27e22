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
///     Err(kube_persist::Error::Locked { path, .. }) => assert_eq!(path, dir.path()),
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
    #[non_exhaustive]
    Locked {
        /// The store directory.
        path: PathBuf,
    },
    /// The store's files are damaged. Remove the directory to start over; the next start relists.
    #[error("store at {} is corrupt ({detail}); remove the directory to start over, the next start relists", path.display())]
    #[non_exhaustive]
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
    #[non_exhaustive]
    DiskFull {
        /// The store directory.
        path: PathBuf,
    },
    /// The store directory or its files cannot be read or written.
    #[error("cannot access the store at {}: {source}", path.display())]
    #[non_exhaustive]
    Io {
        /// The store directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The storage engine reported an unexpected failure.
    #[error("storage engine failure in the store at {}: {detail}", path.display())]
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
    Kube {
        /// Which kind of request failed: [`to_watcher_error`](crate::controller::to_watcher_error)
        /// classifies by it.
        request: RequestKind,
        /// What was being done (request, URL and resourceVersion), for people.
        context: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The API server answered with something that is not a valid list or watch response.
    #[error("malformed response for {context}: {detail}")]
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
    NotAStore {
        /// The directory.
        path: PathBuf,
        /// The entries in it that the store did not make, sorted (what is inside them is
        /// not read).
        found: Vec<PathBuf>,
    },
    /// An encrypted store was opened without its key, or with another key.
    #[error("cannot open the encrypted store at {}: {detail}", path.display())]
    #[non_exhaustive]
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
    #[non_exhaustive]
    EmptyKeyVariable {
        /// The variable's name.
        var: String,
    },
    /// The store directory was written by another storage engine than the one explicitly
    /// requested with [`DbConfig::engine`](crate::DbConfig::engine). (Without that choice a
    /// store is opened with the engine recorded in it.) Nothing in the store is touched.
    #[error("store at {} was written by the {stored} engine and cannot be opened with {requested}: open it without DbConfig::engine or with DbConfig::engine(Engine::{stored:?}), or remove it with Db::destroy to start over", path.display())]
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    #[non_exhaustive]
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
    /// An argument or setting is invalid, whatever the store holds: a `StreamConfig`
    /// combination out of range, an empty stream or controller name, a shard that is not a
    /// set of ranges, an index name, a selector that does not fit in a request, an object
    /// without the metadata a call needs. Fix the call: retrying does not help.
    #[non_exhaustive]
    #[error("invalid argument: {detail}")]
    InvalidArgument {
        /// What is invalid, naming the setting or argument.
        detail: String,
    },
    /// [`Engine`](crate::Engine)'s `FromStr` was given a name that is no engine.
    #[non_exhaustive]
    #[error("unknown storage engine {name:?} (sled or redb)")]
    UnknownEngine {
        /// The name given.
        name: String,
    },
    /// What was asked needs a cargo feature of kube-persist that this build leaves out
    /// (`sled` for a sled store, `encryption` for a key).
    #[non_exhaustive]
    #[error("{detail}: this build leaves out kube-persist's `{feature}` feature")]
    FeatureNotBuilt {
        /// The feature (`sled`, `encryption`).
        feature: &'static str,
        /// What needed it.
        detail: String,
    },
    /// There is no kube-persist store at the path: a read-only open of a directory that
    /// holds none, or [`Db::destroy`](crate::Db::destroy) of a directory that lacks its
    /// engine's files. Nothing was changed.
    #[non_exhaustive]
    #[error("no kube-persist store at {} ({detail})", path.display())]
    NoStore {
        /// The directory.
        path: PathBuf,
        /// What is missing.
        detail: String,
    },
    /// A write, or the open of a stream or a durable controller, through a store handle
    /// opened read-only (`DbConfig::read_only`). Use a writable handle.
    #[non_exhaustive]
    #[error("the store at {} is open read-only (DbConfig::read_only): {detail}", path.display())]
    ReadOnly {
        /// The store directory.
        path: PathBuf,
        /// What needed to write.
        detail: String,
    },
    /// The store cannot be opened read-only as it is (a sled store, which has no read-only
    /// mode, or a redb store not closed cleanly, which needs its recovery first): open it
    /// for writing once, with its controller stopped.
    #[non_exhaustive]
    #[error("the store at {} cannot be opened read-only: {detail}", path.display())]
    ReadOnlyUnavailable {
        /// The store directory.
        path: PathBuf,
        /// Why.
        detail: String,
    },
    /// An encryption key is not 64 hexadecimal characters, or the environment variable
    /// meant to hold one is unset or not UTF-8 (an empty one is
    /// [`Error::EmptyKeyVariable`]).
    #[non_exhaustive]
    #[error("invalid encryption key{}: {detail}", var.as_ref().map(|v| format!(" in environment variable {v}")).unwrap_or_default())]
    InvalidKey {
        /// The environment variable read, if the key came from one.
        var: Option<String>,
        /// What is wrong (never the key's text).
        detail: String,
    },
    /// The stream is already open in this process: its `Watcher` (or its shared watch)
    /// lives. One writer per stream: drop (or await the aborted task of) the other one.
    #[non_exhaustive]
    #[error("stream {stream:?} in the store at {} is already open in this process (one writer per stream; the owner of a task just aborted on a current-thread runtime is dropped once that task is awaited)", path.display())]
    StreamInUse {
        /// The store directory.
        path: PathBuf,
        /// The stream.
        stream: String,
    },
    /// The durable state of controller `controller` is already open in this process (the
    /// controller runs). One writer per controller state.
    #[non_exhaustive]
    #[error("the state of controller {controller:?} in the store at {} is already open in this process (one writer per controller)", path.display())]
    ControllerInUse {
        /// The store directory.
        path: PathBuf,
        /// The controller's name.
        controller: String,
    },
    /// A stream or controller state was closed, but its last writes were still queued on
    /// the store's disk thread when the open gave up waiting (60 s). Transient: retry.
    #[non_exhaustive]
    #[error("{name:?} in the store at {} was closed, but its last writes were still queued on the disk thread after {} s", path.display(), waited.as_secs())]
    StillClosing {
        /// The store directory.
        path: PathBuf,
        /// The stream, or `controller/<name>`.
        name: String,
        /// How long the open waited.
        waited: std::time::Duration,
    },
    /// There is no stream of that name in the store.
    #[non_exhaustive]
    #[error("no stream {stream:?} in the store at {}", path.display())]
    NoSuchStream {
        /// The store directory.
        path: PathBuf,
        /// The stream asked for.
        stream: String,
    },
    /// There is no stored reconcile state of that controller in the store.
    #[non_exhaustive]
    #[error("no controller state {controller:?} in the store at {}", path.display())]
    NoSuchController {
        /// The store directory.
        path: PathBuf,
        /// The controller asked for.
        controller: String,
    },
    /// A stream of a sensitive kind (Secrets, ...) would write whole objects, or their
    /// metadata, to disk: use `StreamConfig::drop_secret_data()`, `keys_only()`, or opt in
    /// with `allow_sensitive_data()`.
    #[non_exhaustive]
    #[error("{detail}")]
    SensitiveKind {
        /// The store directory.
        path: PathBuf,
        /// The stream.
        stream: String,
        /// The kind (`Secret`, or the kind `StreamConfig::sensitive` marked).
        kind: String,
        /// The full explanation, with the options.
        detail: String,
    },
    /// The API server refused the stream's shard (`shardSelector`): an invalid selector,
    /// or a server without sharded lists and watches. Terminal: the watcher stops.
    #[non_exhaustive]
    #[error("the API server refused the shard: {message}")]
    ShardRefused {
        /// The server's message.
        message: String,
    },
    /// A read on tokio's blocking pool was cancelled before it ran (the runtime is shutting
    /// down). Transient: a read retried on a running runtime succeeds.
    #[non_exhaustive]
    #[error("a read was cancelled: {detail}")]
    ReadCancelled {
        /// The runtime's message.
        detail: String,
    },
    /// An object was read from a keys-only stream (`StreamConfig::keys_only`), which
    /// stores no bodies: use its events, or its keys.
    #[non_exhaustive]
    #[error("stream {stream:?} in {} is keys-only: it stores no objects to read (use its events)", path.display())]
    KeysOnly {
        /// The store directory.
        path: PathBuf,
        /// The stream.
        stream: String,
    },
    /// A wait on a reader ended because the stream's `Watcher` was dropped before what was
    /// awaited happened (ready, a resourceVersion, a write).
    #[non_exhaustive]
    #[error("the watcher of stream {stream:?} in the store at {} was dropped before it got there", path.display())]
    WatcherDropped {
        /// The store directory.
        path: PathBuf,
        /// The stream.
        stream: String,
    },
    /// A lookup by index asked for an index the stream does not have, or has not built
    /// yet.
    #[non_exhaustive]
    #[error("index {index:?} is not configured on stream {stream:?} in {}, or is still being built", path.display())]
    IndexUnavailable {
        /// The store directory.
        path: PathBuf,
        /// The stream.
        stream: String,
        /// The index asked for.
        index: String,
    },
    /// A state kube-persist does not expect to reach: a bug, please report it.
    #[non_exhaustive]
    #[error("internal error (a kube-persist bug, please report it): {detail}")]
    Internal {
        /// What happened.
        detail: String,
    },
    /// An error of a shared watch, as each of its subscribers sees it (one error, shared by
    /// them; see `Watcher::shared`).
    #[error("{0}")]
    Shared(std::sync::Arc<Error>),
}

/// The kind of request to the Kubernetes API that failed, in [`Error::Kube`].
///
/// ```
/// use kube_persist::RequestKind;
/// assert_eq!(RequestKind::List.to_string(), "LIST");
/// assert_eq!(RequestKind::Watch.to_string(), "WATCH");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestKind {
    /// A LIST: an initial list, a relist, a continued page, a delta relist's fetch, the
    /// server's resourceVersion, a verification.
    List,
    /// A WATCH (connecting or streaming), including a watch-list (`sendInitialEvents`).
    Watch,
}

impl std::fmt::Display for RequestKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RequestKind::List => "LIST",
            RequestKind::Watch => "WATCH",
        })
    }
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

    /// Whether retrying later may succeed (network, server or disk-space trouble, a read
    /// cancelled while the runtime shut down, a stream whose previous writer is still
    /// closing), as opposed to a configuration or corruption problem that needs a human.
    ///
    /// ```
    /// use kube_persist::Error;
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path()).unwrap();
    /// // A store locked by another handle needs that handle closed, not a retry.
    /// let locked = kube_persist::Db::open(dir.path()).unwrap_err();
    /// assert!(matches!(locked, Error::Locked { .. }) && !locked.is_transient());
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
                    | Error::ReadCancelled { .. }
                    | Error::StillClosing { .. }
            ),
        }
    }

    /// Whether this error, met by a watcher, stops it for good (an invalid setting, a
    /// refused shard, a read-only store): retrying the same request cannot succeed.
    pub(crate) fn stops_watcher(&self) -> bool {
        matches!(
            self,
            Error::InvalidArgument { .. } | Error::ShardRefused { .. } | Error::ReadOnly { .. }
        )
    }
}
