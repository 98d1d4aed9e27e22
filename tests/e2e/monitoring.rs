//! `deploy/monitoring/` checked by a real Prometheus against the running operator (issue 58,
//! item 4): the example operator runs as its own process, as its ServiceAccount
//! (impersonated: the test API server makes no tokens), with `deploy/`'s RBAC applied for
//! real; a Prometheus server (Debian's `prometheus`) scrapes its `/metrics` every second
//! and evaluates `deploy/monitoring/rules.yaml` with every range and `for:` shortened (so
//! that the scenario takes a minute, not an hour).
//!
//! - Every metric the rules and `dashboard.json` query is in Prometheus' scrape.
//! - The ServiceAccount's `list` is removed from its ClusterRole while a replica starts
//!   with an empty store (a Pod on a new node): its LIST is refused and retried, and
//!   `KubePersistErrors` fires with `kind="refused"`, `code="403"`; once the verb is back
//!   the replica lists, is ready, and the alert resolves.
//!
//! Without `prometheus` on the PATH the scenario is skipped with one line, unless
//! `KP_REQUIRE_PROMETHEUS=1` (CI installs it and sets that).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::Value;

use crate::common::metric_names::metric_names;
use crate::deploy;
use crate::support::{Fail, Outcome, Server};

/// The label that selects the scenario's Pods (the operator's hidden `--labels`): the
/// shared server's other Pods are not this operator's business.
const SELECTOR: (&str, &str) = ("kp-e2e", "monitoring");
/// The alert that must fire on a refused LIST.
const ERRORS_ALERT: &str = "KubePersistErrors";
/// What every range and `for:` of the rules becomes.
const SHORT_RANGE: &str = "30s";

/// A child process killed (and reaped) when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn free_port() -> Result<u16, Fail> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A GET on 127.0.0.1:`port`: the status and body.
fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(
        conn,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_string()))
}

/// A Prometheus API call's `data`.
fn api(port: u16, path: &str) -> Result<Value, String> {
    let (status, body) = http_get(port, path)?;
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{path}: {e}: {body}"))?;
    if status != 200 || v["status"] != "success" {
        return Err(format!("{path}: {status} {body}"));
    }
    Ok(v["data"].clone())
}

fn query(port: u16, promql: &str) -> Result<Vec<Value>, String> {
    let q: String = form_urlencoded::byte_serialize(promql.as_bytes()).collect();
    let data = api(port, &format!("/api/v1/query?query={q}"))?;
    Ok(data["result"].as_array().cloned().unwrap_or_default())
}

/// Poll `check` every 500 ms until it gives a value, for at most `secs`.
async fn wait_for<T>(
    what: &str,
    secs: u64,
    mut check: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, Fail> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut last = String::new();
    loop {
        match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = e,
        }
        if Instant::now() > deadline {
            return Err(Fail::Diverged(format!(
                "{what}: not within {secs} s (last error: {last})"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `text` with every PromQL range `[..]` and every `for:` set to [`SHORT_RANGE`].
fn shortened(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('[') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        match after.find(']') {
            Some(end)
                if end > 1
                    && after[..end].chars().all(|c| c.is_ascii_alphanumeric())
                    && after[..end].starts_with(|c: char| c.is_ascii_digit()) =>
            {
                out.push('[');
                out.push_str(SHORT_RANGE);
                out.push(']');
                rest = &after[end + 1..];
            }
            _ => {
                out.push('[');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.lines()
        .map(|l| match l.split_once("for:") {
            Some((indent, _)) if indent.trim().is_empty() => format!("{indent}for: 0s"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The example operator built beside this test binary by `cargo test`.
fn operator_binary() -> Result<PathBuf, Fail> {
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("examples").join("operator"))
        .ok_or_else(|| Fail::Error("no target directory".into()))?;
    if !bin.exists() {
        return Err(Fail::Error(format!(
            "{} is not built (cargo test --release --all-features builds the examples)",
            bin.display()
        )));
    }
    Ok(bin)
}

/// The admin kubeconfig of `s`, impersonating `user` (`as:`), as a file in `dir`.
fn impersonating_kubeconfig(s: &Server, user: &str, dir: &Path) -> Result<PathBuf, Fail> {
    let mut config = kube::config::Kubeconfig::read_from(&s.kubeconfig)
        .map_err(|e| Fail::Error(format!("{}: {e}", s.kubeconfig.display())))?;
    for named in &mut config.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.to_string());
        }
    }
    let path = dir.join("kubeconfig-sa.json");
    std::fs::write(&path, serde_json::to_vec(&config)?)?;
    Ok(path)
}

fn start_operator(
    bin: &Path,
    kubeconfig: &Path,
    store: &Path,
    port: u16,
    log: &Path,
) -> Result<Running, Fail> {
    let child = Command::new(bin)
        .args([
            "--cluster",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--labels",
            &format!("{}={}", SELECTOR.0, SELECTOR.1),
            "--log-format",
            "json",
        ])
        .arg("--dir")
        .arg(store)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info")
        .env_remove("KUBE_PERSIST_KEY")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .spawn()?;
    Ok(Running(child))
}

/// The ClusterRole of `rbac.yaml` among `docs`, with its pods verbs set to `verbs`.
fn cluster_role(docs: &[(String, Value)], verbs: &[&str]) -> Result<(String, Value), Fail> {
    let (at, role) = docs
        .iter()
        .find(|(_, d)| d["kind"] == "ClusterRole")
        .ok_or_else(|| Fail::Error("no ClusterRole in deploy/rbac.yaml".into()))?;
    let mut role = role.clone();
    for rule in role["rules"].as_array_mut().into_iter().flatten() {
        if rule["resources"]
            .as_array()
            .is_some_and(|r| r.iter().any(|x| x == "pods"))
        {
            rule["verbs"] = serde_json::json!(verbs);
        }
    }
    Ok((at.clone(), role))
}

/// The `ERRORS_ALERT` alerts Prometheus holds now: `(state, labels)`.
fn errors_alerts(port: u16) -> Result<Vec<(String, Value)>, String> {
    let data = api(port, "/api/v1/alerts")?;
    Ok(data["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["labels"]["alertname"] == ERRORS_ALERT)
        .map(|a| {
            (
                a["state"].as_str().unwrap_or("").to_string(),
                a["labels"].clone(),
            )
        })
        .collect())
}

/// The scenario; see the module docs.
pub async fn prometheus(s: std::sync::Arc<Server>) -> Outcome {
    let Some(prometheus) = which("prometheus") else {
        if std::env::var("KP_REQUIRE_PROMETHEUS").is_ok_and(|v| v == "1") {
            return Err(Fail::Error(
                "prometheus is not installed (apt-get install prometheus) and KP_REQUIRE_PROMETHEUS=1".into(),
            ));
        }
        println!(
            "e2e prometheus skipped: no prometheus on the PATH (Debian: apt-get install prometheus)"
        );
        return Ok(());
    };
    let operator = operator_binary()?;
    let tmp = tempfile::tempdir()?;
    let client = s.client.clone();
    let docs = deploy::access_documents().map_err(Fail::Error)?;
    deploy::apply(client.clone(), &docs, false)
        .await
        .map_err(Fail::Error)?;
    let ns = docs
        .iter()
        .find(|(_, d)| d["kind"] == "ServiceAccount")
        .and_then(|(_, d)| d["metadata"]["namespace"].as_str())
        .ok_or_else(|| Fail::Error("no ServiceAccount in deploy/rbac.yaml".into()))?
        .to_string();
    let sa = docs
        .iter()
        .find(|(_, d)| d["kind"] == "ServiceAccount")
        .and_then(|(_, d)| d["metadata"]["name"].as_str())
        .unwrap_or_default()
        .to_string();
    let user = format!("system:serviceaccount:{ns}:{sa}");
    let kubeconfig = impersonating_kubeconfig(&s, &user, tmp.path())?;

    // The operator's Pods.
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let names: Vec<String> = (0..3).map(|i| format!("prom-{i}")).collect();
    for name in &names {
        let mut pod = deploy::test_pod(name, None).map_err(Fail::Error)?;
        pod.metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert(SELECTOR.0.into(), SELECTOR.1.into());
        let _ = pods.delete(name, &DeleteParams::default()).await;
        pods.create(&PostParams::default(), &pod).await?;
    }

    // Prometheus, scraping the operator's port every second, with the shortened rules.
    let (op_port, prom_port) = (free_port()?, free_port()?);
    let rules_text = std::fs::read_to_string(repo().join("deploy/monitoring/rules.yaml"))?;
    let dashboard = std::fs::read_to_string(repo().join("deploy/monitoring/dashboard.json"))?;
    let rules = tmp.path().join("rules.yaml");
    std::fs::write(&rules, shortened(&rules_text))?;
    let config = tmp.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: kube-persist-operator\n    static_configs:\n      \
             - targets: ['127.0.0.1:{op_port}']\n        labels:\n          namespace: {ns}\n          pod: kube-persist-operator-0\n",
            rules.display()
        ),
    )?;
    let prom_log = tmp.path().join("prometheus.log");
    let _prom = Running(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                tmp.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&prom_log)?)
            .spawn()?,
    );
    let first_log = tmp.path().join("operator-1.log");
    let first = start_operator(
        &operator,
        &kubeconfig,
        &tmp.path().join("store-1"),
        op_port,
        &first_log,
    )?;
    let loaded = wait_for("Prometheus loads the rules", 60, || {
        let groups = api(prom_port, "/api/v1/rules")?;
        let n: usize = groups["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|g| g["rules"].as_array().map_or(0, Vec::len))
            .sum();
        Ok((n > 0).then_some(n))
    })
    .await
    .map_err(|e| with_log(e, &prom_log))?;
    wait_for("Prometheus scrapes a ready store", 120, || {
        let up = query(prom_port, "kube_persist_ready == 1")?;
        Ok((!up.is_empty()).then_some(()))
    })
    .await
    .map_err(|e| with_log(e, &first_log))?;

    // The fault: no `list` for the ServiceAccount; a replica starts with an empty store.
    let (at, without_list) = cluster_role(&docs, &["watch", "patch"])?;
    deploy::apply(client.clone(), &[(at.clone(), without_list)], false)
        .await
        .map_err(Fail::Error)?;
    drop(first);
    let removed = Instant::now();
    let second_log = tmp.path().join("operator-2.log");
    let second = start_operator(
        &operator,
        &kubeconfig,
        &tmp.path().join("store-2"),
        op_port,
        &second_log,
    )?;
    let fired = wait_for("KubePersistErrors fires with kind=refused", 120, || {
        let alerts = errors_alerts(prom_port)?;
        Ok(alerts
            .into_iter()
            .find(|(state, l)| state == "firing" && l["kind"] == "refused")
            .map(|(_, labels)| labels))
    })
    .await
    .map_err(|e| with_log(e, &second_log))?;
    let fired_after = removed.elapsed();
    if fired["code"] != "403" {
        return Err(Fail::Diverged(format!(
            "the refused LIST's alert has code {} (expected 403): {fired}",
            fired["code"]
        )));
    }

    // Every metric the rules and the dashboard query is in the scrape.
    let scraped: BTreeSet<String> = api(prom_port, "/api/v1/label/__name__/values")
        .map_err(Fail::Error)?
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .map(|n| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n)
                .to_string()
        })
        .collect();
    let mut queried = metric_names(&rules_text);
    queried.extend(metric_names(&dashboard));
    let missing: Vec<&String> = queried.iter().filter(|m| !scraped.contains(*m)).collect();
    if !missing.is_empty() {
        return Err(Fail::Diverged(format!(
            "metrics the rules or dashboard query that the operator's scrape lacks: {missing:?}"
        )));
    }

    // The verb back: the replica lists, and the alert resolves.
    let (at, with_list) = cluster_role(&docs, &["list", "watch", "patch"])?;
    deploy::apply(client.clone(), &[(at, with_list)], false)
        .await
        .map_err(Fail::Error)?;
    let restored = Instant::now();
    wait_for("the replica is ready once the verb is back", 120, || {
        let (status, _) = http_get(op_port, "/readyz")?;
        Ok((status == 200).then_some(()))
    })
    .await
    .map_err(|e| with_log(e, &second_log))?;
    wait_for("KubePersistErrors resolves", 180, || {
        Ok(errors_alerts(prom_port)?.is_empty().then_some(()))
    })
    .await?;
    let resolved_after = restored.elapsed();
    drop(second);
    for name in &names {
        let _ = pods.delete(name, &DeleteParams::default()).await;
    }
    println!(
        "e2e prometheus: {loaded} rules loaded; the {} metrics the rules and dashboard query all scraped; \
         {ERRORS_ALERT}{{kind=refused,code=403}} fired {:.1} s after list was removed, resolved {:.1} s after it was back (ranges and for: at {SHORT_RANGE}/0s)",
        queried.len(),
        fired_after.as_secs_f64(),
        resolved_after.as_secs_f64()
    );
    Ok(())
}

/// `e` with the last lines of `log`.
fn with_log(e: Fail, log: &Path) -> Fail {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(8).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    match e {
        Fail::Diverged(m) => {
            Fail::Diverged(format!("{m}; {}:\n{}", log.display(), tail.join("\n")))
        }
        Fail::Error(m) => Fail::Error(format!("{m}; {}:\n{}", log.display(), tail.join("\n"))),
    }
}

/// `name` on the PATH.
fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}
