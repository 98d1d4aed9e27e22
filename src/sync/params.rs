//! The one LIST request builder: the parameters of every LIST of a stream's collection (the
//! machine's pages, the catch-up read of the server's resourceVersion, verification), so
//! that they select the same objects the same way.

use kube::core::params::{ListParams, VersionMatch};

use super::config::StreamConfig;

/// Which objects a LIST selects: the stream's label and field selectors.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Selectors<'a> {
    pub(crate) labels: Option<&'a str>,
    pub(crate) fields: Option<&'a str>,
}

impl<'a> Selectors<'a> {
    /// The selectors every LIST and WATCH of a stream configured by `cfg` carries.
    pub(crate) fn of(cfg: &'a StreamConfig) -> Selectors<'a> {
        Selectors {
            labels: cfg.label_selector.as_deref(),
            fields: cfg.field_selector.as_deref(),
        }
    }
}

/// Where a LIST page starts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum From<'a> {
    /// A consistent read of the newest state (no resourceVersion: never from a stale cache).
    Now,
    /// The next page of a list, by its continue token.
    Continue(&'a str),
    /// The state at exactly this resourceVersion (`resourceVersionMatch=Exact`).
    Exactly(&'a str),
}

/// `ListParams` for `limit` objects of `selectors`, starting `from`.
pub(crate) fn list(selectors: Selectors<'_>, limit: u32, from: From<'_>) -> ListParams {
    let mut lp = ListParams {
        label_selector: selectors.labels.map(str::to_string),
        field_selector: selectors.fields.map(str::to_string),
        limit: Some(limit),
        ..ListParams::default()
    };
    match from {
        From::Now => {}
        From::Continue(token) => lp.continue_token = Some(token.to_string()),
        From::Exactly(rv) => {
            lp.resource_version = Some(rv.to_string());
            lp.version_match = Some(VersionMatch::Exact);
        }
    }
    lp
}

/// `ListParams` of a LIST narrowed to the one object `name` of `selectors` (in the
/// namespace the request's path names): its field selector is the stream's joined to
/// `metadata.name=<name>` (escaped as a field selector value), its label selector the
/// stream's, and its answer not older than `at` (`resourceVersionMatch=NotOlderThan`: served
/// from the API server's watch cache when it has one, never older than a page listed at `at`).
/// It needs only the `list` verb, and an empty answer means the object is not in the
/// selection now.
pub(crate) fn one(selectors: Selectors<'_>, name: &str, at: &str) -> ListParams {
    let named = format!("metadata.name={}", escape_field_value(name));
    let fields = match selectors.fields.filter(|f| !f.trim().is_empty()) {
        Some(f) => format!("{f},{named}"),
        None => named,
    };
    ListParams {
        label_selector: selectors.labels.map(str::to_string),
        field_selector: Some(fields),
        resource_version: Some(at.to_string()),
        version_match: Some(VersionMatch::NotOlderThan),
        ..ListParams::default()
    }
}

/// apimachinery's `fields.EscapeValue`: a field selector value with `\`, `,` and `=`
/// escaped by a backslash (the query string's own encoding is the request builder's).
pub(crate) fn escape_field_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if matches!(c, '\\' | ',' | '=') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The collection path of the objects of `namespace` (`None`: cluster-scoped) listed at
/// `list_url` (`/api/v1/pods`, or `/api/v1/namespaces/ns/pods` for a namespaced `Api`): an
/// object's path is this and its name.
pub(crate) fn collection_path(list_url: &str, namespace: Option<&str>) -> String {
    let list_url = list_url.trim_end_matches('/');
    match namespace {
        Some(ns) => {
            let (prefix, plural) = list_url.rsplit_once('/').unwrap_or(("", list_url));
            if prefix.ends_with(&format!("/namespaces/{ns}")) {
                list_url.to_string()
            } else {
                format!("{prefix}/namespaces/{ns}/{plural}")
            }
        }
        None => list_url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_object_lists_within_the_selection() {
        let sel = Selectors {
            labels: Some("app=web"),
            fields: Some("spec.nodeName=n1"),
        };
        let lp = one(sel, "p-0", "42");
        assert_eq!(
            lp.field_selector.as_deref(),
            Some("spec.nodeName=n1,metadata.name=p-0")
        );
        assert_eq!(lp.label_selector.as_deref(), Some("app=web"));
        assert_eq!(lp.resource_version.as_deref(), Some("42"));
        assert!(matches!(lp.version_match, Some(VersionMatch::NotOlderThan)));
        assert_eq!(lp.limit, None);
        let lp = one(Selectors::default(), "a", "1");
        assert_eq!(lp.field_selector.as_deref(), Some("metadata.name=a"));
    }

    /// Names that RBAC objects and other kinds accept, which a path or a selector must
    /// carry as they are.
    #[test]
    fn names_are_escaped_as_field_selector_values_and_in_the_query() {
        assert_eq!(escape_field_value(r"a,b=c\d"), r"a\,b\=c\\d");
        assert_eq!(escape_field_value("a?b #é"), "a?b #é");
        for name in [
            "a?b",
            "a#b",
            "a b",
            "système:é",
            "a,b=c",
            r"x\y",
            "a&b=c%2F",
        ] {
            let req = kube::core::Request::new("/apis/rbac.authorization.k8s.io/v1/clusterroles")
                .list(&one(Selectors::default(), name, "7"))
                .expect("every name builds a request");
            let uri = req.uri().clone();
            assert_eq!(
                uri.path(),
                "/apis/rbac.authorization.k8s.io/v1/clusterroles"
            );
            let query: std::collections::HashMap<String, String> =
                form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
                    .into_owned()
                    .collect();
            assert_eq!(
                query.get("fieldSelector").map(String::as_str),
                Some(format!("metadata.name={}", escape_field_value(name)).as_str()),
                "{name:?}"
            );
        }
    }

    #[test]
    fn pages_carry_selectors_and_their_start() {
        let sel = Selectors {
            labels: Some("app=web"),
            fields: None,
        };
        let lp = list(sel, 50, From::Continue("t"));
        assert_eq!(lp.label_selector.as_deref(), Some("app=web"));
        assert_eq!(
            (lp.limit, lp.continue_token.as_deref()),
            (Some(50), Some("t"))
        );
        assert_eq!(lp.resource_version, None);
        let lp = list(sel, 1, From::Exactly("42"));
        assert_eq!(lp.resource_version.as_deref(), Some("42"));
        assert!(matches!(lp.version_match, Some(VersionMatch::Exact)));
        assert!(list(sel, 1, From::Now).resource_version.is_none());
    }

    #[test]
    fn collection_paths_follow_the_list_url() {
        assert_eq!(
            collection_path("/api/v1/pods", Some("ns1")),
            "/api/v1/namespaces/ns1/pods"
        );
        assert_eq!(
            collection_path("/api/v1/namespaces/ns1/pods", Some("ns1")),
            "/api/v1/namespaces/ns1/pods"
        );
        assert_eq!(
            collection_path("/apis/apps/v1/deployments", Some("x")),
            "/apis/apps/v1/namespaces/x/deployments"
        );
        assert_eq!(collection_path("/api/v1/nodes", None), "/api/v1/nodes");
        assert_eq!(
            collection_path("/api/v1/namespaces", None),
            "/api/v1/namespaces"
        );
    }
}
