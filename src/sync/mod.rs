//! The persistent watcher: lists and watches one collection and drives the store's writer.
//!
//! The sync layer: everything that speaks HTTP to the API server (the watcher's state
//! machine, the catch-up read, [`Db::verify`](crate::Db::verify) in `verify/`) and the
//! composition root that pairs a store with its machine ([`Db::store`]).
//!
//! May import: `model`, `exec`, `disk`, `store`.

mod backoff;
mod catch_up;
mod compat;
mod config;
mod conn;
mod indexers;
mod kube_events;
mod list_head;
mod machine;
mod naming;
mod pacing;
mod params;
mod parse;
mod raw;
mod shared;
mod touched;
mod verify;
mod watcher;

pub(crate) use verify::{verify, verify_at};

use kube::Resource;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use serde::de::DeserializeOwned;

pub use config::{RelistMode, StreamConfig, Transform};
use machine::{Driver, DriverParts};
pub use shared::{SharedEvent, SharedWatcher, Subscriber};
pub use touched::to_watcher_error;
pub use verify::{Difference, Verdict, Verification};
pub(crate) use watcher::Touched;
pub use watcher::{DeletedKey, Event, Pair, Watcher};

use crate::disk::record::FORMAT_VERSION;
use crate::model::Result;
use crate::store::Identity;
use crate::store::{Dir, Reader};

/// Open stream `name` of `api` in `dir`: the work of [`Db::store`](crate::Db::store) and
/// [`Db::store_with`](crate::Db::store_with). Blocking (opens the stream's keyspace).
pub(crate) fn open_store<K>(
    dir: &Dir,
    name: &str,
    api: Api<K>,
    config: StreamConfig,
    dyntype: &K::DynamicType,
) -> Result<(Reader<K>, Watcher<K>)>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    config.check()?;
    let url = api.resource_url().to_string();
    gate_sensitive(dir, name, &config, &Kind::of::<K>(dyntype, &url), false)?;
    let identity = identity::<K>(&url, &config, dyntype, false, dir.key_fingerprint());
    let keys_only = config
        .keys_only
        .then(|| (identity.api_version.clone(), identity.kind.clone()));
    let validate = indexers::inspector::<K>(config.validate, &config.indexes)?;
    let (reader, mut watcher) = open_pair(
        dir,
        Pairing {
            name,
            client: api.into_client(),
            url,
            config,
            identity,
            validate,
            metadata_only: false,
        },
    )?;
    match keys_only {
        Some(type_meta) => {
            watcher.configure_writer(|w| w.set_keys_only(Some(type_meta)));
            let reader = reader.keys_only();
            watcher.set_reader(reader.clone());
            Ok((reader, watcher))
        }
        None => Ok((reader, watcher)),
    }
}

/// Open the stream of `api` with `config` in `dir` under the name derived from what it
/// watches (`naming.rs`): the constructors shaped like kube-runtime's, which take no name.
/// Blocking, like [`open_store`].
pub(crate) fn open_derived<K>(
    dir: &Dir,
    api: Api<K>,
    config: StreamConfig,
    dyntype: &K::DynamicType,
) -> Result<(Reader<K>, Watcher<K>)>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    let name = naming::derived::<K>(api.resource_url(), dyntype, &config);
    tracing::debug!(stream = %name, url = %api.resource_url(), "stream named after what it watches");
    open_store(dir, &name, api, config, dyntype)
}

/// The work of [`Db::metadata_store`](crate::Db::metadata_store). Blocking.
pub(crate) fn open_metadata_store<K>(
    dir: &Dir,
    name: &str,
    api: Api<K>,
    config: StreamConfig,
) -> Result<Pair<PartialObjectMeta<K>>>
where
    K: Resource + Send + Sync + 'static,
    K::DynamicType: Default,
{
    config.check()?;
    let url = api.resource_url().to_string();
    let dyntype = K::DynamicType::default();
    gate_sensitive(dir, name, &config, &Kind::of::<K>(&dyntype, &url), true)?;
    let identity = identity::<K>(&url, &config, &dyntype, true, dir.key_fingerprint());
    let validate = indexers::inspector::<PartialObjectMeta<K>>(config.validate, &config.indexes)?;
    open_pair(
        dir,
        Pairing {
            name,
            client: api.into_client(),
            url,
            config,
            identity,
            validate,
            metadata_only: true,
        },
    )
}

/// What a stream watches, as the sensitive-kind gate reads it.
struct Kind {
    kind: String,
    group: String,
    /// The resource (plural), from the type and from the URL the requests go to.
    resources: [String; 2],
    /// Whether the URL is of the core group (`/api/...`).
    core_url: bool,
}

impl Kind {
    fn of<K: Resource>(dt: &K::DynamicType, url: &str) -> Kind {
        let path = url.split(['?', '#']).next().unwrap_or_default();
        let mut segments = path.trim_matches('/').split('/');
        let core_url = segments.next() == Some("api");
        Kind {
            kind: K::kind(dt).into_owned(),
            group: K::group(dt).into_owned(),
            resources: [
                K::plural(dt).into_owned(),
                path.rsplit('/').next().unwrap_or_default().to_string(),
            ],
            core_url,
        }
    }

    /// Whether this is a sensitive kind by default: core/v1 `secrets`, named by its kind
    /// (`Secret`), by its group and resource, or by the URL the requests go to.
    fn sensitive(&self) -> bool {
        self.kind == "Secret"
            || (self.group.is_empty() && self.resources[0] == "secrets")
            || (self.core_url && self.resources[1] == "secrets")
    }
}

/// Refuse a stream that would write a sensitive kind's values to disk (see
/// [`StreamConfig::sensitive`]): not keys-only, not dropping the data
/// ([`StreamConfig::drop_secret_data`]) and not opted in
/// ([`StreamConfig::allow_sensitive_data`]). A metadata-only stream too: it keeps
/// annotations, and `kubectl apply`'s last-applied annotation holds the whole object.
fn gate_sensitive(
    dir: &Dir,
    name: &str,
    config: &StreamConfig,
    kind: &Kind,
    metadata_only: bool,
) -> Result<()> {
    let sensitive = config.sensitive.unwrap_or_else(|| kind.sensitive());
    if !sensitive || config.allow_sensitive_data || config.drop_secret_data || config.keys_only {
        return Ok(());
    }
    let what = if metadata_only {
        "the metadata of"
    } else {
        "whole"
    };
    let detail = format!(
        "stream {name:?} would write {what} {} objects (sensitive: {}{}) to {}, where \
         kubectl's last-applied-configuration annotation can hold their data; use \
         StreamConfig::drop_secret_data() (drops data, stringData and that annotation), \
         keys_only(), or opt in with allow_sensitive_data()",
        kind.kind,
        if kind.group.is_empty() {
            "core"
        } else {
            &kind.group
        },
        format_args!("/{}", kind.resources[0]),
        dir.path().display()
    );
    Err(crate::model::Error::SensitiveKind {
        path: dir.path().to_path_buf(),
        stream: name.to_string(),
        kind: kind.kind.to_string(),
        detail,
    })
}

/// What pairs a store with its watcher, besides the directory.
struct Pairing<'a> {
    /// The stream's name (its keyspace).
    name: &'a str,
    client: kube::Client,
    /// The collection's URL.
    url: String,
    config: StreamConfig,
    /// What the store caches, which decides whether it resumes.
    identity: Identity,
    validate: Option<indexers::Inspector>,
    metadata_only: bool,
}

fn open_pair<K>(dir: &Dir, pairing: Pairing<'_>) -> Result<(Reader<K>, Watcher<K>)>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    let Pairing {
        name,
        client,
        url,
        config,
        identity,
        validate,
        metadata_only,
    } = pairing;
    let index_names = config.index_names();
    let parts = dir.open_stream_parts::<K>(
        name,
        &identity,
        config.get_shard(),
        config.hot_cache_bytes,
        &index_names,
    )?;
    let (reader, writer, stats, closer) = (parts.reader, parts.writer, parts.stats, parts.closer);
    let machine = Driver::new(DriverParts {
        client,
        stream: name.to_string(),
        url,
        metadata_only,
        cfg: config,
        validate,
        writer,
        worker: dir.worker(),
        stats: stats.clone(),
    });
    let watcher = Watcher::new(machine, closer, dir.clone(), reader.clone(), stats);
    Ok((reader, watcher))
}

fn identity<K: Resource>(
    url: &str,
    cfg: &StreamConfig,
    dt: &K::DynamicType,
    metadata_only: bool,
    encryption: Option<String>,
) -> Identity {
    Identity {
        format_version: FORMAT_VERSION,
        api_version: K::api_version(dt).into_owned(),
        kind: K::kind(dt).into_owned(),
        url: url.to_string(),
        label_selector: cfg.label_selector.clone(),
        field_selector: cfg.field_selector.clone(),
        metadata_only,
        keys_only: cfg.keys_only,
        transform: cfg.transform_name(),
        encryption,
    }
}
