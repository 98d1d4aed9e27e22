//! [`Fixture`]: what a test starts with. A testkit API server, reached over real HTTP
//! through a real `kube::Client`, holding what the test seeded; and an empty temporary
//! directory for the store, opened with a real engine.

use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, Engine, Reader, StreamConfig};
use kube_persist_testkit::{ServerHandle, TestServer};
use tempfile::TempDir;

use super::{Driven, Ev, drive, init_tracing, try_open_db};

/// A testkit server and a store directory; both go away when it is dropped.
///
/// ```ignore
/// let fx = Fixture::with_pods(1000, 2).await;
/// let db = fx.open(engine);
/// let (reader, mut w) = fx.synced_pods(&db, StreamConfig::default()).await;
/// fx.h.delete(&ResourceType::pods(), Some("ns-0"), "pod-0").unwrap();
/// w.until(|e| *e == Ev::Delete("ns-0/pod-0".into())).await;
/// ```
pub struct Fixture {
    /// The API server: `fx.server.client()` is a new client of it, `url()` its address.
    pub server: TestServer,
    /// The server's objects, counters and faults, in process.
    pub h: ServerHandle,
    /// The store directory (empty at first).
    pub dir: TempDir,
}

impl Fixture {
    /// An empty server (tracing is set up first).
    pub async fn new() -> Fixture {
        init_tracing();
        Fixture::on(TestServer::start().await)
    }

    /// A server holding `pods` Pods `pod-<i>` in namespaces `ns-<i % namespaces>`
    /// ([`ServerHandle::seed_pods`]).
    pub async fn with_pods(pods: usize, namespaces: usize) -> Fixture {
        let fx = Fixture::new().await;
        fx.h.seed_pods(pods, namespaces);
        fx
    }

    /// Around a server the test started itself (with other `ServerOptions`).
    pub fn on(server: TestServer) -> Fixture {
        init_tracing();
        Fixture {
            h: server.handle(),
            server,
            dir: tempfile::tempdir().expect("a temporary directory"),
        }
    }

    /// The store directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Every Pod, through a new client of the server.
    pub fn pods(&self) -> Api<Pod> {
        Api::all(self.server.client())
    }

    /// Open the store directory with `engine` and otherwise default options.
    pub fn open(&self, engine: Engine) -> Db {
        try_open_db(engine, self.path()).expect("the store opens")
    }

    /// Open stream `pods` of `db` (every Pod, [`Fixture::pods`]) with `config`, and drive its
    /// watcher on a task.
    pub fn watch_pods(&self, db: &Db, config: StreamConfig) -> (Reader<Pod>, Driven) {
        let (reader, watcher) = db.store("pods", self.pods(), config).unwrap();
        (reader, drive(watcher))
    }

    /// [`Fixture::watch_pods`], then wait for the end of its first list (`Ev::InitDone`).
    pub async fn synced_pods(&self, db: &Db, config: StreamConfig) -> (Reader<Pod>, Driven) {
        let (reader, mut w) = self.watch_pods(db, config);
        w.until(|e| *e == Ev::InitDone).await;
        (reader, w)
    }
}
