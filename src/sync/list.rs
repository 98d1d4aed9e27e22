//! The one LIST request builder: the parameters of every LIST of a stream's collection (the
//! machine's pages, the catch-up read of the server's resourceVersion, verification), so
//! that they select the same objects the same way.

use kube::core::params::{ListParams, VersionMatch};

/// Which objects a LIST selects: the stream's label and field selectors.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Selectors<'a> {
    pub(crate) labels: Option<&'a str>,
    pub(crate) fields: Option<&'a str>,
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
pub(crate) fn params(selectors: Selectors<'_>, limit: u32, from: From<'_>) -> ListParams {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_carry_selectors_and_their_start() {
        let sel = Selectors {
            labels: Some("app=web"),
            fields: None,
        };
        let lp = params(sel, 50, From::Continue("t"));
        assert_eq!(lp.label_selector.as_deref(), Some("app=web"));
        assert_eq!(
            (lp.limit, lp.continue_token.as_deref()),
            (Some(50), Some("t"))
        );
        assert_eq!(lp.resource_version, None);
        let lp = params(sel, 1, From::Exactly("42"));
        assert_eq!(lp.resource_version.as_deref(), Some("42"));
        assert!(matches!(lp.version_match, Some(VersionMatch::Exact)));
        assert!(params(sel, 1, From::Now).resource_version.is_none());
    }
}
