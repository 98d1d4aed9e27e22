//! The store's own files: what redb, sled and kube-persist itself create in a store
//! directory, and nothing else. The one definition that `Db::open` (which refuses a
//! directory holding anything else, and changes the permissions of these entries only) and
//! `Db::destroy` (which removes only a directory holding nothing else) both read.
//!
//! - kube-persist: the `engine` file, written through a temporary `engine.new.<pid>`
//!   linked into place (`record_engine`); nothing else (its leases are in memory).
//! - redb: `data.redb`, one file; its locks are byte ranges of that file, no lock file.
//! - sled 0.34: `conf` (its configuration), `db` (its log, whose file lock is the store's
//!   lock), the directory `blobs` (one file per large value, named by its decimal log
//!   sequence number) and its snapshot, `snap.<16 hex digits>` (written as
//!   `snap.<16 hex digits>.generating`, then renamed).
//!
//! None of them is a symbolic link: an entry of the right name that is a link, or of the
//! wrong type (a directory named `db`), is not the store's.

use std::fs::FileType;
use std::path::{Path, PathBuf};

use crate::model::{Engine, Error, Result};

/// The file in a store directory that names its engine.
pub(super) const ENGINE_FILE: &str = "engine";
/// The prefix of the temporary file the `engine` file is written to (`engine.new.<pid>`).
pub(super) const ENGINE_FILE_NEW: &str = "engine.new.";

/// The file redb keeps a store in.
pub(super) const REDB_FILE: &str = "data.redb";
/// The files redb keeps in a store directory.
const REDB_FILES: &[&str] = &[REDB_FILE];

/// The files every sled store holds (known without the `sled` feature, so that such a build
/// recognises a sled store and refuses it).
pub(super) const SLED_REQUIRED: &[&str] = &["conf", "db"];
/// sled's directory of large values.
const SLED_BLOBS: &str = "blobs";

/// Whether an entry is a file or a directory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    File,
    Dir,
}

impl Kind {
    fn of(t: FileType) -> Option<Kind> {
        if t.is_file() {
            Some(Kind::File)
        } else if t.is_dir() {
            Some(Kind::Dir)
        } else {
            None
        }
    }
}

/// The files of `engine` every store of it holds.
pub(super) fn required(engine: Engine) -> &'static [&'static str] {
    match engine {
        Engine::Sled => SLED_REQUIRED,
        Engine::Redb => REDB_FILES,
    }
}

/// Whether `s` is a non-empty run of digits in `radix`.
fn digits(s: &str, radix: u32) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_digit(radix))
}

/// What the entry `name`, directly in a store directory written by `engine` (`None`: no
/// engine recorded or told by its files yet), is when the store made it; `None` if the
/// store makes no entry of that name.
fn own_kind(name: &str, engine: Option<Engine>) -> Option<Kind> {
    if name == ENGINE_FILE
        || name
            .strip_prefix(ENGINE_FILE_NEW)
            .is_some_and(|pid| digits(pid, 10))
    {
        return Some(Kind::File);
    }
    match engine? {
        Engine::Redb => (name == REDB_FILE).then_some(Kind::File),
        Engine::Sled if SLED_REQUIRED.contains(&name) => Some(Kind::File),
        Engine::Sled if name == SLED_BLOBS => Some(Kind::Dir),
        Engine::Sled => {
            let snap = name.strip_prefix("snap.");
            let lsn = snap.map(|s| s.strip_suffix(".generating").unwrap_or(s));
            lsn.is_some_and(|lsn| lsn.len() == 16 && digits(lsn, 16))
                .then_some(Kind::File)
        }
    }
}

/// What a store directory holds.
pub(crate) struct Contents {
    /// The engine that wrote the store, if any: the one its `engine` file names, or told by
    /// its files when that file is missing or damaged.
    pub(crate) engine: Option<Engine>,
    /// The directory itself (unless it is a symbolic link) and every entry in it, at any
    /// depth, that the store made.
    pub(crate) own: Vec<PathBuf>,
    /// Every entry that the store did not make (nothing below them is read), sorted.
    pub(crate) foreign: Vec<PathBuf>,
}

impl Contents {
    /// Read the store directory at `dir`: `None` if it does not exist. Reads the directory
    /// and, if it is the store's, sled's `blobs` directory; nothing below a foreign entry.
    pub(crate) fn read(dir: &Path) -> Result<Option<Contents>> {
        let io = |e| Error::from_io(dir.to_path_buf(), e);
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        };
        let (engine, engine_file_ours) = engine_of(dir)?;
        let mut own = Vec::new();
        if !std::fs::symlink_metadata(dir)
            .map_err(io)?
            .file_type()
            .is_symlink()
        {
            own.push(dir.to_path_buf());
        }
        let mut foreign = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io)?;
            let path = entry.path();
            let name = entry.file_name();
            let kind = Kind::of(entry.file_type().map_err(io)?);
            let want = name
                .to_str()
                .filter(|&name| name != ENGINE_FILE || engine_file_ours)
                .and_then(|name| own_kind(name, engine));
            match want {
                Some(want) if kind == Some(want) => {
                    own.push(path.clone());
                    if name == SLED_BLOBS {
                        blobs(&path, &mut own, &mut foreign);
                    }
                }
                _ => foreign.push(path),
            }
        }
        foreign.sort();
        Ok(Some(Contents {
            engine,
            own,
            foreign,
        }))
    }

    /// [`Error::NotAStore`] if the directory holds anything the store did not make.
    pub(crate) fn only_own(&self, dir: &Path) -> Result<()> {
        if self.foreign.is_empty() {
            return Ok(());
        }
        Err(Error::NotAStore {
            path: dir.to_path_buf(),
            found: self.foreign.clone(),
        })
    }
}

/// [`Error::NotAStore`] if the directory at `path` exists and holds anything the store did
/// not make. Changes nothing.
pub(crate) fn refuse_foreign(path: &Path) -> Result<()> {
    match Contents::read(path)? {
        Some(contents) => contents.only_own(path),
        None => Ok(()),
    }
}

/// The entries of sled's `blobs` directory: its files named by a decimal number are
/// sled's, anything else is not. One that cannot be read (mode 0000, say) lists nothing:
/// it is the store's, tightened before it is read again after the engine opened.
fn blobs(dir: &Path, own: &mut Vec<PathBuf>, foreign: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        let numbered = entry.file_name().to_str().is_some_and(|n| digits(n, 10));
        if is_file && numbered {
            own.push(entry.path());
        } else {
            foreign.push(entry.path());
        }
    }
}

/// The engine that wrote the store at `dir`: [`Engine::of_store`], or told by the files
/// when the `engine` file is damaged (its open reports that) or is not a file (a foreign
/// entry of that name). Second, whether an `engine` file that is a file is the store's: not
/// if it names no engine and no engine's files are there (someone else's file of that name).
fn engine_of(dir: &Path) -> Result<(Option<Engine>, bool)> {
    let file = std::fs::symlink_metadata(dir.join(ENGINE_FILE));
    if file.is_ok_and(|m| !m.file_type().is_file()) {
        return Ok((Engine::by_files(dir), true));
    }
    match Engine::of_store(dir) {
        Err(Error::Corrupt { .. }) => {
            let engine = Engine::by_files(dir);
            Ok((engine, engine.is_some()))
        }
        other => Ok((other?, true)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_makes_only_its_engine_s_files() {
        let own = |name, engine| own_kind(name, engine).is_some();
        for engine in [None, Some(Engine::Redb), Some(Engine::Sled)] {
            assert!(own("engine", engine) && own("engine.new.4242", engine));
            for other in [
                "engine.new.",
                "engine.new.x",
                "engine.old",
                "lost+found",
                ".git",
                "run.sh",
            ] {
                assert!(!own(other, engine), "{other}");
            }
        }
        assert!(own("data.redb", Some(Engine::Redb)));
        assert!(!own("data.redb", Some(Engine::Sled)) && !own("data.redb", None));
        let sled = Some(Engine::Sled);
        for name in [
            "conf",
            "db",
            "blobs",
            "snap.00000000000001AF",
            "snap.00000000000001AF.generating",
        ] {
            assert!(own(name, sled), "{name}");
            assert!(!own(name, Some(Engine::Redb)) && !own(name, None), "{name}");
        }
        for name in [
            "snap.",
            "snap.1AF",
            "snap.00000000000001AG",
            "snap.00000000000001AF.old",
        ] {
            assert!(!own(name, sled), "{name}");
        }
        assert_eq!(own_kind("blobs", sled), Some(Kind::Dir));
        assert_eq!(own_kind("db", sled), Some(Kind::File));
    }

    #[test]
    fn contents_sorts_what_the_store_made_from_what_it_did_not() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        assert!(Contents::read(&d.join("absent")).unwrap().is_none());
        std::fs::write(d.join("engine"), "sled\n").unwrap();
        for file in [
            "conf",
            "db",
            "snap.00000000000001AF",
            "blobs/42",
            "blobs/notes",
        ] {
            std::fs::create_dir_all(d.join(file).parent().unwrap()).unwrap();
            std::fs::write(d.join(file), "").unwrap();
        }
        // Right names, wrong types: a link and a directory.
        std::os::unix::fs::symlink(d.join("conf"), d.join("snap.00000000000001B0")).unwrap();
        std::fs::create_dir(d.join("tools")).unwrap();
        std::fs::create_dir(d.join("tools").join("db")).unwrap();
        let c = Contents::read(d).unwrap().unwrap();
        assert_eq!(c.engine, Some(Engine::Sled));
        let all = |names: &[&str]| names.iter().map(|n| d.join(n)).collect::<Vec<_>>();
        assert_eq!(
            c.foreign,
            all(&["blobs/notes", "snap.00000000000001B0", "tools"])
        );
        let mut own = c.own.clone();
        own.sort();
        assert_eq!(
            own,
            all(&[
                "",
                "blobs",
                "blobs/42",
                "conf",
                "db",
                "engine",
                "snap.00000000000001AF"
            ])
        );
        assert!(matches!(c.only_own(d), Err(Error::NotAStore { found, .. }) if found == c.foreign));

        // An `engine` file that names no engine, beside no engine's files, is someone else's.
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join("engine"), "v8\n").unwrap();
        let c = Contents::read(other.path()).unwrap().unwrap();
        assert_eq!(
            (c.engine, c.foreign),
            (None, vec![other.path().join("engine")])
        );
        // An empty directory is the store's.
        let empty = tempfile::tempdir().unwrap();
        assert!(refuse_foreign(empty.path()).is_ok());
    }
}
