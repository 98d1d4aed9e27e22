//! A controller process's log as the driver reads it: the lines the child appended
//! (`r <name> <rv> <start_ms> <end_ms>` per reconcile, `t` per tick, `s` per start signal
//! and `l` per lag of the plain subscriber, `o` per event out of order, `e` per error),
//! tailed while the process runs.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use kube_persist::resource_version;

use crate::now_ms;

/// The index `k` of the testkit's `pod-k`.
fn pod_index(name: &str) -> Option<usize> {
    name.rsplit('/').next()?.strip_prefix("pod-")?.parse().ok()
}

/// One completed reconcile.
pub(crate) struct Rec {
    pub(crate) rv: String,
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// One controller process: its log and life.
pub(crate) struct Gen {
    log: PathBuf,
    pub(crate) started_ms: u64,
    pub(crate) ended_ms: Option<u64>,
    /// Bytes of the log read so far.
    read: u64,
    /// The tail of the log after its last newline.
    partial: String,
    /// Per object, the reconciles in the order they were logged (by end).
    pub(crate) recs: Vec<Vec<Rec>>,
    pub(crate) ticks: Vec<u64>,
    pub(crate) start_signals: Vec<u64>,
    pub(crate) lags: u64,
    pub(crate) errors: Vec<String>,
    pub(crate) disorder: Vec<String>,
}

impl Gen {
    pub(crate) fn new(log: PathBuf, objects: usize) -> Self {
        Gen {
            log,
            started_ms: now_ms(),
            ended_ms: None,
            read: 0,
            partial: String::new(),
            recs: (0..objects).map(|_| Vec::new()).collect(),
            ticks: Vec::new(),
            start_signals: Vec::new(),
            lags: 0,
            errors: Vec::new(),
            disorder: Vec::new(),
        }
    }

    /// Read the lines appended to the log since the last call.
    pub(crate) fn tail(&mut self, newest: &mut [Option<String>]) {
        let Ok(mut f) = std::fs::File::open(&self.log) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.read)).is_err() {
            return;
        }
        let mut buf = String::new();
        let Ok(n) = f.read_to_string(&mut buf) else {
            return;
        };
        self.read += n as u64;
        self.partial.push_str(&buf);
        let Some(cut) = self.partial.rfind('\n') else {
            return;
        };
        let whole: String = self.partial.drain(..=cut).collect();
        for line in whole.lines() {
            self.parse(line, newest);
        }
    }

    fn parse(&mut self, line: &str, newest: &mut [Option<String>]) {
        let f: Vec<&str> = line.split(' ').collect();
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        match f.first().copied() {
            Some("r") => {
                let Some(obj) = f.get(1).and_then(|n| pod_index(n)) else {
                    self.errors.push(format!("unknown object in {line:?}"));
                    return;
                };
                let Some(list) = self.recs.get_mut(obj) else {
                    self.errors.push(format!("unknown object in {line:?}"));
                    return;
                };
                let rv = f.get(2).copied().unwrap_or("").to_string();
                let slot = &mut newest[obj];
                if slot
                    .as_deref()
                    .is_none_or(|n| resource_version::at_least(&rv, n) == Some(true))
                {
                    *slot = Some(rv.clone());
                }
                list.push(Rec {
                    rv,
                    start: num(3),
                    end: num(4),
                });
            }
            Some("t") => self.ticks.push(num(1)),
            Some("s") => self.start_signals.push(num(1)),
            Some("l") => self.lags += 1,
            Some("o") => self.disorder.push(line.to_string()),
            Some("e") => self.errors.push(line.to_string()),
            _ => self.errors.push(format!("unreadable log line {line:?}")),
        }
    }
}
