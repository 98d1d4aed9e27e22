//! One WATCH connection: the request, the classification of connect failures, and the
//! response body split into bounded lines, read in bursts.

use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

use bytes::{Bytes, BytesMut};
use futures::{AsyncBufRead, FutureExt, Stream, StreamExt};
use kube::core::Request;
use kube::core::params::WatchParams;
use tokio_util::codec::{Decoder, FramedRead};
use tokio_util::compat::FuturesAsyncReadCompatExt;

use super::config::StreamConfig;
use super::raw::StatusKind;
use crate::model::{Error, RequestKind, Result};

/// One line of a watch response.
#[derive(Debug)]
pub(crate) enum Line {
    /// A complete line, without its newline (and without its length checked against
    /// anything else).
    Data(Bytes),
    /// A line longer than the limit, reported as soon as it passes the limit: its bytes are
    /// dropped as they arrive, never buffered.
    TooLong,
}

type Lines = Pin<Box<dyn Stream<Item = std::io::Result<Line>> + Send>>;

/// Split a body into lines of at most `max` bytes with tokio-util's `FramedRead` and
/// [`LineCodec`]. A longer line is reported as [`Line::TooLong`] and consumed and dropped as
/// it arrives (memory stays bounded by `max`). Lines are bytes, not `LinesCodec`'s `String`:
/// a line that is not UTF-8 must not end the stream (the store still identifies the object
/// in it and refuses it, see `Ingest::lines`), and the JSON parsers take bytes anyway.
fn bounded_lines(body: impl AsyncBufRead + Send + 'static, max: usize) -> Lines {
    let codec = LineCodec {
        max,
        scanned: 0,
        discarding: false,
    };
    Box::pin(FramedRead::new(Box::pin(body).compat(), codec))
}

/// Lines of at most `max` bytes, found with `memchr` (tokio-util's `AnyDelimiterCodec`
/// compares each byte with a list of delimiters: 1.4 ms of a 500-event burst of 7.5 KB
/// lines in the profile of BENCHMARKS.md, where the HTTP and runtime work of a burst fell
/// from 2.4 to 1.0 ms with this codec). A line over the limit is one [`Line::TooLong`] item, and the
/// stream goes on after it (`FramedRead` ends a stream after a decoder error).
struct LineCodec {
    max: usize,
    /// How many bytes of the buffer are known to hold no newline.
    scanned: usize,
    /// Dropping the rest of a line over the limit, up to its newline.
    discarding: bool,
}

impl Decoder for LineCodec {
    type Item = Line;
    type Error = std::io::Error;

    fn decode(&mut self, buf: &mut BytesMut) -> std::io::Result<Option<Line>> {
        if self.discarding {
            match memchr::memchr(b'\n', buf) {
                Some(at) => {
                    let _ = buf.split_to(at + 1);
                    self.discarding = false;
                }
                None => {
                    buf.clear();
                    return Ok(None);
                }
            }
        }
        // A line of `max` bytes has its newline at `max`: no further byte need be looked at.
        let end = buf.len().min(self.max.saturating_add(1));
        match memchr::memchr(b'\n', &buf[self.scanned.min(end)..end]) {
            Some(offset) => {
                let at = self.scanned + offset;
                self.scanned = 0;
                let mut line = buf.split_to(at + 1);
                line.truncate(at);
                Ok(Some(Line::Data(line.freeze())))
            }
            None if end > self.max => {
                // `max + 1` bytes without a newline: too long. Its bytes are dropped from
                // here up to its newline, wherever that comes.
                let _ = buf.split_to(end);
                self.scanned = 0;
                self.discarding = true;
                Ok(Some(Line::TooLong))
            }
            None => {
                self.scanned = end;
                Ok(None)
            }
        }
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> std::io::Result<Option<Line>> {
        // A last line without newline still counts.
        match self.decode(buf)? {
            Some(line) => Ok(Some(line)),
            None if buf.is_empty() => Ok(None),
            None => {
                self.scanned = 0;
                Ok(Some(Line::Data(buf.split().freeze())))
            }
        }
    }
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
    /// A read error that came after complete lines: those are applied first, and the next
    /// burst reports it (`FramedRead` reports an error once, then ends the stream).
    broken: Option<std::io::Error>,
    /// When the request was sent, when the last line was read, when the stream ended:
    /// whether a watch ran to its deadline, and how quiet it was at the end.
    opened: Instant,
    last_line: Option<Instant>,
    ended_at: Option<Instant>,
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
pub(crate) struct WatchTarget<'a> {
    /// The stream's name, for errors.
    pub(crate) stream: &'a str,
    pub(crate) request: &'a Request,
    pub(crate) metadata_only: bool,
    pub(crate) cfg: &'a StreamConfig,
    /// The server-side timeout in seconds, when not the configured one.
    pub(crate) timeout: Option<u32>,
}

impl WatchConn {
    /// Open a watch from `resource_version` (`""` with `initial` for a streaming list).
    pub(crate) async fn connect(
        client: &kube::Client,
        target: WatchTarget<'_>,
        resource_version: &str,
        initial: bool,
    ) -> std::result::Result<WatchConn, ConnectFailure> {
        let cfg = target.cfg;
        let wp = WatchParams {
            label_selector: cfg.label_selector.clone(),
            field_selector: cfg.field_selector.clone(),
            timeout: Some(target.timeout.unwrap_or(cfg.timeout)),
            bookmarks: true,
            send_initial_events: initial,
        };
        let url = &target.request.url_path;
        let stream = target.stream;
        let context =
            || format!("WATCH {url} (stream {stream:?}) from resourceVersion {resource_version:?}");
        let mut req = if target.metadata_only {
            target.request.watch_metadata(&wp, resource_version)
        } else {
            target.request.watch(&wp, resource_version)
        }
        .map_err(|e| {
            ConnectFailure::Invalid(Error::InvalidArgument {
                detail: format!("{}: {e}", context()),
            })
        })
        .and_then(|r| with_shard(r, cfg).map_err(ConnectFailure::Fatal))?;
        // Events must reach the store as they arrive; a compressed stream would be held
        // back by the decompressor (kube-apiserver does not compress watches anyway).
        req.headers_mut().insert(
            http::header::ACCEPT_ENCODING,
            http::HeaderValue::from_static("identity"),
        );
        // Before the request: the server's deadline starts later, so a watch it ended at its
        // deadline lasted at least its timeout measured from here.
        let opened = Instant::now();
        match client.request_stream(req).await {
            Ok(body) => {
                tracing::debug!(resource_version, initial, "watch connected");
                Ok(WatchConn {
                    lines: bounded_lines(body, cfg.max_line_bytes()),
                    pending: Vec::new(),
                    broken: None,
                    opened,
                    last_line: None,
                    ended_at: None,
                })
            }
            Err(source) => {
                if let Some(e) = invalid_shard(&source) {
                    return Err(ConnectFailure::Fatal(e));
                }
                let status = match &source {
                    kube::Error::Api(s) => Some(StatusKind::of(s.code, is_too_large(s))),
                    _ => None,
                };
                let err = Error::Kube {
                    request: RequestKind::Watch,
                    context: context(),
                    source,
                };
                Err(match status {
                    Some(StatusKind::Gone) => ConnectFailure::Gone,
                    Some(StatusKind::TooLarge) => ConnectFailure::TooLarge(err),
                    Some(StatusKind::Invalid) => ConnectFailure::Invalid(err),
                    Some(StatusKind::Refused | StatusKind::Other) | None => {
                        ConnectFailure::Other(err)
                    }
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
            if let Some(e) = self.broken.take() {
                return Err(broke(e));
            }
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
                Some(Ok(l)) => self.take(l),
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
                Some(Ok(l)) => self.take(l),
                None => ended = true,
                // An error after complete lines: apply those first; the next burst reports it.
                Some(Err(e)) => {
                    self.broken = Some(e);
                    break;
                }
            }
        }
        if ended {
            self.ended_at.get_or_insert_with(Instant::now);
        }
        Ok(Burst {
            lines: std::mem::take(&mut self.pending),
            ended,
            idle: false,
        })
    }

    fn take(&mut self, line: Line) {
        self.pending.push(line);
        self.last_line = Some(Instant::now());
    }

    /// Once the server ended the stream: how long it lasted from the request, and how long
    /// it had been quiet (no line) before it ended.
    pub(crate) fn ended_after(&self) -> Option<(Duration, Duration)> {
        let end = self.ended_at?;
        let quiet_since = self.last_line.unwrap_or(self.opened);
        Some((
            end.saturating_duration_since(self.opened),
            end.saturating_duration_since(quiet_since),
        ))
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
    cfg: &StreamConfig,
) -> std::result::Result<http::Request<Vec<u8>>, Error> {
    let Some(shard) = cfg.get_shard() else {
        return Ok(req);
    };
    let uri = req.uri().to_string();
    let sep = if uri.contains('?') { '&' } else { '?' };
    let selector: String = form_urlencoded::byte_serialize(shard.selector().as_bytes()).collect();
    *req.uri_mut() = format!("{uri}{sep}shardSelector={selector}")
        .parse()
        .map_err(|e| Error::InvalidArgument {
            detail: format!("shardSelector does not fit in a URL: {e}"),
        })?;
    Ok(req)
}

/// kube-apiserver's answer to a `shardSelector` it cannot parse: HTTP 500 with a message
/// starting `invalid shard selector:`. A configuration error, not worth retrying.
pub(crate) fn invalid_shard(e: &kube::Error) -> Option<Error> {
    match e {
        kube::Error::Api(s) if s.message.starts_with("invalid shard selector") => {
            Some(Error::ShardRefused {
                message: s.message.clone(),
            })
        }
        _ => None,
    }
}

/// Whether a `Status` says "resourceVersion too large" (kube-apiserver's
/// `NewTooLargeResourceVersionError`: 504 with cause `ResourceVersionTooLarge`).
pub(crate) fn is_too_large(s: &kube::core::Status) -> bool {
    let causes = s.details.iter().flat_map(|d| &d.causes);
    super::raw::too_large(s.code, &s.message, causes.map(|c| c.reason.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], max: usize) -> Vec<String> {
        let body = futures::io::Cursor::new(input.to_vec());
        futures::executor::block_on(
            bounded_lines(body, max)
                .map(|l| match l.unwrap() {
                    Line::Data(d) => String::from_utf8(d.to_vec()).unwrap(),
                    Line::TooLong => "<too long>".into(),
                })
                .collect(),
        )
    }

    #[test]
    fn long_lines_are_skipped_while_reading() {
        assert_eq!(lines(b"ab\ncd\n", 10), ["ab", "cd"]);
        assert_eq!(
            lines(b"ab\n0123456789abc\ncd", 10),
            ["ab", "<too long>", "cd"]
        );
        assert_eq!(lines(b"0123456789abc", 10), ["<too long>"]);
        assert_eq!(lines(b"0123456789\n", 10), ["0123456789"]);
        assert!(lines(b"", 10).is_empty());
    }

    /// A body that delivers one byte per read: the codec sees every split of a line.
    struct Trickle(Vec<u8>, usize);

    impl futures::AsyncRead for Trickle {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut [u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let n = usize::from(self.1 < self.0.len() && !buf.is_empty());
            if n == 1 {
                buf[0] = self.0[self.1];
                self.1 += 1;
            }
            std::task::Poll::Ready(Ok(n))
        }
    }

    /// Against the plain definition (split at each newline, a line over `max` bytes is one
    /// too-long item, a last line without newline counts), for bodies of short and long
    /// lines arriving in reads of every size (a fixed seed).
    #[test]
    fn lines_are_split_as_defined_whatever_the_reads() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..300 {
            let max = 1 + next(12) as usize;
            let mut input = Vec::new();
            for _ in 0..next(8) {
                input.extend(std::iter::repeat_n(b'x', next(2 * max as u64 + 2) as usize));
                input.push(b'\n');
            }
            input.extend(std::iter::repeat_n(b'y', next(2 * max as u64) as usize));
            let want: Vec<String> = input
                .split(|b| *b == b'\n')
                .enumerate()
                .filter(|(i, l)| !(l.is_empty() && *i == input.split(|b| *b == b'\n').count() - 1))
                .map(|(_, l)| match l.len() > max {
                    true => "<too long>".to_string(),
                    false => String::from_utf8(l.to_vec()).unwrap(),
                })
                .collect();
            let read = 1 + next(2 * max as u64) as usize;
            let body = futures::io::BufReader::with_capacity(
                read,
                futures::io::Cursor::new(input.clone()),
            );
            let got: Vec<String> = futures::executor::block_on(
                bounded_lines(body, max)
                    .map(|l| match l.unwrap() {
                        Line::Data(d) => String::from_utf8(d.to_vec()).unwrap(),
                        Line::TooLong => "<too long>".into(),
                    })
                    .collect(),
            );
            assert_eq!(
                got,
                want,
                "max {max}, reads of {read}: {:?}",
                String::from_utf8_lossy(&input)
            );
        }
    }

    #[test]
    fn a_line_far_over_the_limit_arriving_in_pieces_is_one_too_long_item() {
        let mut input = b"ab\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 1000));
        input.extend_from_slice(b"\n\xffcd\n");
        let body = futures::io::BufReader::with_capacity(1, Trickle(input, 0));
        let got: Vec<String> = futures::executor::block_on(
            bounded_lines(body, 10)
                .map(|l| match l.unwrap() {
                    Line::Data(d) => String::from_utf8_lossy(&d).into_owned(),
                    Line::TooLong => "<too long>".into(),
                })
                .collect(),
        );
        assert_eq!(got, ["ab", "<too long>", "\u{FFFD}cd"]);
    }
}
