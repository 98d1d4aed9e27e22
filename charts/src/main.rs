//! `charts`: draws the SVG charts of BENCHMARKS.md from the benchmarks' `RESULT` lines.
//!
//! ```text
//! cargo run -p kube-persist-charts -- BENCHMARKS.md docs/charts
//! ```
//!
//! Reads every `RESULT` line in the code blocks of the input (see [`parse`] for the format
//! and for which lines are drawn), keeps the last line in the file for each series and N,
//! and writes `memory.svg`, `restart.svg`, `lookup.svg` and `iteration.svg` into the output
//! directory. The values and the lines they came from are printed; each chart names, at
//! its bottom, the sections its values come from with the date and commit of their `Run: `
//! lines. Unreadable lines are reported on stderr and skipped.

#![deny(unsafe_code)]

mod parse;
mod plot;

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use plotters::prelude::*;

use parse::{Measurement, Parsed, Point, Query};
use plot::{Area, Bar, DrawResult, Labels, Series};

const ENGINES: [(&str, RGBColor); 2] = [("redb", plot::REDB), ("sled", plot::SLED)];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (input, out) = match args.as_slice() {
        [] => ("BENCHMARKS.md".into(), "docs/charts".into()),
        [input, out] => (PathBuf::from(input), PathBuf::from(out)),
        _ => {
            eprintln!(
                "usage: charts [BENCHMARKS.md OUTPUT_DIR]  (default: BENCHMARKS.md docs/charts)"
            );
            return ExitCode::FAILURE;
        }
    };
    match run(&input, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("charts: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(input: &Path, out: &Path) -> Result<(), Box<dyn Error>> {
    let text =
        fs::read_to_string(input).map_err(|e| format!("reading {}: {e}", input.display()))?;
    let parsed = parse::parse_document(&text);
    for bad in &parsed.bad {
        eprintln!("skipped {} {bad}", input.display());
    }
    let untagged = parsed
        .measurements
        .iter()
        .filter(|m| m.text("engine").is_none())
        .count();
    if untagged > 0 {
        eprintln!(
            "note: {untagged} RESULT lines have no engine=: read as {}",
            parse::DEFAULT_ENGINE
        );
    }
    if !parsed.ignored.is_empty() {
        eprintln!(
            "note: not drawn (streams=, or an allocator= other than glibc): {} lines {}",
            input.display(),
            ranges(&parsed.ignored)
        );
    }
    if parsed.measurements.is_empty() {
        return Err(format!("no readable RESULT lines in {}", input.display()).into());
    }
    fs::create_dir_all(out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let name = input
        .file_name()
        .map_or("the input".into(), |n| n.to_string_lossy().into_owned());
    let charts = Charts {
        parsed: &parsed,
        source: &name,
        out,
    };
    charts.memory()?;
    charts.restart()?;
    charts.lookup()?;
    charts.iteration()?;
    Ok(())
}

struct Charts<'a> {
    parsed: &'a Parsed,
    /// The input's file name, for the footnotes.
    source: &'a str,
    out: &'a Path,
}

impl Charts<'_> {
    /// Peak RSS against N, per client.
    fn memory(&self) -> DrawResult {
        let engine_series = ENGINES.map(|(engine, color)| {
            self.series(
                format!("kube-persist, {engine}"),
                color,
                query("persist_peak_mib", Some(engine), None),
            )
        });
        let mut series: Vec<Series> = engine_series.into_iter().collect();
        let mut reflector = self.series(
            "kube-runtime reflector".into(),
            plot::REFLECTOR,
            query("reflector_peak_mib", None, None),
        );
        // The largest N measured for kube-persist alone (`--persist-only` runs).
        let alone = series
            .iter()
            .flat_map(|s| &s.points)
            .map(|p| p.n)
            .filter(|n| reflector.points.iter().all(|p| p.n != *n))
            .max();
        if let Some(n) = alone {
            let n = plot::compact(n as f64);
            reflector.label += &format!(" (not run at {n}: kube-persist alone there)");
        }
        series.push(reflector);
        series.push(self.series(
            "bare kube-runtime watcher (floor)".into(),
            plot::FLOOR,
            query("floor_peak_mib", None, None),
        ));
        let labels = Labels {
            title: "Peak RSS during the cold sync (memory bench)",
            x: "objects (Pods), log scale",
            y: "peak RSS (MiB), log scale",
        };
        self.draw_lines("memory.svg", (1000, 620), &labels, series)
    }

    /// Warm restart against N (memory bench), and the restart bench's times at one N.
    fn restart(&self) -> DrawResult {
        let mut series: Vec<Series> = ENGINES
            .into_iter()
            .map(|(engine, color)| {
                let q = query("warm_ready_ms", Some(engine), Some("persist_peak_mib"));
                let lists = self.list_calls(&select(self.parsed, q), "warm_list_calls");
                self.series(
                    format!("kube-persist, {engine}: warm restart{lists}"),
                    color,
                    q,
                )
            })
            .collect();
        series.push(self.series(
            "kube-runtime reflector: restart = full LIST (restart bench)".into(),
            plot::REFLECTOR,
            query("cold_reflector_ready_ms", None, None),
        ));
        series.retain(|s| !s.points.is_empty());

        let marker = "cold_persist_ready_ms";
        let n = self.last_n(marker);
        let bars = n.map_or_else(Vec::new, |n| self.restart_bars(marker, n));
        if n.is_none() {
            eprintln!("restart.svg: no restart bench lines ({marker}=)");
        }
        self.print_series("restart.svg", &series);
        self.print_bars("restart.svg", &bars);
        let used: Vec<&Point> = series
            .iter()
            .flat_map(|s| &s.points)
            .chain(bars.iter().map(|b| &b.point))
            .collect();
        let left = Labels {
            title: "Warm restart against N (memory bench)",
            x: "objects (Pods), log scale",
            y: "time to ready (ms), log scale",
        };
        let n = n.map_or("?".into(), |n| plot::compact(n as f64));
        let title = format!("Restart bench, N = {n}: time to ready");
        let right = Labels {
            title: &title,
            x: "time to ready (ms), log scale",
            y: "",
        };
        self.draw("restart.svg", (1400, 600), &used, |area| {
            let (l, r) = area.split_horizontally(600);
            plot::line_chart(&l, &left, &series)?;
            plot::bar_chart(&r, &right, "ms", &bars)
        })
    }

    /// The restart bench's times at `n`: per engine, then the reflector.
    fn restart_bars(&self, marker: &str, n: u64) -> Vec<Bar> {
        let mut bars = Vec::new();
        for (engine, color) in ENGINES {
            let rows = [
                ("warm restart", "warm_ready_ms", Some("warm_list_calls")),
                (
                    "restart after SIGKILL",
                    "killed_restart_ready_ms",
                    Some("killed_restart_list_calls"),
                ),
                ("cold sync", "cold_persist_ready_ms", None),
            ];
            for (what, field, lists) in rows {
                let q = query(field, Some(engine), Some(marker));
                let lists = lists.map_or(String::new(), |l| self.list_calls(&self.at(q, n), l));
                bars.extend(self.bar(format!("{engine}: {what}{lists}"), color, q, n));
            }
        }
        let reflector = query("cold_reflector_ready_ms", None, Some(marker));
        bars.extend(self.bar(
            "reflector: every start".into(),
            plot::REFLECTOR,
            reflector,
            n,
        ));
        bars
    }

    /// `Reader::get` latency percentiles per engine, and the reflector's `Store::get`, at
    /// each N of the lookup bench.
    fn lookup(&self) -> DrawResult {
        let rows = [
            ("get p50, uniform random", "persist_get_p50_us"),
            ("get p99, uniform random", "persist_get_p99_us"),
            ("get_raw p50 (no decode)", "persist_get_raw_p50_us"),
            ("get p50, last 1,000 changed", "persist_recent_get_p50_us"),
        ];
        let reflector = ("Store::get p50 (in memory)", "reflector_get_p50_us");
        let Some((bars, ns)) = self.lookup_bars("lookup.svg", &rows, reflector) else {
            return Ok(());
        };
        let title = format!("Get latency, N = {ns} (lookup bench)");
        self.draw_bars("lookup.svg", &title, "latency (µs), log scale", "µs", &bars)
    }

    /// Objects per second of iterating over the whole store (`Reader::iter`, and
    /// `Reader::iter_as` of a small type) per engine, and of kube-runtime's
    /// `Store::state()`, at each N of the lookup bench.
    fn iteration(&self) -> DrawResult {
        let rows = [
            ("iter", "persist_iter_objects_per_s"),
            ("iter_as (name and node)", "persist_iter_as_objects_per_s"),
        ];
        let reflector = ("Store::state() (in memory)", "reflector_iter_objects_per_s");
        let Some((bars, ns)) = self.lookup_bars("iteration.svg", &rows, reflector) else {
            return Ok(());
        };
        let title = format!("Iteration over all objects, N = {ns} (lookup bench)");
        let x = "objects per second, log scale";
        self.draw_bars("iteration.svg", &title, x, "/s", &bars)
    }

    /// Bars of the lookup bench at each of its N: per engine the fields of `rows` (label,
    /// field), then the reflector's field. Lines are told by `rows[0]`'s field; the N is in
    /// the labels when there are several. With the N, as "10k, 100k".
    fn lookup_bars(
        &self,
        file: &str,
        rows: &[(&str, &str)],
        (reflector_label, reflector_field): (&str, &str),
    ) -> Option<(Vec<Bar>, String)> {
        let marker = rows[0].1;
        let ns: BTreeSet<u64> = self
            .parsed
            .measurements
            .iter()
            .filter(|m| m.num(marker).is_some())
            .map(|m| m.n)
            .collect();
        if ns.is_empty() {
            eprintln!("{file}: no lookup bench lines with {marker}=");
            return None;
        }
        let mut bars = Vec::new();
        for &n in &ns {
            let at = if ns.len() > 1 {
                format!("N = {}, ", plot::compact(n as f64))
            } else {
                String::new()
            };
            for (engine, color) in ENGINES {
                for (what, field) in rows {
                    let q = query(field, Some(engine), Some(marker));
                    bars.extend(self.bar(format!("{at}{engine}: {what}"), color, q, n));
                }
            }
            let q = query(reflector_field, None, Some(marker));
            let label = format!("{at}reflector: {reflector_label}");
            bars.extend(self.bar(label, plot::REFLECTOR, q, n));
        }
        self.print_bars(file, &bars);
        let ns: Vec<String> = ns.iter().map(|n| plot::compact(*n as f64)).collect();
        Some((bars, ns.join(", ")))
    }

    /// A bar chart alone in `file`, its height following the number of bars.
    fn draw_bars(&self, file: &str, title: &str, x: &str, unit: &str, bars: &[Bar]) -> DrawResult {
        let labels = Labels { title, x, y: "" };
        let used: Vec<&Point> = bars.iter().map(|b| &b.point).collect();
        let height = 180 + 36 * bars.len() as u32;
        self.draw(file, (1000, height), &used, |area| {
            plot::bar_chart(area, &labels, unit, bars)
        })
    }

    fn series(&self, label: String, color: RGBColor, q: Query<'_>) -> Series {
        Series {
            label,
            color,
            points: select(self.parsed, q),
        }
    }

    /// A bar for the last line at `n` matching `q`, if there is one.
    fn bar(&self, label: String, color: RGBColor, q: Query<'_>, n: u64) -> Option<Bar> {
        let point = self.at(q, n);
        if point.is_none() {
            eprintln!("no value for `{label}` ({}=) at n={n}", q.field);
        }
        Some(Bar {
            label,
            color,
            point: point?,
        })
    }

    fn at(&self, q: Query<'_>, n: u64) -> Option<Point> {
        select(self.parsed, q).into_iter().find(|p| p.n == n)
    }

    /// The N of the last line in the file that has `field`.
    fn last_n(&self, field: &str) -> Option<u64> {
        let mut lines = self.parsed.measurements.iter();
        lines.rfind(|m| m.num(field).is_some()).map(|m| m.n)
    }

    /// ", 0 LIST calls" (or a range) from `field` of the lines behind `points`.
    fn list_calls<'p>(&self, points: impl IntoIterator<Item = &'p Point>, field: &str) -> String {
        let points: Vec<&Point> = points.into_iter().collect();
        let calls: Vec<f64> = points
            .iter()
            .filter_map(|p| self.measurement(p.line)?.num(field))
            .collect();
        let lo = calls.iter().copied().reduce(f64::min);
        let hi = calls.iter().copied().reduce(f64::max);
        let partly = if calls.len() < points.len() {
            " where counted"
        } else {
            ""
        };
        match (lo, hi) {
            (Some(lo), Some(hi)) if lo == hi => format!(", {lo} LIST calls{partly}"),
            (Some(lo), Some(hi)) => format!(", {lo}-{hi} LIST calls{partly}"),
            _ => String::new(),
        }
    }

    fn measurement(&self, line: usize) -> Option<&Measurement> {
        self.parsed.measurements.iter().find(|m| m.line == line)
    }

    fn draw_lines(
        &self,
        file: &str,
        size: (u32, u32),
        labels: &Labels,
        mut series: Vec<Series>,
    ) -> DrawResult {
        series.retain(|s| !s.points.is_empty());
        self.print_series(file, &series);
        let used: Vec<&Point> = series.iter().flat_map(|s| &s.points).collect();
        self.draw(file, size, &used, |area| {
            plot::line_chart(area, labels, &series)
        })
    }

    /// Writes `file` (unless there is nothing to draw), with a footnote naming the lines used.
    fn draw(
        &self,
        file: &str,
        size: (u32, u32),
        used: &[&Point],
        body: impl FnOnce(&Area) -> DrawResult,
    ) -> DrawResult {
        if used.is_empty() {
            eprintln!("{file}: no data, not written");
            return Ok(());
        }
        let notes = self.sources(used);
        let mut lines: Vec<usize> = used.iter().map(|p| p.line).collect();
        lines.sort_unstable();
        lines.dedup();
        println!("{file}: {} RESULT lines {}", self.source, ranges(&lines));
        let path = self.out.join(file);
        let root = SVGBackend::new(&path, size).into_drawing_area();
        root.fill(&WHITE)?;
        let foot = 8 + 17 * notes.len() as u32;
        let (main, bottom) = root.split_vertically(size.1 - foot);
        body(&main)?;
        for (i, note) in notes.iter().enumerate() {
            plot::footnote(&bottom.margin(17 * i as u32, 0, 0, 0), note)?;
        }
        root.present()?;
        println!("wrote {}", path.display());
        Ok(())
    }

    /// One note per section: its runs (date and commit) and the N of the values taken
    /// from it. (Line numbers would go stale with any edit of the prose above them; they
    /// are printed instead.)
    fn sources(&self, used: &[&Point]) -> Vec<String> {
        let mut by_section: BTreeMap<usize, BTreeSet<u64>> = BTreeMap::new();
        for p in used {
            by_section.entry(p.section).or_default().insert(p.n);
        }
        by_section
            .into_iter()
            .map(|(section, ns)| {
                let section = self.parsed.sections.get(section);
                let title = section.map_or("", |s| s.title.as_str());
                let runs = match section.map_or(&[][..], |s| &s.runs[..]) {
                    [] => String::new(),
                    [run] => format!(" (run {run})"),
                    runs => format!(" (runs {})", runs.join("; ")),
                };
                let ns: Vec<String> = ns.into_iter().map(|n| plot::compact(n as f64)).collect();
                format!("{}, “{title}”{runs}: N = {}", self.source, ns.join(", "))
            })
            .collect()
    }

    fn print_series(&self, file: &str, series: &[Series]) {
        for s in series {
            let points: Vec<String> = s
                .points
                .iter()
                .map(|p| {
                    format!(
                        "{}={} (line {})",
                        plot::compact(p.n as f64),
                        p.value,
                        p.line
                    )
                })
                .collect();
            println!("{file}: {}: {}", s.label, points.join(", "));
        }
    }

    fn print_bars(&self, file: &str, bars: &[Bar]) {
        for b in bars {
            println!(
                "{file}: {}: {} (line {})",
                b.label, b.point.value, b.point.line
            );
        }
    }
}

fn query<'a>(field: &'a str, engine: Option<&'a str>, requires: Option<&'a str>) -> Query<'a> {
    Query {
        field,
        engine,
        requires,
    }
}

fn select(parsed: &Parsed, q: Query<'_>) -> Vec<Point> {
    parse::select(&parsed.measurements, q)
}

/// Sorted line numbers as "73-76, 223, 225".
fn ranges(lines: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let mut j = i;
        while j + 1 < lines.len() && lines[j + 1] == lines[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            lines[i].to_string()
        } else {
            format!("{}-{}", lines[i], lines[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn line_ranges() {
        assert_eq!(
            super::ranges(&[73, 74, 75, 223, 225, 226]),
            "73-75, 223, 225-226"
        );
        assert_eq!(super::ranges(&[]), "");
    }
}
