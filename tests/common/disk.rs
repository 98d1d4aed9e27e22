//! Behind kube-persist's back: raw edits with an engine's own API, the engines' file locks,
//! and tmpfs mounts (a full or read-only disk).

use std::time::Duration;

use kube_persist::Engine;

/// Replace (or, with `None`, delete) the value at `key` in keyspace `table` of a closed
/// store, with the engine's own API: `edit` gets the current value, if any. For tests that
/// damage or change a store behind kube-persist's back.
pub fn raw_edit(
    engine: Engine,
    dir: &std::path::Path,
    table: &str,
    key: &[u8],
    edit: impl FnOnce(Option<Vec<u8>>) -> Option<Vec<u8>>,
) {
    match engine {
        Engine::Sled => {
            // sled releases its file lock a moment after the store's last handle is dropped
            // (deferred destructors): wait for it, as `Db::open` does.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let raw = loop {
                match ::sled::open(dir) {
                    Ok(raw) => break raw,
                    Err(e)
                        if e.to_string().contains("could not acquire lock")
                            && std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Err(e) => panic!("opening the sled store: {e}"),
                }
            };
            let tree = raw.open_tree(table).unwrap();
            match edit(tree.get(key).unwrap().map(|v| v.to_vec())) {
                Some(v) => drop(tree.insert(key, v).unwrap()),
                None => drop(tree.remove(key).unwrap()),
            }
            raw.flush().unwrap();
        }
        Engine::Redb => {
            use ::redb::ReadableTable;
            let def = ::redb::TableDefinition::<&[u8], &[u8]>::new(table);
            let raw = ::redb::Database::open(dir.join("data.redb")).unwrap();
            let txn = raw.begin_write().unwrap();
            {
                let mut t = txn.open_table(def).unwrap();
                let old = t.get(key).unwrap().map(|v| v.value().to_vec());
                match edit(old) {
                    Some(v) => drop(t.insert(key, v.as_slice()).unwrap()),
                    None => drop(t.remove(key).unwrap()),
                }
            }
            txn.commit().unwrap();
        }
        other => panic!("no raw access to the {other} engine in this test"),
    }
}

/// Wait until no process holds the engine's file lock on the store at `dir` (sled frees it
/// a moment after the last handle is dropped): before another process opens the store.
pub fn wait_unlocked(dir: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for file in ["db", "data.redb"] {
        let Ok(f) = std::fs::File::open(dir.join(file)) else {
            continue;
        };
        // flock on our own open file: it fails while the store's handle holds the lock,
        // and closing `f` drops ours at once.
        // SAFETY: flock on a valid descriptor owned by `f`.
        while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} stays locked",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Whether this process runs as root (tmpfs mounts need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn run_cmd(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A tmpfs mounted for the test; unmounted when dropped (lazily if busy).
pub struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    pub fn mount(dir: &std::path::Path, opts: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(dir).unwrap();
        let d = dir.to_str().unwrap();
        run_cmd("mount", &["-t", "tmpfs", "-o", opts, "tmpfs", d])?;
        Ok(Tmpfs(dir.to_path_buf()))
    }

    /// Mount it again with `opts` (e.g. a new size), keeping its files.
    pub fn remount(&self, opts: &str) {
        let o = format!("remount,{opts}");
        run_cmd("mount", &["-o", &o, self.0.to_str().unwrap()]).expect("remount");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let d = self.0.to_str().unwrap();
        if run_cmd("umount", &[d]).is_err() {
            let _ = run_cmd("umount", &["-l", d]);
        }
    }
}

/// Put what a user keeps in a directory into `dir` (created, mode 0755, if missing): a
/// script `run.sh` (mode 0755) and a folder `tools` (0750) holding `notes.txt` (0640), none
/// of which a store makes. Returns those two entries, sorted: what `Error::NotAStore` names.
pub fn add_user_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path, m| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
    };
    if !dir.exists() {
        std::fs::create_dir_all(dir).unwrap();
        mode(dir, 0o755);
    }
    let script = dir.join("run.sh");
    std::fs::write(&script, "#!/bin/sh\necho hello\n").unwrap();
    mode(&script, 0o755);
    let tools = dir.join("tools");
    std::fs::create_dir(&tools).unwrap();
    std::fs::write(tools.join("notes.txt"), "keep me").unwrap();
    mode(&tools.join("notes.txt"), 0o640);
    mode(&tools, 0o750);
    vec![script, tools]
}

/// The permission bits of `dir` and of every entry below it, by path (symbolic links are
/// listed, not followed).
pub fn modes_below(dir: &std::path::Path) -> std::collections::BTreeMap<std::path::PathBuf, u32> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = std::collections::BTreeMap::new();
    let meta = std::fs::symlink_metadata(dir).unwrap();
    out.insert(dir.to_path_buf(), meta.permissions().mode() & 0o7777);
    if meta.is_dir() {
        for e in std::fs::read_dir(dir).unwrap() {
            out.extend(modes_below(&e.unwrap().path()));
        }
    }
    out
}

/// Every `(keyspace, key, value)` of a closed store, in keyspace then key order, read with
/// the engine's own API (sled's default tree, which the store does not use, left out).
pub fn raw_records(engine: Engine, dir: &std::path::Path) -> Vec<(String, Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    match engine {
        Engine::Sled => {
            wait_unlocked(dir);
            let raw = ::sled::open(dir).expect("opening the sled store");
            for name in raw.tree_names() {
                let name = String::from_utf8(name.to_vec()).expect("tree names are UTF-8");
                if name == "__sled__default" {
                    continue;
                }
                for kv in raw.open_tree(&name).unwrap().iter() {
                    let (k, v) = kv.unwrap();
                    out.push((name.clone(), k.to_vec(), v.to_vec()));
                }
            }
        }
        Engine::Redb => {
            use ::redb::{ReadableDatabase, ReadableTable, TableHandle};
            let raw = ::redb::Database::open(dir.join("data.redb")).unwrap();
            let txn = raw.begin_read().unwrap();
            for handle in txn.list_tables().unwrap() {
                let def = ::redb::TableDefinition::<&[u8], &[u8]>::new(handle.name());
                let table = txn.open_table(def).unwrap();
                for kv in table.iter().unwrap() {
                    let (k, v) = kv.unwrap();
                    out.push((
                        handle.name().to_string(),
                        k.value().to_vec(),
                        v.value().to_vec(),
                    ));
                }
            }
        }
        other => panic!("no raw access to the {other} engine in this test"),
    }
    out.sort();
    out
}

/// Copy the store directory `from` (files and folders, no links) to `to` (created).
pub fn copy_store(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_store(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}
