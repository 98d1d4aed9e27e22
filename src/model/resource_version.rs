//! Comparing resourceVersions, the one place that does (KEP-5504).
//!
//! A resourceVersion is opaque unless the server says otherwise. Since Kubernetes v1.35
//! (KEP-5504, "comparable resource versions"), kube-apiserver promises that its
//! resourceVersions are positive decimal integers without leading zeros, of any length,
//! ordered as numbers: a shorter one is smaller, two of the same length compare digit by
//! digit. `k8s.io/apimachinery/pkg/util/resourceversion.CompareResourceVersion` implements
//! that rule and refuses anything else; [`compare`] is its counterpart here.
//!
//! Everything in kube-persist that orders resourceVersions goes through this module (the
//! freshness of a store, read-your-writes waits, the lag metric); anything that is not of
//! that form (an aggregated API server with its own versions, an older server) is reported
//! as not comparable and the caller falls back to a weaker rule, never to a guess.

use std::cmp::Ordering;

use crate::model::{Error, Result};

/// Why `s` is not a comparable resourceVersion, or `None` when it is one.
fn invalid(s: &str) -> Option<&'static str> {
    let b = s.as_bytes();
    if b.is_empty() {
        return Some("it is empty");
    }
    if !b.iter().all(u8::is_ascii_digit) {
        return Some("it is not a decimal integer");
    }
    if b[0] == b'0' {
        return Some("it has a leading zero (or is zero)");
    }
    None
}

/// Whether `s` has the form KEP-5504 makes comparable: a positive decimal integer without
/// leading zeros.
///
/// ```
/// use kube_persist::resource_version::is_comparable;
/// assert!(is_comparable("100464"));
/// assert!(!is_comparable("0"));
/// assert!(!is_comparable("007"));
/// assert!(!is_comparable("tkab"));
/// ```
pub fn is_comparable(s: &str) -> bool {
    invalid(s).is_none()
}

/// Orders two resourceVersions as KEP-5504 defines: `Ok(Less)` when `a` is older than `b`.
///
/// Fails with [`Error::IncomparableResourceVersions`] when either is not a positive decimal
/// integer without leading zeros: such versions are opaque and must not be ordered.
///
/// ```
/// use std::cmp::Ordering;
/// use kube_persist::resource_version::compare;
/// assert_eq!(compare("99", "100")?, Ordering::Less); // shorter is smaller
/// assert_eq!(compare("123456789012345678901234567890", "123456789012345678901234567889")?,
///            Ordering::Greater); // any length
/// assert_eq!(compare("42", "42")?, Ordering::Equal);
/// assert!(compare("42", "tkab").is_err()); // opaque: not ordered
/// # Ok::<(), kube_persist::Error>(())
/// ```
pub fn compare(a: &str, b: &str) -> Result<Ordering> {
    for s in [a, b] {
        if let Some(reason) = invalid(s) {
            return Err(Error::IncomparableResourceVersions {
                a: a.to_string(),
                b: b.to_string(),
                reason: format!("{s:?}: {reason}"),
            });
        }
    }
    Ok(a.len().cmp(&b.len()).then_with(|| a.cmp(b)))
}

/// Whether `a` is at `b` or newer; `None` when the two are not comparable.
///
/// ```
/// use kube_persist::resource_version::at_least;
/// assert_eq!(at_least("1000", "999"), Some(true));
/// assert_eq!(at_least("7", "8"), Some(false));
/// assert_eq!(at_least("7", "opaque"), None);
/// ```
pub fn at_least(a: &str, b: &str) -> Option<bool> {
    compare(a, b).ok().map(|o| o != Ordering::Less)
}

/// How many revisions `older` is behind `newer` (0 when it is not behind), saturating at
/// `u64::MAX`; `None` when the two are not comparable.
///
/// ```
/// use kube_persist::resource_version::distance;
/// assert_eq!(distance("100464", "100764"), Some(300));
/// assert_eq!(distance("500", "400"), Some(0));
/// assert_eq!(distance("1", "123456789012345678901234567890"), Some(u64::MAX));
/// assert_eq!(distance("1", "x"), None);
/// ```
pub fn distance(older: &str, newer: &str) -> Option<u64> {
    if compare(older, newer).ok()? != Ordering::Less {
        return Some(0);
    }
    // Both are valid digit strings: only their size can stop the subtraction.
    match (older.parse::<u128>(), newer.parse::<u128>()) {
        (Ok(o), Ok(n)) => Some(u64::try_from(n - o).unwrap_or(u64::MAX)),
        _ => Some(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kep_5504_ordering() {
        let cases = [
            ("1", "2", Ordering::Less),
            ("9", "10", Ordering::Less),
            ("10", "9", Ordering::Greater),
            ("100", "100", Ordering::Equal),
            (
                "18446744073709551616",
                "18446744073709551615",
                Ordering::Greater,
            ),
            (
                "99999999999999999999999",
                "100000000000000000000000",
                Ordering::Less,
            ),
        ];
        for (a, b, want) in cases {
            assert_eq!(compare(a, b).unwrap(), want, "{a} vs {b}");
            assert_eq!(compare(b, a).unwrap(), want.reverse(), "{b} vs {a}");
        }
    }

    #[test]
    fn not_comparable_is_an_error_naming_the_value() {
        for bad in ["", "0", "01", "-1", "+1", "1.0", " 1", "1 ", "tkb", "1e3"] {
            let e = compare("5", bad).unwrap_err();
            assert!(
                matches!(&e, Error::IncomparableResourceVersions { reason, .. } if reason.contains(&format!("{bad:?}"))),
                "{bad:?}: {e}"
            );
            assert!(compare(bad, "5").is_err(), "{bad:?}");
            assert_eq!(at_least(bad, "5"), None);
            assert_eq!(distance(bad, "5"), None);
        }
    }

    #[test]
    fn distance_saturates() {
        assert_eq!(distance("1", "18446744073709551617"), Some(u64::MAX));
        assert_eq!(
            distance("18446744073709551615", "18446744073709551616"),
            Some(1)
        );
    }
}
