//! A LIST page is read with a bound, as watch lines and fetches are (issue 60, item 7): a
//! server that sends a page without end (a broken proxy, an aggregated API that ignores
//! `limit`, a hostile endpoint) fails the list at `StreamConfig::max_page_bytes` instead of
//! growing the process without limit.

use crate::common::{self, Engine, Ev, Fixture};
use kube_persist::StreamConfig;

/// Pages of this many Pods are many times the bound below; pages of [`SMALL_PAGE`] fit it.
const PODS: usize = 400;
const SMALL_PAGE: u32 = 5;

/// The smallest bound there is for objects of up to 16 KiB: one object and 64 KiB of envelope.
fn bounded() -> StreamConfig {
    StreamConfig::default()
        .max_object_bytes(16 << 10)
        .max_page_bytes(0)
        .backoff(
            std::time::Duration::from_millis(20),
            std::time::Duration::from_millis(100),
        )
}

/// A page over the bound fails the list, retried with backoff, before any of it is counted
/// or stored (at 9ad23f8 the page was read whole, and the list succeeded); the same bound
/// with smaller pages lists.
async fn a_list_page_over_the_bound_fails_the_list(engine: Engine) {
    let fx = Fixture::with_pods(PODS, 2).await;
    let db = fx.open(engine);
    assert_eq!(bounded().get_max_page_bytes(), (16 << 10) + (64 << 10));
    let (reader, mut w) = fx.watch_pods(&db, bounded());
    // The watcher logs each failed list and retries it with backoff: wait for three.
    common::eventually("three failed lists", || reader.stats().errors >= 3).await;
    let stats = reader.stats();
    assert_eq!(
        stats.list_pages, 0,
        "no page over the bound was read: {stats:?}"
    );
    assert_eq!(reader.len(), 0, "nothing of the page was stored");
    let evs = w.drain_for(std::time::Duration::ZERO).await;
    assert!(
        !evs.contains(&Ev::InitDone),
        "the list did not end: {evs:?}"
    );
    w.stop().await;
    drop(reader);

    let (reader, mut w) = fx.watch_pods(&db, bounded().page_size(SMALL_PAGE));
    w.until(|e| *e == Ev::InitDone).await;
    assert_eq!(reader.len(), PODS, "{:?}", reader.stats());
    w.stop().await;
}

engine_tests!(async: a_list_page_over_the_bound_fails_the_list);
