//! The cold sync bench's reads phase, shared with the memory bench: on a synced store,
//! `iter()` over every object (on the blocking pool, as a caller should), then
//! `get_named_async` of each random key, then 10,000 gets cycling over the hot keys. The
//! peak RSS (VmHWM) is taken after each part.

use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;

/// Gets of the hot set.
pub const HOT_GETS: usize = 10_000;

/// What the reads phase measured.
#[derive(Debug, Default, Clone, Copy)]
pub struct Reads {
    pub iterated: usize,
    pub iter_s: f64,
    pub random_s: f64,
    pub hot_s: f64,
    pub peak_after_iter_kib: u64,
    pub peak_after_random_kib: u64,
    pub peak_kib: u64,
}

/// Run the reads phase on `reader`: every key must be stored.
pub async fn run(
    reader: &kube_persist::Reader<Pod>,
    random: &[(String, String)],
    hot: &[(String, String)],
) -> Reads {
    let peak = || super::rss_kib().0;
    let t = Instant::now();
    let r = reader.clone();
    let iterated = tokio::task::spawn_blocking(move || {
        r.iter()
            .map(|p| p.map(drop))
            .collect::<Result<Vec<()>, _>>()
            .expect("decodes")
            .len()
    })
    .await
    .expect("iterate");
    let (iter_s, peak_after_iter_kib) = (t.elapsed().as_secs_f64(), peak());
    let get = |(ns, name): &(String, String)| {
        let reader = reader.clone();
        let (ns, name) = (ns.clone(), name.clone());
        async move {
            let got = reader.get_named_async(Some(&ns), &name).await.expect("get");
            assert!(got.is_some(), "{ns}/{name} missing");
        }
    };
    let t = Instant::now();
    for key in random {
        get(key).await;
    }
    let (random_s, peak_after_random_kib) = (t.elapsed().as_secs_f64(), peak());
    let t = Instant::now();
    for key in hot.iter().cycle().take(HOT_GETS) {
        get(key).await;
    }
    Reads {
        iterated,
        iter_s,
        random_s,
        hot_s: t.elapsed().as_secs_f64(),
        peak_after_iter_kib,
        peak_after_random_kib,
        peak_kib: peak(),
    }
}
