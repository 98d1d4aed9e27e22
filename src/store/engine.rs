//! The storage engine behind one small interface: atomic batch, point get,
//! ordered range scan, flush and clear. Everything above this module is
//! engine-agnostic; sled 0.34 is the engine today.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One key/value pair read from the engine.
pub(crate) type Entry = (Vec<u8>, Vec<u8>);

/// A set of puts and deletes applied atomically: after a crash either all or none are visible.
#[derive(Default)]
pub(crate) struct WriteBatch {
    ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

impl WriteBatch {
    pub(crate) fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.ops.push((key, Some(value)));
    }

    pub(crate) fn delete(&mut self, key: Vec<u8>) {
        self.ops.push((key, None));
    }

    pub(crate) fn len(&self) -> usize {
        self.ops.len()
    }

    /// The keys this batch writes or deletes.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.ops.iter().map(|(k, _)| k.as_slice())
    }
}

/// What the store needs from a storage engine, for one stream's keyspace.
pub(crate) trait Backend: Send + Sync + 'static {
    /// Point lookup.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Apply all operations of `batch` atomically.
    fn apply(&self, batch: WriteBatch) -> Result<()>;
    /// Ordered scan of keys in `[start, end)`, lazily, without collecting.
    fn range(&self, start: &[u8], end: &[u8]) -> Box<dyn Iterator<Item = Result<Entry>> + Send>;
    /// Make everything applied so far durable.
    fn flush(&self) -> Result<()>;
    /// Remove every key of this keyspace.
    fn clear(&self) -> Result<()>;
}

/// One sled tree holding one stream.
pub(crate) struct SledTree {
    tree: sled::Tree,
    path: PathBuf,
    flush_every_batch: bool,
}

impl SledTree {
    pub(crate) fn new(tree: sled::Tree, path: &Path, flush_every_batch: bool) -> Self {
        SledTree {
            tree,
            path: path.to_path_buf(),
            flush_every_batch,
        }
    }

    fn err(&self, e: sled::Error) -> Error {
        Error::from_sled(&self.path, e)
    }
}

impl Backend for SledTree {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.tree
            .get(key)
            .map(|v| v.map(|v| v.to_vec()))
            .map_err(|e| self.err(e))
    }

    fn apply(&self, batch: WriteBatch) -> Result<()> {
        let mut sb = sled::Batch::default();
        for (k, v) in batch.ops {
            match v {
                Some(v) => sb.insert(k, v),
                None => sb.remove(k),
            }
        }
        self.tree.apply_batch(sb).map_err(|e| self.err(e))?;
        if self.flush_every_batch {
            self.flush()?;
        }
        Ok(())
    }

    fn range(&self, start: &[u8], end: &[u8]) -> Box<dyn Iterator<Item = Result<Entry>> + Send> {
        let path = self.path.clone();
        Box::new(
            self.tree
                .range(start.to_vec()..end.to_vec())
                .map(move |r| match r {
                    Ok((k, v)) => Ok((k.to_vec(), v.to_vec())),
                    Err(e) => Err(Error::from_sled(&path, e)),
                }),
        )
    }

    fn flush(&self) -> Result<()> {
        self.tree.flush().map(|_| ()).map_err(|e| self.err(e))
    }

    fn clear(&self) -> Result<()> {
        self.tree.clear().map_err(|e| self.err(e))
    }
}
