//! RSS of a kube-persist process after a paginated list whose continue tokens kept
//! expiring until its pages grew to 16x `page_size`: what the store directory still holds
//! of the list-page buffers it reused during the list.
//!
//! ```text
//! cargo bench --bench list_buffers                       # 48,000 Pods, page_size 500
//! cargo bench --bench list_buffers -- --pods 96000 --engine sled
//! ```
//! The testkit server runs in this process, with every LIST page delayed by
//! `--page-delay-ms` (default 500) and continue tokens that expire `--ttl-ms` (default
//! 4500) after their list's first page: at 48,000 Pods a list expires at 1x, 2x, 4x and 8x
//! `--page-size` (default 500) and completes at 16x. One store syncs in a child process
//! (`Watcher::run`, no consumer), which prints, once the list is synced and the watch
//! connected: `RESULT pods=<N> page_size=<P> largest_page_mib=.. list_s=.. list_pages=..
//! relists=.. rss_after_list_mib=.. peak_rss_mib=.. engine=<E>`. `largest_page_mib` is the
//! server's JSON of 16 x P Pods; `rss_after_list_mib` the child's VmRSS at that moment,
//! `peak_rss_mib` its VmHWM.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, DbConfig, Engine, StreamConfig};
use kube_persist_testkit::{ResourceType, TestServer};
use support::rss_kib;

/// Set in the child process: the server's URL.
const URL_ENV: &str = "KP_LIST_BUFFERS_URL";
const PAGE_SIZE_ENV: &str = "KP_LIST_BUFFERS_PAGE_SIZE";
const ENGINE_ENV: &str = "KP_LIST_BUFFERS_ENGINE";

fn main() {
    match std::env::var(URL_ENV) {
        Ok(url) => client(&url),
        Err(_) => server(),
    }
}

/// The value after `name` on the command line.
fn arg<T: std::str::FromStr>(name: &str) -> Option<T> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    let v = args.get(i + 1)?;
    Some(
        v.parse()
            .unwrap_or_else(|_| panic!("{name}: cannot parse {v:?}")),
    )
}

fn server() {
    let pods: usize = arg("--pods").unwrap_or(48_000);
    let page_size: u32 = arg("--page-size").unwrap_or(500);
    let delay = Duration::from_millis(arg("--page-delay-ms").unwrap_or(500));
    let ttl = Duration::from_millis(arg("--ttl-ms").unwrap_or(4500));
    let engine: Engine = arg("--engine").unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let server = rt.block_on(TestServer::start());
    let h = server.handle();
    h.seed_pods(pods, 1);
    let bytes: usize = h
        .list(&ResourceType::pods())
        .iter()
        .map(|p| serde_json::to_vec(p).expect("a pod's JSON").len())
        .sum();
    let largest_page = bytes as f64 / pods as f64 * f64::from(page_size * 16);
    h.faults().page_delay(delay);
    h.faults().continue_ttl(Some(ttl));
    eprintln!(
        "== {pods} Pods ({:.1} MiB of JSON), page_size {page_size}, pages delayed {} ms, \
         continue tokens live {} ms; engine {engine}",
        mib(bytes as f64),
        delay.as_millis(),
        ttl.as_millis()
    );
    // The server keeps serving on the runtime's worker threads meanwhile.
    let mut child = Command::new(std::env::current_exe().expect("this bench's path"))
        .env(URL_ENV, server.url())
        .env(PAGE_SIZE_ENV, page_size.to_string())
        .env(ENGINE_ENV, engine.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the client process");
    let out = BufReader::new(child.stdout.take().expect("the child's stdout"));
    for line in out.lines() {
        let line = line.expect("the child's output");
        match line.strip_prefix("RESULT ") {
            Some(rest) => println!(
                "RESULT pods={pods} page_size={page_size} largest_page_mib={:.1} {rest} engine={engine}",
                mib(largest_page)
            ),
            None => eprintln!("   {line}"),
        }
    }
    assert!(child.wait().expect("the client process").success());
    drop(server);
}

/// The client process: one store, synced by `Watcher::run`.
fn client(url: &str) {
    let page_size: u32 = std::env::var(PAGE_SIZE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let engine: Engine = std::env::var(ENGINE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Db::open_with(dir.path(), DbConfig::default().engine(engine)).expect("open");
        let api = Api::<Pod>::all(kube_persist_testkit::client_for(url, None));
        let cfg = StreamConfig::default().page_size(page_size);
        let (reader, watcher) = db.store("pods", api, cfg).expect("store");
        let started = Instant::now();
        let task = tokio::spawn(watcher.run());
        reader.wait_until_ready().await.expect("synced");
        let list_s = started.elapsed().as_secs_f64();
        // Connected: the step that ended the list is over (the buffers it kept are freed
        // or not by now).
        reader.wait_until_live().await.expect("live");
        let (peak, rss) = rss_kib();
        let stats = reader.stats();
        println!(
            "RESULT list_s={list_s:.1} list_pages={} relists={} rss_after_list_mib={:.1} peak_rss_mib={:.1}",
            stats.list_pages,
            stats.relists,
            mib(rss as f64 * 1024.0),
            mib(peak as f64 * 1024.0),
        );
        task.abort();
    });
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}
