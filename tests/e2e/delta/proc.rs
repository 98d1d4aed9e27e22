//! The child process of `delta-relist-kill`: this binary again with
//! `KP_E2E_CHILD=delta-store` (dispatched by `child::run`), a Pod store in `RelistMode::Delta` that prints its phase and
//! counters and SIGKILLs itself where it is told to; and the parent's handle on it.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::{Db, Reader, RelistMode, SyncPhase};

use super::{KILL_PAGE, config};
use crate::child::spawn_role;
use crate::common;
use crate::support::Server;

/// The child role that runs a delta-relisting store (see `main`).
pub const CHILD_ROLE: &str = "delta-store";
const KILL_ENV: &str = "KP_E2E_DELTA_KILL";

/// Where the child kills itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KillAt {
    /// In `Listing`, once this many metadata pages were read (their fetches under way).
    Pages(u64),
    /// In `Sweeping`.
    Sweeping,
    /// As soon as the relist is `Synced`.
    Synced,
}

impl KillAt {
    fn encode(self) -> String {
        match self {
            KillAt::Pages(n) => format!("pages:{n}"),
            KillAt::Sweeping => "sweeping".into(),
            KillAt::Synced => "synced".into(),
        }
    }

    fn decode(s: &str) -> Option<KillAt> {
        match s {
            "sweeping" => Some(KillAt::Sweeping),
            "synced" => Some(KillAt::Synced),
            _ => Some(KillAt::Pages(s.strip_prefix("pages:")?.parse().ok()?)),
        }
    }
}

/// The child process (started by [`Proc::spawn`], its store every batch durable): a Pod
/// store in `RelistMode::Delta` with [`KILL_PAGE`], printing `phase <phase> pages <metadata
/// pages> fetched <bodies>` at each change (watched on a thread every 200 µs), and
/// SIGKILLing itself where `KP_E2E_DELTA_KILL` says (after printing `killed in <phase>`).
pub async fn child(db: Db, client: kube::Client) {
    let kill = std::env::var(KILL_ENV)
        .ok()
        .and_then(|k| KillAt::decode(&k));
    let (reader, watcher) = db
        .store(
            "pods",
            Api::<Pod>::all(client),
            config(RelistMode::Delta, KILL_PAGE),
        )
        .expect("the child's store");
    std::thread::spawn(move || watch_child(reader, kill));
    let mut events = std::pin::pin!(watcher.stream());
    while let Some(ev) = events.next().await {
        if let Err(e) = ev {
            println!("error {e}");
        }
    }
}

fn watch_child(reader: Reader<Pod>, kill: Option<KillAt>) {
    let (mut listed, mut last) = (false, String::new());
    loop {
        let (phase, s) = (reader.phase(), reader.stats());
        listed |= phase == SyncPhase::Listing;
        let line = format!(
            "phase {phase:?} pages {} fetched {}",
            s.metadata_pages, s.bodies_fetched
        );
        if line != last {
            println!("{line}");
            last = line;
        }
        let hit = match kill {
            Some(KillAt::Pages(n)) => phase == SyncPhase::Listing && s.metadata_pages >= n,
            Some(KillAt::Sweeping) => phase == SyncPhase::Sweeping,
            Some(KillAt::Synced) => listed && phase == SyncPhase::Synced,
            None => false,
        };
        if hit {
            println!("killed in {phase:?}");
            // SAFETY: kill(2) on this process's own pid; it does not return.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A delta-store child process and its lines; killed when dropped if still running.
pub struct Proc {
    pub child: std::process::Child,
    pub lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    pub fn spawn(server: &Server, dir: &Path, kill: KillAt) -> Proc {
        let kill = kill.encode();
        let env = [(KILL_ENV, kill.as_str())];
        let (child, lines) = spawn_role(CHILD_ROLE, dir, &server.kubeconfig, &env);
        Proc { child, lines }
    }

    pub fn printed(&self, pred: impl Fn(&[String]) -> bool) -> bool {
        pred(&self.lines.lock().unwrap())
    }

    pub fn last_line(&self) -> String {
        common::last_line(&self.lines)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `phase <p> pages <n> ...` lines: (phase, metadata pages).
pub fn phase_line(l: &str) -> Option<(&str, u64)> {
    let rest = l.strip_prefix("phase ")?;
    let mut f = rest.split(' ');
    let phase = f.next()?;
    (f.next()? == "pages").then_some(())?;
    Some((phase, f.next()?.parse().ok()?))
}

/// Whether the child reached `Synced` after a `Listing` (its relist ended).
pub fn synced_after_listing(lines: &[String]) -> bool {
    let mut phases = lines.iter().filter_map(|l| phase_line(l));
    phases.any(|(p, _)| p == "Listing") && phases.any(|(p, _)| p == "Synced")
}
