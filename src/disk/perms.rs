//! File permissions of a store directory: cached objects are cluster data, readable by the
//! owner only (directory 0700, files 0600), whatever the umask.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::model::{Error, Result};

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

/// Entries of the store directory (recursively) that group or others may access.
pub(crate) fn too_open(path: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(path, &mut |p, mode| {
        if mode & 0o077 != 0 {
            out.push(p.to_path_buf());
        }
    });
    out
}

/// Tighten the store directory to 0700 (directories) and 0600 (files).
pub(crate) fn tighten(path: &Path) -> Result<()> {
    let mut result = Ok(());
    walk(path, &mut |p, mode| {
        let want = if p.is_dir() { 0o700 } else { 0o600 };
        if mode & 0o777 != want && result.is_ok() {
            result = set_mode(p, want);
        }
    });
    result
}

fn set_mode(p: &Path, mode: u32) -> Result<()> {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::from_io(p.to_path_buf(), e))
}

fn walk(p: &Path, f: &mut dyn FnMut(&Path, u32)) {
    let Ok(meta) = std::fs::symlink_metadata(p) else {
        return;
    };
    if meta.file_type().is_symlink() {
        return;
    }
    f(p, meta.permissions().mode());
    if meta.is_dir()
        && let Ok(rd) = std::fs::read_dir(p)
    {
        for e in rd.flatten() {
            walk(&e.path(), f);
        }
    }
}
