//! The `deploy/` manifests against the example operator they run, without a cluster: every
//! YAML document parses; each StatefulSet's container arguments (with `$(VAR)` expanded as
//! the kubelet does, for every ordinal) are accepted by `examples/operator.rs`'s command
//! line, with the shard count read from the StatefulSet itself and a valid shard index; the store is a
//! subdirectory of the `store` volume; the probes and the listen port agree; the Pod runs
//! non-root on a read-only root with `fsGroup` its group; the RBAC binds the StatefulSet's
//! ServiceAccount in its namespace to exactly `list`, `watch`, `update` on Pods and `get` of
//! its own StatefulSet. What the
//! API server says of them is `tests/e2e/deploy.rs`.

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
        // The key comes from an optional Secret (the store is not encrypted without it).
        let env = pod["spec"]["containers"][0]["env"].as_array().unwrap();
        let key = env
            .iter()
            .find(|e| e["name"] == "KUBE_PERSIST_KEY")
            .unwrap_or_else(|| panic!("{at}: no KUBE_PERSIST_KEY"));
        assert_eq!(key["valueFrom"]["secretKeyRef"]["optional"], true, "{at}");
    }
    // One replica down at a time by a voluntary disruption.
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    // Metrics stay reachable while a replica is unready (its watch down).
    assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
    let subject = &binding["subjects"][0];
    assert_eq!(subject["name"], sa["metadata"]["name"]);
    assert_eq!(subject["namespace"], sa["metadata"]["namespace"]);
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    // The operator's calls: the watcher's LIST and WATCH, the reconciler's PUT.
    let rules = role["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0]["resources"], serde_json::json!(["pods"]));
    assert_eq!(
        rules[0]["verbs"],
        serde_json::json!(["list", "watch", "update"])
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
