//! The invariants, checked on what the controller processes logged and what the driver
//! wrote (see the bench's doc): the `note:`, `violation:` and `soak:` lines and the RESULT
//! line.

use kube_persist::resource_version;

use crate::Params;
use crate::driver::Written;
use crate::logs::{Gen, Rec};
use crate::support;

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
    let pct = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(0.0, |&ms| ms as f64 / 1000.0)
    };
    notes.push(format!(
        "trigger latency: p50 {:.2} s, p90 {:.2} s, p99 {:.2} s, max {:.2} s",
        pct(0.5),
        pct(0.9),
        pct(0.99),
        max_latency_ms as f64 / 1000.0
    ));

    // Ticks.
    let bound_ms = p.sweep_bound_s() * 1000.0;
    let (mut ticks, mut swept, mut cut, mut failed) = (0u64, 0u64, 0u64, 0u64);
    let mut sweep_times: Vec<f64> = Vec::new();
    for (gi, g) in gens.iter().enumerate() {
        let ended = g.ended_ms.unwrap_or(u64::MAX);
        let mut by_start: Vec<Vec<(u64, u64)>> = g
            .recs
            .iter()
            .map(|recs| recs.iter().map(|r| (r.start, r.end)).collect())
            .collect();
        for v in by_start.iter_mut() {
            v.sort_unstable();
        }
        for &t in &g.ticks {
            ticks += 1;
            // When the last object was reconciled after the tick (None: some never were).
            let mut done: Option<u64> = Some(t);
            let mut missing = 0usize;
            for recs in &by_start {
                let at = recs.partition_point(|&(s, _)| s < t);
                // The first reconcile to end among those that started after the tick.
                match recs[at..].iter().map(|&(_, e)| e).min() {
                    Some(e) => done = done.map(|d| d.max(e)),
                    None => {
                        done = None;
                        missing += 1;
                    }
                }
            }
            let deadline = t as f64 + bound_ms;
            match done {
                Some(d) if (d as f64) <= deadline => {
                    swept += 1;
                    sweep_times.push((d - t) as f64 / 1000.0);
                }
                _ if (ended as f64) < deadline => {
                    cut += 1;
                    notes.push(format!(
                        "process {gi}: tick at +{:.0} s of its life cut by its end {:.0} s later ({missing} objects not reached)",
                        (t - g.started_ms) as f64 / 1000.0,
                        (ended - t) as f64 / 1000.0
                    ));
                }
                _ => {
                    failed += 1;
                    notes.push(format!(
                        "process {gi}: tick at +{:.0} s of its life not swept within {:.0} s ({missing} objects not reached)",
                        (t - g.started_ms) as f64 / 1000.0,
                        bound_ms / 1000.0
                    ));
                }
            }
        }
    }

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
    let max_sweep = sweep_times.iter().copied().fold(0.0, f64::max);
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
        "soak: {} processes, {reconciles} reconciles, {write_errors} failed writes, plain subscriber lagged {lags} times; ticks: {swept} swept (longest {max_sweep:.1} s), {cut} cut by a restart, {failed} not swept within the bound of {:.0} s",
        gens.len(),
        bound_ms / 1000.0
    ));
    let result = format!(
        "RESULT soak_minutes={} objects={} triggers={} lost_triggers={lost} max_trigger_latency_s={:.1} ticks={ticks} ticks_fully_swept={swept} peak_rss_mib={:.1} violations={}",
        p.minutes,
        p.objects,
        writes.len(),
        max_latency_ms as f64 / 1000.0,
        support::mib(peak_hwm_kib),
        violations.len()
    );
    Report { detail, result }
}
