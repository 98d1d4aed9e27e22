//! Warm restart versus cold sync, each client in its own process against one
//! `testkit-server` process; and a restart after the client was SIGKILLed right after
//! applying changes (crash recovery of the engine, then resume).
//!
//! ```text
//! cargo bench --bench restart [-- --pods 100000]
//! ```
//! `-- --engine sled|redb` picks the storage engine (default redb).
//! Last line: `RESULT n=<N> warm_ready_ms=<x> warm_list_calls=<k> cold_persist_ready_ms=<y> cold_reflector_ready_ms=<z> killed_restart_ready_ms=<r> killed_restart_list_calls=<l> engine=<E>`

mod support;

use support::{ClientKind, ClientOpts, mib, run_client, start_server};

fn main() {
    if support::client_main() {
        return;
    }
    let n = support::pods_arg().unwrap_or(100_000);
    let engine = support::engine_arg();
    eprintln!("storage engine: {engine}");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let server = start_server(n, &["--history", "50000"]);
    let url = server.url.clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = ClientOpts {
        dir: Some(dir.path().join("store")),
        engine,
        ..ClientOpts::default()
    };

    rt.block_on(support::admin(&url, "POST", "/testkit/reset-counts"));
    let cold = run_client(ClientKind::Persist, &url, &opts, |_| {});
    let cold_lists = rt.block_on(support::list_calls(&url));
    eprintln!(
        "kube-persist cold sync: ready {} ms, {cold_lists} LIST calls, peak {:.1} MiB",
        cold.ready_ms,
        mib(cold.peak_rss_kib)
    );

    // Change 1,200 Pods (1,000 updates, 100 creates, 100 deletes); returns the revision.
    let churn = |seed: u32| {
        let path = format!("/testkit/churn?updates=1000&creates=100&deletes=100&seed={seed}");
        let changed = rt.block_on(support::admin(&url, "POST", &path));
        changed["revision"].as_u64().unwrap_or(0)
    };
    // Start a client on the store and wait until it caught up with `target`; with the
    // server's LIST calls meanwhile.
    let resume = |target: u64, what: &str| {
        rt.block_on(support::admin(&url, "POST", "/testkit/reset-counts"));
        let until = ClientOpts {
            until_rv: Some(target),
            ..opts.clone()
        };
        let r = run_client(ClientKind::Persist, &url, &until, |_| {});
        let lists = rt.block_on(support::list_calls(&url));
        eprintln!(
            "kube-persist {what}: ready {} ms, caught up with 1200 changes {} ms, {lists} LIST calls, peak {:.1} MiB",
            r.ready_ms,
            r.live_ms,
            mib(r.peak_rss_kib)
        );
        (r, lists)
    };

    let (warm, warm_lists) = resume(churn(1), "warm restart");

    // Crash: a client resumes, applies another 1,200 changes, goes live and is SIGKILLed at
    // once (its last commits may not be durable yet); the next start recovers the store.
    let target = churn(2);
    let kill = ClientOpts {
        kill_when_live: true,
        ..opts.clone()
    };
    run_client(ClientKind::Persist, &url, &kill, |_| {});
    let (killed, killed_lists) = resume(target, "restart after SIGKILL");

    rt.block_on(support::admin(&url, "POST", "/testkit/reset-counts"));
    let reflector = run_client(ClientKind::Reflector, &url, &ClientOpts::default(), |_| {});
    let r_lists = rt.block_on(support::list_calls(&url));
    eprintln!(
        "reflector cold start: ready {} ms, {r_lists} LIST calls, peak {:.1} MiB",
        reflector.ready_ms,
        mib(reflector.peak_rss_kib)
    );
    println!(
        "RESULT n={n} warm_ready_ms={} warm_list_calls={warm_lists} cold_persist_ready_ms={} cold_reflector_ready_ms={} killed_restart_ready_ms={} killed_restart_list_calls={killed_lists} engine={engine}",
        warm.ready_ms, cold.ready_ms, reflector.ready_ms, killed.ready_ms
    );
}
