//! What kind of trouble an [`Error`] is, for alerts and dashboards: the label
//! `kind` of `kube_persist_errors_total`, and the HTTP status behind it (`code`).

use super::error::Error;

/// The kind of an [`Error`], as an operator pages on it ([`Error::kind`]): the label
/// `kind` of the metric `kube_persist_errors_total`.
///
/// ```
/// use kube_persist::ErrorKind;
/// assert_eq!(ErrorKind::Refused.as_str(), "refused");
/// assert_eq!(ErrorKind::Gone.to_string(), "gone");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The server refused the request and retrying the same request will not help: 401,
    /// 403 (a verb the credentials lack), 404, 405, 406, 415, 400, 422 and the other 4xx
    /// but 408, 410 and 429.
    Refused,
    /// `410 Gone`: the resourceVersion or continue token is older than the server keeps.
    Gone,
    /// `429 Too Many Requests`: API Priority and Fairness (or a proxy) throttled it.
    Throttled,
    /// A 5xx: the server (or a proxy before it) failed.
    Server,
    /// No answer: a timeout (408, 504 included) or a broken or refused connection.
    Timeout,
    /// An answer that does not decode: a malformed list or watch, an object that is not
    /// what the stream holds, a stored body that no longer decodes.
    Decode,
    /// The store's disk: full, unreadable, damaged, or an engine failure.
    Disk,
    /// Anything else (a setting, a lock, a key).
    Other,
}

impl ErrorKind {
    /// Every kind, in order.
    ///
    /// ```
    /// assert_eq!(kube_persist::ErrorKind::ALL.len(), 8);
    /// ```
    pub const ALL: [ErrorKind; 8] = [
        ErrorKind::Refused,
        ErrorKind::Gone,
        ErrorKind::Throttled,
        ErrorKind::Server,
        ErrorKind::Timeout,
        ErrorKind::Decode,
        ErrorKind::Disk,
        ErrorKind::Other,
    ];

    /// Its label value: `refused`, `gone`, `throttled`, `server`, `timeout`, `decode`,
    /// `disk` or `other`.
    ///
    /// ```
    /// assert_eq!(kube_persist::ErrorKind::Throttled.as_str(), "throttled");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Refused => "refused",
            ErrorKind::Gone => "gone",
            ErrorKind::Throttled => "throttled",
            ErrorKind::Server => "server",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Decode => "decode",
            ErrorKind::Disk => "disk",
            ErrorKind::Other => "other",
        }
    }

    /// The kind of an HTTP status the API server answered with.
    ///
    /// ```
    /// use kube_persist::ErrorKind;
    /// assert_eq!(ErrorKind::of_status(403), ErrorKind::Refused);
    /// assert_eq!(ErrorKind::of_status(410), ErrorKind::Gone);
    /// assert_eq!(ErrorKind::of_status(429), ErrorKind::Throttled);
    /// assert_eq!(ErrorKind::of_status(504), ErrorKind::Timeout);
    /// assert_eq!(ErrorKind::of_status(503), ErrorKind::Server);
    /// ```
    pub fn of_status(code: u16) -> ErrorKind {
        match code {
            408 | 504 => ErrorKind::Timeout,
            410 => ErrorKind::Gone,
            429 => ErrorKind::Throttled,
            400..=499 => ErrorKind::Refused,
            500..=599 => ErrorKind::Server,
            _ => ErrorKind::Other,
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Error {
    /// What kind of trouble this is, for an alert: see [`ErrorKind`].
    ///
    /// ```
    /// use kube_persist::{Db, ErrorKind};
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = Db::open(dir.path()).unwrap();
    /// // A store locked by another handle: neither the server's nor the disk's trouble.
    /// let locked = Db::open(dir.path()).unwrap_err();
    /// assert_eq!(locked.kind(), ErrorKind::Other);
    /// # drop(db);
    /// ```
    pub fn kind(&self) -> ErrorKind {
        if let Some(code) = self.status_code() {
            return ErrorKind::of_status(code);
        }
        match self {
            Error::Shared(e) => e.kind(),
            Error::Kube { source, .. } => match source {
                kube::Error::SerdeError(_) | kube::Error::FromUtf8(_) => ErrorKind::Decode,
                kube::Error::LinesCodecMaxLineLengthExceeded => ErrorKind::Decode,
                _ => ErrorKind::Timeout,
            },
            Error::Protocol { .. } | Error::Decode { .. } | Error::ObjectRejected { .. } => {
                ErrorKind::Decode
            }
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Corrupt { .. }
            | Error::DiskFull { .. }
            | Error::Io { .. }
            | Error::Storage { .. }
            | Error::Permissions { .. } => ErrorKind::Disk,
            _ => ErrorKind::Other,
        }
    }

    /// The HTTP status the API server answered with, where this error is one (a refused
    /// or failed request, a watch's `ERROR` event): the label `code` of
    /// `kube_persist_errors_total`.
    ///
    /// ```
    /// let dir = tempfile::tempdir().unwrap();
    /// let db = kube_persist::Db::open(dir.path()).unwrap();
    /// let locked = kube_persist::Db::open(dir.path()).unwrap_err();
    /// assert_eq!(locked.status_code(), None); // no request was made
    /// # drop(db);
    /// ```
    pub fn status_code(&self) -> Option<u16> {
        match self {
            Error::Shared(e) => e.status_code(),
            Error::Kube {
                source: kube::Error::Api(s),
                ..
            } => Some(s.code),
            Error::WatchStatus { code, .. } => Some(*code),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_have_the_kinds_an_alert_pages_on() {
        let kinds: Vec<(u16, ErrorKind)> = [400, 401, 403, 404, 408, 410, 422, 429, 500, 503, 504]
            .into_iter()
            .map(|c| (c, ErrorKind::of_status(c)))
            .collect();
        use ErrorKind::*;
        assert_eq!(
            kinds,
            vec![
                (400, Refused),
                (401, Refused),
                (403, Refused),
                (404, Refused),
                (408, Timeout),
                (410, Gone),
                (422, Refused),
                (429, Throttled),
                (500, Server),
                (503, Server),
                (504, Timeout)
            ]
        );
        let watch = Error::WatchStatus {
            url: "/api/v1/pods".into(),
            resource_version: "1".into(),
            code: 403,
            reason: "Forbidden".into(),
            message: String::new(),
        };
        assert_eq!((watch.kind(), watch.status_code()), (Refused, Some(403)));
        let shared = Error::Shared(std::sync::Arc::new(watch));
        assert_eq!((shared.kind(), shared.status_code()), (Refused, Some(403)));
        let disk = Error::Io {
            path: "/x".into(),
            source: std::io::Error::other("EIO"),
        };
        assert_eq!((disk.kind(), disk.status_code()), (Disk, None));
    }
}
