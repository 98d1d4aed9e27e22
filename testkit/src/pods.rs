//! A deterministic generator of realistic Pod objects.

use serde_json::{Value, json};

use crate::object::{rfc3339, uuid_string};

/// splitmix64: small, fast and stable across crate versions.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn hex(&mut self, len: usize) -> String {
        let mut s = format!("{:016x}{:016x}", self.next(), self.next());
        s.truncate(len);
        s
    }

    fn uid(&mut self) -> String {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.next().to_le_bytes());
        b[8..].copy_from_slice(&self.next().to_le_bytes());
        uuid_string(&b)
    }

    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len() as u64) as usize]
    }
}

const APPS: &[&str] = &[
    "checkout", "payments", "search", "catalog", "frontend", "auth", "ledger", "mailer",
];
const TIERS: &[&str] = &["frontend", "backend", "cache", "worker"];
const REGISTRIES: &[&str] = &["registry.example.com", "ghcr.io/example", "quay.io/example"];

fn env_vars(rng: &mut Rng, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"name": format!("VAR_{i}_{}", rng.hex(4).to_uppercase()), "value": rng.hex(12)}))
        .collect()
}

fn container(rng: &mut Rng, name: &str, image: &str, port: u64, envs: usize) -> Value {
    json!({
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["--port", port.to_string(), "--log-level=info"],
        "env": env_vars(rng, envs),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": format!("{}m", 50 + rng.below(450)), "memory": format!("{}Mi", 64 + rng.below(448))},
            "limits": {"cpu": format!("{}m", 500 + rng.below(1500)), "memory": format!("{}Mi", 512 + rng.below(1536))}
        },
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/config", "readOnly": true},
            {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}
        ],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 10},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File"
    })
}

fn container_status(rng: &mut Rng, name: &str, image: &str, started: &str) -> Value {
    json!({
        "name": name,
        "image": image,
        "imageID": format!("{image}@sha256:{}{}", rng.hex(32), rng.hex(32)),
        "containerID": format!("containerd://{}{}", rng.hex(32), rng.hex(32)),
        "ready": true,
        "started": true,
        "restartCount": rng.below(3),
        "state": {"running": {"startedAt": started}}
    })
}

/// A realistic Pod (2-6 KB of JSON): labels, annotations, ownerReferences, two managedFields
/// entries, two containers with env/ports/resources/volumeMounts, `nodeName` `node-<k>`, and a
/// status with conditions, containerStatuses and podIP. Deterministic for a given seed.
pub fn make_pod(namespace: &str, name: &str, seed: u64) -> Value {
    let mut rng = Rng(seed ^ 0x5EED_0F_90D5);
    let app = rng.pick(APPS);
    let tier = rng.pick(TIERS);
    let hash = rng.hex(10);
    let registry = rng.pick(REGISTRIES);
    let version = format!("1.{}.{}", rng.below(30), rng.below(10));
    let image = format!("{registry}/{app}:{version}");
    let sidecar = format!("{registry}/envoy:1.{}.0", 25 + rng.below(5));
    let created = rfc3339(1_700_000_000 + rng.below(10_000_000));
    let node = format!("node-{}", rng.below(100));
    let ip = format!(
        "10.{}.{}.{}",
        rng.below(256),
        rng.below(256),
        1 + rng.below(254)
    );
    let owner_uid = rng.uid();
    let port = 8000 + rng.below(1000);
    let envs = 2 + rng.below(12) as usize;
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "app": app,
                "tier": tier,
                "pod-template-hash": hash,
                "app.kubernetes.io/name": app,
                "app.kubernetes.io/version": version,
                "shard": format!("s{}", rng.below(16)),
            },
            "annotations": {
                "kubectl.kubernetes.io/restartedAt": created,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": port.to_string(),
                "example.com/commit": rng.hex(32),
            },
            "ownerReferences": [{
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": format!("{app}-{hash}"),
                "uid": owner_uid,
                "controller": true,
                "blockOwnerDeletion": true
            }],
            "managedFields": [
                {
                    "manager": "kube-controller-manager",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "time": created,
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}, "f:pod-template-hash": {}, "f:tier": {}},
                        "f:ownerReferences": {".": {}, format!("k:{{\"uid\":\"{owner_uid}\"}}"): {}}},
                        "f:spec": {"f:containers": {format!("k:{{\"name\":\"{app}\"}}"): {".": {}, "f:image": {}, "f:name": {}}}}}
                },
                {
                    "manager": "kubelet",
                    "operation": "Update",
                    "apiVersion": "v1",
                    "time": created,
                    "fieldsType": "FieldsV1",
                    "subresource": "status",
                    "fieldsV1": {"f:status": {"f:conditions": {}, "f:containerStatuses": {}, "f:hostIP": {}, "f:phase": {}, "f:podIP": {}, "f:startTime": {}}}
                }
            ]
        },
        "spec": {
            "containers": [
                container(&mut rng, app, &image, port, envs),
                container(&mut rng, "envoy", &sidecar, 15000, 2),
            ],
            "volumes": [
                {"name": "config", "configMap": {"name": format!("{app}-config"), "defaultMode": 420}},
                {"name": "kube-api-access", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}], "defaultMode": 420}}
            ],
            "nodeName": node,
            "serviceAccountName": app,
            "restartPolicy": "Always",
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "terminationGracePeriodSeconds": 30,
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            ]
        },
        "status": {
            "phase": "Running",
            "hostIP": format!("192.168.{}.{}", rng.below(256), 1 + rng.below(254)),
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "qosClass": "Burstable",
            "startTime": created,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": created},
                {"type": "Ready", "status": "True", "lastTransitionTime": created},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": created},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": created}
            ],
            "containerStatuses": [
                container_status(&mut rng, app, &image, &created),
                container_status(&mut rng, "envoy", &sidecar, &created)
            ]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_sized() {
        for seed in 0..200 {
            let a = make_pod("ns", "p", seed);
            assert_eq!(a, make_pod("ns", "p", seed));
            let len = serde_json::to_vec(&a).unwrap().len();
            assert!((2048..=6144).contains(&len), "seed {seed}: {len} bytes");
            let _: k8s_openapi::api::core::v1::Pod = serde_json::from_value(a).unwrap();
        }
        assert_ne!(make_pod("ns", "p", 1), make_pod("ns", "p", 2));
    }
}
