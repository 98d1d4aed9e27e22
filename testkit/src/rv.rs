//! How revisions are rendered as `resourceVersion` strings, and parsed back.
//!
//! By default a resourceVersion is the decimal revision, like etcd-backed kube-apiserver.
//! With [`ServerOptions::opaque_resource_versions`](crate::ServerOptions) it is a
//! non-numeric string: the prefix `tk` followed by the revision in base 26 written with the
//! letters `a`..`z`, least significant digit first (revision 0 is `tka`, 1 is `tkb`, 26 is
//! `tkab`). It is reversible, cannot be parsed as an integer and does not sort like the
//! number (`tkab` < `tkb` although 26 > 1), so clients that treat resourceVersions as opaque
//! (as the API requires) work and clients that parse or compare them break.

use crate::status::ApiError;

/// Prefix of every opaque resourceVersion.
const PREFIX: &str = "tk";
const BASE: u64 = 26;

/// A `resourceVersion` query parameter, after the special values are set apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RvParam {
    /// Absent or empty: the most recent state (a consistent read).
    Unset,
    /// `"0"`: any state.
    Any,
    /// A revision the server rendered.
    Rev(u64),
}

/// Renders a revision.
pub(crate) fn render(rev: u64, opaque: bool) -> String {
    if !opaque {
        return rev.to_string();
    }
    let mut s = String::from(PREFIX);
    let mut n = rev;
    loop {
        s.push(char::from(b'a' + (n % BASE) as u8));
        n /= BASE;
        if n == 0 {
            return s;
        }
    }
}

/// Parses a rendered revision; `None` for anything the server would not have rendered.
pub(crate) fn parse(s: &str, opaque: bool) -> Option<u64> {
    if !opaque {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        return s.parse().ok();
    }
    let digits = s.strip_prefix(PREFIX)?.as_bytes();
    // Canonical form only: no most-significant zero digits.
    if digits.is_empty() || (digits.len() > 1 && digits[digits.len() - 1] == b'a') {
        return None;
    }
    let mut n: u64 = 0;
    for &d in digits.iter().rev() {
        if !d.is_ascii_lowercase() {
            return None;
        }
        n = n.checked_mul(BASE)?.checked_add(u64::from(d - b'a'))?;
    }
    Some(n)
}

/// The 400 answer to a resourceVersion the server cannot parse, as kube-apiserver words it.
pub(crate) fn invalid(s: &str) -> ApiError {
    ApiError::bad_request(format!("invalid resource version: {s:?}"))
}

/// Parses a `resourceVersion` query parameter: `""` and `"0"` are special, anything else must
/// be a rendered revision (400 BadRequest otherwise).
pub(crate) fn parse_param(s: &str, opaque: bool) -> Result<RvParam, ApiError> {
    match s {
        "" => Ok(RvParam::Unset),
        "0" => Ok(RvParam::Any),
        s => parse(s, opaque).map(RvParam::Rev).ok_or_else(|| invalid(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opaque_round_trip_and_order() {
        for rev in [0, 1, 25, 26, 27, 675, 676, 123_456_789, u64::MAX] {
            let s = render(rev, true);
            assert!(s.parse::<u64>().is_err(), "{s}");
            assert_eq!(parse(&s, true), Some(rev), "{s}");
            assert_eq!(parse(&s, false), None);
            assert_eq!(parse(&rev.to_string(), true), None);
            assert_eq!(parse(&rev.to_string(), false), Some(rev));
        }
        assert_eq!(render(0, true), "tka");
        assert_eq!(render(1, true), "tkb");
        assert_eq!(render(26, true), "tkab");
        assert!(
            render(26, true) < render(1, true),
            "does not sort like the number"
        );
        for bad in [
            "",
            "tk",
            "tkba",
            "tkB",
            "tk1",
            "xyz",
            "tkzzzzzzzzzzzzzzzzzz",
        ] {
            assert_eq!(parse(bad, true), None, "{bad}");
        }
        assert_eq!(parse_param("0", true).unwrap(), RvParam::Any);
        assert_eq!(parse_param("", true).unwrap(), RvParam::Unset);
        assert_eq!(parse_param("7", true).unwrap_err().code, 400);
        assert_eq!(parse_param("-1", false).unwrap_err().code, 400);
    }
}
