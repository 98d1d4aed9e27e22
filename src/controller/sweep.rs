//! Sweeps: reading every stored object's reference from disk, chunk by chunk.
//!
//! A blocking task iterates the store (lazily, one decoded object at a time) and hands
//! chunks of references to the runner over a channel of capacity one. The runner takes the
//! next chunk only once half of the previous one has started, so a sweep never holds more
//! than about three chunks of references, whatever the size of the collection.

use std::task::{Context, Poll};

use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::triggers::bare_ref;
use crate::Reader;

/// A chunk of references, or a read error of one stored object (the sweep goes on).
pub(crate) type Chunk<K> = crate::Result<Vec<ObjectRef<K>>>;

/// A running sweep; dropping it stops the reading task.
pub(crate) struct Sweep<K: Resource> {
    rx: mpsc::Receiver<Chunk<K>>,
}

impl<K> Sweep<K>
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Clone + Send + 'static,
{
    /// Start reading `reader`'s objects in chunks of `chunk` references.
    pub(crate) fn start(reader: Reader<K>, dyntype: K::DynamicType, chunk: usize) -> Self {
        let (tx, rx) = mpsc::channel(1);
        tokio::task::spawn_blocking(move || {
            let mut buf = Vec::with_capacity(chunk);
            let mut total = 0usize;
            for item in reader.iter() {
                let sent = match item {
                    Ok(obj) => {
                        buf.push(bare_ref(&obj, dyntype.clone()));
                        total += 1;
                        if buf.len() < chunk {
                            continue;
                        }
                        tx.blocking_send(Ok(std::mem::replace(&mut buf, Vec::with_capacity(chunk))))
                    }
                    Err(e) => tx.blocking_send(Err(e)),
                };
                if sent.is_err() {
                    tracing::debug!(
                        total,
                        "sweep abandoned (controller stopped or a new sweep began)"
                    );
                    return;
                }
            }
            if !buf.is_empty() {
                let _ = tx.blocking_send(Ok(buf));
            }
            tracing::debug!(total, "sweep read every stored object");
        });
        Sweep { rx }
    }

    /// The next chunk; `Ready(None)` once the whole store was read.
    pub(crate) fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Chunk<K>>> {
        self.rx.poll_recv(cx)
    }
}
