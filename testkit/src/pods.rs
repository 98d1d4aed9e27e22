//! A deterministic generator of realistic Pod objects.

use std::fmt::Write;

use serde_json::Value;

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

/// Server-assigned metadata embedded directly by the fast seeding path.
pub(crate) struct ServerFields<'a> {
    /// The revision as the server renders it.
    pub rv: &'a str,
    pub uid: &'a str,
    pub created: &'a str,
}

/// A JSON string literal (quoted and escaped).
fn q(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

fn container(out: &mut String, rng: &mut Rng, name: &str, image: &str, port: u64, envs: usize) {
    let _ = write!(
        out,
        r#"{{"name":{name},"image":{image},"imagePullPolicy":"IfNotPresent","args":["--port","{port}","--log-level=info"],"env":["#,
        name = q(name),
        image = q(image)
    );
    for i in 0..envs {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            r#"{{"name":"VAR_{i}_{}","value":"{}"}}"#,
            rng.hex(4).to_uppercase(),
            rng.hex(12)
        );
    }
    let _ = write!(
        out,
        r#"],"ports":[{{"name":"http","containerPort":{port},"protocol":"TCP"}}],"resources":{{"requests":{{"cpu":"{}m","memory":"{}Mi"}},"limits":{{"cpu":"{}m","memory":"{}Mi"}}}},"volumeMounts":[{{"name":"config","mountPath":"/etc/config","readOnly":true}},{{"name":"kube-api-access","mountPath":"/var/run/secrets/kubernetes.io/serviceaccount","readOnly":true}}],"readinessProbe":{{"httpGet":{{"path":"/healthz","port":{port}}},"periodSeconds":10}},"terminationMessagePath":"/dev/termination-log","terminationMessagePolicy":"File"}}"#,
        50 + rng.below(450),
        64 + rng.below(448),
        500 + rng.below(1500),
        512 + rng.below(1536)
    );
}

fn container_status(out: &mut String, rng: &mut Rng, name: &str, image: &str, started: &str) {
    let _ = write!(
        out,
        r#"{{"name":{name},"image":{image},"imageID":{image_id},"containerID":"containerd://{}{}","ready":true,"started":true,"restartCount":{},"state":{{"running":{{"startedAt":"{started}"}}}}}}"#,
        rng.hex(32),
        rng.hex(32),
        rng.below(3),
        name = q(name),
        image = q(image),
        image_id = q(&format!("{image}@sha256:{}{}", rng.hex(32), rng.hex(32))),
    );
}

/// Builds the Pod JSON text and its labels. With `server`, the server-assigned metadata
/// (resourceVersion, uid, creationTimestamp, generation) is embedded too.
pub(crate) fn pod_json(
    namespace: &str,
    name: &str,
    seed: u64,
    server: Option<&ServerFields<'_>>,
) -> (String, Vec<(String, String)>) {
    let mut rng = Rng(seed ^ 0x0005_EED0_F90D);
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
    let shard = format!("s{}", rng.below(16));
    let labels: Vec<(String, String)> = [
        ("app", app),
        ("tier", tier),
        ("pod-template-hash", hash.as_str()),
        ("app.kubernetes.io/name", app),
        ("app.kubernetes.io/version", version.as_str()),
        ("shard", shard.as_str()),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();

    let mut out = String::with_capacity(6144);
    let _ = write!(
        out,
        r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":{},"namespace":{},"#,
        q(name),
        q(namespace)
    );
    if let Some(f) = server {
        let _ = write!(
            out,
            r#""resourceVersion":{},"uid":{},"creationTimestamp":{},"generation":1,"#,
            q(f.rv),
            q(f.uid),
            q(f.created)
        );
    }
    out.push_str(r#""labels":{"#);
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{}:{}", q(k), q(v));
    }
    let _ = write!(
        out,
        r#"}},"annotations":{{"kubectl.kubernetes.io/restartedAt":"{created}","prometheus.io/scrape":"true","prometheus.io/port":"{port}","example.com/commit":"{commit}"}},"ownerReferences":[{{"apiVersion":"apps/v1","kind":"ReplicaSet","name":{rs},"uid":"{owner_uid}","controller":true,"blockOwnerDeletion":true}}],"managedFields":[{{"manager":"kube-controller-manager","operation":"Update","apiVersion":"v1","time":"{created}","fieldsType":"FieldsV1","fieldsV1":{{"f:metadata":{{"f:labels":{{".":{{}},"f:app":{{}},"f:pod-template-hash":{{}},"f:tier":{{}}}},"f:ownerReferences":{{".":{{}},"k:{{\"uid\":\"{owner_uid}\"}}":{{}}}}}},"f:spec":{{"f:containers":{{"k:{{\"name\":\"{app}\"}}":{{".":{{}},"f:image":{{}},"f:name":{{}}}}}}}}}}}},{{"manager":"kubelet","operation":"Update","apiVersion":"v1","time":"{created}","fieldsType":"FieldsV1","subresource":"status","fieldsV1":{{"f:status":{{"f:conditions":{{}},"f:containerStatuses":{{}},"f:hostIP":{{}},"f:phase":{{}},"f:podIP":{{}},"f:startTime":{{}}}}}}}}]}},"spec":{{"containers":["#,
        commit = rng.hex(32),
        rs = q(&format!("{app}-{hash}")),
    );
    container(&mut out, &mut rng, app, &image, port, envs);
    out.push(',');
    container(&mut out, &mut rng, "envoy", &sidecar, 15000, 2);
    let _ = write!(
        out,
        r#"],"volumes":[{{"name":"config","configMap":{{"name":"{app}-config","defaultMode":420}}}},{{"name":"kube-api-access","projected":{{"sources":[{{"serviceAccountToken":{{"path":"token","expirationSeconds":3607}}}}],"defaultMode":420}}}}],"nodeName":"{node}","serviceAccountName":"{app}","restartPolicy":"Always","dnsPolicy":"ClusterFirst","schedulerName":"default-scheduler","terminationGracePeriodSeconds":30,"tolerations":[{{"key":"node.kubernetes.io/not-ready","operator":"Exists","effect":"NoExecute","tolerationSeconds":300}}]}},"status":{{"phase":"Running","hostIP":"192.168.{}.{}","podIP":"{ip}","podIPs":[{{"ip":"{ip}"}}],"qosClass":"Burstable","startTime":"{created}","conditions":[{{"type":"Initialized","status":"True","lastTransitionTime":"{created}"}},{{"type":"Ready","status":"True","lastTransitionTime":"{created}"}},{{"type":"ContainersReady","status":"True","lastTransitionTime":"{created}"}},{{"type":"PodScheduled","status":"True","lastTransitionTime":"{created}"}}],"containerStatuses":["#,
        rng.below(256),
        1 + rng.below(254),
    );
    container_status(&mut out, &mut rng, app, &image, &created);
    out.push(',');
    container_status(&mut out, &mut rng, "envoy", &sidecar, &created);
    out.push_str("]}}");
    (out, labels)
}

/// A realistic Pod (2-6 KB of JSON): labels (app, tier, pod-template-hash, ...), annotations,
/// ownerReferences, two managedFields entries, two containers with env/ports/resources/
/// volumeMounts, `nodeName` `node-<k>`, and a status with conditions, containerStatuses and
/// podIP. Deterministic for a given seed.
pub fn make_pod(namespace: &str, name: &str, seed: u64) -> Value {
    serde_json::from_str(&pod_json(namespace, name, seed, None).0).unwrap_or(Value::Null)
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
        let odd = make_pod("we\"ird", "na\\me", 3);
        assert_eq!(odd["metadata"]["name"], "na\\me");
        let fields = ServerFields {
            rv: "7",
            uid: "u",
            created: "2024-01-01T00:00:00Z",
        };
        let (text, labels) = pod_json("ns", "p", 5, Some(&fields));
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["metadata"]["resourceVersion"], "7");
        assert_eq!(labels.len(), 6);
    }
}
