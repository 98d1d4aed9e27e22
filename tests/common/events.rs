//! A watcher's event stream driven on a task, its events compact for assertions.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kube::Resource;
use kube_persist::{Event, Watcher};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use super::WAIT;

/// A compact view of an event for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ev {
    Resumed(String),
    Init,
    InitApply(String),
    InitDone,
    Apply(String),
    Delete(String),
    Error(String),
}

pub fn key<K: Resource>(k: &K) -> String {
    let m = k.meta();
    match &m.namespace {
        Some(ns) => format!("{ns}/{}", m.name.clone().unwrap_or_default()),
        None => m.name.clone().unwrap_or_default(),
    }
}

/// Runs a watcher's event stream on a task and forwards compact events.
pub struct Driven {
    pub rx: mpsc::UnboundedReceiver<Ev>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Driven {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

pub fn drive<K>(watcher: Watcher<K>) -> Driven
where
    K: Resource + DeserializeOwned + Send + Sync + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut s = std::pin::pin!(watcher.stream());
        while let Some(ev) = s.next().await {
            let ev = match ev {
                Ok(Event::Resumed {
                    resource_version, ..
                }) => Ev::Resumed(resource_version),
                Ok(Event::Init) => Ev::Init,
                Ok(Event::InitApply(k)) => Ev::InitApply(key(&k)),
                Ok(Event::InitDone) => Ev::InitDone,
                Ok(Event::Apply(k)) => Ev::Apply(key(&k)),
                Ok(Event::Delete(k)) => Ev::Delete(key(&k)),
                Ok(Event::DeleteKey(k)) => Ev::Delete(k.to_string()),
                Ok(_) => panic!("an event this harness does not know"),
                Err(e) => Ev::Error(e.to_string()),
            };
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    Driven {
        rx,
        task: Some(task),
    }
}

impl Driven {
    /// Stop the watcher and wait until its task (and so its store handles) is gone.
    pub async fn stop(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    /// Collect events until `pred` holds for one of them; returns all events seen.
    pub async fn until(&mut self, pred: impl Fn(&Ev) -> bool) -> Vec<Ev> {
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(ev)) => {
                    let done = pred(&ev);
                    seen.push(ev);
                    if done {
                        return seen;
                    }
                }
                Ok(None) => panic!("watcher stream ended; events so far: {}", summary(&seen)),
                Err(_) => panic!(
                    "timed out waiting for an event; events so far: {}",
                    summary(&seen)
                ),
            }
        }
    }

    /// Collect whatever arrives within `d`.
    pub async fn drain_for(&mut self, d: Duration) -> Vec<Ev> {
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + d;
        while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, self.rx.recv()).await {
            seen.push(ev);
        }
        seen
    }
}

pub fn summary(evs: &[Ev]) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for e in evs {
        let k = match e {
            Ev::Resumed(_) => "Resumed",
            Ev::Init => "Init",
            Ev::InitApply(_) => "InitApply",
            Ev::InitDone => "InitDone",
            Ev::Apply(_) => "Apply",
            Ev::Delete(_) => "Delete",
            Ev::Error(_) => "Error",
        };
        *counts.entry(k).or_default() += 1;
    }
    let errors: Vec<_> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::Error(s) => Some(s.as_str()),
            _ => None,
        })
        .take(3)
        .collect();
    format!("{counts:?} errors: {errors:?}")
}

/// The keys of the `Delete` events among `evs`, sorted.
pub fn deleted_keys(evs: &[Ev]) -> Vec<String> {
    let mut keys: Vec<String> = evs
        .iter()
        .filter_map(|e| match e {
            Ev::Delete(k) => Some(k.clone()),
            _ => None,
        })
        .collect();
    keys.sort_unstable();
    keys
}

/// Collect events until `Apply(key)` arrives: the positive signal that everything the stream
/// delivered before the change that produced it has been received.
pub async fn until_apply(w: &mut Driven, key: &str) -> Vec<Ev> {
    let want = Ev::Apply(key.to_string());
    w.until(|e| *e == want).await
}
