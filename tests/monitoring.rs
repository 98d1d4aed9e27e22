//! The monitoring files of `deploy/monitoring/` (issue 58, items 3, 4 and 6) and the
//! deployment steps that go with them.
//!
//! - `promtool check rules` on `rules.yaml` and `promtool test rules` on `rules.test.yaml`
//!   (Prometheus's own parser and rule engine), and `promtool check rules` on the
//!   dashboard's queries; every alert has a unit test case where it fires and one where it
//!   does not. Without promtool (Debian's `prometheus` package) these checks print one line
//!   and pass, unless `KP_REQUIRE_PROMETHEUS=1` (set by `.ci/run`) makes that a failure.
//! - `prometheusrule.yaml`'s `spec.groups` equal `rules.yaml`'s `groups`.
//! - Every alert has a severity, a summary, a description and a `runbook_url` into a
//!   heading of docs/operations.md (GitHub's anchors).
//! - Every metric the rules and the dashboard name is one the library serves, and the
//!   dashboard shows every metric an alert uses.
//! - `podmonitor.yaml` and the StatefulSets' `prometheus.io/*` annotations scrape the port
//!   the operator serves `/metrics` on.
//! - docs/kubernetes.md puts the image where the cluster pulls it, and warns about what the
//!   operator does, before `kubectl apply -f deploy/`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

#[path = "common/metric_names.rs"]
mod metric_names;
use metric_names::metric_names;

/// The metrics docs/operations.md, *Metrics*, lists (the table a test of the `it` suite
/// holds equal to a scrape, `metrics::the_metric_tables_and_a_scrape_name_the_same_metrics`):
/// every name, and the histograms among them (a scrape returns those as `_bucket`, `_sum`,
/// `_count`).
fn documented_metrics() -> (BTreeSet<String>, BTreeSet<String>) {
    let ops = read(&root().join("docs/operations.md"));
    let at = ops
        .find("\n## Metrics")
        .expect("docs/operations.md: ## Metrics");
    let section = &ops[at..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let ticked = |s: &str| -> Vec<String> {
        s.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    let counters = {
        let para = &section[section.find("The counters of").expect("the counters' list")..];
        let para = &para[..para.find("\n\n").unwrap_or(para.len())];
        ticked(para.split_once(':').expect("a list after a colon").1)
    };
    let (mut names, mut histograms) = (BTreeSet::new(), BTreeSet::new());
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with("`kube_persist_") {
            continue;
        }
        let name = cells[1].trim_matches('`');
        if name == "kube_persist_<field>_total" {
            names.extend(counters.iter().map(|c| format!("kube_persist_{c}_total")));
        } else {
            names.insert(name.to_string());
            if cells[2] == "histogram" {
                histograms.insert(name.to_string());
            }
        }
    }
    assert!(names.len() > 40 && histograms.len() >= 4, "{names:?}");
    (names, histograms)
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn monitoring() -> PathBuf {
    root().join("deploy/monitoring")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn yaml(path: &Path) -> Value {
    serde_saphyr::from_str(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn dashboard() -> Value {
    let path = monitoring().join("dashboard.json");
    serde_json::from_str(&read(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The alerting rules of a `groups` list.
fn alerts(groups: &Value) -> Vec<&Value> {
    groups
        .as_array()
        .expect("groups is a list")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("a group's rules is a list"))
        .filter(|r| r.get("alert").is_some())
        .collect()
}

fn alert_names(groups: &Value) -> BTreeSet<String> {
    alerts(groups)
        .iter()
        .map(|r| r["alert"].as_str().expect("alert is a string").to_string())
        .collect()
}

/// Every expression of the dashboard's panels (rows included).
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"].as_str().unwrap_or_default();
                out.push((title.clone(), expr.to_string()));
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// promtool, or `None` (and one line saying so) when it is not installed and
/// `KP_REQUIRE_PROMETHEUS` is not `1`.
fn promtool(what: &str) -> Option<Command> {
    match Command::new("promtool").arg("--version").output() {
        Ok(out) if out.status.success() => Some(Command::new("promtool")),
        result => {
            let why = match result {
                Ok(out) => format!("`promtool --version` exited with {}", out.status),
                Err(e) => format!("promtool: {e}"),
            };
            if std::env::var("KP_REQUIRE_PROMETHEUS").as_deref() == Ok("1") {
                panic!(
                    "{why}; KP_REQUIRE_PROMETHEUS=1 requires it (Debian: apt-get install prometheus)"
                );
            }
            // Straight to stderr: the harness would swallow a print! of a passing test.
            let _ = writeln!(
                std::io::stderr(),
                "monitoring: {what} skipped: {why} (install Debian's prometheus package; \
                 KP_REQUIRE_PROMETHEUS=1 makes this a failure)"
            );
            None
        }
    }
}

fn run(mut cmd: Command) -> String {
    let out = cmd.output().expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn promtool_checks_and_tests_the_rules() {
    let Some(mut check) = promtool("promtool check rules / test rules") else {
        return;
    };
    check
        .current_dir(monitoring())
        .args(["check", "rules", "rules.yaml"]);
    let checked = run(check);
    let mut test = Command::new("promtool");
    test.current_dir(monitoring())
        .args(["test", "rules", "rules.test.yaml"]);
    let tested = run(test);
    assert!(tested.contains("SUCCESS"), "promtool test rules:\n{tested}");

    // The dashboard's queries, as recording rules: Prometheus's parser checks them
    // (Grafana's variables replaced by what they stand for).
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (title, expr)) in dashboard_exprs(&dashboard()).iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$namespace", ".*")
            .replace("$pod", ".*")
            .replace("$stream", ".*")
            .replace("$controller", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:panel_{i}\n        expr: {}\n        labels: {{panel: {}}}\n",
            serde_json::to_string(&expr).unwrap(),
            serde_json::to_string(title).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard-queries.yaml");
    std::fs::write(&file, rules).unwrap();
    let mut dash = Command::new("promtool");
    dash.args(["check", "rules"]).arg(&file);
    let dash_checked = run(dash);

    let tests = yaml(&monitoring().join("rules.test.yaml"));
    let cases: usize = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["alert_rule_test"].as_array().map_or(0, Vec::len))
        .sum();
    println!("{}", checked.trim());
    println!("{}", dash_checked.trim());
    println!(
        "promtool test rules: {} tests, {cases} alert evaluations: {}",
        tests["tests"].as_array().unwrap().len(),
        tested.trim()
    );
}

#[test]
fn every_alert_fires_and_stays_quiet_in_a_unit_test() {
    let rules = yaml(&monitoring().join("rules.yaml"));
    let names = alert_names(&rules["groups"]);
    assert!(names.len() >= 10, "alerts: {names:?}");
    let tests = yaml(&monitoring().join("rules.test.yaml"));
    assert_eq!(tests["rule_files"], serde_json::json!(["rules.yaml"]));
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for t in tests["tests"].as_array().expect("tests is a list") {
        for case in t["alert_rule_test"].as_array().into_iter().flatten() {
            let name = case["alertname"].as_str().expect("alertname").to_string();
            assert!(names.contains(&name), "a test case of no alert: {name}");
            let expected = case["exp_alerts"].as_array().map_or(0, Vec::len);
            if expected > 0 { &mut fires } else { &mut quiet }.insert(name);
        }
    }
    let never_fires: Vec<_> = names.difference(&fires).collect();
    let never_quiet: Vec<_> = names.difference(&quiet).collect();
    assert!(
        never_fires.is_empty() && never_quiet.is_empty(),
        "rules.test.yaml has no case where these fire: {never_fires:?}; none where these \
         do not: {never_quiet:?}"
    );
}

#[test]
fn prometheus_rule_holds_the_rules_file_groups() {
    let rules = yaml(&monitoring().join("rules.yaml"));
    let object = yaml(&monitoring().join("prometheusrule.yaml"));
    assert_eq!(object["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(object["kind"], "PrometheusRule");
    assert_eq!(object["metadata"]["namespace"], "kube-persist-example");
    assert_eq!(
        object["metadata"]["labels"]["app.kubernetes.io/name"],
        "kube-persist-operator"
    );
    assert!(rules["groups"].is_array());
    assert!(
        rules["groups"] == object["spec"]["groups"],
        "prometheusrule.yaml's spec.groups differ from rules.yaml's groups: edit both"
    );
}

/// GitHub's anchor of a heading: lowercase, spaces to `-`, punctuation other than `-` and
/// `_` dropped; a repeated anchor gets `-1`, `-2`...
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let Some(text) = line
            .strip_prefix('#')
            .map(|l| l.trim_start_matches('#'))
            .filter(|l| l.starts_with(' '))
        else {
            continue;
        };
        if fenced {
            continue;
        }
        let slug: String = text
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

#[test]
fn every_alert_says_what_to_do() {
    let cargo = read(&root().join("Cargo.toml"));
    let repository = cargo
        .lines()
        .find_map(|l| l.strip_prefix("repository = \""))
        .and_then(|l| l.strip_suffix('"'))
        .expect("Cargo.toml: repository = \"...\"");
    let prefix = format!("{repository}/blob/main/docs/operations.md#");
    let doc = anchors(&read(&root().join("docs/operations.md")));
    let rules = yaml(&monitoring().join("rules.yaml"));
    let mut problems = Vec::new();
    for rule in alerts(&rules["groups"]) {
        let name = rule["alert"].as_str().unwrap();
        let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
        if !["critical", "warning", "info"].contains(&severity) {
            problems.push(format!("{name}: severity {severity:?}"));
        }
        if rule.get("for").is_none() {
            problems.push(format!("{name}: no `for`"));
        }
        for key in ["summary", "description"] {
            if rule["annotations"][key].as_str().is_none_or(str::is_empty) {
                problems.push(format!("{name}: no {key}"));
            }
        }
        let url = rule["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_default();
        match url.strip_prefix(&prefix) {
            Some(anchor) if doc.contains(anchor) => {}
            Some(anchor) => problems.push(format!(
                "{name}: runbook_url anchor #{anchor}: no such heading in docs/operations.md"
            )),
            None => problems.push(format!(
                "{name}: runbook_url {url:?} is not a section of {prefix}"
            )),
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn rules_and_dashboard_use_served_metrics() {
    let rules = metric_names(&read(&monitoring().join("rules.yaml")));
    let dash = metric_names(&read(&monitoring().join("dashboard.json")));
    let known = documented_metrics().0;
    let unknown: Vec<_> = rules.union(&dash).filter(|n| !known.contains(*n)).collect();
    assert!(unknown.is_empty(), "metrics no scrape returns: {unknown:?}");
    let undrawn: Vec<_> = rules.difference(&dash).collect();
    assert!(
        undrawn.is_empty(),
        "metrics the alerts use and the dashboard does not show: {undrawn:?}"
    );
    assert!(rules.len() >= 10, "{rules:?}");
}

#[test]
fn dashboard_panels_query_prometheus() {
    let dash = dashboard();
    assert_eq!(dash["uid"], "kube-persist");
    let exprs = dashboard_exprs(&dash);
    assert!(exprs.len() >= 20, "{} queries", exprs.len());
    for (title, expr) in &exprs {
        assert!(!expr.trim().is_empty(), "panel {title:?}: an empty query");
    }
    let mut ids = BTreeSet::new();
    for p in dash["panels"].as_array().unwrap() {
        assert!(
            ids.insert(p["id"].as_u64()),
            "panel id {} repeated",
            p["id"]
        );
        if p["type"] != "row" {
            assert_eq!(
                p["datasource"]["uid"], "${datasource}",
                "panel {}: the dashboard's data source variable",
                p["title"]
            );
        }
    }
}

/// Every StatefulSet under `deploy/` (its `.yaml` files, `monitoring/` excepted).
fn statefulsets() -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    let mut dirs = vec![root().join("deploy")];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "monitoring") {
                    dirs.push(path);
                }
            } else if path.extension().is_some_and(|x| x == "yaml") {
                let docs: Vec<Value> = serde_saphyr::from_multiple(&read(&path)).unwrap();
                out.extend(
                    docs.into_iter()
                        .filter(|d| d["kind"] == "StatefulSet")
                        .map(|d| (path.clone(), d)),
                );
            }
        }
    }
    out
}

#[test]
fn pod_monitor_and_annotations_scrape_the_metrics_port() {
    let monitor = yaml(&monitoring().join("podmonitor.yaml"));
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["kind"], "PodMonitor");
    let endpoints = monitor["spec"]["podMetricsEndpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 1);
    let (port, path) = (&endpoints[0]["port"], &endpoints[0]["path"]);
    let sets = statefulsets();
    assert!(sets.len() >= 2, "both StatefulSets of deploy/");
    for (file, set) in &sets {
        let at = file.display();
        assert_eq!(
            monitor["metadata"]["namespace"], set["metadata"]["namespace"],
            "{at}"
        );
        let template = &set["spec"]["template"];
        for (k, v) in monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .unwrap()
        {
            assert_eq!(
                &template["metadata"]["labels"][k], v,
                "{at}: the PodMonitor selects {k}={v}"
            );
        }
        let ports: Vec<&Value> = template["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| c["ports"].as_array().into_iter().flatten())
            .collect();
        let served = ports
            .iter()
            .find(|p| &p["name"] == port)
            .unwrap_or_else(|| panic!("{at}: no container port named {port}"));
        let annotations = &template["metadata"]["annotations"];
        assert_eq!(annotations["prometheus.io/scrape"], "true", "{at}");
        assert_eq!(
            annotations["prometheus.io/port"],
            served["containerPort"].to_string(),
            "{at}"
        );
        assert_eq!(&annotations["prometheus.io/path"], path, "{at}");
        // The operator serves /metrics on --listen's port.
        let args = template["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap();
        let listen = format!("--listen=0.0.0.0:{}", served["containerPort"]);
        assert!(args.iter().any(|a| a == &listen), "{at}: {listen}");
    }
    assert_eq!(path, "/metrics");
}

#[test]
fn kubernetes_doc_ships_the_image_and_warns_before_the_apply() {
    let text = read(&root().join("docs/kubernetes.md"));
    let lines: Vec<&str> = text.lines().collect();
    let apply = lines
        .iter()
        .position(|l| {
            l.trim_start()
                .strip_prefix("kubectl apply -f deploy/")
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(' '))
        })
        .expect("docs/kubernetes.md: `kubectl apply -f deploy/`");
    let before = lines[..apply].join("\n");
    let sets = statefulsets();
    for (file, set) in &sets {
        let image = set["spec"]["template"]["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap();
        let (_, tag) = image.rsplit_once(':').expect("a tagged image");
        let name = image.rsplit_once('/').map_or(image, |(_, n)| n);
        for step in [
            format!("kind load docker-image {image}"),
            format!("docker push $REGISTRY/{name}"),
            format!("-t $REGISTRY/{name}"),
        ] {
            assert!(
                before.contains(&step),
                "docs/kubernetes.md: `{step}` ({}'s image, tag {tag}) before the apply",
                file.display()
            );
        }
    }
    assert!(
        before.contains("labels every Pod") && before.contains("test cluster"),
        "docs/kubernetes.md: the warning (the operator labels every Pod it can see; a test \
         cluster) before the apply"
    );
}
