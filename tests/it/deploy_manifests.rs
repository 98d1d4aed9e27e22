//! The `deploy/` manifests against the example operator they run, without a cluster: every
//! YAML document parses; each StatefulSet's container arguments (with `$(VAR)` expanded as
//! the kubelet does, for every ordinal) are accepted by `examples/operator.rs`'s command
//! line, with the shard count read from the StatefulSet itself and a valid shard index; the store is a
//! subdirectory of the `store` volume; the probes and the listen port agree; the Pod runs
//! non-root on a read-only root with `fsGroup` its group; the encryption key's Secret is
//! required; the RBAC binds the StatefulSet's ServiceAccount in its namespace to exactly
//! `list`, `watch`, `patch` on Pods and `get` of its own StatefulSet; the admission policy
//! is bound, matches that ServiceAccount's Pod updates and names the operator's label; the
//! NetworkPolicy admits only the probe/metrics port of the operator's Pods. What the API
//! server says of them is `tests/e2e/deploy.rs`.

use crate::deploy::{self, operator};

use clap::Parser;
use serde_json::Value;

fn docs() -> Vec<(String, Value)> {
    let docs = deploy::documents(&deploy::deploy_dir()).expect("the manifests parse");
    for (at, d) in &docs {
        for field in ["/apiVersion", "/kind", "/metadata/name"] {
            assert!(
                d.pointer(field).is_some_and(Value::is_string),
                "{at}: {field}"
            );
        }
    }
    docs
}

fn of_kind<'a>(docs: &'a [(String, Value)], kind: &str) -> Vec<&'a (String, Value)> {
    docs.iter().filter(|(_, d)| d["kind"] == kind).collect()
}

/// `$(NAME)` replaced by `env`'s value, as the kubelet expands container arguments.
fn expand(arg: &str, env: &[(&str, String)]) -> String {
    env.iter().fold(arg.to_string(), |a, (k, v)| {
        a.replace(&format!("$({k})"), v)
    })
}

fn check_statefulset(at: &str, sts: &Value) {
    let replicas = sts["spec"]["replicas"].as_u64().expect("replicas") as u32;
    assert!(replicas >= 1, "{at}: replicas");
    let pod = &sts["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let env = c["env"].as_array().expect("env");
    let var = |name: &str| env.iter().find(|e| e["name"] == name).expect(name);
    assert_eq!(
        var("SHARD_INDEX")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.labels['apps.kubernetes.io/pod-index']",
        "{at}: the shard index is the StatefulSet ordinal"
    );
    assert_eq!(
        var("POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace",
        "{at}"
    );
    let ns = sts["metadata"]["namespace"]
        .as_str()
        .expect("namespace")
        .to_string();
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    for ordinal in 0..replicas {
        let env = [
            ("SHARD_INDEX", ordinal.to_string()),
            ("POD_NAMESPACE", ns.clone()),
        ];
        let argv =
            std::iter::once("operator".to_string()).chain(args.iter().map(|a| expand(a, &env)));
        let parsed = operator::Args::try_parse_from(argv)
            .unwrap_or_else(|e| panic!("{at}: the operator refuses its arguments: {e}"));
        assert!(parsed.cluster, "{at}: --cluster");
        let opts = parsed.cluster_opts();
        // The shard count is this StatefulSet's replicas, read through the API.
        assert_eq!(
            opts.shards_from.as_deref(),
            Some(format!("{ns}/{}", sts["metadata"]["name"].as_str().unwrap()).as_str()),
            "{at}: --shards-from names the StatefulSet itself"
        );
        let index = opts
            .shard_index
            .as_deref()
            .and_then(operator::cluster::parse_shard_index);
        assert_eq!(
            index,
            Some(ordinal),
            "{at}: shard index of ordinal {ordinal}"
        );
        // The store is a subdirectory of the `store` volume's mount.
        let mounts = c["volumeMounts"].as_array().expect("volumeMounts");
        let mount = mounts
            .iter()
            .find(|m| m["name"] == "store")
            .expect("store mount");
        let root = std::path::Path::new(mount["mountPath"].as_str().unwrap());
        assert!(
            opts.dir.starts_with(root) && opts.dir != root,
            "{at}: store {} inside {}",
            opts.dir.display(),
            root.display()
        );
        // Probes and metrics on the port the operator listens on.
        let port = c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "http");
        assert_eq!(
            port.and_then(|p| p["containerPort"].as_u64()),
            Some(u64::from(opts.listen.port())),
            "{at}: containerPort http = --listen"
        );
    }
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/livez")] {
        assert_eq!(c[probe]["httpGet"]["path"], path, "{at}: {probe}");
        assert_eq!(c[probe]["httpGet"]["port"], "http", "{at}: {probe}");
    }
    let sc = &pod["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true, "{at}");
    assert!(
        sc["fsGroup"].is_u64() && sc["fsGroup"] == sc["runAsGroup"],
        "{at}: fsGroup"
    );
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true, "{at}");
    let claim = sts["spec"]["volumeClaimTemplates"]
        .as_array()
        .is_some_and(|v| v.iter().any(|t| t["metadata"]["name"] == "store"));
    let empty_dir = pod["volumes"].as_array().is_some_and(|v| {
        v.iter()
            .any(|v| v["name"] == "store" && v["emptyDir"].is_object())
    });
    assert!(
        claim != empty_dir,
        "{at}: the store is a claim or an emptyDir"
    );
    assert_eq!(empty_dir, at.starts_with("emptydir/"), "{at}");
}

#[test]
fn manifests_fit_the_operator() {
    let docs = docs();
    let sets = of_kind(&docs, "StatefulSet");
    assert_eq!(sets.len(), 2, "the claim and the emptyDir variants");
    let sa = &of_kind(&docs, "ServiceAccount")[0].1;
    let binding = &of_kind(&docs, "ClusterRoleBinding")[0].1;
    let role = &of_kind(&docs, "ClusterRole")[0].1;
    let service = &of_kind(&docs, "Service")[0].1;
    let pdb = &of_kind(&docs, "PodDisruptionBudget")[0].1;
    for (at, sts) in sets {
        check_statefulset(at, sts);
        let ns = &sts["metadata"]["namespace"];
        let pod = &sts["spec"]["template"];
        assert_eq!(
            pod["spec"]["serviceAccountName"], sa["metadata"]["name"],
            "{at}"
        );
        assert_eq!(sa["metadata"]["namespace"], *ns, "{at}");
        assert_eq!(
            sts["spec"]["serviceName"], service["metadata"]["name"],
            "{at}"
        );
        for (k, v) in service["spec"]["selector"].as_object().unwrap() {
            assert_eq!(
                pod["metadata"]["labels"][k], *v,
                "{at}: the Service selects the Pods"
            );
        }
        // Replicas spread over nodes, and the budget covers them.
        let spread = &pod["spec"]["topologySpreadConstraints"][0];
        assert_eq!(spread["topologyKey"], "kubernetes.io/hostname", "{at}");
        assert_eq!(
            spread["labelSelector"]["matchLabels"], pod["metadata"]["labels"],
            "{at}: the spread counts the operator's Pods"
        );
        for (k, v) in pdb["spec"]["selector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(
                pod["metadata"]["labels"][k], *v,
                "{at}: the budget selects the Pods"
            );
        }
        assert_eq!(pdb["metadata"]["namespace"], *ns, "{at}");
        // The key comes from a required Secret: without it the Pod does not start, rather
        // than write its store in plaintext.
        let env = pod["spec"]["containers"][0]["env"].as_array().unwrap();
        let key = env
            .iter()
            .find(|e| e["name"] == operator::cluster::KEY_ENV)
            .unwrap_or_else(|| panic!("{at}: no KUBE_PERSIST_KEY"));
        let secret = &key["valueFrom"]["secretKeyRef"];
        assert_eq!(secret["name"], "kube-persist-key", "{at}");
        assert!(
            secret["optional"].is_null() || secret["optional"] == false,
            "{at}: the key's Secret is optional: a Pod without it would run unencrypted"
        );
        // The NetworkPolicy selects these Pods and admits their one port.
        check_network_policy(at, sts, &of_kind(&docs, "NetworkPolicy"));
    }
    // One replica down at a time by a voluntary disruption.
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    // Metrics stay reachable while a replica is unready (its watch down).
    assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
    let subject = &binding["subjects"][0];
    assert_eq!(subject["name"], sa["metadata"]["name"]);
    assert_eq!(subject["namespace"], sa["metadata"]["namespace"]);
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    // The operator's calls: the watcher's LIST and WATCH, the reconciler's label patch.
    // Never `update` (a PUT of a whole Pod).
    let rules = role["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0]["resources"], serde_json::json!(["pods"]));
    assert_eq!(
        rules[0]["verbs"],
        serde_json::json!(["list", "watch", "patch"])
    );
    // And `get` of its own StatefulSet, in its namespace (--shards-from).
    let ns_role = &of_kind(&docs, "Role")[0].1;
    let ns_binding = &of_kind(&docs, "RoleBinding")[0].1;
    let sts = &of_kind(&docs, "StatefulSet")[0].1;
    assert_eq!(
        ns_role["metadata"]["namespace"],
        sts["metadata"]["namespace"]
    );
    assert_eq!(
        ns_role["rules"],
        serde_json::json!([{"apiGroups": ["apps"], "resources": ["statefulsets"],
            "resourceNames": [sts["metadata"]["name"]], "verbs": ["get"]}])
    );
    assert_eq!(ns_binding["roleRef"]["name"], ns_role["metadata"]["name"]);
    assert_eq!(ns_binding["roleRef"]["kind"], "Role");
    assert_eq!(ns_binding["subjects"][0]["name"], sa["metadata"]["name"]);
}

/// The NetworkPolicy of the operator's Pods (of StatefulSet `sts`): one, selecting them, for
/// ingress only, admitting TCP to their `http` port (probes and metrics) and nothing else.
fn check_network_policy(at: &str, sts: &Value, policies: &[&(String, Value)]) {
    assert_eq!(policies.len(), 1, "one NetworkPolicy under deploy/");
    let (np_at, np) = policies[0];
    let pod = &sts["spec"]["template"];
    assert_eq!(
        np["metadata"]["namespace"], sts["metadata"]["namespace"],
        "{np_at}"
    );
    for (k, v) in np["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(
            pod["metadata"]["labels"][k], *v,
            "{np_at}: selects the Pods of {at}"
        );
    }
    assert_eq!(
        np["spec"]["policyTypes"],
        serde_json::json!(["Ingress"]),
        "{np_at}"
    );
    let ingress = np["spec"]["ingress"].as_array().expect("ingress rules");
    assert_eq!(ingress.len(), 1, "{np_at}: one rule");
    let ports = ingress[0]["ports"]
        .as_array()
        .expect("the rule names its ports");
    let http = pod["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "http")
        .expect("the http port");
    assert_eq!(ports.len(), 1, "{np_at}: the probe/metrics port only");
    assert!(
        ports[0]["port"] == http["name"] || ports[0]["port"] == http["containerPort"],
        "{np_at}: admits {}, not the http port of {at}",
        ports[0]["port"]
    );
    assert_eq!(ports[0]["protocol"], "TCP", "{np_at}");
    assert!(
        ingress[0]["from"].as_array().is_some_and(|f| !f.is_empty()),
        "{np_at}: from some peers, not from everywhere"
    );
}

/// The ValidatingAdmissionPolicy that holds the operator's ServiceAccount to its label:
/// GA API, bound with `Deny`, failing closed, matching Pod updates by exactly the
/// ServiceAccount of `rbac.yaml`, and naming the operator's label in its expressions and
/// its message.
#[test]
fn admission_policy_fits_the_operator() {
    let docs = docs();
    let policies = of_kind(&docs, "ValidatingAdmissionPolicy");
    assert_eq!(
        policies.len(),
        1,
        "one ValidatingAdmissionPolicy under deploy/"
    );
    let (at, policy) = policies[0];
    assert_eq!(
        policy["apiVersion"], "admissionregistration.k8s.io/v1",
        "{at}"
    );
    let bindings = of_kind(&docs, "ValidatingAdmissionPolicyBinding");
    assert_eq!(bindings.len(), 1, "its binding");
    let binding = &bindings[0].1;
    assert_eq!(binding["apiVersion"], "admissionregistration.k8s.io/v1");
    assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
    assert_eq!(
        binding["spec"]["validationActions"],
        serde_json::json!(["Deny"])
    );
    let spec = &policy["spec"];
    assert_eq!(spec["failurePolicy"], "Fail", "{at}: fails closed");
    let rules = spec["matchConstraints"]["resourceRules"]
        .as_array()
        .unwrap();
    assert!(
        rules
            .iter()
            .any(|r| r["apiGroups"] == serde_json::json!([""])
                && r["resources"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| x == "pods")
                && r["operations"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| x == "UPDATE")),
        "{at}: matches updates of Pods: {rules:?}"
    );
    // The ServiceAccount of rbac.yaml, by its user name.
    let sa = &of_kind(&docs, "ServiceAccount")[0].1;
    let user = format!(
        "'system:serviceaccount:{}:{}'",
        sa["metadata"]["namespace"].as_str().unwrap(),
        sa["metadata"]["name"].as_str().unwrap()
    );
    let conditions = spec["matchConditions"].as_array().expect("matchConditions");
    assert!(
        conditions.iter().any(|c| {
            let e = c["expression"].as_str().unwrap_or_default();
            e.contains("request.userInfo.username") && e.contains(&user)
        }),
        "{at}: matches {user}: {conditions:?}"
    );
    // The operator's label, in the policy and in each message.
    let text = serde_json::to_string(spec).unwrap();
    assert!(
        text.contains(operator::OWNER_LABEL),
        "{at}: no {}",
        operator::OWNER_LABEL
    );
    let validations = spec["validations"].as_array().expect("validations");
    assert!(!validations.is_empty(), "{at}");
    for v in validations {
        let message = v["message"].as_str().expect("a message");
        assert!(message.contains(operator::OWNER_LABEL), "{at}: {message}");
        // Each compares the new version with the old one (directly or through variables).
        let expression = v["expression"].as_str().unwrap();
        assert!(
            expression.contains("oldObject") || expression.contains("variables.old"),
            "{at}: {expression}"
        );
    }
}

#[test]
fn shard_index_from_ordinal_or_pod_name() {
    use operator::cluster::parse_shard_index;
    assert_eq!(parse_shard_index("3"), Some(3));
    assert_eq!(parse_shard_index("kube-persist-operator-12"), Some(12));
    assert_eq!(parse_shard_index("kube-persist-operator"), None);
    assert_eq!(parse_shard_index(""), None);
}

/// The image (`deploy/Dockerfile`) builds the `kube-persist` tool beside the operator and
/// installs both in its final stage, so that the tool can be run in the operator's Pod.
#[test]
fn the_image_ships_the_tool() {
    let path = deploy::deploy_dir().join("Dockerfile");
    let text = std::fs::read_to_string(&path).expect("deploy/Dockerfile");
    let final_stage = text.rsplit("\nFROM ").next().expect("a final stage");
    assert!(
        text.contains("cargo build --release --locked -p kube-persist-cli --bin kube-persist"),
        "the build stage builds the tool"
    );
    for line in [
        "COPY --from=build /kube-persist /usr/local/bin/kube-persist",
        "COPY --from=build /operator /usr/local/bin/kube-persist-operator",
    ] {
        assert!(
            final_stage.lines().any(|l| l == line),
            "final stage lacks {line:?}"
        );
    }
}

/// The `sh` blocks of a markdown page (fenced with three backticks and `sh`, indented as in
/// a list item: each block is dedented by its first line's indentation).
fn shell_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut lines = markdown.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "```sh" {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        blocks.push(
            body.iter()
                .map(|l| format!("{}\n", l.get(indent..).unwrap_or(l.trim_start())))
                .collect(),
        );
    }
    blocks
}

/// Every block of docs/kubernetes.md that generates the encryption key never makes the
/// key's Secret from an empty or short key: each is run with bash in a scratch folder, with
/// stand-ins for `openssl` and `kubectl` first on PATH. When `openssl` fails (no output,
/// exit 1), no `kubectl create secret` is called; when it works, one is, from a file that
/// holds exactly the 64 hex characters `openssl` printed.
#[test]
fn runbooks_never_make_an_empty_key() {
    let page = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/kubernetes.md");
    let text = std::fs::read_to_string(&page).expect("docs/kubernetes.md");
    let blocks: Vec<String> = shell_blocks(&text)
        .into_iter()
        .filter(|b| b.contains("openssl rand"))
        .collect();
    assert!(
        blocks.len() >= 2,
        "the key is generated at the start and when rotated: {} blocks",
        blocks.len()
    );
    let key = "0123456789abcdef".repeat(4);
    for block in &blocks {
        for works in [false, true] {
            let tmp = tempfile::tempdir().unwrap();
            let bin = tmp.path().join("bin");
            std::fs::create_dir(&bin).unwrap();
            let openssl = if works {
                format!("#!/bin/sh\necho {key}\n")
            } else {
                "#!/bin/sh\necho 'openssl: cannot read random bytes' >&2\nexit 1\n".to_string()
            };
            // Records each call and, for the Secret's key, what it would hold.
            let kubectl = r#"#!/bin/bash
echo "kubectl $*" >> "$KP_CALLS"
for a in "$@"; do
  case "$a" in
    --from-file=key=*) echo "key from file: [$(cat "${a#--from-file=key=}")]" >> "$KP_CALLS" ;;
    --from-literal=key=*) echo "key from literal: [${a#--from-literal=key=}]" >> "$KP_CALLS" ;;
  esac
done
"#;
            for (name, script) in [("openssl", openssl.as_str()), ("kubectl", kubectl)] {
                let path = bin.join(name);
                std::fs::write(&path, script).unwrap();
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            let calls = tmp.path().join("calls");
            std::fs::write(&calls, "").unwrap();
            let work = tmp.path().join("work");
            std::fs::create_dir(&work).unwrap();
            let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
            let out = std::process::Command::new("bash")
                .args(["-c", block])
                .current_dir(&work)
                .env("PATH", path)
                .env("NS", "kube-persist-example")
                .env("KP_CALLS", &calls)
                .output()
                .expect("bash");
            let calls = std::fs::read_to_string(&calls).unwrap();
            let creates = calls
                .lines()
                .filter(|l| l.starts_with("kubectl ") && l.contains(" create secret "))
                .count();
            let keys: Vec<&str> = calls
                .lines()
                .filter(|l| l.starts_with("key from"))
                .collect();
            let why = || {
                format!(
                    "openssl {}: the block\n{block}\ncalled\n{calls}\nstderr: {}",
                    if works { "works" } else { "fails" },
                    String::from_utf8_lossy(&out.stderr)
                )
            };
            if works {
                assert_eq!(creates, 1, "{}", why());
                assert_eq!(keys, [format!("key from file: [{key}]")], "{}", why());
            } else {
                assert_eq!(creates, 0, "a Secret made without a key: {}", why());
            }
            // The key file is not left behind.
            assert_eq!(
                std::fs::read_dir(&work).unwrap().count(),
                0,
                "files left: {}",
                why()
            );
        }
    }
}
