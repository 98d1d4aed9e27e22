//! Data at rest: directory and file permissions (and the refusal of a directory that is not
//! a store's), the Secret opt-in, and encryption of stored objects (round trip, missing
//! key, wrong key, a modified record on disk, a record copied from another stream or store,
//! index values kept off disk).

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::common::*;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube_persist::{Compression, Db, DbConfig, EncryptionKey, Error, Reader, StreamConfig};
use kube_persist_testkit::ResourceType;

fn assert_private(dir: &Path) {
    for (p, mode) in modes_below(dir) {
        let want = if p.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode, want, "{} has mode {mode:o}", p.display());
    }
}

async fn store_is_private_whatever_the_umask(engine: Engine) {
    let fx = Fixture::with_pods(50, 1).await;
    // A permissive umask (0o000) and a restrictive one (0o077).
    for mask in [0o000, 0o077] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cache");
        // SAFETY: umask only changes the process's file-creation mask.
        let old = unsafe { libc::umask(mask) };
        {
            let db = try_open_db(engine, &dir).unwrap();
            sync_pods(&fx.server, &db).await;
            db.flush().unwrap();
        }
        assert_private(&dir);
        // The store reopens and resumes under the same umask.
        let db = try_open_db(engine, &dir).unwrap();
        let (reader, _w) = db
            .store("pods", fx.pods(), StreamConfig::default())
            .unwrap();
        assert_eq!(reader.len(), 50, "umask {mask:o}");
        unsafe { libc::umask(old) };
    }
}

async fn world_readable_store_is_tightened_or_refused(engine: Engine) {
    let fx = Fixture::with_pods(50, 1).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    {
        let db = try_open_db(engine, &dir).unwrap();
        sync_pods(&fx.server, &db).await;
    }
    for p in modes_below(&dir).into_keys() {
        let mode = if p.is_dir() { 0o755 } else { 0o644 };
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    match Db::open_with(
        &dir,
        DbConfig::default().engine(engine).strict_permissions(true),
    ) {
        Err(Error::Permissions { path, open }) => {
            assert_eq!(path, dir);
            assert!(!open.is_empty());
        }
        other => panic!("expected a permissions error, got {other:?}"),
    }
    let db = try_open_db(engine, &dir).unwrap();
    assert_private(&dir);
    drop(db);
}

async fn secrets_need_an_explicit_opt_in(engine: Engine) {
    let fx = Fixture::new().await;
    let h = &fx.h;
    let secrets = ResourceType::new("", "v1", "secrets", "Secret", true);
    h.register(&secrets);
    for i in 0..20 {
        h.apply(
            &secrets,
            serde_json::json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": format!("s-{i}"), "namespace": "default"},
                "data": {"password": "aHVudGVyMg=="}
            }),
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let db = try_open_db(engine, tmp.path()).unwrap();
    let err = db
        .store(
            "secrets",
            Api::<Secret>::all(fx.server.client()),
            StreamConfig::default(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("allow_sensitive_data"), "{err}");
    // Metadata-only needs no opt-in: no data is stored.
    let (meta, watcher) = db
        .metadata_store(
            "secret-meta",
            Api::<Secret>::all(fx.server.client()),
            StreamConfig::default(),
        )
        .unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    assert_eq!(meta.len(), 20);
    // With the opt-in, whole Secrets are stored.
    let (reader, watcher) = db
        .store(
            "secrets",
            Api::<Secret>::all(fx.server.client()),
            StreamConfig::default().allow_sensitive_data(),
        )
        .unwrap();
    let mut w2 = drive(watcher);
    w2.until(|e| *e == Ev::InitDone).await;
    assert_matches(&reader, h, &secrets);
    // Any kind can be marked sensitive.
    let err = db
        .store("pods", fx.pods(), StreamConfig::default().sensitive(true))
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
}

fn key(b: u8) -> EncryptionKey {
    EncryptionKey::from_bytes([b; 32])
}

/// Bytes of every file under `dir` contain `needle`?
fn on_disk(dir: &Path, needle: &[u8]) -> bool {
    modes_below(dir).into_keys().any(|p| {
        p.is_file()
            && std::fs::read(&p)
                .unwrap()
                .windows(needle.len())
                .any(|w| w == needle)
    })
}

async fn encrypted_store_round_trip_and_wrong_or_missing_key(engine: Engine) {
    let fx = Fixture::with_pods(300, 2).await;
    let h = &fx.h;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let open = |k: Option<EncryptionKey>| {
        let cfg = match k {
            // Uncompressed, so that only encryption can hide the bodies.
            Some(k) => DbConfig::default()
                .engine(engine)
                .compression(false)
                .encryption_key(k),
            None => DbConfig::default().engine(engine).compression(false),
        };
        Db::open_with(&dir, cfg).unwrap()
    };
    {
        let db = open(Some(key(1)));
        let (reader, w) = fx.synced_pods(&db, StreamConfig::default()).await;
        assert_matches(&reader, h, &ResourceType::pods());
        w.stop().await;
        db.flush().unwrap();
    }
    // Object bodies are not on disk in clear (a plain store would show them).
    assert!(
        !on_disk(&dir, b"imagePullPolicy"),
        "plaintext body found on disk"
    );

    for (k, what) in [(None, "missing key"), (Some(key(2)), "wrong key")] {
        let db = open(k);
        match db.store("pods", fx.pods(), StreamConfig::default()) {
            Err(Error::Encryption { path, .. }) => assert_eq!(path, dir, "{what}"),
            Err(e) => panic!("{what}: expected an encryption error, got {e}"),
            Ok(_) => panic!("{what}: opened an encrypted store"),
        }
    }
    // The right key resumes without a LIST.
    h.reset_counts();
    let db = open(Some(key(1)));
    let (reader, mut w) = fx.watch_pods(&db, StreamConfig::default());
    assert!(matches!(w.until(|_| true).await[0], Ev::Resumed(_)));
    assert_matches(&reader, h, &ResourceType::pods());
    assert_eq!(h.counts().list, 0);

    let plain_dir = tmp.path().join("plain");
    let plain = Db::open_with(
        &plain_dir,
        DbConfig::default().engine(engine).compression(false),
    )
    .unwrap();
    sync_pods(&fx.server, &plain).await;
    plain.flush().unwrap();
    assert!(
        on_disk(&plain_dir, b"imagePullPolicy"),
        "the check above can see plaintext"
    );
}

async fn modified_encrypted_record_is_a_corruption_error(engine: Engine) {
    let fx = Fixture::with_pods(20, 1).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    {
        let db = Db::open_with(
            &dir,
            DbConfig::default().engine(engine).encryption_key(key(1)),
        )
        .unwrap();
        sync_pods(&fx.server, &db).await;
        db.flush().unwrap();
    }
    // Flip one byte of one stored record, through the engine itself.
    raw_edit(engine, &dir, "stream/pods", b"ons-0\0pod-3", |v| {
        let mut v = v.expect("record present");
        let last = v.len() - 1;
        v[last] ^= 0x01;
        Some(v)
    });
    let db = Db::open_with(
        &dir,
        DbConfig::default().engine(engine).encryption_key(key(1)),
    )
    .unwrap();
    let (reader, _w) = db
        .store("pods", fx.pods(), StreamConfig::default())
        .unwrap();
    match reader.get_named(Some("ns-0"), "pod-3") {
        Err(Error::Corrupt { detail, .. }) => {
            assert!(detail.contains("authentication"), "{detail}")
        }
        other => panic!("expected a corruption error, got {other:?}"),
    }
    assert!(
        reader.get_named(Some("ns-0"), "pod-4").unwrap().is_some(),
        "other records still read"
    );
}

/// The number in a fixture pod's name (`pod-17`: 17).
fn pod_number(p: &Pod) -> usize {
    let name = p.metadata.name.as_deref().unwrap_or_default();
    name.trim_start_matches("pod-")
        .parse()
        .unwrap_or(usize::MAX)
}

/// An index value that appears nowhere in the objects, so that finding it on disk can only
/// mean the index stored it.
fn marker(p: &Pod) -> Vec<String> {
    vec![format!("idx-marker-{}", pod_number(p) % 4)]
}

/// A second such index, built from disk when it is added to a stored stream.
fn second(p: &Pod) -> Vec<String> {
    vec![format!("idx-second-{}", pod_number(p) % 3)]
}

/// The names of the pods `reader` finds under `value` of `index` (once the index is usable).
async fn looked_up(reader: &Reader<Pod>, index: &str, value: &str) -> BTreeSet<String> {
    eventually(&format!("index {index} usable"), || {
        reader.by_index(index, value).is_ok()
    })
    .await;
    reader
        .by_index(index, value)
        .unwrap()
        .map(|p| p.unwrap().metadata.name.clone().unwrap())
        .collect()
}

/// Issue 60 item 4: with a key, index keys carry keyed hashes of the values an index
/// function returns, never the values (nor do the sealed entry lists), whether the entries
/// are written with their objects or built from disk for an index added later; lookups by
/// value still find exactly the objects, across a restart too. Without a key, the same
/// check does see the values (so it can see them).
///
/// Seen failing without the fix: index keys held `idx-marker-N` in clear, and the check
/// found it in the engine's file of the encrypted store.
async fn encrypted_index_values_are_not_on_disk_and_lookups_work(engine: Engine) {
    let fx = Fixture::with_pods(60, 2).await;
    let tmp = tempfile::tempdir().unwrap();
    let want = |of: fn(&Pod) -> Vec<String>, value: &str| -> BTreeSet<String> {
        (0..60)
            .filter(|&i| {
                let mut p = Pod::default();
                p.metadata.name = Some(format!("pod-{i}"));
                of(&p) == [value.to_string()]
            })
            .map(|i| format!("pod-{i}"))
            .collect()
    };
    for encrypted in [true, false] {
        let dir = tmp.path().join(format!("encrypted-{encrypted}"));
        let open = || {
            // Uncompressed, so that only encryption can hide what is stored.
            let mut cfg = DbConfig::default().engine(engine).compression(false);
            if encrypted {
                cfg = cfg.encryption_key(key(1));
            }
            Db::open_with(&dir, cfg).unwrap()
        };
        {
            // Entries written with their objects.
            let db = open();
            let (reader, w) = fx
                .synced_pods(&db, StreamConfig::default().index("marker", marker))
                .await;
            for m in 0..4 {
                let value = format!("idx-marker-{m}");
                assert_eq!(
                    looked_up(&reader, "marker", &value).await,
                    want(marker, &value)
                );
            }
            assert!(
                looked_up(&reader, "marker", "idx-marker-9")
                    .await
                    .is_empty()
            );
            w.stop().await;
            db.flush().unwrap();
        }
        {
            // Resumed, with an index added: built from disk.
            let db = open();
            let config = StreamConfig::default()
                .index("marker", marker)
                .index("second", second);
            let (reader, mut w) = fx.watch_pods(&db, config);
            assert!(matches!(w.until(|_| true).await[0], Ev::Resumed(_)));
            for m in 0..3 {
                let value = format!("idx-second-{m}");
                assert_eq!(
                    looked_up(&reader, "second", &value).await,
                    want(second, &value)
                );
            }
            let value = "idx-marker-2";
            assert_eq!(
                looked_up(&reader, "marker", value).await,
                want(marker, value)
            );
            w.stop().await;
            db.flush().unwrap();
        }
        for needle in [&b"idx-marker-"[..], b"idx-second-"] {
            assert_eq!(
                on_disk(&dir, needle),
                !encrypted,
                "{}: index values on disk, encrypted: {encrypted}",
                String::from_utf8_lossy(needle)
            );
        }
    }
}

/// Open stream `name` of `db` with the fixture's pods and wait for its first list.
async fn synced_stream(fx: &Fixture, db: &Db, name: &str) {
    let (_reader, watcher) = db.store(name, fx.pods(), StreamConfig::default()).unwrap();
    let mut w = drive(watcher);
    w.until(|e| *e == Ev::InitDone).await;
    w.stop().await;
}

/// Issue 60 item 4: a sealed record is bound to its stream and store. The same object's
/// record, valid where it was written, copied over its record in another stream of the same
/// store, or in the same stream of another store with the same key, fails authentication
/// there (`Error::Corrupt`); the other records still read.
///
/// Seen failing without the fix: every stream was sealed with the store's key itself, and
/// the copies opened (`Ok(Some(pod))`) in both places.
async fn a_record_copied_to_another_stream_or_store_fails_authentication(engine: Engine) {
    let fx = Fixture::with_pods(20, 1).await;
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let config = || DbConfig::default().engine(engine).encryption_key(key(1));
    for (dir, streams) in [(&a, &["pods", "pods-2"][..]), (&b, &["pods"])] {
        let db = Db::open_with(dir, config()).unwrap();
        for stream in streams {
            synced_stream(&fx, &db, stream).await;
        }
        db.flush().unwrap();
    }
    let key3 = b"ons-0\0pod-3";
    let mut copied = None;
    raw_edit(engine, &a, "stream/pods", key3, |v| {
        copied = v.clone();
        v
    });
    let copied = copied.expect("record present");
    for (dir, table) in [(&a, "stream/pods-2"), (&b, "stream/pods")] {
        raw_edit(engine, dir, table, key3, |v| {
            assert!(v.is_some(), "{table}: its own pod-3");
            Some(copied.clone())
        });
    }
    for (dir, stream, what) in [
        (&a, "pods", "where it was written"),
        (&a, "pods-2", "another stream of the store"),
        (&b, "pods", "the same stream of another store"),
    ] {
        let db = Db::open_with(dir, config()).unwrap();
        let (reader, _w) = db
            .store(stream, fx.pods(), StreamConfig::default())
            .unwrap();
        let got = reader.get_named(Some("ns-0"), "pod-3");
        if stream == "pods" && dir == &a {
            assert!(got.unwrap().is_some(), "{what}: the record reads");
        } else {
            match got {
                Err(Error::Corrupt { detail, .. }) => {
                    assert!(detail.contains("authentication"), "{what}: {detail}")
                }
                // Not the whole object: only whether it read.
                other => panic!(
                    "{what}: expected a corruption error, got {:?}",
                    other.map(|pod| pod.is_some())
                ),
            }
        }
        assert!(
            reader.get_named(Some("ns-0"), "pod-4").unwrap().is_some(),
            "{what}: other records still read"
        );
    }
}

/// Every codec round-trips, with and without encryption, and the codec can change between
/// runs of one store: records written with each stay readable next to the others, and the
/// watch resumes without a LIST.
async fn every_codec_reads_back_and_codecs_mix_in_one_store(engine: Engine) {
    let fx = Fixture::with_pods(400, 4).await;
    let h = &fx.h;
    let tmp = tempfile::tempdir().unwrap();
    for encrypted in [false, true] {
        let dir = tmp.path().join(format!("encrypted-{encrypted}"));
        let mut first = true;
        for (round, codec) in [
            Compression::Lz4,
            Compression::Zstd,
            Compression::Off,
            Compression::Lz4,
        ]
        .into_iter()
        .enumerate()
        {
            let mut cfg = DbConfig::default().engine(engine).compression_codec(codec);
            if encrypted {
                cfg = cfg.encryption_key(key(3));
            }
            let db = Db::open_with(&dir, cfg).unwrap();
            h.reset_counts();
            let (reader, watcher) = db
                .store("pods", fx.pods(), StreamConfig::default())
                .unwrap();
            let w = drive(watcher);
            converge(&reader, h, &ResourceType::pods()).await;
            if !first {
                assert_eq!(h.counts().list, 0, "{codec:?}: resumed without LIST");
            }
            first = false;
            // Rewrite a quarter of the objects with this codec, read them all back.
            h.churn(100, 0, 0, round as u64 + 1);
            converge(&reader, h, &ResourceType::pods()).await;
            w.stop().await;
        }
    }
}

/// Issue 56 item 6: a directory holding what a store does not make (a user's script and
/// folder, a volume's `lost+found`) is refused by every open, with `Error::NotAStore`
/// naming it and those entries, and nothing in it changes: no permission, no file. A store
/// directory with such entries added is refused the same way, by `Db::destroy` too, and
/// opens again, private, once they are gone. An empty directory is the store's.
fn a_directory_holding_other_files_is_refused_and_left_alone(engine: Engine) {
    let tmp = tempfile::tempdir().unwrap();
    let refused = |dir: &Path, found: &[std::path::PathBuf], config: DbConfig| {
        let before = modes_below(dir);
        match Db::open_with(dir, config.clone()) {
            Err(e @ Error::NotAStore { .. }) => {
                let text = e.to_string();
                let Error::NotAStore { path, found: named } = e else {
                    unreachable!()
                };
                assert_eq!(
                    (path.as_path(), named.as_slice()),
                    (dir, found),
                    "{config:?}"
                );
                assert!(text.contains(dir.to_str().unwrap()), "{text}");
                for f in found {
                    let name = f.file_name().unwrap().to_str().unwrap();
                    assert!(text.contains(name), "{text}");
                }
            }
            other => panic!("{config:?}: expected NotAStore, got {other:?}"),
        }
        assert_eq!(modes_below(dir), before, "{config:?} changed the directory");
    };
    let configs = [
        DbConfig::default().engine(engine),
        DbConfig::default(),
        DbConfig::default().engine(engine).strict_permissions(true),
        DbConfig::default().read_only(),
    ];

    // The user's files, no store.
    let home = tmp.path().join("home");
    let found = add_user_files(&home);
    for config in &configs {
        refused(&home, &found, config.clone());
    }
    // A volume's root: its `lost+found` is not the store's either (docs/kubernetes.md).
    let volume = tmp.path().join("volume");
    std::fs::create_dir_all(volume.join("lost+found")).unwrap();
    refused(&volume, &[volume.join("lost+found")], configs[0].clone());

    // A store, with the same entries added.
    let store = tmp.path().join("store");
    drop(try_open_db(engine, &store).unwrap());
    let found = add_user_files(&store);
    for config in &configs {
        refused(&store, &found, config.clone());
    }
    let before = modes_below(&store);
    assert!(matches!(Db::destroy(&store), Err(Error::NotAStore { .. })));
    assert_eq!(modes_below(&store), before, "destroy changed the directory");
    // Once they are gone, the store opens again, private, and reopens.
    std::fs::remove_file(&found[0]).unwrap();
    std::fs::remove_dir_all(&found[1]).unwrap();
    for _ in 0..2 {
        let db = try_open_db(engine, &store).unwrap();
        assert_eq!(db.engine(), engine);
        drop(db);
        assert_private(&store);
    }

    // An empty directory, even a world-readable one, is the store's.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::set_permissions(&empty, std::fs::Permissions::from_mode(0o755)).unwrap();
    drop(try_open_db(engine, &empty).unwrap());
    assert_private(&empty);
}

engine_tests! {
    async: store_is_private_whatever_the_umask,
        every_codec_reads_back_and_codecs_mix_in_one_store,
        world_readable_store_is_tightened_or_refused,
        secrets_need_an_explicit_opt_in,
        encrypted_store_round_trip_and_wrong_or_missing_key,
        modified_encrypted_record_is_a_corruption_error,
        encrypted_index_values_are_not_on_disk_and_lookups_work,
        a_record_copied_to_another_stream_or_store_fails_authentication;
    sync: a_directory_holding_other_files_is_refused_and_left_alone,
}
