//! [`ServerHandle`]: in-process access to the server's data, counters and faults.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::faults::Faults;
use crate::object::{self, Prepared, StoredObject};
use crate::pods::{ServerFields, make_pod, pod_json};
use crate::resource::{RequestCounts, ResourceType};
use crate::rv;
use crate::shared::Shared;
use crate::status::ApiError;

/// In-process handle to a running [`TestServer`](crate::TestServer). Cheap to clone; every
/// write goes through the same revision counter, history and watch fan-out as HTTP writes.
#[derive(Clone)]
pub struct ServerHandle {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("revision", &self.revision())
            .finish()
    }
}

impl ServerHandle {
    /// Serves an extra resource type (the five of [`ResourceType`]'s constructors are always
    /// served; writing through a handle registers a type too). Idempotent.
    pub fn register(&self, rt: &ResourceType) {
        self.shared.state().register(rt);
    }

    /// Creates an object (409 AlreadyExists if present). A namespaced object without
    /// namespace lands in `default`.
    pub fn create(&self, rt: &ResourceType, obj: Value) -> Result<Value, ApiError> {
        let p = object::prepare(rt, obj, None)?;
        let o = self.shared.write(|st| {
            let ty = st.register(rt);
            st.create(ty, p)
        })?;
        Ok(o.value())
    }

    /// Replaces an object: 404 if absent; if `metadata.resourceVersion` is set it must match
    /// (409 Conflict otherwise; 400 BadRequest if it is not a resourceVersion this server
    /// renders, e.g. a number with opaque resourceVersions).
    pub fn replace(&self, rt: &ResourceType, obj: Value) -> Result<Value, ApiError> {
        let p = object::prepare(rt, obj, None)?;
        let o = self.shared.write(|st| {
            let ty = st.register(rt);
            st.replace(ty, p, true)
        })?;
        Ok(o.value())
    }

    /// Creates or replaces an object, ignoring any `metadata.resourceVersion`.
    /// An invalid object is not stored; the returned value is then the `Status` describing why.
    pub fn apply(&self, rt: &ResourceType, obj: Value) -> Value {
        match object::prepare(rt, obj, None).and_then(|p| self.upsert(rt, p)) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "apply rejected an invalid object");
                e.to_status()
            }
        }
    }

    fn upsert(&self, rt: &ResourceType, p: Prepared) -> Result<Value, ApiError> {
        let o = self.shared.write(|st| {
            let ty = st.register(rt);
            if st.get(ty, &p.namespace, &p.name).is_some() {
                st.replace(ty, p, false)
            } else {
                st.create(ty, p)
            }
        })?;
        Ok(o.value())
    }

    /// Deletes an object; returns its last state (stamped with the deletion's revision).
    pub fn delete(&self, rt: &ResourceType, namespace: Option<&str>, name: &str) -> Option<Value> {
        let ns = scope_ns(rt, namespace);
        self.shared
            .write(|st| {
                let ty = st.register(rt);
                st.delete(ty, ns, name)
            })
            .map(|o| o.value())
    }

    /// The current state of an object.
    pub fn get(&self, rt: &ResourceType, namespace: Option<&str>, name: &str) -> Option<Value> {
        let ns = scope_ns(rt, namespace);
        let mut st = self.shared.state();
        let ty = st.register(rt);
        st.get(ty, ns, name).map(|o| o.value())
    }

    /// All current objects of a type, ordered by (namespace, name).
    pub fn list(&self, rt: &ResourceType) -> Vec<Value> {
        let objs = {
            let mut st = self.shared.state();
            let ty = st.register(rt);
            st.current(ty, &Default::default())
        };
        objs.iter().map(|o| o.value()).collect()
    }

    /// `(namespace, name) -> resourceVersion` of every current object of a type (cheap: no
    /// JSON parsing), rendered as in the objects. Not in the original brief; added for
    /// store-vs-server comparisons.
    pub fn resource_versions(&self, rt: &ResourceType) -> BTreeMap<(String, String), String> {
        let objs = {
            let mut st = self.shared.state();
            let ty = st.register(rt);
            st.current(ty, &Default::default())
        };
        let opaque = self.shared.opts.opaque_resource_versions;
        objs.iter()
            .map(|o| (o.key(), rv::render(o.rev, opaque)))
            .collect()
    }

    /// The current global revision, as a number (also with
    /// [`ServerOptions::opaque_resource_versions`](crate::ServerOptions::opaque_resource_versions);
    /// see [`ServerHandle::resource_version`] for the rendered form).
    pub fn revision(&self) -> u64 {
        self.shared.state().revision
    }

    /// The current global revision as the server renders it in `resourceVersion` fields
    /// (list metadata, objects, bookmarks): the decimal number, or the opaque string with
    /// [`ServerOptions::opaque_resource_versions`](crate::ServerOptions::opaque_resource_versions).
    /// Compare it with a client's checkpoint without parsing either.
    pub fn resource_version(&self) -> String {
        self.render_resource_version(self.revision())
    }

    /// Renders a revision the way this server writes `resourceVersion` fields.
    pub fn render_resource_version(&self, revision: u64) -> String {
        rv::render(revision, self.shared.opts.opaque_resource_versions)
    }

    /// Parses a `resourceVersion` this server rendered back to its revision; `None` for
    /// anything else (with opaque resourceVersions, a plain number is `None`).
    pub fn parse_resource_version(&self, resource_version: &str) -> Option<u64> {
        rv::parse(resource_version, self.shared.opts.opaque_resource_versions)
    }

    /// Forgets all history up to now: watches from older revisions, and continue tokens
    /// issued before this call or Exact lists older than now, get 410 Expired.
    pub fn compact(&self) {
        self.shared.state().compact();
    }

    /// Creates (or overwrites) `n` realistic pods `pod-<i>` in namespaces `ns-<i % namespaces>`.
    pub fn seed_pods(&self, n: usize, namespaces: usize) {
        let rt = ResourceType::pods();
        let namespaces = namespaces.max(1);
        const BATCH: usize = 1000;
        let mut i = 0;
        while i < n {
            let end = (i + BATCH).min(n);
            let created = object::now_rfc3339();
            self.shared.write(|st| {
                let ty = st.register(&rt);
                for k in i..end {
                    let (ns, name) = (format!("ns-{}", k % namespaces), format!("pod-{k}"));
                    if st.get(ty, &ns, &name).is_some() {
                        let pod = make_pod(&ns, &name, k as u64);
                        if let Err(e) =
                            object::prepare(&rt, pod, None).and_then(|p| st.replace(ty, p, false))
                        {
                            tracing::warn!(error = %e, "seed_pods skipped a pod");
                        }
                        continue;
                    }
                    let (rev, uid) = (st.revision + 1, object::new_uid());
                    let rv = st.rv(rev);
                    let fields = ServerFields {
                        rv: &rv,
                        uid: &uid,
                        created: &created,
                    };
                    let (json, labels) = pod_json(&ns, &name, k as u64, Some(&fields));
                    let obj = StoredObject {
                        rev,
                        namespace: ns,
                        name,
                        uid,
                        created: created.clone(),
                        generation: 1,
                        labels,
                        json: Bytes::from(json),
                    };
                    st.insert_created(ty, obj);
                }
            });
            i = end;
        }
    }

    /// Applies random pod changes: `updates` label/annotation bumps of existing pods, `creates`
    /// new pods and `deletes` of existing pods (deterministic for a given `seed` and state).
    /// Returns the revision afterwards.
    pub fn churn(&self, updates: usize, creates: usize, deletes: usize, seed: u64) -> u64 {
        let rt = ResourceType::pods();
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut keys, start_rev) = {
            let mut st = self.shared.state();
            let ty = st.register(&rt);
            (st.keys(ty), st.revision)
        };
        let mut namespaces: Vec<String> = keys.iter().map(|k| k.0.clone()).collect();
        namespaces.dedup();
        if namespaces.is_empty() {
            namespaces.push("ns-0".into());
        }
        for u in 0..updates {
            if keys.is_empty() {
                break;
            }
            let (ns, name) = keys[rng.random_range(0..keys.len())].clone();
            let Some(mut obj) = self.get(&rt, Some(&ns), &name) else {
                continue;
            };
            if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                let value = format!("c{start_rev}-{u}");
                let labels = meta.entry("labels").or_insert_with(|| json!({}));
                if let Some(l) = labels.as_object_mut() {
                    l.insert("testkit/churn".into(), Value::String(value.clone()));
                }
                let ann = meta.entry("annotations").or_insert_with(|| json!({}));
                if let Some(a) = ann.as_object_mut() {
                    a.insert("testkit/churned-at".into(), Value::String(value));
                }
            }
            self.apply(&rt, obj);
        }
        for c in 0..creates {
            let ns = &namespaces[rng.random_range(0..namespaces.len())];
            let name = format!("pod-r{start_rev}-{c}");
            let seed = rng.random::<u64>();
            self.apply(&rt, make_pod(ns, &name, seed));
        }
        for _ in 0..deletes {
            if keys.is_empty() {
                break;
            }
            let (ns, name) = keys.swap_remove(rng.random_range(0..keys.len()));
            self.delete(&rt, Some(&ns), &name);
        }
        self.revision()
    }

    /// Requests served per verb.
    pub fn counts(&self) -> RequestCounts {
        self.shared.counters.snapshot()
    }

    /// Resets the request counters to zero.
    pub fn reset_counts(&self) {
        self.shared.counters.reset();
    }

    /// The fault-injection handle.
    pub fn faults(&self) -> Faults {
        Faults {
            shared: self.shared.clone(),
        }
    }
}

/// The stored namespace for a scope: `""` for cluster-scoped, `default` if unspecified.
fn scope_ns<'a>(rt: &ResourceType, namespace: Option<&'a str>) -> &'a str {
    if rt.namespaced {
        namespace.unwrap_or("default")
    } else {
        ""
    }
}
