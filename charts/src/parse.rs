//! Reading the benchmarks' `RESULT` lines out of BENCHMARKS.md, and choosing the value of
//! each series at each N.
//!
//! A `RESULT` line is `RESULT key=value key=value ...`, inside a fenced code block. Values
//! of keys named with a unit (`_mib`, `_ms`, `_us`, ...: [`UNIT_SUFFIXES`]) and values that
//! look like numbers (they start with a digit, a sign or a dot, or are NaN or inf) must be
//! finite numbers; other values (`engine=redb`) are text. Unknown keys are kept and ignored
//! by the charts; missing keys only leave the line out of the series that need them.
//!
//! Which lines count: BENCHMARKS.md reports the current figures only (superseded ones live
//! in git history), so every `RESULT` line in a code block is current. If two lines of the
//! same series have the same N, the later one in the file wins. A line without `engine=` is
//! a redb line (the default engine). Lines with `streams=` (the memory bench's many-streams
//! mode, which has no `n=`) and lines with an `allocator=` other than `glibc` are not drawn:
//! they are counted in [`Parsed::ignored`].
//!
//! Outside code blocks, a line starting with `Run: ` (the date, the commit and the command
//! in backticks, as in ``Run: 2026-12-01, commit abc1234, `cargo bench ...` ``) names the
//! run of its `## ` section; the charts' footnotes quote its date and commit.

use std::collections::BTreeMap;
use std::fmt;

/// Key endings of the benchmarks' numeric fields: such a field's value must be a number.
pub const UNIT_SUFFIXES: [&str; 7] = [
    "_mib",
    "_ms",
    "_us",
    "_calls",
    "_per_s",
    "_rate",
    "_per_object",
];

/// The engine of a line without `engine=`.
pub const DEFAULT_ENGINE: &str = "redb";

/// One value of a `RESULT` field.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A finite number (`persist_peak_mib=45.8`).
    Num(f64),
    /// Anything that does not look like a number (`engine=redb`).
    Text(String),
}

/// One parsed `RESULT` line.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// 1-based line number in the input.
    pub line: usize,
    /// Index of the `## ` section holding the line (0: before the first such heading).
    pub section: usize,
    /// The `n=` field: number of objects.
    pub n: u64,
    /// Every field but `n`, by key.
    pub fields: BTreeMap<String, Value>,
}

impl Measurement {
    /// The numeric field `key`, if present and numeric.
    pub fn num(&self, key: &str) -> Option<f64> {
        match self.fields.get(key) {
            Some(Value::Num(v)) => Some(*v),
            _ => None,
        }
    }

    /// The text field `key`, if present and text.
    pub fn text(&self, key: &str) -> Option<&str> {
        match self.fields.get(key) {
            Some(Value::Text(t)) => Some(t),
            _ => None,
        }
    }

    /// The `engine=` field, [`DEFAULT_ENGINE`] when absent.
    pub fn engine(&self) -> &str {
        self.text("engine").unwrap_or(DEFAULT_ENGINE)
    }
}

/// A `RESULT` line that could not be read: reported and skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct BadLine {
    /// 1-based line number in the input.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for BadLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

/// A `## ` section of the input.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Section {
    /// Its title ("" for the part before the first heading).
    pub title: String,
    /// Its `Run: ` lines, each cut before the command (`2026-12-02, commit abc1234`),
    /// without repeats.
    pub runs: Vec<String>,
}

/// Everything read from the input.
#[derive(Debug, Default)]
pub struct Parsed {
    /// The `RESULT` lines the charts use, in file order.
    pub measurements: Vec<Measurement>,
    /// The unreadable ones.
    pub bad: Vec<BadLine>,
    /// Readable `RESULT` lines the charts do not draw (`streams=`, or an `allocator=` other
    /// than glibc): their line numbers.
    pub ignored: Vec<usize>,
    /// The sections; `sections[i]` is section `i` (index 0 is the part before the first
    /// heading).
    pub sections: Vec<Section>,
}

/// Reads every `RESULT` line inside fenced code blocks of a Markdown document, and the
/// `Run: ` lines of its sections.
pub fn parse_document(text: &str) -> Parsed {
    let mut parsed = Parsed {
        sections: vec![Section::default()],
        ..Parsed::default()
    };
    let mut in_fence = false;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let section = parsed.sections.len() - 1;
        if line.starts_with("```") {
            in_fence = !in_fence;
        } else if in_fence {
            if line == "RESULT" || line.starts_with("RESULT ") {
                match parse_result_line(line, i + 1, section) {
                    Ok(Some(m)) => parsed.measurements.push(m),
                    Ok(None) => parsed.ignored.push(i + 1),
                    Err(reason) => parsed.bad.push(BadLine {
                        line: i + 1,
                        reason,
                    }),
                }
            }
        } else if let Some(title) = line.strip_prefix("## ") {
            parsed.sections.push(Section {
                title: title.trim().to_string(),
                runs: Vec::new(),
            });
        } else if let Some(run) = line.strip_prefix("Run: ") {
            let run = run.split('`').next().unwrap_or("").trim();
            let run = run.trim_end_matches(',').trim().to_string();
            let runs = &mut parsed.sections[section].runs;
            if !run.is_empty() && !runs.contains(&run) {
                runs.push(run);
            }
        }
    }
    parsed
}

/// Parses one `RESULT key=value ...` line: `Ok(None)` for a line the charts do not draw
/// (see the module docs); the error says why a line cannot be used.
pub fn parse_result_line(
    line: &str,
    line_no: usize,
    section: usize,
) -> Result<Option<Measurement>, String> {
    let mut tokens = line.split_whitespace();
    if tokens.next() != Some("RESULT") {
        return Err("does not start with RESULT".into());
    }
    let mut n = None;
    let mut fields = BTreeMap::new();
    for token in tokens {
        let (key, value) = token
            .split_once('=')
            .ok_or_else(|| format!("`{token}` is not key=value"))?;
        if key.is_empty() || value.is_empty() {
            return Err(format!("`{token}` has an empty key or value"));
        }
        if key == "n" {
            if n.is_some() {
                return Err("n= appears twice".into());
            }
            n = Some(
                value
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("n={value} is not a positive integer"))?,
            );
            continue;
        }
        let numeric = value.starts_with(|c: char| c.is_ascii_digit() || "+-.".contains(c))
            || UNIT_SUFFIXES.iter().any(|u| key.ends_with(u));
        let value = match value.parse::<f64>() {
            Ok(v) if v.is_finite() => Value::Num(v),
            Ok(_) => return Err(format!("{key}={value} is not a finite number")),
            Err(_) if numeric => return Err(format!("{key}={value} is not a number")),
            Err(_) => Value::Text(value.to_string()),
        };
        if fields.insert(key.to_string(), value).is_some() {
            return Err(format!("{key}= appears twice"));
        }
    }
    let other_allocator =
        matches!(fields.get("allocator"), Some(a) if *a != Value::Text("glibc".into()));
    if fields.contains_key("streams") || other_allocator {
        return Ok(None);
    }
    let n = n.ok_or("no n= field")?;
    Ok(Some(Measurement {
        line: line_no,
        section,
        n,
        fields,
    }))
}

/// Which lines feed a series, and which field of them.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// The plotted field.
    pub field: &'a str,
    /// Only lines of this engine (`None`: any line).
    pub engine: Option<&'a str>,
    /// Only lines that also have this field (tells one benchmark's lines from another's).
    pub requires: Option<&'a str>,
}

/// One plotted value and the line it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// Number of objects.
    pub n: u64,
    /// The field's value.
    pub value: f64,
    /// The `RESULT` line it came from.
    pub line: usize,
    /// That line's section.
    pub section: usize,
}

/// The last matching measurement in the file at each N, sorted by N.
pub fn select(measurements: &[Measurement], query: Query<'_>) -> Vec<Point> {
    let mut last: BTreeMap<u64, Point> = BTreeMap::new();
    for m in measurements {
        let Some(value) = m.num(query.field) else {
            continue;
        };
        if query.engine.is_some_and(|e| m.engine() != e)
            || query.requires.is_some_and(|r| !m.fields.contains_key(r))
        {
            continue;
        }
        let point = Point {
            n: m.n,
            value,
            line: m.line,
            section: m.section,
        };
        last.insert(m.n, point);
    }
    last.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "\
# Benchmarks
RESULT n=1 outside_a_fence=1
## Memory
Run: 2026-12-02, commit abc1234, `cargo bench --bench memory -- --engine redb`
Run: 2026-12-02, commit abc1234, `cargo bench --bench memory -- --engine sled`
```text
RESULT n=100 peak_mib=45.8 engine=redb
RESULT n=100 peak_mib=110.4 engine=sled
RESULT n=100 peak_mib=44.0 engine=redb future_field=zstd
RESULT n=oops peak_mib=1
RESULT n=10 peak_mib=12.5MiB engine=redb
RESULT streams=20 objects=400000 persist_peak_mib=80.1 threads=9 allocator=glibc
```
## Lookup
Run: FILL date, commit FILL, `cargo bench --bench lookup`
```text
RESULT n=200 peak_mib=50.4 engine=redb
RESULT n=200 peak_mib=3.0
RESULT n=200 other=1 engine=redb
RESULT n=200 peak_mib=2.0 allocator=mimalloc
RESULT n=100 peak_mib=99.0 engine=redb allocator=glibc
```
";

    #[test]
    fn reads_fields_and_reports_bad_lines() {
        let p = parse_document(DOC);
        let titles: Vec<&str> = p.sections.iter().map(|s| s.title.as_str()).collect();
        assert_eq!(titles, ["", "Memory", "Lookup"]);
        // Two Run: lines with the same date and commit are one run; the text after the
        // first backtick is the command, left out.
        assert_eq!(p.sections[1].runs, ["2026-12-02, commit abc1234"]);
        assert_eq!(p.sections[2].runs, ["FILL date, commit FILL"]);
        // The line outside a code block is prose, not a measurement.
        assert!(p.measurements.iter().all(|m| m.n != 1));
        assert_eq!(p.measurements.len(), 7);
        let first = &p.measurements[0];
        assert_eq!((first.line, first.section, first.n), (7, 1, 100));
        assert_eq!(first.num("peak_mib"), Some(45.8));
        assert_eq!(first.engine(), "redb");
        assert_eq!(first.num("engine"), None);
        assert_eq!(first.num("missing"), None);
        // An unknown text field is kept, not an error.
        assert_eq!(
            p.measurements[2].fields.get("future_field"),
            Some(&Value::Text("zstd".into()))
        );
        // No engine=: a redb line.
        assert_eq!(p.measurements[4].line, 18);
        assert_eq!(p.measurements[4].engine(), DEFAULT_ENGINE);
        let bad: Vec<usize> = p.bad.iter().map(|b| b.line).collect();
        assert_eq!(bad, [10, 11]);
        assert!(p.bad[0].reason.contains("n=oops"), "{}", p.bad[0]);
        assert!(p.bad[1].reason.contains("peak_mib=12.5MiB"), "{}", p.bad[1]);
        // The streams= line (no n=) and the mimalloc line are readable but not drawn.
        assert_eq!(p.ignored, [12, 20]);
    }

    #[test]
    fn rejects_malformed_tokens() {
        for line in [
            "RESULT peak_mib=1",
            "RESULT n=0",
            "RESULT n=5 n=6",
            "RESULT n=5 a=1 a=2",
            "RESULT n=5 lonely",
            "RESULT n=5 x=",
            "RESULT n=5 x=NaN",
            "RESULT n=5 x=-inf",
            "RESULT n=5 peak_mib=abc",
            "RESULT streams=20 persist_peak_mib=abc",
        ] {
            assert!(
                parse_result_line(line, 1, 0).is_err(),
                "{line} was accepted"
            );
        }
        let m = parse_result_line("RESULT   n=7  x=-1.5e3 ", 3, 2)
            .unwrap()
            .unwrap();
        assert_eq!(
            (m.n, m.num("x"), m.line, m.section),
            (7, Some(-1500.0), 3, 2)
        );
        let streams = "RESULT streams=20 objects=400000 persist_peak_mib=61.2 allocator=mimalloc";
        assert_eq!(parse_result_line(streams, 1, 0), Ok(None));
    }

    #[test]
    fn the_later_line_wins() {
        let p = parse_document(DOC);
        let q = |engine| Query {
            field: "peak_mib",
            engine,
            requires: None,
        };
        // n=100, redb: lines 7 and 9 in one section, line 21 in a later one: the last wins.
        // n=200: line 18 has no engine= (redb) and comes after line 17; line 19 has no
        // peak_mib, line 20 is mimalloc (not drawn).
        let redb = select(&p.measurements, q(Some("redb")));
        let got: Vec<(u64, f64, usize)> = redb.iter().map(|p| (p.n, p.value, p.line)).collect();
        assert_eq!(got, [(100, 99.0, 21), (200, 3.0, 18)]);
        let sled = select(&p.measurements, q(Some("sled")));
        assert_eq!(sled.len(), 1);
        assert_eq!(
            (sled[0].value, sled[0].line, sled[0].section),
            (110.4, 8, 1)
        );
        // Any engine: at n=100 the redb line 21 is later than the sled line 8.
        let any = select(&p.measurements, q(None));
        let lines: Vec<usize> = any.iter().map(|p| p.line).collect();
        assert_eq!(lines, [21, 18]);
        let requiring = select(
            &p.measurements,
            Query {
                requires: Some("future_field"),
                ..q(None)
            },
        );
        assert_eq!(requiring.iter().map(|p| p.line).collect::<Vec<_>>(), [9]);
    }
}
