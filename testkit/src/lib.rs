//! A fake Kubernetes API server over real HTTP on 127.0.0.1, for kube-persist's tests,
//! demo and benchmarks.
//!
//! It serves generic JSON objects for a few resource types ([`ResourceType`]) with the
//! list/watch semantics a reflector depends on: one global revision, consistent paginated
//! snapshots, a bounded event history (older watches and continue tokens get `410 Expired`),
//! bookmarks, streaming lists, label/field selectors, metadata-only responses, bearer-token
//! auth, per-verb request counters and fault injection ([`Faults`]).
//!
//! ```no_run
//! # async fn demo() {
//! use kube_persist_testkit::{ResourceType, TestServer};
//! let server = TestServer::start().await;
//! server.handle().seed_pods(1000, 4);
//! let client = server.client();
//! let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::all(client);
//! # let _ = pods;
//! # }
//! ```
//!
//! # Testing your own controller
//!
//! The server is a test double for what a reflector or a controller depends on (LIST and
//! WATCH, their errors, resumption and expiry), not a conformant API server: there is no
//! admission, no validation of object bodies, no defaulting and no garbage collection of
//! owned objects. Point the controller's `kube::Client` at it ([`TestServer::client`], or
//! [`client_for_opts`] without kube's retry layer so that injected errors reach your code),
//! seed and change objects through its [`ServerHandle`], inject faults, and count requests:
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use k8s_openapi::api::core::v1::Pod;
//! use kube::api::{Api, ListParams};
//! use kube_persist_testkit::{TestServer, Verb, client_for_opts};
//! let server = TestServer::start().await;
//! server.handle().seed_pods(10, 2);
//! let pods: Api<Pod> = Api::all(client_for_opts(&server.url(), None, false));
//! assert_eq!(pods.list(&ListParams::default()).await.unwrap().items.len(), 10);
//! server.handle().faults().fail_next(Verb::List, 503, 1);
//! assert!(pods.list(&ListParams::default()).await.is_err());
//! assert_eq!(server.handle().counts().list, 2);
//! # });
//! ```
//!
//! # HTTP surface
//!
//! - `/api/v1/...` and `/apis/{group}/{version}/...`: LIST (`limit`, `continue`,
//!   `resourceVersion`, `resourceVersionMatch`, `labelSelector`, `fieldSelector`,
//!   `shardSelector` unless [`ServerOptions::sharded_list_and_watch`] is off), WATCH
//!   (`watch=true`, `allowWatchBookmarks`, `sendInitialEvents`, `timeoutSeconds`), GET, POST,
//!   PUT, DELETE; `Accept: ...;as=PartialObjectMetadata(List)` for metadata-only answers.
//!   Errors are Kubernetes `Status` bodies.
//!   LIST and WATCH options are validated like kube-apiserver's `ValidateListOptions`
//!   (422 `Invalid`); errors after a WATCH is accepted (too old or too large
//!   resourceVersion) are one ERROR event on an HTTP 200 stream. Options make the server
//!   stricter or older: opaque resourceVersions, short/empty pages, gzip, servers without
//!   streaming lists ([`ServerOptions`], [`StreamingLists`]).
//! - Admin (same bearer-token rule): `GET /testkit/counts`, `POST /testkit/reset-counts`,
//!   `GET /testkit/revision` (`{"revision": N, "resourceVersion": "<as rendered>"}`),
//!   `POST /testkit/compact`, `POST /testkit/churn?updates=U&creates=C&deletes=D&seed=S`,
//!   `POST /testkit/seed?pods=N&namespaces=M`, and under `POST /testkit/faults/`:
//!   `gone-next-watch`, `too-large-next-watch`, `drop-watch-after?events=N`,
//!   `fail-next?verb=list&status=503&count=1`, `timeout-next?verb=list&count=1`,
//!   `page-delay?ms=N`, `malformed-next-list`, `malformed-next-watch`, `close-watches`, `clear`.
//!   The raw injections ([`Faults::inject_next_list`], [`Faults::inject_next_watch`]) are
//!   in-process only.
//!
//! Note: a [`kube::Client`] built by [`TestServer::client`] keeps kube's default retry layer,
//! which transparently retries 429/503/504 responses (up to 15 times with backoff). Use
//! [`client_for_opts`] with `retry = false` to observe those statuses directly.

#![warn(missing_docs)]
#![deny(unsafe_code)]

mod admin;
mod faults;
mod handle;
mod http;
mod object;
mod pods;
pub mod realk8s;
mod resource;
mod rv;
mod selectors;
mod shared;
mod state;
mod status;
mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

pub use faults::Faults;
pub use handle::ServerHandle;
pub use pods::make_pod;
pub use resource::{RequestCounts, ResourceType, Verb};
pub use status::ApiError;

use shared::Shared;

/// Server configuration.
///
/// Build it with struct-update syntax so new fields keep their defaults:
/// `ServerOptions { gzip: true, ..Default::default() }`.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Address to bind; default `127.0.0.1:0` (an ephemeral port).
    pub addr: SocketAddr,
    /// When set, every request needs `Authorization: Bearer <token>` (else 401 `Status`).
    pub token: Option<String>,
    /// Number of events kept in the history (at least 1); default 10 000.
    pub history: usize,
    /// Period of BOOKMARK events on watches with `allowWatchBookmarks=true`; default 1 s
    /// (minimum 10 ms), which is convenient for tests. kube-apiserver sends one about every
    /// minute (set `Duration::from_secs(60)` for realism), and, like it, this server also
    /// sends one about 2 s before a watch's `timeoutSeconds` deadline when that comes
    /// before the next periodic one. A bookmark's resourceVersion is always the revision
    /// the watch has delivered up to: never ahead of an event not yet sent.
    pub bookmark_interval: Duration,
    /// How long a request for a resourceVersion newer than the current revision waits for
    /// the revision to catch up before failing with 504 `Timeout` and cause
    /// `ResourceVersionTooLarge` (kube-apiserver's watch cache waits 3 s: the default).
    /// A LIST then answers HTTP 504; a WATCH (already accepted) answers HTTP 200 with one
    /// ERROR event carrying that `Status`, then ends. If the revision is reached meanwhile,
    /// the request proceeds normally. See also [`ServerOptions::future_watch_waits`].
    pub too_large_wait: Duration,
    /// When true, a WATCH without `sendInitialEvents=true` from a resourceVersion newer than
    /// the current revision is accepted at once and silently waits: it gets no event until
    /// the revision passes the requested one, then only events after it. That is what
    /// kube-apiserver 1.36's watch cache does (only watch-list requests wait
    /// [`ServerOptions::too_large_wait`] and fail). Default false: every such WATCH waits
    /// `too_large_wait` and then gets the `ResourceVersionTooLarge` ERROR event.
    pub future_watch_waits: bool,
    /// Render every resourceVersion the server emits (objects, list metadata, bookmarks,
    /// `Status` messages) as a non-numeric string that does not sort like the revision
    /// (`tk` + the revision in letters, least significant first), and accept only that form
    /// back (`""` and `"0"` keep their special meaning; a plain number is 400 BadRequest
    /// `invalid resource version`). [`ServerHandle::resource_version`] gives the current
    /// revision in the rendered form. Default false (decimal revisions, like etcd).
    pub opaque_resource_versions: bool,
    /// Make LIST pages with a `limit` short or empty while still carrying a `continue`
    /// token, as etcd-backed lists with selectors can be: page k (0-based) holds no item
    /// when `k % 3 == 1` and about half the limit otherwise. Pages never skip or repeat an
    /// object, the token is present until the last page and `remainingItemCount` stays
    /// exact (or absent, as without this option). Default false.
    pub short_pages: bool,
    /// gzip-compress non-watch responses (LIST, GET, writes, admin and `Status` error bodies)
    /// when the request has `Accept-Encoding: gzip`, with `Content-Encoding: gzip` and
    /// `Vary: Accept-Encoding`. WATCH streams are never compressed: kube-apiserver's
    /// `APIResponseCompression` only applies to the buffered response writer, not to the
    /// watch server. Default false.
    pub gzip: bool,
    /// With [`ServerOptions::gzip`], bodies shorter than this stay uncompressed.
    /// kube-apiserver compresses only bodies over 128 KiB (`defaultGzipThresholdBytes`),
    /// so small `Status` bodies are never compressed there; the default 0 compresses
    /// everything, to exercise clients.
    pub gzip_min_bytes: usize,
    /// How WATCH requests with `sendInitialEvents` (streaming lists) are handled; default
    /// [`StreamingLists::Supported`].
    pub streaming_lists: StreamingLists,
    /// Like kube-apiserver 1.36 with the `ShardedListAndWatch` feature gate (KEP-5866):
    /// LIST and WATCH honour `shardSelector` (only objects whose uid or namespace FNV-1a
    /// hash is in range; lists echo it in `metadata.shardInfo.selector`; a malformed one
    /// is HTTP 500 `invalid shard selector: ...`). Default true; false behaves like a
    /// server without the feature, which ignores the parameter entirely.
    pub sharded_list_and_watch: bool,
}

/// How a server handles streaming lists (WATCH with `sendInitialEvents=true`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamingLists {
    /// Like kube-apiserver 1.36 with the WatchList feature: initial ADDED events, then a
    /// bookmark annotated `k8s.io/initial-events-end` (only with `allowWatchBookmarks=true`).
    #[default]
    Supported,
    /// The storage lacks the `RequestWatchProgress` feature a watch-list needs: a WATCH with
    /// `sendInitialEvents=true` and `allowWatchBookmarks=true` is answered HTTP 200 with a
    /// single ERROR event (500 `InternalError`, `a watch stream was requested by the client
    /// but the required storage feature RequestWatchProgress is disabled`, as kube-apiserver's
    /// cacher sends) and ends. Without bookmarks the request is served as with `Supported`.
    Rejected,
    /// The WatchList feature gate is off: any WATCH with `sendInitialEvents` is 422 `Invalid`
    /// (`sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless the
    /// WatchList feature gate is enabled`).
    Forbidden,
    /// A server older than streaming lists, which ignores `sendInitialEvents` and
    /// `resourceVersionMatch` on WATCH entirely (and `sendInitialEvents` on LIST): a watch
    /// from resourceVersion `""` or `"0"` gets synthetic ADDED events for every current object
    /// then live events, and never an initial-events-end bookmark.
    Ignored,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: None,
            history: 10_000,
            bookmark_interval: Duration::from_secs(1),
            too_large_wait: Duration::from_secs(3),
            future_watch_waits: false,
            opaque_resource_versions: false,
            short_pages: false,
            gzip: false,
            gzip_min_bytes: 0,
            streaming_lists: StreamingLists::Supported,
            sharded_list_and_watch: true,
        }
    }
}

/// A running server. It serves on a tokio task; dropping it shuts the server down
/// (open watch streams end, the listener closes).
pub struct TestServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    /// The serving task (ends once the listener is closed and every connection is done).
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for TestServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestServer")
            .field("url", &self.url())
            .finish()
    }
}

impl TestServer {
    /// Starts a server with [`ServerOptions::default`].
    ///
    /// # Panics
    /// If the address cannot be bound (see [`TestServer::try_start_with`]).
    pub async fn start() -> TestServer {
        Self::start_with(ServerOptions::default()).await
    }

    /// Starts a server holding two Pods, `default/web-0` on `node-1` and `default/web-1`
    /// on `node-2`, both labeled `app=web`: the fixture of kube-persist's doc examples.
    ///
    /// # Panics
    /// As [`TestServer::start`].
    pub async fn with_web_pods() -> TestServer {
        let server = Self::start().await;
        let pods = ResourceType::pods();
        for (name, node) in [("web-0", "node-1"), ("web-1", "node-2")] {
            let pod = serde_json::json!({
                "metadata": {"name": name, "namespace": "default", "labels": {"app": "web"}},
                "spec": {"nodeName": node, "containers": []},
            });
            server.handle().apply(&pods, pod);
        }
        server
    }

    /// Starts a server with the given options.
    ///
    /// # Panics
    /// If `opts.addr` cannot be bound (see [`TestServer::try_start_with`]).
    pub async fn start_with(opts: ServerOptions) -> TestServer {
        let addr = opts.addr;
        match Self::try_start_with(opts).await {
            Ok(s) => s,
            Err(e) => panic!("kube-persist-testkit: cannot bind {addr}: {e}"),
        }
    }

    /// Starts a server, returning the bind error instead of panicking.
    pub async fn try_start_with(opts: ServerOptions) -> std::io::Result<TestServer> {
        let listener = tokio::net::TcpListener::bind(opts.addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(opts));
        let mut server = TestServer {
            addr,
            shared,
            shutdown: None,
            task: None,
        };
        server.serve(listener);
        Ok(server)
    }

    /// Serves on `listener` on a new task until the shutdown signal.
    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let app = http::router(self.shared.clone());
        let (tx, rx) = oneshot::channel::<()>();
        self.task = Some(tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = rx.await;
            });
            if let Err(e) = serve.await {
                tracing::warn!(error = %e, "testkit server stopped with an error");
            }
        }));
        self.shutdown = Some(tx);
        tracing::debug!(addr = %self.addr, "testkit server listening");
    }

    /// Restarts the server as its clients see an API server restart: every open watch
    /// ends, the listener closes and open connections are shut down (new connections are
    /// refused), and after `down` the server listens again on the same address. Objects,
    /// history, counters and pending faults are kept, as an API server restarted on the
    /// same etcd keeps them.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> std::io::Result<()> {
    /// let mut server = kube_persist_testkit::TestServer::with_web_pods().await;
    /// let addr = server.addr();
    /// server.restart(std::time::Duration::from_millis(50)).await?;
    /// assert_eq!(server.addr(), addr);
    /// assert_eq!(server.handle().list(&kube_persist_testkit::ResourceType::pods()).len(), 2);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// If the address cannot be bound again (another process took the port meanwhile).
    pub async fn restart(&mut self, down: Duration) -> std::io::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(mut task) = self.task.take() {
            // Graceful shutdown waits for the requests in flight (a slow LIST page ends
            // within its `Faults::page_delay`); a watch that a kept-alive connection started
            // after the signal is ended too, until the last connection is gone.
            loop {
                self.shared.close_watches();
                let wait = tokio::time::timeout(Duration::from_millis(50), &mut task);
                if wait.await.is_ok() {
                    break;
                }
            }
        }
        tokio::time::sleep(down).await;
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        self.serve(listener);
        Ok(())
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound socket address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A plain-HTTP [`kube::Client`] for this server, sending the bearer token if one is set.
    pub fn client(&self) -> kube::Client {
        client_for(&self.url(), self.shared.opts.token.as_deref())
    }

    /// In-process access to data, counters and faults.
    pub fn handle(&self) -> ServerHandle {
        ServerHandle {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shared.close_watches();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A plain-HTTP [`kube::Client`] for a server at `url` (e.g. one run by `testkit-server` in
/// another process), with kube's default retry layer.
///
/// # Panics
/// If `url` is not a valid URI or the client cannot be built (must be called inside a
/// tokio runtime).
pub fn client_for(url: &str, token: Option<&str>) -> kube::Client {
    client_for_opts(url, token, true)
}

/// Like [`client_for`], choosing whether kube's default retry layer (which retries
/// 429/503/504 responses) is installed.
///
/// # Panics
/// If `url` is not a valid URI or the client cannot be built.
pub fn client_for_opts(url: &str, token: Option<&str>, retry: bool) -> kube::Client {
    let uri: axum::http::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => panic!("kube-persist-testkit: invalid server URL {url:?}: {e}"),
    };
    let mut config = kube::Config::new(uri);
    config.auth_info.token = token.map(|t| secrecy::SecretString::from(t.to_string()));
    config.default_retry = retry;
    match kube::Client::try_from(config) {
        Ok(c) => c,
        Err(e) => panic!("kube-persist-testkit: cannot build a client for {url}: {e}"),
    }
}
