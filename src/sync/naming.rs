//! Stream names derived from what a stream watches, for the constructors that take an
//! `Api` and a configuration as kube-runtime's do (`Controller::new`, `.owns`, `.watches`,
//! `kube_persist::watcher`) and so have no name to give.
//!
//! A name is `<resource>[.<group>][@<namespace>][#<hash>]`: the resource (plural) and API
//! group of the kind, the namespace of a namespaced `Api`, and a hash of the label and
//! field selectors and the shard, when any is set (`pods`, `configmapgenerators.nullable.se`,
//! `pods@default#9f2c41d07a3b5e18`). Two streams of one directory that would cache different
//! collections never get the same name; the version is left out, so that a stream moved to
//! another version of its kind keeps its name (its identity changes: it relists in place).

use kube::Resource;

use super::config::StreamConfig;
use crate::model::fnv1a64;

/// The name of the stream of `K` (with `dyntype`) at collection `url` with `config`.
pub(crate) fn derived<K: Resource>(
    url: &str,
    dyntype: &K::DynamicType,
    config: &StreamConfig,
) -> String {
    let path = url.split(['?', '#']).next().unwrap_or_default();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let resource = segments
        .last()
        .filter(|s| !s.is_empty())
        .map(|s| s.to_string())
        .unwrap_or_else(|| K::plural(dyntype).into_owned());
    let mut name = resource;
    let group = K::group(dyntype);
    if !group.is_empty() {
        name.push('.');
        name.push_str(&group);
    }
    // `.../namespaces/<ns>/<resource>`: a namespaced collection.
    if let Some(i) = segments.iter().position(|s| *s == "namespaces")
        && i + 2 < segments.len()
    {
        name.push('@');
        name.push_str(segments[i + 1]);
    }
    let labels = config.get_label_selector();
    let fields = config.get_field_selector();
    let shard = config.get_shard();
    if labels.is_some() || fields.is_some() || shard.is_some() {
        let key = format!("labels={labels:?}\0fields={fields:?}\0shard={shard:?}");
        name.push_str(&format!("#{:016x}", fnv1a64(key.as_bytes())));
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ConfigMap, Pod};
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};

    #[test]
    fn names_tell_collections_apart() {
        let all = StreamConfig::default();
        assert_eq!(derived::<Pod>("/api/v1/pods", &(), &all), "pods");
        assert_eq!(
            derived::<Pod>("/api/v1/namespaces/default/pods", &(), &all),
            "pods@default"
        );
        assert_eq!(
            derived::<ConfigMap>("/api/v1/configmaps", &(), &all),
            "configmaps"
        );
        let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
            "nullable.se",
            "v1",
            "ConfigMapGenerator",
        ));
        assert_eq!(
            derived::<DynamicObject>("/apis/nullable.se/v1/configmapgenerators", &ar, &all),
            "configmapgenerators.nullable.se"
        );
        // Selectors and shards make other collections: other names, stable ones.
        let web = derived::<Pod>(
            "/api/v1/pods",
            &(),
            &StreamConfig::default().labels("app=web"),
        );
        let db = derived::<Pod>(
            "/api/v1/pods",
            &(),
            &StreamConfig::default().labels("app=db"),
        );
        let fields = derived::<Pod>(
            "/api/v1/pods",
            &(),
            &StreamConfig::default().fields("app=web"),
        );
        let shard = derived::<Pod>("/api/v1/pods", &(), &StreamConfig::default().shards(0, 2));
        let names = [&web, &db, &fields, &shard];
        for (i, a) in names.iter().enumerate() {
            assert!(a.starts_with("pods#"), "{a}");
            for b in &names[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(
            web,
            derived::<Pod>(
                "/api/v1/pods",
                &(),
                &StreamConfig::default().labels("app=web")
            )
        );
        // The version is not part of the name.
        assert_eq!(derived::<Pod>("/api/v2/pods", &(), &all), "pods");
    }
}
