//! # kube-persist
//!
//! A disk-backed, persistent reflector store for Kubernetes controllers written with
//! [kube-rs](https://kube.rs), built on [redb](https://docs.rs/redb) (the default) or
//! [sled](https://docs.rs/sled): see [`Engine`] for why redb is the default (a store is
//! reopened with the engine that wrote it).
//!
//! Controllers cache the objects they watch. Today's caches (kube-runtime's `Store`,
//! client-go informers) live in RAM: at 100k+ objects that costs gigabytes, every initial
//! LIST and every relist spikes memory well above steady state, and a restarted controller
//! lists the whole cluster again. kube-persist instead:
//!
//! - writes each LIST page and each burst of WATCH events straight into an on-disk keyspace
//!   keyed by object, with the resourceVersion checkpoint **in the same atomic batch**;
//! - **resumes the WATCH from that checkpoint** after a restart or a crash, while the API
//!   server still keeps that history: no relist, only one `LIST limit=1` that reads the
//!   server's current resourceVersion (to know when the store has caught up);
//! - keeps memory flat in the number of objects: a stream holds list pages as raw JSON (two
//!   or three while listing), within a per-directory page budget;
//! - relists after `410 Gone` page by page, skipping unchanged objects and reporting exact
//!   deletions (mark and sweep on disk, no in-memory key set);
//! - serves [`Reader::get`], iteration and namespace scans from disk.
//!
//! The code map, its entry points and its invariants are in the repository's
//! [`ARCHITECTURE.md`](https://github.com/kube-persist/kube-persist/blob/main/ARCHITECTURE.md);
//! the design (data flow, the watcher's state machine, the
//! on-disk layout) is in the repository's
//! [`docs/design.md`](https://github.com/kube-persist/kube-persist/blob/main/docs/design.md),
//! and the manual's topics are in its
//! [`docs/`](https://github.com/kube-persist/kube-persist/tree/main/docs).
//!
//! ```no_run
//! use futures::StreamExt;
//! use k8s_openapi::api::core::v1::Pod;
//! use kube::{Api, Client, runtime::reflector::ObjectRef};
//! use kube_persist::{StreamConfig, Db, Event};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::try_default().await?;
//! let db = Db::open("/var/lib/my-controller/cache")?;
//! let (reader, watcher) = db.store("pods", Api::<Pod>::all(client), StreamConfig::default().drop_managed_fields())?;
//!
//! // Drive the store and react to changes (or `tokio::spawn(watcher.run())` to only cache).
//! tokio::spawn(async move {
//!     let mut events = std::pin::pin!(watcher.stream());
//!     while let Some(ev) = events.next().await {
//!         match ev {
//!             Ok(Event::Resumed { resource_version, .. }) => println!("warm start at {resource_version}"),
//!             Ok(Event::Apply(pod)) => println!("changed: {:?}", pod.metadata.name),
//!             Ok(Event::Delete(pod)) => println!("deleted: {:?}", pod.metadata.name),
//!             Ok(_) => {}
//!             Err(e) => eprintln!("retrying after: {e}"),
//!         }
//!     }
//! });
//!
//! reader.wait_until_ready().await?;
//! let pod = reader.get(&ObjectRef::new("web-0").within("default"))?;
//! # Ok(()) }
//! ```
//!
//! # Features
//!
//! - `sled` (opt-in): the sled engine. Without it, a sled store or
//!   `DbConfig::engine(Engine::Sled)` is [`Error::FeatureNotBuilt`]; redb is always built. sled
//!   0.34's upstream is dormant (see [`Engine`]), so it is not a default.
//! - `encryption` (default): encryption at rest ([`DbConfig::encryption_key`]). Without it,
//!   a key is [`Error::FeatureNotBuilt`].
//! - `metrics`: Prometheus metrics of streams and controllers (`kube_persist::metrics`, with
//!   prometheus-client).
//!
//! The crate enables no Kubernetes version of k8s-openapi, and no TLS stack of kube (it
//! depends on kube with `default-features = false, features = ["client", "runtime"]`): the
//! binary that uses it picks both, as the README's
//! [*Installation*](https://github.com/kube-persist/kube-persist#installation) shows.
#![deny(missing_docs)]
// Safe Rust only; the one exception, the effective uid of the owner check
// (`disk/perms.rs`), and a unit test of key zeroization are allowed where they are.
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod controller;
mod db;
mod disk;
mod exec;
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub mod fuzz;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
mod model;
mod store;
mod sync;

pub use controller::Controller;
pub use controller::keyspace::{ControllerStateInfo, ReconcileStateInfo, ReconcileStates};
pub use db::watcher;
pub use disk::{Compression, DbConfig, Durability, EncryptionKey};
pub use model::resource_version;
pub use model::{Engine, Error, ErrorKind, RequestKind, Result, Shard, ShardKey, Stats};
pub use store::{
    ByIndex, CatchUpRule, Db, Freshness, Iter, RawObjects, Reader, Removed, StreamInfo, SyncPhase,
};
pub use sync::{
    DeletedKey, Event, Pair, RelistMode, SharedEvent, SharedWatcher, StreamConfig, Subscriber,
    Transform, Watcher,
};
pub use sync::{Difference, Verdict, Verification};

/// The README's code blocks are compiled as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
