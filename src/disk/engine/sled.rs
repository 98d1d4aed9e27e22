//! The sled 0.34 engine: one sled database per store directory, one tree per stream.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::held::Held;
use super::{
    Backend, Engine, Entry, Guarded, OpenReads, Storage, WriteBatch, catch_open, catch_panic,
};
use crate::disk::{DbConfig, Durability};
use crate::model::{Error, Result};

/// One sled database.
pub(super) struct SledStorage {
    sled: sled::Db,
    path: PathBuf,
    flush_every_batch: bool,
    /// Shared with every tree; dropped after the last of them.
    held: Arc<Held>,
    /// The scans open on the directory, shared with every tree.
    reads: Arc<OpenReads>,
}

impl SledStorage {
    pub(super) fn open(path: &Path, config: &DbConfig) -> Result<SledStorage> {
        let flush_every_ms = match config.durability {
            Durability::Periodic(d) => Some((d.as_millis() as u64).max(1)),
            Durability::EveryBatch => None,
        };
        // Whether sled's log holds anything: if it does, sled must recover something from it.
        let had_data = std::fs::metadata(path.join("db")).is_ok_and(|m| m.len() > 0);
        // Measured (BENCHMARKS.md, "sled's memory under reads"): sled 0.34 splits its page cache into 256
        // shards that evict only after 64 queued reads each and never drop their last page,
        // so under random reads it holds thousands of ~33 KB leaves whatever
        // `cache_capacity` says; `Mode` is stored but read by nothing, and a smaller
        // `segment_size` only turns leaves into blob files. The defaults are kept.
        let sled_config = sled::Config::new()
            .path(path)
            .cache_capacity(config.cache_capacity)
            .flush_every_ms(flush_every_ms);
        let sled = open_sled(&sled_config, path)?;
        check_marker(&sled, path, had_data)?;
        tracing::debug!(path = %path.display(), recovered = sled.was_recovered(), "sled opened");
        Ok(SledStorage {
            sled,
            path: path.to_path_buf(),
            flush_every_batch: config.durability == Durability::EveryBatch,
            held: Arc::new(Held::new(path)),
            reads: Arc::default(),
        })
    }

    fn err(&self, e: sled::Error) -> Error {
        sled_error(&self.path, e)
    }
}

impl Storage for SledStorage {
    fn keyspace_of(&self, group: &str, name: &str) -> Result<Arc<dyn Backend>> {
        let tree = self
            .sled
            .open_tree(format!("{group}{name}"))
            .map_err(|e| self.err(e))?;
        Ok(Arc::new(SledTree {
            tree,
            path: self.path.clone(),
            flush_every_batch: self.flush_every_batch,
            held: self.held.clone(),
            reads: self.reads.clone(),
        }))
    }

    fn keyspaces_of(&self, group: &str) -> Result<Vec<String>> {
        Ok(self
            .sled
            .tree_names()
            .iter()
            .filter_map(|n| std::str::from_utf8(n).ok()?.strip_prefix(group))
            .map(str::to_string)
            .collect())
    }

    fn drop_keyspace(&self, group: &str, name: &str) -> Result<bool> {
        let dropped = catch_panic(&self.path, "dropping a keyspace", || {
            self.sled
                .drop_tree(format!("{group}{name}"))
                .map_err(|e| self.err(e))
        })?;
        self.flush()?;
        Ok(dropped)
    }

    fn flush(&self) -> Result<()> {
        self.sled.flush().map(|_| ()).map_err(|e| self.err(e))
    }

    fn engine(&self) -> Engine {
        Engine::Sled
    }

    fn size_on_disk(&self) -> Result<u64> {
        self.sled.size_on_disk().map_err(|e| self.err(e))
    }
}

/// One sled tree holding one stream.
struct SledTree {
    tree: sled::Tree,
    path: PathBuf,
    flush_every_batch: bool,
    /// Dropped after `tree` (and after each scan's iterator, which holds a clone).
    held: Arc<Held>,
    reads: Arc<OpenReads>,
}

impl SledTree {
    fn err(&self, e: sled::Error) -> Error {
        sled_error(&self.path, e)
    }

    /// Make everything applied so far durable.
    fn flush(&self) -> Result<()> {
        catch_panic(&self.path, "flushing", || {
            self.tree.flush().map(|_| ()).map_err(|e| self.err(e))
        })
    }
}

impl Backend for SledTree {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        catch_panic(&self.path, "reading", || {
            self.tree
                .get(key)
                .map(|v| v.map(|v| v.to_vec()))
                .map_err(|e| self.err(e))
        })
    }

    fn apply(&self, batch: WriteBatch) -> Result<()> {
        let mut sb = sled::Batch::default();
        for (k, v) in batch.ops {
            match v {
                Some(v) => sb.insert(k, v),
                None => sb.remove(k),
            }
        }
        catch_panic(&self.path, "writing", || {
            self.tree.apply_batch(sb).map_err(|e| self.err(e))
        })?;
        if self.flush_every_batch {
            self.flush()?;
        }
        Ok(())
    }

    fn range(&self, start: &[u8], end: &[u8]) -> Box<dyn Iterator<Item = Result<Entry>> + Send> {
        let (path, held) = (self.path.clone(), self.held.clone());
        let entries = self
            .tree
            .range(start.to_vec()..end.to_vec())
            // The closure owns a mark, dropped after sled's iterator.
            .map(move |r| {
                let _open = &held;
                match r {
                    Ok((k, v)) => Ok((k.to_vec(), v.to_vec())),
                    Err(e) => Err(sled_error(&path, e)),
                }
            });
        Box::new(Guarded::new(entries, &self.path, self.reads.begin()))
    }

    fn engine(&self) -> Engine {
        Engine::Sled
    }

    fn open_reads(&self) -> Arc<OpenReads> {
        self.reads.clone()
    }

    fn clear(&self) -> Result<()> {
        catch_panic(&self.path, "clearing a stream", || {
            self.tree.clear().map_err(|e| self.err(e))
        })
    }

    fn disk_bytes(&self) -> Result<u64> {
        catch_panic(&self.path, "scanning a stream", || {
            self.tree.iter().try_fold(0u64, |sum, entry| {
                let (k, v) = entry.map_err(|e| self.err(e))?;
                Ok(sum + (k.len() + v.len()) as u64)
            })
        })
    }
}

/// Open and close the sled database at `path`: [`Error::Locked`] if it is open elsewhere.
pub(super) fn probe_lock(path: &Path) -> Result<()> {
    open_sled(&sled::Config::new().path(path), path).map(drop)
}

/// Open sled, turning a panic inside it (which some damaged files cause) into
/// [`Error::Corrupt`] naming the path.
fn open_sled(config: &sled::Config, path: &Path) -> Result<sled::Db> {
    catch_open(path, || match config.open() {
        // sled reports a `conf` file it cannot parse as a store from an old sled version.
        Err(sled::Error::Unsupported(detail)) if detail.contains("earlier than 0.29") => {
            Err(Error::Corrupt {
                path: path.to_path_buf(),
                detail: format!("its conf file does not parse ({detail})"),
            })
        }
        res => res.map_err(|e| sled_error(path, e)),
    })
}

/// Key (in sled's default tree) written once when a store is created.
const MARKER_KEY: &[u8] = b"kube-persist/store";

/// Tell a store that sled could not read from a new one. sled recovers a log whose bytes are
/// garbage as an empty database, silently; a store always holds its marker, so a non-empty
/// log that recovers to nothing is reported as [`Error::Corrupt`].
fn check_marker(sled: &sled::Db, path: &Path, had_data: bool) -> Result<()> {
    let err = |e| sled_error(path, e);
    if sled.contains_key(MARKER_KEY).map_err(err)? {
        return Ok(());
    }
    // Stores written before the marker existed have stream trees: adopt them.
    let has_trees = sled.tree_names().len() > 1;
    if had_data && !has_trees && sled.is_empty() {
        return Err(Error::Corrupt {
            path: path.to_path_buf(),
            detail: "its db file holds data, but the storage engine recovered nothing from it \
                     (overwritten or not a sled log)"
                .into(),
        });
    }
    sled.insert(MARKER_KEY, &b"1"[..]).map_err(err)?;
    sled.flush().map_err(err)?;
    Ok(())
}

/// Map a sled error to a user-facing error naming the store path (sled's errors are the sled
/// engine's to map: the error type itself knows no engine).
fn sled_error(path: &std::path::Path, err: sled::Error) -> Error {
    let path = path.to_path_buf();
    match err {
        sled::Error::Io(io) => Error::from_io(path, io),
        sled::Error::Corruption { at, .. } => Error::Corrupt {
            path,
            detail: match at {
                Some(at) => format!("engine detected corruption at {at:?}"),
                None => "engine detected corruption".to_string(),
            },
        },
        sled::Error::CollectionNotFound(name) => Error::Storage {
            path,
            detail: format!("tree {:?} not found", String::from_utf8_lossy(&name)),
        },
        sled::Error::Unsupported(detail) | sled::Error::ReportableBug(detail) => {
            Error::Storage { path, detail }
        }
    }
}
