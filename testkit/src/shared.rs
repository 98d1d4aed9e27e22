//! State shared by the HTTP handlers, watch tasks and handles.

use std::sync::{Mutex, MutexGuard};

use tokio::sync::watch;

use crate::ServerOptions;
use crate::faults::FaultState;
use crate::resource::Counters;
use crate::state::State;

/// Everything one server instance owns.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    faults: Mutex<FaultState>,
    /// Carries the current revision; watches wait on it for new events.
    pub rev_tx: watch::Sender<u64>,
    /// Bumped to close every open watch stream (and on shutdown).
    pub close_tx: watch::Sender<u64>,
    pub counters: Counters,
    pub opts: ServerOptions,
}

impl Shared {
    pub(crate) fn new(opts: ServerOptions) -> Self {
        Self {
            state: Mutex::new(State::new(opts.history, opts.opaque_resource_versions)),
            faults: Mutex::new(FaultState::default()),
            rev_tx: watch::channel(0).0,
            close_tx: watch::channel(0).0,
            counters: Counters::default(),
            opts,
        }
    }

    /// Locks the data (recovering from a poisoned lock: state stays consistent per write).
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the fault settings.
    pub(crate) fn faults(&self) -> MutexGuard<'_, FaultState> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs a write under the lock and wakes watches if the revision moved.
    pub(crate) fn write<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let (out, rev) = {
            let mut st = self.state();
            let out = f(&mut st);
            (out, st.revision)
        };
        self.rev_tx.send_if_modified(|r| {
            let changed = *r != rev;
            *r = rev;
            changed
        });
        out
    }

    /// Waits until the revision reaches `rev`, at most [`ServerOptions::too_large_wait`];
    /// `Err(current revision)` on timeout.
    pub(crate) async fn wait_for_revision(&self, rev: u64) -> Result<(), u64> {
        let mut rx = self.rev_tx.subscribe();
        if self.state().revision >= rev {
            return Ok(());
        }
        let waited = tokio::time::timeout(self.opts.too_large_wait, rx.wait_for(|r| *r >= rev));
        match waited.await {
            Ok(Ok(_)) => Ok(()),
            _ => {
                let current = self.state().revision;
                if current >= rev { Ok(()) } else { Err(current) }
            }
        }
    }

    /// Ends every open watch stream.
    pub(crate) fn close_watches(&self) {
        self.close_tx.send_modify(|e| *e += 1);
    }
}
