//! The testkit server's side: a server seeded with Pods, changes made on it, what it holds,
//! and plain HTTP requests to a port.

use std::collections::BTreeMap;

use kube_persist_testkit::{ResourceType, ServerHandle};

/// `namespace/name` → resourceVersion of every object the server holds of `rt`.
pub fn server_versions(h: &ServerHandle, rt: &ResourceType) -> BTreeMap<String, String> {
    h.list(rt)
        .into_iter()
        .map(|o| {
            let m = &o["metadata"];
            let name = m["name"].as_str().unwrap().to_string();
            let key = match m["namespace"].as_str() {
                Some(ns) => format!("{ns}/{name}"),
                None => name,
            };
            (key, m["resourceVersion"].as_str().unwrap().to_string())
        })
        .collect()
}

/// Sets label `touched=<value>` on the Pod `ns/name` on the server: a change the watch
/// delivers.
pub fn relabel_pod(h: &ServerHandle, ns: &str, name: &str, value: &str) {
    let rt = ResourceType::pods();
    let mut pod = h.get(&rt, Some(ns), name).expect("seeded pod");
    pod["metadata"]["labels"]["touched"] = value.into();
    h.apply(&rt, pod);
}

/// A testkit server holding `pods` Pods over 10 namespaces, with a watch history long
/// enough (100,000 events) for a restarted client to resume through what it missed.
pub async fn pod_server(pods: usize) -> kube_persist_testkit::TestServer {
    let server =
        kube_persist_testkit::TestServer::start_with(kube_persist_testkit::ServerOptions {
            history: 100_000,
            ..Default::default()
        })
        .await;
    server.handle().seed_pods(pods, 10);
    server
}

/// One HTTP/1.1 GET to `addr` (`host:port`): (status code, body).
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut conn) = tokio::net::TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let req = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    if conn.write_all(req.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut resp = String::new();
    let _ = conn.read_to_string(&mut resp).await;
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

/// A kubeconfig whose current context points at `server` (plain HTTP, no credentials), for
/// the tool and the example binaries.
pub fn kubeconfig(
    dir: &std::path::Path,
    server: &kube_persist_testkit::TestServer,
) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: testkit\n  cluster:\n    server: {}\n\
             contexts:\n- name: testkit\n  context:\n    cluster: testkit\n    user: nobody\n\
             users:\n- name: nobody\n  user: {{}}\ncurrent-context: testkit\n",
            server.url()
        ),
    )
    .unwrap();
    path
}
