//! File permissions of a store directory: cached objects are cluster data, readable by the
//! owner only (directory 0700, files 0600), whatever the umask. Only the directory and the
//! entries the store made in it ([`Contents`]) are ever read or changed here: a directory
//! that holds anything else is refused ([`Error::NotAStore`]), never tightened.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::engine::Contents;
use crate::model::{Error, Result};

/// The directory a store at `path` really is. A symbolic link is refused with
/// `strict` ([`Error::SymlinkedStore`]); otherwise it is resolved (with a warning), so that
/// the permission checks, the tightening and the engine all work on its target, the real
/// folder. `path` itself when it is no link, or does not exist yet.
pub(crate) fn resolve_root(path: &Path, strict: bool) -> Result<PathBuf> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {}
        Ok(_) => return Ok(path.to_path_buf()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(path.to_path_buf()),
        Err(e) => return Err(Error::from_io(path.to_path_buf(), e)),
    }
    let target = std::fs::canonicalize(path);
    if strict {
        let target = match target {
            Ok(t) => t,
            Err(_) => {
                std::fs::read_link(path).map_err(|e| Error::from_io(path.to_path_buf(), e))?
            }
        };
        return Err(Error::SymlinkedStore {
            path: path.to_path_buf(),
            target,
        });
    }
    let target = target.map_err(|e| Error::from_io(path.to_path_buf(), e))?;
    tracing::warn!(path = %path.display(), target = %target.display(),
        "the store path is a symbolic link; the store is its target (checked, tightened and opened there)");
    Ok(target)
}

/// Check that the directory at `path`, if it exists, belongs to the process's effective
/// user: [`Error::NotOwner`] with `strict`, a warning otherwise (its owner can read the
/// store whatever the modes, and only the owner can tighten them).
pub(crate) fn check_owner(path: &Path, strict: bool) -> Result<()> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::from_io(path.to_path_buf(), e)),
    };
    let (owner, user) = (meta.uid(), effective_uid());
    if owner == user {
        return Ok(());
    }
    if strict {
        return Err(Error::NotOwner {
            path: path.to_path_buf(),
            owner,
            user,
        });
    }
    tracing::warn!(path = %path.display(), owner, user,
        "the store directory belongs to another user, who can read the store whatever its modes");
    Ok(())
}

/// The process's effective uid.
#[allow(unsafe_code)]
fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) takes no argument, touches no memory of the caller, cannot fail
    // and is async-signal-safe; it only reads the calling process's credentials.
    unsafe { libc::geteuid() }
}

/// Create `path` (mode 0700) if missing.
pub(crate) fn create_private_dir(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|e| Error::from_io(path.to_path_buf(), e))?;
    // `mode` is filtered by the umask on creation: set it explicitly.
    set_mode(path, 0o700)
}

/// The store's entries (the directory and what the store made in it) that group or others
/// may access; [`Error::NotAStore`] if it holds anything else.
pub(crate) fn too_open(path: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    each_own(path, &mut |p, mode| {
        if mode & 0o077 != 0 {
            out.push(p.to_path_buf());
        }
        Ok(())
    })?;
    Ok(out)
}

/// Tighten the store's entries to 0700 (directories) and 0600 (files);
/// [`Error::NotAStore`], changing nothing, if the directory holds anything else.
pub(crate) fn tighten(path: &Path) -> Result<()> {
    each_own(path, &mut |p, mode| {
        let want = if p.is_dir() { 0o700 } else { 0o600 };
        if mode & 0o777 != want {
            set_mode(p, want)?;
        }
        Ok(())
    })
}

fn set_mode(p: &Path, mode: u32) -> Result<()> {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::from_io(p.to_path_buf(), e))
}

/// Call `f` with each entry the store made at `path` (the directory first) and its mode,
/// never following a symbolic link; nothing at all if the directory itself is one, or
/// does not exist; [`Error::NotAStore`], calling nothing, if it holds anything else.
fn each_own(path: &Path, f: &mut dyn FnMut(&Path, u32) -> Result<()>) -> Result<()> {
    let Some(contents) = Contents::read(path)? else {
        return Ok(());
    };
    contents.only_own(path)?;
    if contents.own.first().map(PathBuf::as_path) != Some(path) {
        return Ok(());
    }
    for p in &contents.own {
        let Ok(meta) = std::fs::symlink_metadata(p) else {
            continue;
        };
        if !meta.file_type().is_symlink() {
            f(p, meta.permissions().mode())?;
        }
    }
    Ok(())
}
