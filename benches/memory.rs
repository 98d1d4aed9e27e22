//! Peak RSS of each client variant, each in its own process, against one `testkit-server`
//! process per N: kube-persist, kube-runtime's reflector (in-memory `Store`), and a bare
//! kube-runtime watcher that discards objects (the floor).
//!
//! ```text
//! cargo bench --bench memory            # N = 10k, 50k, 100k, 200k
//! cargo bench --bench memory -- --quick # N = 10k, 100k
//! cargo bench --bench memory -- --pods 20000
//! ```
//! The last lines are one `RESULT n=<N> ...` line per N.

mod support;

use support::{ClientKind, ClientOpts, ClientReport, mib, run_client, start_server};

fn main() {
    if support::client_main() {
        return;
    }
    let sizes: Vec<usize> = if let Some(n) = support::pods_arg() {
        vec![n]
    } else if std::env::args().any(|a| a == "--quick") {
        vec![10_000, 100_000]
    } else {
        vec![10_000, 50_000, 100_000, 200_000]
    };
    let mut results = Vec::new();
    for &n in &sizes {
        eprintln!("== N = {n}: starting testkit-server");
        let server = start_server(n, &["--history", "50000"]);
        let url = server.url.clone();
        let dir = tempfile::tempdir().expect("tempdir");
        let store = dir.path().join("store");
        let persist_opts = ClientOpts {
            dir: Some(store.clone()),
            ..ClientOpts::default()
        };
        let run = |kind, opts: &ClientOpts, what: &str| -> ClientReport {
            let r = run_client(kind, &url, opts, |_| {});
            eprintln!(
                "   {what:<28} ready {:>7.2} s  peak {:>8.1} MiB  end {:>8.1} MiB  objects {}",
                r.ready_ms as f64 / 1000.0,
                mib(r.peak_rss_kib),
                mib(r.rss_kib),
                r.objects
            );
            r
        };
        let persist = run(ClientKind::Persist, &persist_opts, "kube-persist cold sync");
        let reflector = run(
            ClientKind::Reflector,
            &ClientOpts::default(),
            "reflector cold sync",
        );
        let floor = run(
            ClientKind::Floor,
            &ClientOpts::default(),
            "bare watcher (floor)",
        );
        let relist = ClientOpts {
            until_relist: true,
            ..persist_opts.clone()
        };
        let persist_relist = run(ClientKind::Persist, &relist, "kube-persist forced relist");
        let reflector_relist = run(
            ClientKind::Reflector,
            &ClientOpts {
                until_relist: true,
                ..ClientOpts::default()
            },
            "reflector sync + forced relist",
        );
        let disk = dir_size(&store);
        eprintln!(
            "   store on disk: {:.1} MiB ({:.0} bytes/object)",
            mib(disk / 1024),
            disk as f64 / n as f64
        );
        results.push(format!(
            "RESULT n={n} persist_peak_mib={:.1} reflector_peak_mib={:.1} floor_peak_mib={:.1} persist_relist_peak_mib={:.1} reflector_relist_peak_mib={:.1}",
            mib(persist.peak_rss_kib),
            mib(reflector.peak_rss_kib),
            mib(floor.peak_rss_kib),
            mib(persist_relist.peak_rss_kib),
            mib(reflector_relist.peak_rss_kib),
        ));
        eprintln!(
            "   after sync: kube-persist {:.1} MiB, reflector {:.1} MiB",
            mib(persist.rss_kib),
            mib(reflector.rss_kib)
        );
    }
    for r in results {
        println!("{r}");
    }
}

fn dir_size(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_size(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}
