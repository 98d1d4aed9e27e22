//! Many streams in one client process: the namespaced collections `ns-0` … `ns-{N-1}` of a
//! `testkit-server --namespaces N`, each its own stream (kube-persist: one `Db`, stream
//! `pods-ns-<i>` each; kube-runtime: one `reflector` each), started all at once or, with
//! `--sequential`, each after the one before it is ready.
//!
//! The client reports the time until every stream is ready, the objects in all of them,
//! its peak RSS and the most threads it had at once (sampled from `/proc/self/status`
//! every 5 ms while syncing).

use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};

use super::{ClientKind, ClientOpts, ClientReport};

/// The namespace of stream `i`.
pub fn namespace(i: usize) -> String {
    format!("ns-{i}")
}

/// Threads of this process now (`Threads:` in /proc/self/status).
pub fn threads_now() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Sync `opts.streams` streams as `kind` (kube-persist or reflector) and report.
pub async fn run(kind: ClientKind, url: &str, opts: &ClientOpts) -> ClientReport {
    let start = Instant::now();
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let sampler = tokio::spawn(async move {
        let mut most = threads_now();
        loop {
            tokio::select! {
                _ = &mut stop_rx => return most,
                _ = tokio::time::sleep(Duration::from_millis(5)) => most = most.max(threads_now()),
            }
        }
    });
    let client = kube_persist_testkit::client_for(url, None);
    let mut report = ClientReport::default();
    let n = opts.streams;
    match kind {
        ClientKind::Persist => {
            let dir = opts.dir.clone().expect("--dir for the persist client");
            let dbc = kube_persist::DbConfig::default().engine(opts.engine);
            let db = kube_persist::Db::open_with(&dir, dbc).expect("open store");
            let mut readers = Vec::with_capacity(n);
            let mut tasks = Vec::with_capacity(n);
            for i in 0..n {
                let api = Api::<Pod>::namespaced(client.clone(), &namespace(i));
                let (reader, watcher) = db
                    .store(
                        &format!("pods-{}", namespace(i)),
                        api,
                        kube_persist::StreamConfig::default(),
                    )
                    .expect("open stream");
                tasks.push(tokio::spawn(watcher.run()));
                if opts.sequential {
                    reader.wait_until_ready().await.expect("ready");
                }
                readers.push(reader);
            }
            for r in join_all(readers.iter().map(|r| r.wait_until_ready())).await {
                r.expect("ready");
            }
            report.ready_ms = start.elapsed().as_millis() as u64;
            report.objects = readers.iter().map(|r| r.len() as u64).sum();
            for t in tasks {
                t.abort();
                let _ = t.await;
            }
        }
        ClientKind::Reflector | ClientKind::Floor => {
            let mut stores = Vec::with_capacity(n);
            let mut tasks = Vec::with_capacity(n);
            let mut readies = Vec::with_capacity(n);
            for i in 0..n {
                let api = Api::<Pod>::namespaced(client.clone(), &namespace(i));
                let (store, writer) = reflector::store::<Pod>();
                let (ready_tx, mut ready_rx) = tokio::sync::watch::channel(false);
                let cfg = watcher::Config::default().page_size(500);
                tasks.push(tokio::spawn(async move {
                    let events = reflector(writer, watcher(api, cfg).default_backoff());
                    let mut events = std::pin::pin!(events);
                    while let Some(ev) = events.next().await {
                        if let Ok(watcher::Event::InitDone) = ev {
                            let _ = ready_tx.send(true);
                        }
                    }
                }));
                if opts.sequential {
                    ready_rx.wait_for(|r| *r).await.expect("ready");
                }
                readies.push(ready_rx);
                stores.push(store);
            }
            for mut r in readies {
                r.wait_for(|r| *r).await.expect("ready");
            }
            report.ready_ms = start.elapsed().as_millis() as u64;
            report.objects = stores.iter().map(|s| s.state().len() as u64).sum();
            for t in tasks {
                t.abort();
                let _ = t.await;
            }
        }
    }
    let _ = stop_tx.send(());
    report.threads = sampler.await.unwrap_or(0);
    let (hwm, rss) = super::rss_kib();
    report.peak_rss_kib = hwm;
    report.rss_kib = rss;
    if std::env::var_os("KP_TRIM").is_some() && !super::alloc::MIMALLOC {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: glibc's malloc_trim only returns free memory to the system.
        unsafe { malloc_trim(0) };
        eprintln!(
            "   rss {} KiB, after malloc_trim {} KiB",
            rss,
            super::rss_kib().1
        );
    }
    report
}
