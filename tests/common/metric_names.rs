//! The `kube_persist_*` metric names a Prometheus text names (a rules file, a dashboard),
//! a histogram's series (`_bucket`, `_sum`, `_count`) by its family's name. Shared by the
//! `monitoring` tests and the e2e scenario that runs Prometheus.

use std::collections::BTreeSet;

/// The metric names `text` queries.
pub fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kube_persist_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        names.insert(family.to_string());
        rest = &tail[end..];
    }
    names
}
