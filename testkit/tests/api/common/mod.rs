//! Helpers shared by the strictness tests: raw requests through a real `kube::Client`.
#![allow(dead_code)]

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::WatchEvent;
use kube::core::Status;
use kube_persist_testkit::{TestServer, client_for_opts};

/// A client without kube's retry layer, so 5xx answers are observed directly.
pub fn raw_client(server: &TestServer) -> kube::Client {
    client_for_opts(&server.url(), None, false)
}

/// A GET request for `path` (with query).
pub fn get(path: &str) -> axum::http::Request<Vec<u8>> {
    axum::http::Request::get(path).body(Vec::new()).unwrap()
}

/// The `Status` of a request that must fail with an HTTP error.
pub async fn status_of(client: &kube::Client, path: &str) -> Status {
    match client.request_text(get(path)).await {
        Err(kube::Error::Api(s)) => *s,
        other => panic!("{path}: expected an API error, got {other:?}"),
    }
}

/// One-line description of a watch event.
pub fn describe(ev: &WatchEvent<Pod>) -> String {
    let meta = |p: &Pod| {
        format!(
            "{}@{}",
            p.metadata.name.clone().unwrap_or_default(),
            p.metadata.resource_version.clone().unwrap_or_default()
        )
    };
    match ev {
        WatchEvent::Added(p) => format!("ADDED {}", meta(p)),
        WatchEvent::Modified(p) => format!("MODIFIED {}", meta(p)),
        WatchEvent::Deleted(p) => format!("DELETED {}", meta(p)),
        WatchEvent::Bookmark(b) => {
            let end = b
                .metadata
                .annotations
                .contains_key("k8s.io/initial-events-end");
            format!(
                "BOOKMARK{} {}",
                if end { " END" } else { "" },
                b.metadata.resource_version
            )
        }
        WatchEvent::Error(e) => format!("ERROR {} {}", e.code, e.reason),
    }
}

/// Every event of a raw WATCH request until the server ends the stream (the request should
/// carry `timeoutSeconds` or end by itself); panics after 20 s.
pub async fn all_events(client: &kube::Client, path: &str) -> Vec<WatchEvent<Pod>> {
    let stream = client
        .request_events::<Pod>(get(path))
        .await
        .unwrap_or_else(|e| panic!("{path}: {e:?}"));
    let all: Vec<kube::Result<WatchEvent<Pod>>> =
        tokio::time::timeout(Duration::from_secs(20), stream.collect())
            .await
            .unwrap_or_else(|_| panic!("{path}: the stream did not end"));
    all.into_iter()
        .collect::<kube::Result<Vec<_>>>()
        .unwrap_or_else(|e| panic!("{path}: {e:?}"))
}

/// The first `n` events of a raw WATCH request (panics after 20 s).
pub async fn first_events(client: &kube::Client, path: &str, n: usize) -> Vec<WatchEvent<Pod>> {
    let stream = client
        .request_events::<Pod>(get(path))
        .await
        .unwrap_or_else(|e| panic!("{path}: {e:?}"));
    let some: Vec<kube::Result<WatchEvent<Pod>>> =
        tokio::time::timeout(Duration::from_secs(20), stream.take(n).collect())
            .await
            .unwrap_or_else(|_| panic!("{path}: fewer than {n} events"));
    assert_eq!(some.len(), n, "{path}: the stream ended early");
    some.into_iter()
        .collect::<kube::Result<Vec<_>>>()
        .unwrap_or_else(|e| panic!("{path}: {e:?}"))
}

/// The cause reasons of a `Status`.
pub fn cause_reasons(s: &Status) -> Vec<String> {
    s.details
        .as_ref()
        .map(|d| d.causes.iter().map(|c| c.reason.clone()).collect())
        .unwrap_or_default()
}

/// A response read off a raw HTTP/1.1 connection (no client-side decompression).
pub struct RawResponse {
    pub status: u16,
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body as sent (de-chunked, not decompressed).
    pub body: Vec<u8>,
}

impl RawResponse {
    /// The first value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `GET path` over a plain TCP connection to `addr` with extra request headers and
/// reads the whole response (the request asks the server to close the connection; the body
/// of a stream should end by itself, e.g. a WATCH with `timeoutSeconds`).
pub async fn raw_get(
    addr: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> RawResponse {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut raw))
        .await
        .expect("response ended")
        .unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    RawResponse {
        status,
        headers,
        body,
    }
}

/// Decodes an HTTP/1.1 chunked body.
fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = std::str::from_utf8(&data[..eol]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&data[start..start + size]);
        data = &data[start + size + 2..];
    }
}
