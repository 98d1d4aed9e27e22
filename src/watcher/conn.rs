//! One WATCH connection: the request, the classification of connect failures, and the
//! response body split into bounded lines, read in bursts.

use std::pin::Pin;
use std::time::Duration;

use futures::{AsyncBufRead, AsyncBufReadExt, FutureExt, Stream, StreamExt};
use kube::core::Request;
use kube::core::params::WatchParams;

use super::config::Config;
use crate::error::{Error, Result};

/// One line of a watch response.
#[derive(Debug)]
pub(crate) enum Line {
    /// A complete line (without its length checked against anything else).
    Data(Vec<u8>),
    /// A line longer than the limit: its bytes were skipped while reading, never buffered.
    TooLong { bytes: usize },
}

type Lines = Pin<Box<dyn Stream<Item = std::io::Result<Line>> + Send>>;

/// Split a body into lines of at most `max` bytes. A longer line is consumed and dropped
/// as it arrives (memory stays bounded by `max`) and reported as [`Line::TooLong`]. Lines
/// are bytes: one that is not UTF-8 does not break the stream.
fn bounded_lines(body: impl AsyncBufRead + Send + 'static, max: usize) -> Lines {
    Box::pin(futures::stream::unfold(
        Box::pin(body),
        move |mut body| async move {
            let mut line = Vec::new();
            let mut skipped = 0usize;
            loop {
                let buf = match body.fill_buf().await {
                    Ok(b) => b,
                    Err(e) => return Some((Err(e), body)),
                };
                if buf.is_empty() {
                    // End of stream: a last line without newline still counts.
                    return match (line.is_empty(), skipped) {
                        (true, 0) => None,
                        (_, 0) => Some((Ok(Line::Data(line)), body)),
                        (_, n) => Some((Ok(Line::TooLong { bytes: n }), body)),
                    };
                }
                let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
                    Some(i) => (&buf[..=i], true),
                    None => (buf, false),
                };
                let n = chunk.len();
                if skipped > 0 || line.len() + n > max {
                    skipped += line.len() + n;
                    line = Vec::new();
                } else {
                    line.extend_from_slice(chunk);
                }
                body.as_mut().consume(n);
                if done {
                    return Some((
                        Ok(if skipped > 0 {
                            Line::TooLong { bytes: skipped }
                        } else {
                            Line::Data(line)
                        }),
                        body,
                    ));
                }
            }
        },
    ))
}

/// A burst of lines read from a connection.
#[derive(Debug, Default)]
pub(crate) struct Burst {
    pub(crate) lines: Vec<Line>,
    /// The server ended the stream (timeout or close) after these lines.
    pub(crate) ended: bool,
    /// No line arrived within the idle limit.
    pub(crate) idle: bool,
}

/// An open watch response.
pub(crate) struct WatchConn {
    lines: Lines,
    /// Lines of a burst whose read was cancelled (see [`WatchConn::burst`]).
    pending: Vec<Line>,
}

impl std::fmt::Debug for WatchConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WatchConn")
    }
}

/// Why a watch could not be opened.
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// 410: the resourceVersion is compacted; relist.
    Gone,
    /// 504 with cause `ResourceVersionTooLarge` (a lagging replica): retry, then relist.
    TooLarge(Error),
    /// 400/422: the server refused the request's parameters.
    Invalid(Error),
    /// Anything else (network, 5xx, auth): retry with backoff.
    Other(Error),
    /// A configuration the server will never accept (an invalid shard selector): stop.
    Fatal(Error),
}

/// What to watch.
pub(crate) struct Target<'a> {
    pub(crate) request: &'a Request,
    pub(crate) metadata_only: bool,
    pub(crate) cfg: &'a Config,
}

impl WatchConn {
    /// Open a watch from `resource_version` (`""` with `initial` for a streaming list).
    pub(crate) async fn connect(
        client: &kube::Client,
        target: Target<'_>,
        resource_version: &str,
        initial: bool,
    ) -> std::result::Result<WatchConn, ConnectFailure> {
        let cfg = target.cfg;
        let wp = WatchParams {
            label_selector: cfg.label_selector.clone(),
            field_selector: cfg.field_selector.clone(),
            timeout: Some(cfg.timeout),
            bookmarks: true,
            send_initial_events: initial,
        };
        let url = &target.request.url_path;
        let context = || format!("WATCH {url} from resourceVersion {resource_version:?}");
        let mut req = if target.metadata_only {
            target.request.watch_metadata(&wp, resource_version)
        } else {
            target.request.watch(&wp, resource_version)
        }
        .map_err(|e| ConnectFailure::Invalid(Error::Config(format!("{}: {e}", context()))))
        .and_then(|r| with_shard(r, cfg).map_err(ConnectFailure::Fatal))?;
        // Events must reach the store as they arrive; a compressed stream would be held
        // back by the decompressor (kube-apiserver does not compress watches anyway).
        req.headers_mut().insert(
            http::header::ACCEPT_ENCODING,
            http::HeaderValue::from_static("identity"),
        );
        match client.request_stream(req).await {
            Ok(body) => {
                tracing::debug!(resource_version, initial, "watch connected");
                Ok(WatchConn {
                    lines: bounded_lines(body, cfg.max_object_bytes.saturating_add(4096)),
                    pending: Vec::new(),
                })
            }
            Err(source) => {
                if let Some(e) = invalid_shard(&source) {
                    return Err(ConnectFailure::Fatal(e));
                }
                let status = match &source {
                    kube::Error::Api(s) => Some((s.code, is_too_large(s))),
                    _ => None,
                };
                let err = Error::Kube {
                    context: context(),
                    source,
                };
                Err(match status {
                    Some((410, _)) => ConnectFailure::Gone,
                    Some((_, true)) => ConnectFailure::TooLarge(err),
                    Some((400 | 422, _)) => ConnectFailure::Invalid(err),
                    _ => ConnectFailure::Other(err),
                })
            }
        }
    }

    /// Wait for the next line (at most `idle`, if given), then take the lines that arrive
    /// within `linger` of it (every line already buffered, then more as they come), up to
    /// `max` lines in all: one batch per burst of events, not one per TCP read.
    ///
    /// Cancel-safe: lines read by a burst that is dropped before it returns are kept and
    /// start the next burst (the line stream itself keeps a partly read line).
    pub(crate) async fn burst(
        &mut self,
        max: usize,
        idle: Option<Duration>,
        linger: Duration,
    ) -> Result<Burst> {
        let mut ended = false;
        if self.pending.is_empty() {
            let first = match idle {
                Some(d) => match tokio::time::timeout(d, self.lines.next()).await {
                    Ok(l) => l,
                    Err(_) => {
                        return Ok(Burst {
                            idle: true,
                            ..Burst::default()
                        });
                    }
                },
                None => self.lines.next().await,
            };
            match first {
                None => ended = true,
                Some(Err(e)) => return Err(broke(e)),
                Some(Ok(l)) => self.pending.push(l),
            }
        }
        let deadline = tokio::time::Instant::now() + linger;
        while !ended && self.pending.len() < max {
            let next = match self.lines.next().now_or_never() {
                Some(next) => next,
                None if linger.is_zero() => break,
                None => match tokio::time::timeout_at(deadline, self.lines.next()).await {
                    Ok(next) => next,
                    Err(_) => break,
                },
            };
            match next {
                Some(Ok(l)) => self.pending.push(l),
                None => ended = true,
                // An error after complete lines: apply those first; the next read reports it.
                Some(Err(_)) => break,
            }
        }
        Ok(Burst {
            lines: std::mem::take(&mut self.pending),
            ended,
            idle: false,
        })
    }
}

fn broke(e: std::io::Error) -> Error {
    Error::Protocol {
        context: "WATCH".into(),
        detail: format!("stream broke: {e}"),
    }
}

/// Add the `shardSelector` list option of a sharded stream to a LIST or WATCH request.
pub(crate) fn with_shard(
    mut req: http::Request<Vec<u8>>,
    cfg: &Config,
) -> std::result::Result<http::Request<Vec<u8>>, Error> {
    let Some(shard) = cfg.get_shard() else {
        return Ok(req);
    };
    let uri = req.uri().to_string();
    let sep = if uri.contains('?') { '&' } else { '?' };
    let selector: String = form_urlencoded::byte_serialize(shard.selector().as_bytes()).collect();
    *req.uri_mut() = format!("{uri}{sep}shardSelector={selector}")
        .parse()
        .map_err(|e| Error::Config(format!("shardSelector does not fit in a URL: {e}")))?;
    Ok(req)
}

/// kube-apiserver's answer to a `shardSelector` it cannot parse: HTTP 500 with a message
/// starting `invalid shard selector:`. A configuration error, not worth retrying.
pub(crate) fn invalid_shard(e: &kube::Error) -> Option<Error> {
    match e {
        kube::Error::Api(s) if s.message.starts_with("invalid shard selector") => Some(
            Error::Config(format!("the API server refused the shard: {}", s.message)),
        ),
        _ => None,
    }
}

/// Whether a `Status` says "resourceVersion too large" (kube-apiserver's
/// `NewTooLargeResourceVersionError`: 504 with cause `ResourceVersionTooLarge`).
pub(crate) fn is_too_large(s: &kube::core::Status) -> bool {
    let cause = s.details.as_ref().is_some_and(|d| {
        d.causes
            .iter()
            .any(|c| c.reason == "ResourceVersionTooLarge")
    });
    cause || (s.code == 504 && s.message.contains("Too large resource version"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], max: usize) -> Vec<String> {
        let body = futures::io::Cursor::new(input.to_vec());
        futures::executor::block_on(
            bounded_lines(body, max)
                .map(|l| match l.unwrap() {
                    Line::Data(d) => String::from_utf8(d).unwrap(),
                    Line::TooLong { bytes } => format!("<{bytes}>"),
                })
                .collect(),
        )
    }

    #[test]
    fn long_lines_are_skipped_while_reading() {
        assert_eq!(lines(b"ab\ncd\n", 10), ["ab\n", "cd\n"]);
        assert_eq!(lines(b"ab\n0123456789abc\ncd", 10), ["ab\n", "<14>", "cd"]);
        assert_eq!(lines(b"0123456789abc", 10), ["<13>"]);
        assert!(lines(b"", 10).is_empty());
    }
}
