//! A guard for a real kube-apiserver (with its own etcd) started from the project's shared
//! `realk8s` folder, for end-to-end tests and differential checks against the real server.
//!
//! [`locate`] finds what to run against: the cluster of `KUBE_PERSIST_E2E_KUBECONFIG` when
//! that variable is set, otherwise the realk8s folder of `KUBE_PERSIST_REALK8S` (or the one
//! the caller names, [`locate_or`]): a folder with `start.sh`, `stop.sh` and `compact.sh`
//! scripts that run a kube-apiserver with its own etcd. When neither exists it says why, so
//! that the caller can print one line and skip.
//!
//! [`RealK8s::start`] runs `start.sh` in a temporary directory (with the test process as the
//! watchdog's owner, so that nothing outlives a killed test), and its `Drop` runs
//! `stop.sh DIR --wipe`. [`RealK8s::stop`] and [`RealK8s::restart`] keep the data;
//! [`RealK8s::compact`] compacts etcd to its current revision. [`request_count`] reads the
//! server's own `apiserver_request_total` from `/metrics`.
//!
//! The start, stop and compact calls wait for child processes: call them from a blocking
//! context (`tokio::task::block_in_place` or `spawn_blocking`) when other tasks must keep
//! running meanwhile.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kube_persist_testkit::realk8s::Error> {
//! use kube_persist_testkit::realk8s::{self, Target};
//! let server = match realk8s::locate_or("/opt/realk8s") {
//!     Target::Folder(folder) => realk8s::RealK8s::start(&folder, "")?,
//!     Target::Kubeconfig(path) => realk8s::RealK8s::external(&path),
//!     Target::Missing(why) => {
//!         println!("e2e: skipped: {why}");
//!         return Ok(());
//!     }
//! };
//! let client = server.client().await?;
//! println!("kube-apiserver {}", realk8s::git_version(&client).await?);
//! let lists = realk8s::request_count(&client, "pods", "LIST").await?;
//! # let _ = lists;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment variable naming the kubeconfig of an existing cluster to test against.
pub const KUBECONFIG_ENV: &str = "KUBE_PERSIST_E2E_KUBECONFIG";
/// Environment variable naming a realk8s folder (it wins over [`locate_or`]'s argument).
pub const FOLDER_ENV: &str = "KUBE_PERSIST_REALK8S";

/// An error starting, stopping or talking to the real server, with what was being done.
#[derive(Debug)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

fn err(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Error {
    Error(format!("{what}: {e}"))
}

/// What an end-to-end test can run against.
#[derive(Debug, Clone)]
pub enum Target {
    /// The shared `realk8s` folder (holding `start.sh`): start servers from it.
    Folder(PathBuf),
    /// An existing cluster's kubeconfig (`KUBE_PERSIST_E2E_KUBECONFIG`).
    Kubeconfig(PathBuf),
    /// Neither: the reason, for the caller's one skip line.
    Missing(String),
}

/// Finds what to run against: `KUBE_PERSIST_E2E_KUBECONFIG` if set, else the realk8s folder
/// of `KUBE_PERSIST_REALK8S` if it holds `start.sh`, else [`Target::Missing`] with the reason.
///
/// ```
/// match kube_persist_testkit::realk8s::locate() {
///     kube_persist_testkit::realk8s::Target::Missing(why) => assert!(!why.is_empty()),
///     _ => {}
/// }
/// ```
pub fn locate() -> Target {
    find(None)
}

/// Like [`locate`], with `folder` as the realk8s folder when `KUBE_PERSIST_REALK8S` is not set.
///
/// ```
/// use kube_persist_testkit::realk8s::{Target, locate_or};
/// let none = tempfile::tempdir().unwrap();
/// if std::env::var_os("KUBE_PERSIST_REALK8S").is_none()
///     && std::env::var_os("KUBE_PERSIST_E2E_KUBECONFIG").is_none()
/// {
///     assert!(matches!(locate_or(none.path()), Target::Missing(_)));
/// }
/// ```
pub fn locate_or(folder: impl AsRef<Path>) -> Target {
    find(Some(folder.as_ref()))
}

fn find(default: Option<&Path>) -> Target {
    if let Some(k) = std::env::var_os(KUBECONFIG_ENV).filter(|k| !k.is_empty()) {
        return Target::Kubeconfig(PathBuf::from(k));
    }
    let Some(folder) = std::env::var_os(FOLDER_ENV)
        .filter(|f| !f.is_empty())
        .map(PathBuf::from)
        .or_else(|| default.map(Path::to_path_buf))
    else {
        return Target::Missing(format!(
            "no real kube-apiserver: neither {FOLDER_ENV} nor {KUBECONFIG_ENV} is set"
        ));
    };
    if folder.join("start.sh").is_file() {
        // Canonical, so that messages and scripts see a plain path.
        Target::Folder(folder.canonicalize().unwrap_or(folder))
    } else {
        Target::Missing(format!(
            "no real kube-apiserver: {} has no start.sh and {KUBECONFIG_ENV} is not set",
            folder.display()
        ))
    }
}

/// Where `start.sh` unpacks the binaries once for all instances (`REALK8S_BIN_CACHE`).
fn bin_cache() -> PathBuf {
    std::env::temp_dir().join("kube-persist-realk8s-bin")
}

/// A real kube-apiserver: one started by this guard (stopped and wiped on drop), or an
/// external cluster (never stopped).
#[derive(Debug)]
pub struct RealK8s {
    /// The shared folder and the instance's directory, when this guard runs the server.
    local: Option<(PathBuf, Instance)>,
    extra_flags: String,
    kubeconfig: PathBuf,
    running: bool,
}

impl RealK8s {
    /// Starts a kube-apiserver and its etcd from `folder` in a new temporary directory, with
    /// `extra_flags` as `EXTRA_APISERVER_FLAGS` (e.g. `--watch-cache-sizes=pods#0`); returns
    /// once the server is ready.
    pub fn start(folder: &Path, extra_flags: &str) -> Result<Self, Error> {
        let dir = tempfile::Builder::new()
            .prefix("realk8s")
            .tempdir()
            .map_err(|e| err("creating the server's directory", e))?;
        let kubeconfig = dir.path().join("kubeconfig");
        let mut me = RealK8s {
            local: Some((folder.to_path_buf(), Instance::Temporary(dir))),
            extra_flags: extra_flags.to_string(),
            kubeconfig,
            running: false,
        };
        me.restart()?;
        Ok(me)
    }

    /// Starts (or starts again) a kube-apiserver and its etcd from `folder` in `dir`, which
    /// is kept: its data outlives this guard, whose `Drop` only stops the servers. For
    /// benchmarks that load their data once and reuse it between runs. Blocks until ready.
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), kube_persist_testkit::realk8s::Error> {
    /// let folder = std::path::Path::new("/opt/realk8s");
    /// let server = kube_persist_testkit::realk8s::RealK8s::start_kept(folder, "/var/tmp/k8s", "")?;
    /// assert_eq!(server.dir(), Some(std::path::Path::new("/var/tmp/k8s")));
    /// # Ok(()) }
    /// ```
    pub fn start_kept(
        folder: &Path,
        dir: impl Into<PathBuf>,
        extra_flags: &str,
    ) -> Result<Self, Error> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| err(format!("creating {}", dir.display()), e))?;
        let mut me = RealK8s {
            kubeconfig: dir.join("kubeconfig"),
            local: Some((folder.to_path_buf(), Instance::Kept(dir))),
            extra_flags: extra_flags.to_string(),
            running: false,
        };
        me.restart()?;
        Ok(me)
    }

    /// An existing cluster, from its kubeconfig: [`stop`](Self::stop),
    /// [`restart`](Self::restart) and [`compact`](Self::compact) are refused.
    pub fn external(kubeconfig: &Path) -> Self {
        RealK8s {
            local: None,
            extra_flags: String::new(),
            kubeconfig: kubeconfig.to_path_buf(),
            running: true,
        }
    }

    /// Whether this guard started the server (and so can stop, restart and compact it).
    pub fn is_local(&self) -> bool {
        self.local.is_some()
    }

    /// The instance's directory (`DIR` of the realk8s scripts), for a local server.
    pub fn dir(&self) -> Option<&Path> {
        self.local.as_ref().map(|(_, d)| d.path())
    }

    /// The `EXTRA_APISERVER_FLAGS` this server was started with.
    pub fn extra_flags(&self) -> &str {
        &self.extra_flags
    }

    fn script(&self, name: &str) -> Result<(Command, &Path), Error> {
        let (folder, dir) = self.local.as_ref().ok_or_else(|| {
            Error(format!(
                "{name}: the cluster of {KUBECONFIG_ENV} is not run by this guard"
            ))
        })?;
        let mut cmd = Command::new(folder.join(name));
        cmd.arg(dir.path());
        Ok((cmd, dir.path()))
    }

    fn run(what: &str, mut cmd: Command) -> Result<String, Error> {
        let out = cmd.output().map_err(|e| err(what, e))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(Error(format!(
                "{what} failed ({}): {}{}",
                out.status,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(stdout)
    }

    /// Starts the server again in the same directory after [`stop`](Self::stop): the data
    /// and the URL (the same ports) are kept. Blocks until it is ready.
    pub fn restart(&mut self) -> Result<(), Error> {
        let (mut cmd, dir) = self.script("start.sh")?;
        let ready = format!("realk8s ready: {}", dir.join("kubeconfig").display());
        // Keep the previous ports: start.sh takes them again only if no socket (other than
        // TIME_WAIT) uses them, and a client's connections to the stopped server can hold
        // the server's side in FIN_WAIT2 for a minute; the servers bind with SO_REUSEADDR.
        // Clients then follow the restart, as they would a real API server's.
        if let Ok(ports) = std::fs::read_to_string(dir.join("run").join("ports")) {
            for line in ports.lines() {
                if let Some((k, v)) = line.split_once('=')
                    && ["APISERVER_PORT", "ETCD_PORT", "ETCD_PEER_PORT"].contains(&k)
                {
                    cmd.env(k, v);
                }
            }
        }
        cmd.env("REALK8S_OWNER_PID", std::process::id().to_string())
            .env("REALK8S_BIN_CACHE", bin_cache())
            .env("EXTRA_APISERVER_FLAGS", &self.extra_flags);
        let out = Self::run("start.sh", cmd)?;
        // The script's last line names DIR made absolute; tempdir paths already are, but
        // compare only the suffix in case /tmp is a symlink.
        let last = out.lines().last().unwrap_or_default();
        if !last.starts_with("realk8s ready: ") || !last.ends_with("/kubeconfig") {
            return Err(Error(format!(
                "start.sh: unexpected last line {last:?} (wanted {ready:?})"
            )));
        }
        self.running = true;
        Ok(())
    }

    /// Stops the server (both processes), keeping its data for [`restart`](Self::restart).
    pub fn stop(&mut self) -> Result<(), Error> {
        let (cmd, _) = self.script("stop.sh")?;
        Self::run("stop.sh", cmd)?;
        self.running = false;
        Ok(())
    }

    /// Compacts etcd physically to its current revision (`compact.sh`); returns what the
    /// script printed (`compacted to revision N`).
    pub fn compact(&self) -> Result<String, Error> {
        let (cmd, _) = self.script("compact.sh")?;
        Self::run("compact.sh", cmd).map(|out| out.trim().to_string())
    }

    /// The kubeconfig file of this server.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A new [`kube::Client`] from the kubeconfig (it keeps working across
    /// [`restart`](Self::restart), which keeps the URL).
    pub async fn client(&self) -> Result<kube::Client, Error> {
        let config = self.config().await?;
        kube::Client::try_from(config).map_err(|e| err("client", e))
    }

    /// The [`kube::Config`] of the kubeconfig (to change, e.g., `default_retry` before
    /// building a client).
    pub async fn config(&self) -> Result<kube::Config, Error> {
        let what = || format!("config from {}", self.kubeconfig.display());
        let kc =
            kube::config::Kubeconfig::read_from(&self.kubeconfig).map_err(|e| err(what(), e))?;
        kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .map_err(|e| err(what(), e))
    }
}

impl Drop for RealK8s {
    fn drop(&mut self) {
        let wipe = matches!(self.local, Some((_, Instance::Temporary(_))));
        if let Ok((mut cmd, _)) = self.script("stop.sh") {
            if wipe {
                cmd.arg("--wipe");
            }
            if let Err(e) = Self::run("stop.sh", cmd) {
                eprintln!("realk8s: {e}");
            }
        }
    }
}

/// The directory a local server runs in: a temporary one (wiped with the guard) or one the
/// caller keeps ([`RealK8s::start_kept`]).
#[derive(Debug)]
enum Instance {
    Temporary(tempfile::TempDir),
    Kept(PathBuf),
}

impl Instance {
    fn path(&self) -> &Path {
        match self {
            Instance::Temporary(d) => d.path(),
            Instance::Kept(p) => p,
        }
    }
}

/// The number of requests the server has counted for `resource` (plural, e.g. `pods`)
/// with `verb` as `/metrics` labels it (`LIST`, `WATCH`, `GET`, `POST`, ...), summed over
/// response codes, scopes and clients. kube-apiserver counts a LIST when it is answered and
/// a WATCH (a streaming list too) only when it ends: read it just before and after the
/// client being measured, since every client of the server adds to it.
pub async fn request_count(
    client: &kube::Client,
    resource: &str,
    verb: &str,
) -> Result<u64, Error> {
    Ok(count_requests(&metrics(client).await?, resource, verb))
}

/// Whether `/metrics` reports feature gate `name` enabled (`kubernetes_feature_enabled`).
pub async fn feature_enabled(client: &kube::Client, name: &str) -> Result<bool, Error> {
    let text = metrics(client).await?;
    let needle = format!("name=\"{name}\"");
    Ok(text
        .lines()
        .filter(|l| l.starts_with("kubernetes_feature_enabled{") && l.contains(&needle))
        .any(|l| l.trim_end().ends_with(" 1")))
}

/// The server's `/metrics` text.
pub async fn metrics(client: &kube::Client) -> Result<String, Error> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .map_err(|e| err("GET /metrics", e))?;
    client
        .request_text(req)
        .await
        .map_err(|e| err("GET /metrics", e))
}

/// `gitVersion` of the server's `/version` (e.g. `v1.36.2`).
pub async fn git_version(client: &kube::Client) -> Result<String, Error> {
    client
        .apiserver_version()
        .await
        .map(|v| v.git_version)
        .map_err(|e| err("GET /version", e))
}

/// Sums the `apiserver_request_total` samples of `resource` and `verb` in `/metrics` text.
///
/// ```
/// let text = r#"apiserver_request_total{code="200",resource="pods",scope="cluster",verb="LIST"} 3
/// apiserver_request_total{code="410",resource="pods",scope="namespace",verb="LIST"} 2
/// apiserver_request_total{code="200",resource="pods",scope="cluster",verb="WATCH"} 7"#;
/// assert_eq!(kube_persist_testkit::realk8s::count_requests(text, "pods", "LIST"), 5);
/// ```
pub fn count_requests(metrics: &str, resource: &str, verb: &str) -> u64 {
    let res = format!("resource=\"{resource}\"");
    let verb = format!("verb=\"{verb}\"");
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("apiserver_request_total{"))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once("} ")?;
            let labels: Vec<&str> = labels.split(',').collect();
            (labels.contains(&res.as_str()) && labels.contains(&verb.as_str()))
                .then(|| value.trim().parse::<f64>().ok())?
        })
        .map(|v| v as u64)
        .sum()
}
