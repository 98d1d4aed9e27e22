//! The reader-beside operation of the lifecycle model: another handle opens the live run's
//! store read-only, as the `kube-persist` tool does (`kubectl exec` beside an operator), and
//! verifies it against the server.

use kube_persist::{Db, Engine, Error, Verdict};

use super::Model;
use crate::app::STREAM;
use crate::checks;

impl Model {
    /// With redb and every batch durable, a read-only handle opens beside the live writer
    /// and `verify_at` never reports a difference (a store that moved under it is verified
    /// again); with periodic durability it is refused at once (`Error::Locked`), and so is
    /// the tool's open of a sled store (for writing: sled has no read-only mode).
    /// Either way the run goes on: the checks after the step see it in sync.
    pub(super) async fn read_beside(&mut self, step: usize) {
        if self.live.is_none() {
            return;
        }
        let dir = self.dir.path().to_path_buf();
        let shared = self.engine == Engine::Redb && self.cfg.flush_ms == 0;
        let at = dir.clone();
        // As the tool opens it: redb read-only; sled, which has no read-only mode, for writing.
        let config = match self.engine {
            Engine::Redb => self.cfg.read_only_config(),
            _ => self.cfg.db_config(self.engine),
        };
        let opened = tokio::task::spawn_blocking(move || Db::open_with(&at, config).map(drop))
            .await
            .expect("the reader's open");
        self.history.push(format!(
            "(reader beside {}: {})",
            if shared {
                "an every-batch redb writer"
            } else {
                "an exclusive writer"
            },
            match &opened {
                Ok(()) => "opened".to_string(),
                Err(e) => format!("{e}").chars().take(40).collect(),
            }
        ));
        let found = match (shared, opened) {
            (true, Ok(())) | (false, Err(Error::Locked { .. })) => None,
            (true, Err(e)) => Some(("a reader opens beside an every-batch writer", e.to_string())),
            (false, Ok(())) => Some((
                "a reader is refused beside an exclusive writer",
                "it opened".to_string(),
            )),
            (false, Err(e)) => Some((
                "a reader beside an exclusive writer is Locked",
                e.to_string(),
            )),
        };
        if let Some((invariant, detail)) = found {
            return self.report(step, checks::found(invariant, detail));
        }
        if !shared {
            return;
        }
        let verified = Db::verify_at(
            &dir,
            self.cfg.read_only_config(),
            STREAM,
            self.server.client(),
            5,
        )
        .await;
        self.history.push(format!(
            "(verify beside: {})",
            match &verified {
                Ok(v) => format!("{:?}", v.verdict),
                Err(e) => format!("{e}").chars().take(60).collect(),
            }
        ));
        match verified {
            Ok(v) if v.verdict == Verdict::Differs => self.report(
                step,
                checks::found(
                    "verify beside the writer finds no difference",
                    format!("{v:?}"),
                ),
            ),
            // Equal, behind, compacted; or not synced yet, or moving on every attempt.
            Ok(_) | Err(Error::NotVerifiable { .. }) => {}
            Err(e) => self.report(
                step,
                checks::found("verify beside the writer runs", e.to_string()),
            ),
        }
    }
}
