//! Temporary experiment: write N ~5 KB JSON values into a sled tree in batches and
//! report VmHWM / VmRSS. Env: N, BATCH, MODE (low|high), SEG (segment_size), CACHE,
//! FLUSH_MS (0 = none), TRIM=1 (malloc_trim at end), DIR.
use std::time::Instant;

unsafe extern "C" {
    fn malloc_trim(pad: usize) -> i32;
}

fn env(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn rss() -> String {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let f = |n: &str| {
        s.lines()
            .find(|l| l.starts_with(n))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            / 1024
    };
    format!("hwm={}MiB rss={}MiB", f("VmHWM:"), f("VmRSS:"))
}

fn main() {
    let n = env("N", 20000);
    let batch = env("BATCH", 500);
    let dir = std::env::var("DIR").unwrap_or_else(|_| "/tmp/kpexp/sled".into());
    let _ = std::fs::remove_dir_all(&dir);
    let pod = std::fs::read_to_string("/tmp/kpexp/pod.json").unwrap();
    let mut cfg = sled::Config::new()
        .path(&dir)
        .cache_capacity(env("CACHE", 8 << 20))
        .mode(if std::env::var("MODE").as_deref() == Ok("high") {
            sled::Mode::HighThroughput
        } else {
            sled::Mode::LowSpace
        });
    let fm = env("FLUSH_MS", 500);
    cfg = cfg.flush_every_ms(if fm == 0 { None } else { Some(fm) });
    if let Some(seg) = std::env::var("SEG").ok().and_then(|v| v.parse().ok()) {
        cfg = cfg.segment_size(seg);
    }
    let db = cfg.open().unwrap();
    let tree = db.open_tree("pods").unwrap();
    println!("open {}", rss());
    let t = Instant::now();
    let mut i = 0u64;
    while i < n {
        let mut b = sled::Batch::default();
        let end = (i + batch).min(n);
        for j in i..end {
            let key = format!("\x01ns-{}\0pod-{}", j % 100, j);
            let val = pod.replace("\"pod-0\"", &format!("\"pod-{j}\""));
            b.insert(key.as_bytes(), val.into_bytes());
        }
        b.insert(b"\x00state".as_ref(), format!("{end}").into_bytes());
        tree.apply_batch(b).unwrap();
        i = end;
        if i % 10000 == 0 {
            println!("{i} {}", rss());
        }
    }
    println!("written in {:?} {}", t.elapsed(), rss());
    db.flush().unwrap();
    println!("flushed {}", rss());
    if env("TRIM", 0) == 1 {
        unsafe { malloc_trim(0) };
        println!("trimmed {}", rss());
    }
    let smaps = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    for l in smaps
        .lines()
        .filter(|l| l.starts_with("Rss") || l.starts_with("Anonymous") || l.starts_with("Pss_File"))
    {
        println!("  {l}");
    }
}
