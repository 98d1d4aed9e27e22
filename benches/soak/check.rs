//! The invariants, checked on what the controller processes logged and what the driver
//! wrote (see the bench's doc): the `note:`, `violation:` and `soak:` lines and the RESULT
//! line.

use kube_persist::resource_version;

use crate::Params;
use crate::driver::Written;
use crate::logs::{Gen, Rec};
use crate::support;

/// Writes made more than this long after their process started count as steady.
const STEADY_AFTER_MS: u64 = 30_000;

/// What the soak prints: the detail (`note:`, `violation:` and `soak:` lines, on stderr)
/// and the RESULT line (on stdout).
pub(crate) struct Report {
    pub(crate) detail: String,
    pub(crate) result: String,
}

pub(crate) fn check(
    p: &Params,
    gens: Vec<Gen>,
    mut writes: Vec<Written>,
    write_errors: u64,
    mut violations: Vec<String>,
    peak_hwm_kib: u64,
) -> Report {
    let mut notes: Vec<String> = Vec::new();
    let cmp = |a: &str, b: &str| resource_version::compare(a, b).expect("comparable versions");

    // Every reconcile of each object, across processes, in the order they ended.
    let mut per_obj: Vec<Vec<&Rec>> = vec![Vec::new(); p.objects];
    for g in &gens {
        for (obj, recs) in g.recs.iter().enumerate() {
            per_obj[obj].extend(recs.iter());
        }
    }
    for recs in per_obj.iter_mut() {
        recs.sort_by_key(|r| (r.end, r.start));
    }

    // No two reconciles of one object at once (within a process), no version going back.
    for (gi, g) in gens.iter().enumerate() {
        for (obj, recs) in g.recs.iter().enumerate() {
            let mut by_start: Vec<&Rec> = recs.iter().collect();
            by_start.sort_by_key(|r| r.start);
            for w in by_start.windows(2) {
                if w[1].start < w[0].end {
                    violations.push(format!(
                        "process {gi}: pod-{obj} reconciled twice at once ({}..{} and {}..{})",
                        w[0].start, w[0].end, w[1].start, w[1].end
                    ));
                }
            }
        }
    }
    for (obj, recs) in per_obj.iter().enumerate() {
        for w in recs.windows(2) {
            if cmp(&w[1].rv, &w[0].rv).is_lt() {
                violations.push(format!(
                    "pod-{obj}: reconciled at {} after {}",
                    w[1].rv, w[0].rv
                ));
            }
        }
    }

    // Triggers: each write is followed by a reconcile at its version or newer.
    writes.sort_by(|a, b| a.obj.cmp(&b.obj).then_with(|| cmp(&a.rv, &b.rv)));
    let (mut lost, mut late, mut max_latency_ms) = (0u64, 0u64, 0u64);
    let mut latencies: Vec<u64> = Vec::with_capacity(writes.len());
    // Late triggers by the process that was running (or starting) when the write was made.
    let mut late_by_gen = vec![0u64; gens.len()];
    let gen_at = |ms: u64| gens.iter().rposition(|g| g.started_ms <= ms).unwrap_or(0);
    // Latencies of the writes made while a process was alive and more than
    // `STEADY_AFTER_MS` after it started.
    let mut steady: Vec<u64> = Vec::new();
    let is_steady = |ms: u64| {
        let g = &gens[gen_at(ms)];
        g.started_ms + STEADY_AFTER_MS < ms && g.ended_ms.is_none_or(|e| ms < e)
    };
    let mut i = 0;
    while i < writes.len() {
        let obj = writes[i].obj;
        let recs = &per_obj[obj];
        let mut r = 0;
        while i < writes.len() && writes[i].obj == obj {
            let w = &writes[i];
            while r < recs.len() && resource_version::at_least(&recs[r].rv, &w.rv) != Some(true) {
                r += 1;
            }
            match recs.get(r) {
                None => lost += 1,
                Some(rec) => {
                    let latency = rec.end.saturating_sub(w.at_ms);
                    max_latency_ms = max_latency_ms.max(latency);
                    latencies.push(latency);
                    if is_steady(w.at_ms) {
                        steady.push(latency);
                    }
                    if latency as f64 > p.trigger_bound_s * 1000.0 {
                        late += 1;
                        late_by_gen[gen_at(w.at_ms)] += 1;
                    }
                }
            }
            i += 1;
        }
    }
    if late > 0 {
        violations.push(format!(
            "{late} triggers reconciled later than {} s (by the process running at the write: {late_by_gen:?})",
            p.trigger_bound_s
        ));
    }
    latencies.sort_unstable();
    steady.sort_unstable();
    let secs = |v: &[u64], q: f64| percentile(v, q).map_or(f64::NAN, |ms| ms as f64 / 1000.0);
    notes.push(format!(
        "trigger latency: p50 {:.2} s, p90 {:.2} s, p99 {:.2} s, max {:.2} s; steady (writes more than {} s after their process started: {} of {}): p50 {:.2} s, p99 {:.2} s",
        secs(&latencies, 0.5),
        secs(&latencies, 0.9),
        secs(&latencies, 0.99),
        max_latency_ms as f64 / 1000.0,
        STEADY_AFTER_MS / 1000,
        steady.len(),
        latencies.len(),
        secs(&steady, 0.5),
        secs(&steady, 0.99),
    ));

    // Ticks, across processes: a tick is swept when every object has a reconcile (by any
    // process) that started at or after it and ended within its bound.
    let restarts: Vec<u64> = gens.iter().skip(1).map(|g| g.started_ms).collect();
    let soak_end = gens.last().and_then(|g| g.ended_ms).unwrap_or(u64::MAX);
    // Per object, its reconciles by start, and the earliest end among those from each on.
    let by_start: Vec<(Vec<u64>, Vec<u64>)> = per_obj
        .iter()
        .map(|recs| {
            let mut v: Vec<(u64, u64)> = recs.iter().map(|r| (r.start, r.end)).collect();
            v.sort_unstable();
            let starts = v.iter().map(|&(s, _)| s).collect();
            let mut min_end: Vec<u64> = v.iter().map(|&(_, e)| e).collect();
            for i in (0..min_end.len().saturating_sub(1)).rev() {
                min_end[i] = min_end[i].min(min_end[i + 1]);
            }
            (starts, min_end)
        })
        .collect();
    let mut tick_times: Vec<(usize, u64)> = gens
        .iter()
        .enumerate()
        .flat_map(|(gi, g)| g.ticks.iter().map(move |&t| (gi, t)))
        .collect();
    tick_times.sort_unstable_by_key(|&(_, t)| t);
    let (mut swept, mut open, mut failed, mut across) = (0u64, 0u64, 0u64, 0u64);
    let mut pass_ms: Vec<u64> = Vec::new();
    let mut longest_bound_ms = 0.0f64;
    for &(gi, t) in &tick_times {
        // When every object had a reconcile that started at or after the tick (None: some
        // object has none yet).
        let mut done: Option<u64> = Some(t);
        let mut missing = 0usize;
        for (starts, min_end) in &by_start {
            match min_end.get(starts.partition_point(|&s| s < t)) {
                Some(&e) => done = done.map(|d| d.max(e)),
                None => {
                    done = None;
                    missing += 1;
                }
            }
        }
        let bound_ms = p.tick_bound_ms(t, &restarts);
        longest_bound_ms = longest_bound_ms.max(bound_ms);
        let deadline = t as f64 + bound_ms;
        let life = (t - gens[gi].started_ms) as f64 / 1000.0;
        match done {
            Some(d) if (d as f64) <= deadline => {
                swept += 1;
                pass_ms.push(d - t);
                if restarts.iter().any(|&r| t <= r && r < d) {
                    across += 1;
                }
            }
            _ if soak_end as f64 <= deadline => {
                open += 1;
                notes.push(format!(
                    "process {gi}: tick at +{life:.0} s of its life open at the end ({missing} objects not reached in {:.0} s, bound {:.0} s)",
                    soak_end.saturating_sub(t) as f64 / 1000.0,
                    bound_ms / 1000.0
                ));
            }
            _ => {
                failed += 1;
                violations.push(format!(
                    "process {gi}: tick at +{life:.0} s of its life not swept within its bound of {:.0} s ({missing} objects never reached{})",
                    bound_ms / 1000.0,
                    done.map_or(String::new(), |d| format!(", the last {:.0} s after the tick", (d - t) as f64 / 1000.0))
                ));
            }
        }
    }
    let ticks = tick_times.len();
    pass_ms.sort_unstable();

    // The plain subscriber: a start signal in each process that lived long enough; order.
    let mut lags = 0;
    for (gi, g) in gens.iter().enumerate() {
        lags += g.lags;
        let lived = g.ended_ms.unwrap_or(u64::MAX).saturating_sub(g.started_ms);
        let bound = p.start_bound_s * 1000;
        if lived > bound
            && !g
                .start_signals
                .iter()
                .any(|&s| s.saturating_sub(g.started_ms) <= bound)
        {
            violations.push(format!(
                "process {gi}: the plain subscriber got no start signal within {} s",
                p.start_bound_s
            ));
        }
        for d in &g.disorder {
            violations.push(format!(
                "process {gi}: out of order at the plain subscriber: {d}"
            ));
        }
        for e in &g.errors {
            violations.push(format!("process {gi}: {e}"));
        }
    }

    let reconciles: usize = per_obj.iter().map(Vec::len).sum();
    let mut detail = String::new();
    for n in &notes {
        detail.push_str(&format!("note: {n}\n"));
    }
    for v in violations.iter().take(30) {
        detail.push_str(&format!("violation: {v}\n"));
    }
    if violations.len() > 30 {
        detail.push_str(&format!("... {} violations in all\n", violations.len()));
    }
    detail.push_str(&format!(
        "soak: {} processes, {reconciles} reconciles, {write_errors} failed writes, plain subscriber lagged {lags} times; ticks: {swept} swept (longest {:.1} s, {across} across a restart), {open} open at the end, {failed} not swept within their bound (at most {:.0} s)",
        gens.len(),
        pass_ms.last().map_or(0.0, |&ms| ms as f64 / 1000.0),
        longest_bound_ms / 1000.0
    ));
    let result = format!(
        "RESULT soak_minutes={} objects={} triggers={} lost_triggers={lost} max_trigger_latency_s={:.1} ticks={ticks} ticks_fully_swept={swept} peak_rss_mib={:.1} violations={} change_latency_p50_s={:.2} change_latency_p99_s={:.2} steady_latency_p99_s={:.2} pass_p99_s={:.1}",
        p.minutes,
        p.objects,
        writes.len(),
        max_latency_ms as f64 / 1000.0,
        support::mib(peak_hwm_kib),
        violations.len(),
        secs(&latencies, 0.5),
        secs(&latencies, 0.99),
        secs(&steady, 0.99),
        secs(&pass_ms, 0.99),
    );
    Report { detail, result }
}

/// The `q` quantile of sorted values (the value at index ⌊n·q⌋, the last at most).
fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    let i = ((sorted.len() as f64 * q) as usize).min(sorted.len().checked_sub(1)?);
    sorted.get(i).copied()
}
