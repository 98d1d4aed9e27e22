//! Reading the benchmarks' `RESULT` lines out of BENCHMARKS.md, and choosing the newest
//! measurement of each series at each N.
//!
//! A `RESULT` line is `RESULT key=value key=value ...`, inside a fenced code block. Values
//! of keys named with a unit (`_mib`, `_ms`, `_us`, ...: [`UNIT_SUFFIXES`]) and values that
//! look like numbers (they start with a digit, a sign or a dot, or are NaN or inf) must be
//! finite numbers; other values (`engine=redb`) are text. Unknown keys are kept and ignored by the charts;
//! missing keys only leave the line out of the series that need them.
//!
//! Recency: BENCHMARKS.md puts the latest session's section (`## ` heading) first, and within
//! a section a later line is a later run. So a line is newer than another when its section
//! comes earlier in the file, or, in the same section, when it comes later.

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

    /// The `engine=` field, if present.
    pub fn engine(&self) -> Option<&str> {
        match self.fields.get("engine") {
            Some(Value::Text(e)) => Some(e),
            _ => None,
        }
    }

    /// Whether `self` was measured after `other` (see the module docs).
    pub fn is_newer_than(&self, other: &Measurement) -> bool {
        self.section < other.section || (self.section == other.section && self.line > other.line)
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

/// Everything read from the input.
#[derive(Debug, Default)]
pub struct Parsed {
    /// The readable `RESULT` lines, in file order.
    pub measurements: Vec<Measurement>,
    /// The unreadable ones.
    pub bad: Vec<BadLine>,
    /// The `## ` section titles; `sections[i]` is the title of section `i` (index 0 is the
    /// part before the first heading, titled "").
    pub sections: Vec<String>,
}

/// Reads every `RESULT` line inside fenced code blocks of a Markdown document.
pub fn parse_document(text: &str) -> Parsed {
    let mut parsed = Parsed {
        sections: vec![String::new()],
        ..Parsed::default()
    };
    let mut in_fence = false;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let heading = if in_fence {
            None
        } else {
            line.strip_prefix("## ")
        };
        if line.starts_with("```") {
            in_fence = !in_fence;
        } else if let Some(title) = heading {
            parsed.sections.push(title.trim().to_string());
        } else if in_fence && (line == "RESULT" || line.starts_with("RESULT ")) {
            let section = parsed.sections.len() - 1;
            match parse_result_line(line, i + 1, section) {
                Ok(m) => parsed.measurements.push(m),
                Err(reason) => parsed.bad.push(BadLine {
                    line: i + 1,
                    reason,
                }),
            }
        }
    }
    parsed
}

/// Parses one `RESULT key=value ...` line; the error says why it cannot be used.
pub fn parse_result_line(
    line: &str,
    line_no: usize,
    section: usize,
) -> Result<Measurement, String> {
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
    let n = n.ok_or("no n= field")?;
    Ok(Measurement {
        line: line_no,
        section,
        n,
        fields,
    })
}

/// Which lines feed a series, and which field of them.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// The plotted field.
    pub field: &'a str,
    /// Only lines with this `engine=` (`None`: any line, with or without `engine=`).
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

/// The newest matching measurement at each N, sorted by N.
pub fn select(measurements: &[Measurement], query: Query<'_>) -> Vec<Point> {
    let mut newest: BTreeMap<u64, &Measurement> = BTreeMap::new();
    let matching = measurements.iter().filter(|m| {
        m.num(query.field).is_some()
            && query.engine.is_none_or(|e| m.engine() == Some(e))
            && query.requires.is_none_or(|r| m.fields.contains_key(r))
    });
    for m in matching {
        let entry = newest.entry(m.n).or_insert(m);
        if m.is_newer_than(entry) {
            *entry = m;
        }
    }
    newest
        .into_values()
        .filter_map(|m| {
            Some(Point {
                n: m.n,
                value: m.num(query.field)?,
                line: m.line,
                section: m.section,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "\
# Benchmarks
RESULT n=1 outside_a_fence=1
## Newest session
```text
RESULT n=100 peak_mib=45.8 engine=redb
RESULT n=100 peak_mib=110.4 engine=sled
RESULT n=100 peak_mib=44.0 engine=redb future_field=zstd
RESULT n=oops peak_mib=1
RESULT n=10 peak_mib=12.5MiB engine=redb
```
## Older session
```text
RESULT n=100 peak_mib=99.0 engine=redb
RESULT n=200 peak_mib=50.4 engine=redb
RESULT n=200 peak_mib=3.0
RESULT n=200 other=1 engine=redb
```
";

    #[test]
    fn reads_fields_and_reports_bad_lines() {
        let p = parse_document(DOC);
        assert_eq!(p.sections, ["", "Newest session", "Older session"]);
        // The line outside a code block is prose, not a measurement.
        assert!(p.measurements.iter().all(|m| m.n != 1));
        assert_eq!(p.measurements.len(), 7);
        let first = &p.measurements[0];
        assert_eq!((first.line, first.section, first.n), (5, 1, 100));
        assert_eq!(first.num("peak_mib"), Some(45.8));
        assert_eq!(first.engine(), Some("redb"));
        assert_eq!(first.num("engine"), None);
        assert_eq!(first.num("missing"), None);
        // An unknown text field is kept, not an error.
        assert_eq!(
            p.measurements[2].fields.get("future_field"),
            Some(&Value::Text("zstd".into()))
        );
        let bad: Vec<usize> = p.bad.iter().map(|b| b.line).collect();
        assert_eq!(bad, [8, 9]);
        assert!(p.bad[0].reason.contains("n=oops"), "{}", p.bad[0]);
        assert!(p.bad[1].reason.contains("peak_mib=12.5MiB"), "{}", p.bad[1]);
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
        ] {
            assert!(
                parse_result_line(line, 1, 0).is_err(),
                "{line} was accepted"
            );
        }
        let m = parse_result_line("RESULT   n=7  x=-1.5e3 ", 3, 2).unwrap();
        assert_eq!(
            (m.n, m.num("x"), m.line, m.section),
            (7, Some(-1500.0), 3, 2)
        );
    }

    #[test]
    fn selects_the_newest_line_per_n() {
        let p = parse_document(DOC);
        let q = |engine| Query {
            field: "peak_mib",
            engine,
            requires: None,
        };
        // n=100: both lines 5 and 7 are in the newest section; 7 is the later run. Line 13
        // (an older section) loses although it comes last in the file. n=200 exists only
        // in the older section; line 15 has no engine= and line 16 no peak_mib.
        let redb = select(&p.measurements, q(Some("redb")));
        let got: Vec<(u64, f64, usize)> = redb.iter().map(|p| (p.n, p.value, p.line)).collect();
        assert_eq!(got, [(100, 44.0, 7), (200, 50.4, 14)]);
        let sled = select(&p.measurements, q(Some("sled")));
        assert_eq!(sled.len(), 1);
        assert_eq!((sled[0].value, sled[0].section), (110.4, 1));
        // Any engine: at n=200 the engine-less line 15 is newer than line 14.
        let any = select(&p.measurements, q(None));
        assert_eq!(any.last().map(|p| p.line), Some(15));
        let requiring = select(
            &p.measurements,
            Query {
                requires: Some("future_field"),
                ..q(None)
            },
        );
        assert_eq!(requiring.iter().map(|p| p.line).collect::<Vec<_>>(), [7]);
    }
}
