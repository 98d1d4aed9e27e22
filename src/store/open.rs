//! Opening one stream's keyspace, in one place ([`stream`], [`stream_parts`], which
//! `Dir::open_stream_parts` runs): the lease, the identity check (a stream
//! stored with another identity is wiped, its reason logged), the stored state, the hot
//! cache reset, and the writer and reader that share them. A wiped store can never keep a
//! hot cache of its former objects: the cache is reset here, before either side exists.

use std::sync::Arc;

use super::stream_state::{Identity, Phase, State};
use super::writer::WriterParts;
use super::{Dir, Reader, StatusTx, Writer};
use crate::disk::record::{self, BOUND_FORMAT};
use crate::disk::{Backend, LeaseCloser, StreamLease, WriteBatch, keys};
use crate::model::{Counters, Error, Result, Shard};

/// A stream's keyspace as opened, with its stored state.
pub(crate) struct OpenStream {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) state: State,
    /// Why the store was wiped on open, if it was.
    pub(crate) reset: Option<String>,
    pub(crate) lease: StreamLease,
}

/// A stream's store side, opened: what the sync layer pairs with its state machine.
pub(crate) struct StreamParts<K> {
    pub(crate) reader: Reader<K>,
    pub(crate) writer: Writer,
    pub(crate) stats: Arc<Counters>,
    /// Releases the stream's lease when the last holder is dropped.
    pub(crate) closer: LeaseCloser,
}

/// Open stream `name` (identity check, wipe, hot cache reset) and build its writer and
/// reader. `index_names`: the indexes configured now; those already built on disk for
/// exactly these are usable at once. Blocking (reads the stored state).
pub(super) fn stream_parts<K>(
    dir: &Dir,
    name: &str,
    identity: &Identity,
    shard: Option<&Shard>,
    hot_cache_bytes: usize,
    index_names: &[String],
) -> Result<StreamParts<K>>
where
    K: kube::Resource + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let opened = stream(dir, name, identity, shard)?;
    let fetched_through = dir.read_meta::<String>(&*opened.backend, name, keys::FETCHED_KEY)?;
    let stats = Arc::new(Counters::default());
    if opened.reset.is_some() {
        Counters::add(&stats.identity_resets, 1);
    }
    let (tx, rx) = StatusTx::channel();
    let path = dir.path().to_path_buf();
    let cache = dir.hot_cache(name, hot_cache_bytes);
    // The stream's identity is checked: with a key, it is encrypted with this one.
    let cipher = dir.stream_cipher(&*opened.backend, name)?;
    let closer = opened.lease.closer();
    let mut writer = Writer::new(WriterParts {
        backend: opened.backend.clone(),
        path: path.clone(),
        stream: name.to_string(),
        state: opened.state,
        status: tx,
        stats: stats.clone(),
        cache: cache.clone(),
        cipher: cipher.clone(),
        lease: opened.lease,
    });
    let reader = Reader::new(opened.backend, path, name, rx, stats.clone(), cache, cipher);
    writer.set_fetched_through(fetched_through);
    // A narrowed shard still holding objects it no longer owns is not ready.
    writer.set_pruning(writer.prune_pending()?.is_some());
    writer.publish();
    writer.set_compress(dir.compression());
    let built = writer.built_indexes()?;
    if built == index_names {
        writer.set_built_indexes(&built)?;
    }
    Ok(StreamParts {
        reader,
        writer,
        stats,
        closer,
    })
}

/// Open the keyspace of stream `name`, checking its identity. A stream stored with a
/// different identity is wiped (and the reason logged): it must not be resumed.
pub(super) fn stream(
    dir: &Dir,
    name: &str,
    identity: &Identity,
    shard: Option<&Shard>,
) -> Result<OpenStream> {
    if name.is_empty() {
        return Err(Error::InvalidArgument {
            detail: "stream name must not be empty".into(),
        });
    }
    let lease = dir.lease(name, "stream")?;
    let path = &dir.inner.path;
    let backend = dir.inner.storage.keyspace(name)?;

    let stored_identity = dir.read_meta::<Identity>(&*backend, name, keys::IDENTITY_KEY)?;
    let stored_shard = dir.read_meta::<Shard>(&*backend, name, keys::SHARD_KEY)?;
    let stored_state = dir.read_meta::<State>(&*backend, name, keys::STATE_KEY)?;
    let stored = Stored {
        identity: stored_identity.as_ref(),
        shard: stored_shard.as_ref(),
        phase: stored_state.as_ref().map(|s| &s.phase),
    };
    let mut reset = None;
    let state = match plan(&stored, identity, shard) {
        OpenPlan::WrongKey { has_key } => {
            return Err(Error::Encryption {
                path: path.clone(),
                detail: if has_key {
                    format!("stream {name:?} was encrypted with another key")
                } else {
                    format!(
                        "stream {name:?} is encrypted; open the store with its key (DbConfig::encryption_key)"
                    )
                },
            });
        }
        OpenPlan::Resume {
            narrow,
            upgrade_format,
        } => {
            let mut b = WriteBatch::default();
            if let (true, Some(new)) = (narrow, shard) {
                tracing::info!(stream = name, path = %path.display(), shard = %new.selector(),
                    "shard narrowed: pruning the objects outside it, resuming without a paginated LIST");
                b.put(keys::SHARD_KEY.to_vec(), record::encode(new));
                b.put(keys::PRUNE_KEY.to_vec(), record::encode(&None::<Vec<u8>>));
            }
            if let (true, Some(old)) = (upgrade_format, &stored_identity) {
                // Its records stay readable; new ones are written in this format, which
                // older versions must not resume.
                tracing::info!(stream = name, path = %path.display(),
                    from = old.format_version, to = identity.format_version,
                    "store format upgraded in place");
                b.put(keys::IDENTITY_KEY.to_vec(), record::encode(identity));
            }
            if !b.is_empty() {
                backend.apply(b)?;
            }
            stored_state.unwrap_or_default()
        }
        plan @ (OpenPlan::New | OpenPlan::Wipe { .. }) => {
            if let OpenPlan::Wipe { why } = plan {
                tracing::warn!(stream = name, path = %path.display(), changed = %why,
                    "store identity changed: starting clean instead of resuming");
                reset = Some(why);
            }
            backend.clear()?;
            let state = State::default();
            let mut b = WriteBatch::default();
            b.put(keys::IDENTITY_KEY.to_vec(), record::encode(identity));
            // A new id for each clean start: what was sealed before it does not open.
            let id = rand::random::<[u8; 16]>().to_vec();
            b.put(keys::STREAM_ID_KEY.to_vec(), record::encode(&id));
            b.put(keys::STATE_KEY.to_vec(), record::encode(&state));
            if let Some(shard) = shard {
                b.put(keys::SHARD_KEY.to_vec(), record::encode(shard));
            }
            backend.apply(b)?;
            state
        }
    };
    Ok(OpenStream {
        backend,
        state,
        reset,
        lease,
    })
}

/// What a stream's keyspace holds when it is opened: the decision's inputs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stored<'a> {
    pub(crate) identity: Option<&'a Identity>,
    pub(crate) shard: Option<&'a Shard>,
    /// The stored phase (`None`: no state record).
    pub(crate) phase: Option<&'a Phase>,
}

/// What opening a stream does with what its keyspace holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OpenPlan {
    /// Nothing stored: start clean (nothing to report).
    New,
    /// Resume from the stored state. `narrow`: the shard is inside the stored one (or the
    /// stream was not sharded), so the objects outside it are pruned instead of listing
    /// again. `upgrade_format`: the stored format is older and readable; the identity is
    /// rewritten in this one.
    Resume { narrow: bool, upgrade_format: bool },
    /// The stored stream is another (or another shard of it, widened or moved, or
    /// narrowed during a list): wiped, and listed again; `why` says what changed.
    Wipe { why: String },
    /// The stored stream is encrypted with a key this store was not opened with
    /// (`has_key`: opened with another key, rather than with none). Nothing is touched.
    WrongKey { has_key: bool },
}

/// What opening a stream with `identity` and `shard` does with what is `stored`: the
/// whole decision, without I/O.
pub(crate) fn plan(stored: &Stored<'_>, identity: &Identity, shard: Option<&Shard>) -> OpenPlan {
    let Some(old) = stored.identity else {
        return OpenPlan::New;
    };
    if old.encryption.is_some() && old.encryption != identity.encryption {
        return OpenPlan::WrongKey {
            has_key: identity.encryption.is_some(),
        };
    }
    if !old.resumes_as(identity) {
        let mut why = old.difference(identity);
        if old.encryption.is_some() && old.format_version < BOUND_FORMAT {
            why.push_str(&format!(
                " (an encrypted stream of format {} is rebuilt: its records were not bound to \
                 their stream and its index values were stored in clear)",
                old.format_version
            ));
        }
        return OpenPlan::Wipe { why };
    }
    // A shard inside the stored one keeps the checkpoint.
    let narrow = match (stored.shard, shard) {
        (a, b) if a == b => false,
        (None, Some(_)) => true,
        (Some(old), Some(new)) if old.covers(new) => true,
        (old, new) => {
            return OpenPlan::Wipe {
                why: format!(
                    "shard: {:?} -> {:?}",
                    old.map(Shard::selector),
                    new.map(Shard::selector)
                ),
            };
        }
    };
    // A continue token belongs to the query that started the list: narrow only a store
    // that is complete.
    if narrow
        && stored
            .phase
            .is_some_and(|p| !matches!(p, Phase::Synced { .. }))
    {
        return OpenPlan::Wipe {
            why: "shard narrowed while a list was in progress".into(),
        };
    }
    OpenPlan::Resume {
        narrow,
        upgrade_format: old.format_version != identity.format_version,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::record::{Codec, FORMAT_VERSION, Record};
    use crate::disk::{Compression, DbConfig};
    use crate::model::{Engine, ShardKey};

    fn identity(format_version: u32) -> Identity {
        Identity {
            format_version,
            api_version: "v1".into(),
            kind: "Pod".into(),
            url: "/api/v1/pods".into(),
            label_selector: None,
            field_selector: None,
            metadata_only: false,
            keys_only: false,
            transform: None,
            encryption: None,
        }
    }

    /// The decision on opening, case by case: new, resumed (narrowed, upgraded), wiped (with
    /// what changed), refused (another key).
    #[test]
    fn the_open_plan_resumes_only_the_same_stream_and_a_narrower_complete_shard() {
        let id = identity(FORMAT_VERSION);
        let synced = Phase::Synced {
            resource_version: "7".into(),
        };
        let listing = Phase::Listing {
            continue_token: Some("c".into()),
            sweep: false,
        };
        let half = Shard::even(ShardKey::Uid, 0, 2).unwrap();
        let quarter = Shard::even(ShardKey::Uid, 0, 4).unwrap();
        let other_half = Shard::even(ShardKey::Uid, 1, 2).unwrap();
        let stored = |identity, shard, phase| Stored {
            identity,
            shard,
            phase,
        };
        assert_eq!(plan(&Stored::default(), &id, None), OpenPlan::New);
        let resume = |narrow, upgrade_format| OpenPlan::Resume {
            narrow,
            upgrade_format,
        };
        assert_eq!(
            plan(&stored(Some(&id), None, Some(&synced)), &id, None),
            resume(false, false)
        );
        // Format 5 resumes no older format: format 4 is listed again.
        let old = identity(FORMAT_VERSION - 1);
        let why = match plan(&stored(Some(&old), None, Some(&synced)), &id, None) {
            OpenPlan::Wipe { why } => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(why, format!("format_version: 4 -> {FORMAT_VERSION}"));
        // Narrower shards resume (and prune) when the store is complete.
        assert_eq!(
            plan(&stored(Some(&id), None, Some(&synced)), &id, Some(&half)),
            resume(true, false)
        );
        assert_eq!(
            plan(&stored(Some(&id), Some(&half), None), &id, Some(&quarter)),
            resume(true, false)
        );
        let wipe = |p: OpenPlan| match p {
            OpenPlan::Wipe { why } => why,
            other => panic!("{other:?}"),
        };
        assert!(
            wipe(plan(
                &stored(Some(&id), Some(&half), Some(&listing)),
                &id,
                Some(&quarter)
            ))
            .contains("while a list was in progress")
        );
        assert!(
            wipe(plan(
                &stored(Some(&id), Some(&half), Some(&synced)),
                &id,
                Some(&other_half)
            ))
            .starts_with("shard:")
        );
        assert!(
            !wipe(plan(
                &stored(Some(&id), Some(&half), Some(&synced)),
                &id,
                None
            ))
            .is_empty()
        );
        let mut pods_v2 = id.clone();
        pods_v2.label_selector = Some("app=web".into());
        assert!(
            !wipe(plan(
                &stored(Some(&id), None, Some(&synced)),
                &pods_v2,
                None
            ))
            .is_empty()
        );
        // An encrypted stream without its key is refused, whatever else changed.
        let mut sealed = id.clone();
        sealed.encryption = Some("k1".into());
        assert_eq!(
            plan(&stored(Some(&sealed), None, None), &pods_v2, None),
            OpenPlan::WrongKey { has_key: false }
        );
        let mut other_key = id.clone();
        other_key.encryption = Some("k2".into());
        assert_eq!(
            plan(&stored(Some(&sealed), None, None), &other_key, None),
            OpenPlan::WrongKey { has_key: true }
        );
        // Issue 60 item 4: an encrypted stream of a format before 4 (records sealed with the
        // store's key itself, index values in clear) is rebuilt, saying why, never resumed.
        let old_sealed: Vec<Identity> = [2, 3]
            .into_iter()
            .map(|format| Identity {
                encryption: Some("k1".into()),
                ..identity(format)
            })
            .collect();
        for old_sealed in &old_sealed {
            let format = old_sealed.format_version;
            let why = wipe(plan(
                &stored(Some(old_sealed), None, Some(&synced)),
                &sealed,
                None,
            ));
            assert!(
                why.contains(&format!("format_version: {format} -> {FORMAT_VERSION}"))
                    && why.contains("rebuilt"),
                "{why}"
            );
        }
        // One of format 4 (bound to its stream already) is listed again as any format 4
        // stream is, with no such reason.
        let four_sealed = Identity {
            encryption: Some("k1".into()),
            ..identity(4)
        };
        let why = wipe(plan(
            &stored(Some(&four_sealed), None, Some(&synced)),
            &sealed,
            None,
        ));
        assert_eq!(why, format!("format_version: 4 -> {FORMAT_VERSION}"));
    }

    /// A stream of an older format (2: zstd bodies, 3, 4: the formats of redb 4) is not
    /// resumed since format 5: it starts clean (a relist), its records removed.
    #[test]
    fn previous_format_stores_start_clean() {
        let json = br#"{"metadata":{"name":"a","namespace":"n","resourceVersion":"7"},"spec":{"x":"yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"}}"#;
        let key = keys::tagged(keys::OBJECT, &keys::object_suffix(Some("n"), "a"));
        let synced = State {
            phase: Phase::Synced {
                resource_version: "7".into(),
            },
            epoch: 1,
            count: 1,
            last_synced: Some("7".into()),
        };
        for engine in [Engine::Redb, Engine::Sled] {
            let dir = tempfile::tempdir().unwrap();
            let db = Dir::open(dir.path(), DbConfig::default().engine(engine)).unwrap();
            {
                // What format 2 wrote: its identity, state, and a zstd-compressed record.
                let s = stream(&db, "pods", &identity(2), None).unwrap();
                let rec = Record {
                    resource_version: "7".into(),
                    uid: "u".into(),
                    epoch: 1,
                    codec: Codec::Zstd as u8,
                    body: zstd::bulk::compress(json, 1).unwrap(),
                };
                let mut b = WriteBatch::default();
                b.put(key.clone(), record::encode(&rec));
                b.put(keys::STATE_KEY.to_vec(), record::encode(&synced));
                s.backend.apply(b).unwrap();
            }
            let s = stream(&db, "pods", &identity(FORMAT_VERSION), None).unwrap();
            assert!(
                s.reset
                    .as_deref()
                    .is_some_and(|r| r.contains("format_version: 2 -> ")),
                "{engine}: {:?}",
                s.reset
            );
            assert_eq!(s.state, State::default(), "{engine}: format 2 is relisted");
            assert_eq!(
                s.backend.get(&key).unwrap(),
                None,
                "{engine}: record removed"
            );
            let id = s.backend.get(keys::IDENTITY_KEY).unwrap().unwrap();
            assert_eq!(
                record::decode::<Identity>(&id).unwrap().format_version,
                FORMAT_VERSION,
                "{engine}: the identity now says the current format"
            );
            drop(s);

            // Formats 1, 3 and 4 neither: the stream starts clean (a relist).
            for format in [1, 3, 4] {
                let s = stream(&db, "old", &identity(format), None).unwrap();
                let mut b = WriteBatch::default();
                b.put(
                    key.clone(),
                    record::encode(&Record::sealed(record::Sealing {
                        key: &key,
                        resource_version: "7".into(),
                        uid: "u".into(),
                        epoch: 1,
                        plain: json,
                        packed: None,
                        cipher: None,
                        compress: Compression::Lz4,
                    })),
                );
                b.put(keys::STATE_KEY.to_vec(), record::encode(&synced));
                s.backend.apply(b).unwrap();
                drop(s);
                let s = stream(&db, "old", &identity(FORMAT_VERSION), None).unwrap();
                assert!(
                    s.reset
                        .as_deref()
                        .is_some_and(|r| r
                            .contains(&format!("format_version: {format} -> {FORMAT_VERSION}"))),
                    "{engine}: {:?}",
                    s.reset
                );
                assert_eq!(s.state, State::default(), "{engine}: relisted from scratch");
                assert_eq!(
                    s.backend.get(&key).unwrap(),
                    None,
                    "{engine}: old objects removed"
                );
            }
        }
    }
}
