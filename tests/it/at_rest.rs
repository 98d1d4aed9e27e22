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
use kube_persist::{
    Compression, Db, DbConfig, EncryptionKey, Error, Reader, Removed, StreamConfig,
};
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
        Err(Error::Permissions { path, open, .. }) => {
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
    // Metadata-only needs the data dropped too (annotations can hold it); keys-only not.
    let (meta, watcher) = db
        .metadata_store(
            "secret-meta",
            Api::<Secret>::all(fx.server.client()),
            StreamConfig::default().drop_secret_data(),
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
    assert!(
        matches!(&err, Error::SensitiveKind { stream, kind, .. } if stream == "pods" && kind == "Pod"),
        "{err}"
    );
}

/// A Secret as `kubectl apply -f` creates it: the manifest's values in `data` (a
/// `stringData` manifest's, encoded, as kube-apiserver stores them), and the manifest
/// itself, values in clear, in the last-applied annotation.
fn applied_secret(name: &str, value: &str) -> Secret {
    let manifest = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": "default"},
        "type": "Opaque",
        "stringData": {"password": value},
    });
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {
            "name": name, "namespace": "default",
            "labels": {"app": "db"},
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": manifest.to_string(),
                "team": "storage",
            },
        },
        "type": "Opaque",
        "data": {"password": base64(value.as_bytes())},
    }))
    .unwrap()
}

/// Standard base64 with padding (what a Secret's `data` holds).
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Issue 60 item 3: a Secret created by a `kubectl apply`-like client holds its values in
/// `data` and in the last-applied annotation. Without the built-in configuration every
/// sensitive stream is refused, the error naming it: full, metadata-only, and a dynamic
/// stream of core/v1 `secrets` whatever kind its `ApiResource` gives. With
/// `drop_secret_data()` all three sync (the listed Secrets and a changed one, watched),
/// and no value, in clear or encoded, is in any file of the store; with
/// `allow_sensitive_data()` the same search finds them (the check can see them).
async fn secret_values_never_reach_disk_with_drop_secret_data(engine: Engine) {
    use kube::api::{ApiResource, DynamicObject, PostParams};
    let fx = Fixture::new().await;
    fx.h.register(&ResourceType::new("", "v1", "secrets", "Secret", true));
    let client = fx.server.client();
    let api = Api::<Secret>::namespaced(client.clone(), "default");
    let values = [
        "hunter2-in-clear",
        "s3cret-too-long-to-miss",
        "rotated-value-9",
    ];
    for (i, value) in values[..2].iter().enumerate() {
        api.create(
            &PostParams::default(),
            &applied_secret(&format!("db-{i}"), value),
        )
        .await
        .unwrap();
    }
    let dynamic = |kind: &str| {
        let ar = ApiResource {
            group: String::new(),
            version: "v1".into(),
            api_version: "v1".into(),
            kind: kind.into(),
            plural: "secrets".into(),
        };
        (Api::<DynamicObject>::all_with(client.clone(), &ar), ar)
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let open = |dir: &Path| {
        Db::open_with(dir, DbConfig::default().engine(engine).compression(false)).unwrap()
    };
    let db = open(&dir);
    let refused = |res: kube_persist::Result<()>, what: &str| match res {
        Err(Error::SensitiveKind { detail, .. }) => {
            assert!(detail.contains("drop_secret_data()"), "{what}: {detail}")
        }
        other => panic!("{what}: expected Error::SensitiveKind, got {other:?}"),
    };
    refused(
        db.store(
            "secrets",
            Api::<Secret>::all(client.clone()),
            StreamConfig::default(),
        )
        .map(drop),
        "full store",
    );
    refused(
        db.metadata_store(
            "meta",
            Api::<Secret>::all(client.clone()),
            StreamConfig::default(),
        )
        .map(drop),
        "metadata store",
    );
    let (dyn_api, ar) = dynamic("Credentials");
    refused(
        db.store_with("dynamic", dyn_api, StreamConfig::default(), &ar)
            .map(drop),
        "dynamic store of core/v1 secrets",
    );

    let cfg = || StreamConfig::default().drop_secret_data();
    let (full, w_full) = db
        .store("secrets", Api::<Secret>::all(client.clone()), cfg())
        .unwrap();
    let (meta, w_meta) = db
        .metadata_store("meta", Api::<Secret>::all(client.clone()), cfg())
        .unwrap();
    let (dyn_api, ar) = dynamic("Credentials");
    let (dyn_reader, w_dyn) = db.store_with("dynamic", dyn_api, cfg(), &ar).unwrap();
    let mut watchers = [drive(w_full), drive(w_meta), drive(w_dyn)];
    for w in &mut watchers {
        w.until(|e| *e == Ev::InitDone).await;
    }
    // A change, as `kubectl apply` of a new value makes it.
    let mut changed = api.get("db-1").await.unwrap();
    let new = applied_secret("db-1", values[2]);
    changed.data = new.data;
    changed.metadata.annotations = new.metadata.annotations;
    api.replace("db-1", &PostParams::default(), &changed)
        .await
        .unwrap();
    for w in &mut watchers {
        w.until(|e| *e == Ev::Apply("default/db-1".into())).await;
    }
    let secret = full.get_named(Some("default"), "db-1").unwrap().unwrap();
    assert!(secret.data.is_none() && secret.string_data.is_none());
    let annotations = secret.metadata.annotations.clone().unwrap();
    assert!(!annotations.contains_key("kubectl.kubernetes.io/last-applied-configuration"));
    assert_eq!(annotations["team"], "storage");
    assert_eq!(secret.type_.as_deref(), Some("Opaque"));
    assert_eq!((full.len(), meta.len(), dyn_reader.len()), (2, 2, 2));
    let m = meta.get_named(Some("default"), "db-0").unwrap().unwrap();
    assert_eq!(
        m.metadata.annotations.as_ref().unwrap().len(),
        1,
        "only `team` is left"
    );
    for w in watchers {
        w.stop().await;
    }
    db.flush().unwrap();
    drop((full, meta, dyn_reader, db));
    let leaked = |dir: &Path| {
        values
            .iter()
            .flat_map(|v| [v.to_string(), base64(v.as_bytes())])
            .filter(|needle| on_disk(dir, needle.as_bytes()))
            .collect::<Vec<_>>()
    };
    assert_eq!(leaked(&dir), Vec::<String>::new(), "secret values on disk");

    // The check can see them: opted in, they are on disk (in `data` and the annotation).
    let plain = tmp.path().join("plain");
    let db = open(&plain);
    let (_r, w) = db
        .store(
            "secrets",
            Api::<Secret>::all(client.clone()),
            StreamConfig::default().allow_sensitive_data(),
        )
        .unwrap();
    let mut w = drive(w);
    w.until(|e| *e == Ev::InitDone).await;
    w.stop().await;
    db.flush().unwrap();
    let found = leaked(&plain);
    // db-1 holds its new value now.
    for v in [values[0], values[2]] {
        assert!(found.contains(&v.to_string()), "{v} in clear: {found:?}");
        assert!(
            found.contains(&base64(v.as_bytes())),
            "{v} encoded: {found:?}"
        );
    }
}

/// Issue 60 item 5: a store opened through a symbolic link is its target: the real
/// folder's entries are checked and tightened (they kept umask modes before: the checks
/// skipped a link), `strict_permissions` refuses the link, `Db::path` is the target; a
/// folder owned by another user is refused in strict mode and only warned about
/// otherwise (as root: the test chowns it); `Db::destroy` through the link removes the
/// store's files in the target and says so, keeping the link and the directory, and the
/// next open through the link lists from scratch.
async fn a_symlinked_store_path_is_its_target(engine: Engine) {
    let fx = Fixture::with_pods(20, 1).await;
    let tmp = tempfile::tempdir().unwrap();
    let (real, link) = (tmp.path().join("real"), tmp.path().join("link"));
    std::fs::create_dir(&real).unwrap();
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let real = real.canonicalize().unwrap();
    {
        let db = try_open_db(engine, &link).unwrap();
        sync_pods(&fx.server, &db).await;
        db.flush().unwrap();
    }
    assert_private(&real);
    // Made world-readable, then opened through the link: tightened.
    for p in modes_below(&real).into_keys() {
        let mode = if p.is_dir() { 0o755 } else { 0o644 };
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let strict = DbConfig::default().engine(engine).strict_permissions(true);
    match Db::open_with(&link, strict.clone()) {
        Err(Error::SymlinkedStore { path, target, .. }) => {
            assert_eq!((path, target), (link.clone(), real.clone()))
        }
        other => panic!("expected SymlinkedStore, got {other:?}"),
    }
    let db = try_open_db(engine, &link).unwrap();
    assert_private(&real);
    assert_eq!(db.path(), real);
    drop(db);
    // Its real path opens in strict mode.
    drop(Db::open_with(&real, strict.clone()).unwrap());

    if is_root() {
        // Another user's folder: refused in strict mode, a warning otherwise.
        let chown = |uid: u32| std::os::unix::fs::chown(&real, Some(uid), None).unwrap();
        chown(65534);
        match Db::open_with(&real, strict.clone()) {
            Err(Error::NotOwner {
                path, owner, user, ..
            }) => {
                assert_eq!((path, owner, user), (real.clone(), 65534, 0))
            }
            other => panic!("expected NotOwner, got {other:?}"),
        }
        drop(try_open_db(engine, &real).unwrap());
        chown(0);
    } else {
        println!("not root: the owner check is not tested");
    }

    match Db::destroy(&link).unwrap() {
        Removed::Target { target } => assert_eq!(target, real),
        other => panic!("expected the target's files removed, got {other:?}"),
    }
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "link kept"
    );
    assert_eq!(
        std::fs::read_dir(&real).unwrap().count(),
        0,
        "the target is empty"
    );
    fx.h.reset_counts();
    let db = try_open_db(engine, &link).unwrap();
    sync_pods(&fx.server, &db).await;
    assert_eq!(fx.h.counts().list, 1, "listed from scratch");
}

/// Issue 60 item 7: an object a tenant makes invalid for the store's type (here a Pod
/// whose `spec.containers` holds a token as a string) is input anyone who can write such
/// an object can send. It is refused: the stream yields `Error::ObjectRejected` naming
/// its key and resourceVersion, `Stats::bad_objects` counts it, and its previous version
/// is removed (documented on `Watcher::stream` as such input). The error names what is
/// wrong and where, never the object's content: serde_json's own message quotes the value.
async fn a_rejected_object_is_named_without_its_content(engine: Engine) {
    let fx = Fixture::with_pods(2, 1).await;
    let db = fx.open(engine);
    let (reader, mut w) = fx.synced_pods(&db, StreamConfig::default()).await;
    let token = "s3cret-token-in-a-wrong-field";
    fx.h.apply(
        &ResourceType::pods(),
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "pod-0", "namespace": "ns-0"},
            "spec": {"containers": token},
        }),
    );
    let events = w.until(|e| matches!(e, Ev::Error(_))).await;
    let Some(Ev::Error(msg)) = events.last() else {
        unreachable!()
    };
    assert!(msg.contains("ns-0/pod-0"), "{msg}");
    assert!(msg.contains("invalid type, expected a sequence"), "{msg}");
    assert!(
        !msg.contains(token),
        "the object's content in an error: {msg}"
    );
    assert_eq!(reader.stats().bad_objects, 1);
    assert!(reader.get_named(Some("ns-0"), "pod-0").unwrap().is_none());
    assert!(reader.get_named(Some("ns-0"), "pod-1").unwrap().is_some());
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
                let Error::NotAStore {
                    path, found: named, ..
                } = e
                else {
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
        secret_values_never_reach_disk_with_drop_secret_data,
        a_symlinked_store_path_is_its_target,
        a_rejected_object_is_named_without_its_content,
        encrypted_store_round_trip_and_wrong_or_missing_key,
        modified_encrypted_record_is_a_corruption_error,
        encrypted_index_values_are_not_on_disk_and_lookups_work,
        a_record_copied_to_another_stream_or_store_fails_authentication;
    sync: a_directory_holding_other_files_is_refused_and_left_alone,
}
