//! Read-only access to a store without knowing its object types: what streams it holds,
//! and their objects as JSON (the work of `Dir::streams`, `raw_get`, `raw_objects`,
//! `stored_versions`). Used by the `kube-persist` command-line tool and verifications.

use std::sync::Arc;

use super::stream_state::{Identity, State};
use super::{Dir, SyncPhase};
use crate::disk::Backend;
use crate::disk::Cipher;
use crate::disk::keys::{self, FETCHED_KEY, IDENTITY_KEY, OBJECT, PRUNE_KEY, SHARD_KEY, STATE_KEY};
use crate::disk::record::{self, BOUND_FORMAT, FORMAT_VERSION, Record};
use crate::model::Shard;
use crate::model::{Error, Result};

/// What a stored stream caches and where it is in its list/watch cycle.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// # let client = server.client();
/// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
/// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
/// # tokio::spawn(watcher.run());
/// reader.wait_until_ready().await?;
/// let info: kube_persist::StreamInfo = db.streams()?.remove(0);
/// assert_eq!((info.name.as_str(), info.kind.as_str()), ("pods", "Pod"));
/// assert_eq!(info.phase, kube_persist::SyncPhase::Synced);
/// assert_eq!(info.objects, 2);
/// assert_eq!(info.checkpoint, reader.checkpoint());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamInfo {
    /// The stream's name.
    pub name: String,
    /// API version of the cached kind.
    pub api_version: String,
    /// The cached kind.
    pub kind: String,
    /// The collection URL (group, version, plural, namespace).
    pub url: String,
    /// Label selector, if any.
    pub label_selector: Option<String>,
    /// Field selector, if any.
    pub field_selector: Option<String>,
    /// Whether only metadata is stored.
    pub metadata_only: bool,
    /// Name of the transform applied before writing, if any.
    pub transform: Option<String>,
    /// Fingerprint of the encryption key, for encrypted streams.
    pub key_fingerprint: Option<String>,
    /// Where the stream is in its list/watch cycle.
    pub phase: SyncPhase,
    /// The resourceVersion at which the stream was last complete.
    pub checkpoint: Option<String>,
    /// Number of stored objects.
    pub objects: u64,
    /// The on-disk format version the stream was written with.
    pub format_version: u32,
    /// Whether only keys, uids and resourceVersions are stored (no bodies).
    pub keys_only: bool,
    /// The shard the stream keeps ([`StreamConfig::shard`](crate::StreamConfig::shard)), if sharded.
    pub shard: Option<Shard>,
    /// While a delta relist's fetch window is open ([`RelistMode`](crate::RelistMode)): the
    /// newest resourceVersion its fetches were answered at. Until the watch's checkpoint
    /// reaches it, a stored object may be newer than the checkpoint (never outside the
    /// selection), and one deleted between its metadata page and its fetch may be gone:
    /// the one bounded exception to "the store equals the server at its checkpoint".
    /// `None`: the store is exact at its checkpoint.
    pub fetched_through: Option<String>,
    /// Whether the objects outside a narrowed [`StreamInfo::shard`] are being pruned
    /// (`keys::PRUNE_KEY`): until the prune is done the store holds some outside it.
    pub(crate) pruning: bool,
}

/// A stream's keyspace and the cipher for its bodies.
type Readable = (Arc<dyn Backend>, Option<Arc<Cipher>>);

/// Objects of a stream as JSON, in key order; see [`Db::raw_objects`](crate::Db::raw_objects).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let server = kube_persist_testkit::TestServer::with_web_pods().await;
/// # let dir = tempfile::tempdir()?;
/// # let db = kube_persist::Db::open(dir.path())?;
/// # let client = server.client();
/// # let api = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client);
/// # let (reader, watcher) = db.store("pods", api, kube_persist::StreamConfig::default())?;
/// # tokio::spawn(watcher.run());
/// reader.wait_until_ready().await?;
/// let objects: kube_persist::RawObjects = db.raw_objects("pods")?;
/// let keys: Vec<String> = objects.map(|o| o.map(|(key, _json)| key)).collect::<Result<_, _>>()?;
/// assert_eq!(keys, ["default/web-0", "default/web-1"]);
/// # Ok(()) }
/// ```
pub type RawObjects = Box<dyn Iterator<Item = Result<(String, Vec<u8>)>> + Send>;

/// The work of [`Db::streams`](crate::Db::streams).
pub(super) fn streams(dir: &Dir) -> Result<Vec<StreamInfo>> {
    let mut out = Vec::new();
    let mut names = dir.inner.storage.keyspaces()?;
    names.sort();
    for name in &names {
        let backend = dir.inner.storage.keyspace(name)?;
        let Some(identity) = dir.read_meta::<Identity>(&*backend, name, IDENTITY_KEY)? else {
            continue;
        };
        let state = dir
            .read_meta::<State>(&*backend, name, STATE_KEY)?
            .unwrap_or_default();
        let shard = dir.read_meta::<Shard>(&*backend, name, SHARD_KEY)?;
        let fetched_through = dir.read_meta::<String>(&*backend, name, FETCHED_KEY)?;
        let pruning = backend.get(PRUNE_KEY)?.is_some();
        out.push(StreamInfo {
            name: name.to_string(),
            api_version: identity.api_version,
            kind: identity.kind,
            url: identity.url,
            label_selector: identity.label_selector,
            field_selector: identity.field_selector,
            metadata_only: identity.metadata_only,
            transform: identity.transform,
            key_fingerprint: identity.encryption,
            phase: (&state.phase).into(),
            checkpoint: state.last_synced,
            objects: state.count,
            format_version: identity.format_version,
            keys_only: identity.keys_only,
            shard,
            fetched_through,
            pruning,
        });
    }
    Ok(out)
}

/// The work of [`Db::stream_disk_bytes`](crate::Db::stream_disk_bytes).
pub(super) fn stream_disk_bytes(dir: &Dir, stream: &str) -> Result<u64> {
    stream_keyspace(dir, stream)?.disk_bytes()
}

/// The work of [`Db::raw_get`](crate::Db::raw_get).
pub(super) fn raw_get(
    dir: &Dir,
    stream: &str,
    namespace: Option<&str>,
    name: &str,
) -> Result<Option<Vec<u8>>> {
    let (backend, cipher) = readable(dir, stream)?;
    let key = keys::tagged(OBJECT, &keys::object_suffix(namespace, name));
    match backend.get(&key)? {
        Some(v) => open_record(dir, stream, &key, &v, cipher.as_deref()).map(Some),
        None => Ok(None),
    }
}

/// The work of [`Db::raw_objects`](crate::Db::raw_objects).
/// With `after` (a key as this iterator gives it), the work of
/// [`Db::raw_objects_after`](crate::Db::raw_objects_after).
pub(super) fn raw_objects(dir: &Dir, stream: &str, after: Option<&str>) -> Result<RawObjects> {
    let (backend, cipher) = readable(dir, stream)?;
    let (mut start, end) = keys::range(OBJECT, None);
    if let Some(after) = after {
        let (ns, name) = match after.split_once('/') {
            Some((ns, name)) => (Some(ns), name),
            None => (None, after),
        };
        // The first key after `after`'s own.
        start = keys::tagged(OBJECT, &keys::object_suffix(ns, name));
        start.push(0);
    }
    let (db, stream) = (dir.clone(), stream.to_string());
    Ok(Box::new(backend.range(&start, &end).map(move |entry| {
        let (k, v) = entry?;
        let body = open_record(&db, &stream, &k, &v, cipher.as_deref())?;
        Ok((keys::display(&k[1..]), body))
    })))
}

fn stream_keyspace(dir: &Dir, stream: &str) -> Result<Arc<dyn Backend>> {
    let path = &dir.inner.path;
    if !dir.inner.storage.keyspaces()?.iter().any(|n| n == stream) {
        return Err(Error::NoSuchStream {
            path: path.clone(),
            stream: stream.to_string(),
        });
    }
    dir.inner.storage.keyspace(stream)
}

/// The resourceVersions of stream `stream`'s stored objects, read without their bodies
/// (what a verification compares with a LIST). [`Error::NoSuchStream`] if there is no such
/// stream.
pub(super) fn stored_versions(dir: &Dir, stream: &str) -> Result<StoredVersions> {
    Ok(StoredVersions {
        backend: stream_keyspace(dir, stream)?,
        path: dir.inner.path.clone(),
        stream: stream.to_string(),
    })
}

/// The stream's keyspace and cipher, refusing an encrypted stream without its key.
fn readable(dir: &Dir, stream: &str) -> Result<Readable> {
    let backend = stream_keyspace(dir, stream)?;
    let identity = dir.read_meta::<Identity>(&*backend, stream, IDENTITY_KEY)?;
    let identity_format = identity.as_ref().map(|i| i.format_version);
    let stored = identity.and_then(|i| i.encryption);
    if stored.is_some() && stored != dir.key_fingerprint() {
        return Err(Error::Encryption {
            path: dir.inner.path.clone(),
            detail: format!(
                "stream {stream:?} is encrypted (key {}); give its key to read objects",
                stored.unwrap_or_default()
            ),
        });
    }
    let cipher = match identity_format {
        _ if stored.is_none() => None,
        Some(format) if !(BOUND_FORMAT..=FORMAT_VERSION).contains(&format) => {
            return Err(Error::Encryption {
                path: dir.inner.path.clone(),
                detail: format!(
                    "stream {stream:?} is encrypted in format {format}, which this version does \
                     not read (its records are not bound to their stream): open it as a \
                     stream to rebuild it, or drop it"
                ),
            });
        }
        _ => dir.stream_cipher(&*backend, stream)?,
    };
    Ok((backend, cipher))
}

fn open_record(
    dir: &Dir,
    stream: &str,
    key: &[u8],
    value: &[u8],
    cipher: Option<&Cipher>,
) -> Result<Vec<u8>> {
    let corrupt = |detail: String| record::corrupt(&dir.inner.path, stream, key, detail);
    let rec: Record = record::decode(value).map_err(corrupt)?;
    rec.open(key, cipher).map_err(corrupt)
}

/// The resourceVersions of one stream's stored objects, by key suffix (`namespace \0 name`,
/// [`keys::object_suffix`]), read from their records' heads: bodies are neither decoded nor
/// decrypted. Blocking reads.
pub(crate) struct StoredVersions {
    backend: Arc<dyn Backend>,
    path: std::path::PathBuf,
    stream: String,
}

impl StoredVersions {
    /// The stored version of each object of `suffixes`, `None` for one not stored.
    pub(crate) fn get(&self, suffixes: &[&[u8]]) -> Result<Vec<Option<String>>> {
        let keys: Vec<Vec<u8>> = suffixes.iter().map(|s| keys::tagged(OBJECT, s)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut stored = vec![None; keys.len()];
        self.backend.get_each(&refs, &mut |i, value| {
            stored[i] = Some(self.head_version(&keys[i], value)?);
            Ok(())
        })?;
        Ok(stored)
    }

    /// Every stored object, in key order: `f(suffix, version, uid)`.
    pub(crate) fn each(&self, mut f: impl FnMut(&[u8], String, &str)) -> Result<()> {
        let (start, end) = keys::range(OBJECT, None);
        for entry in self.backend.range(&start, &end) {
            let (key, value) = entry?;
            let head = record::decode_ref(&value)
                .map_err(|d| record::corrupt(&self.path, &self.stream, &key, d))?;
            f(&key[1..], head.resource_version.to_string(), head.uid);
        }
        Ok(())
    }

    /// The resourceVersion of a stored record, without opening its body.
    fn head_version(&self, key: &[u8], value: &[u8]) -> Result<String> {
        record::decode_ref(value)
            .map(|r| r.resource_version.to_string())
            .map_err(|detail| record::corrupt(&self.path, &self.stream, key, detail))
    }
}
