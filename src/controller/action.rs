//! Reading the requeue delay out of kube-runtime's [`Action`].
//!
//! kube-runtime 5.0's `Action` keeps `requeue_after` private and has no getter; its only
//! public windows are `PartialEq` and `Debug`. We parse the derived `Debug` output
//! (`Action { requeue_after: Some(1.5s) }`) and then CHECK the result with `PartialEq`
//! against `Action::requeue(parsed)`, so a change of the format can never make us requeue
//! at a wrong time: an action we cannot read back exactly is requeued after
//! [`FALLBACK`] with a warning (and the unit tests below fail).

use std::time::Duration;

use kube::runtime::controller::Action;

/// Requeue delay used if an `Action` cannot be read back exactly (never expected).
pub(crate) const FALLBACK: Duration = Duration::from_secs(300);

/// The delay after which `action` asks to run again, `None` for `Action::await_change()`.
pub(crate) fn requeue_after(action: &Action) -> Option<Duration> {
    if *action == Action::await_change() {
        return None;
    }
    let text = format!("{action:?}");
    match parse(&text) {
        Some(d) if Action::requeue(d) == *action => Some(d),
        _ => {
            tracing::warn!(action = %text, fallback = ?FALLBACK, "cannot read the requeue delay of this Action; using the fallback");
            Some(FALLBACK)
        }
    }
}

/// `Action { requeue_after: Some(<Duration as Debug>) }` → the duration.
fn parse(text: &str) -> Option<Duration> {
    let inner = text.split("Some(").nth(1)?.split(')').next()?;
    parse_duration_debug(inner)
}

/// Parses `Duration`'s `Debug` form: a decimal number and one of `s`, `ms`, `µs`, `ns`.
fn parse_duration_debug(s: &str) -> Option<Duration> {
    let (number, unit_nanos) = if let Some(n) = s.strip_suffix("ns") {
        (n, 1u128)
    } else if let Some(n) = s.strip_suffix("µs") {
        (n, 1_000)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1_000_000)
    } else {
        (s.strip_suffix('s')?, 1_000_000_000)
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let whole: u128 = whole.parse().ok()?;
    let mut nanos = whole.checked_mul(unit_nanos)?;
    if !frac.is_empty() {
        if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits: u128 = frac.parse().ok()?;
        let scale = 10u128.pow(frac.len() as u32);
        nanos = nanos.checked_add(digits * unit_nanos / scale)?;
    }
    let secs = u64::try_from(nanos / 1_000_000_000).ok()?;
    Some(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_every_kind_of_duration() {
        let cases = [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_nanos(999),
            Duration::from_micros(1),
            Duration::from_nanos(1_500),
            Duration::from_millis(1),
            Duration::from_micros(2_500),
            Duration::from_millis(50),
            Duration::from_secs(1),
            Duration::from_millis(1_500),
            Duration::from_nanos(1_000_000_001),
            Duration::from_secs(300),
            Duration::from_secs(86_400 * 365),
            Duration::new(u64::MAX, 999_999_999),
        ];
        for d in cases {
            assert_eq!(requeue_after(&Action::requeue(d)), Some(d), "{d:?}");
        }
        assert_eq!(requeue_after(&Action::await_change()), None);
    }

    #[test]
    fn refuses_garbage() {
        assert_eq!(parse_duration_debug("abc"), None);
        assert_eq!(parse_duration_debug("1.2.3s"), None);
        assert_eq!(parse_duration_debug("1.0000000001s"), None);
    }
}
