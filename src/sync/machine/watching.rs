//! The watch stage: connecting from the checkpoint, and committing bursts of live events
//! while the next burst is read and parsed.

use super::{Deferred, Machine, PendingBurst, Stage, WATCH_LINGER};
use crate::exec::compute;
use crate::model::{Error, Result};
use crate::store::Phase;
use crate::sync::conn::{ConnectFailure, Line, WatchConn};
use crate::sync::parse::{Ingest, Parsed};
use crate::sync::raw::StatusKind;

impl Machine {
    /// Connect the watch from the checkpoint. A failure ends the watch's healthy period
    /// (see `Pacing::watch_failed`).
    pub(super) async fn connect_watch(&mut self, deferred: Deferred) -> Result<Stage> {
        let next = self.open_watch(deferred).await;
        if next.is_err() {
            self.pacing.watch_failed();
        }
        next
    }

    /// One step of a live watch (see `watch_step`); a failure ends the watch's healthy
    /// period (see `Pacing::watch_failed`).
    pub(super) async fn read_watch(
        &mut self,
        conn: WatchConn,
        deferred: Deferred,
    ) -> Result<Stage> {
        let next = self.watch_step(conn, deferred).await;
        if next.is_err() {
            self.pacing.watch_failed();
        }
        next
    }

    async fn open_watch(&mut self, deferred: Deferred) -> Result<Stage> {
        let rv = match &self.writer.state.phase {
            Phase::Synced { resource_version } => resource_version.clone(),
            _ => return Ok(Stage::Resume),
        };
        let timeout = self
            .catch_up
            .before_connect(&self.client, &self.request, &self.cfg, &self.stats, &rv)
            .await;
        match WatchConn::connect(&self.client, self.target(timeout), &rv, false).await {
            Ok(conn) => {
                self.set_live(true);
                self.pacing.watch_up();
                Ok(Stage::Watching {
                    conn: Some(conn),
                    deferred,
                })
            }
            Err(ConnectFailure::Gone) => self.relist("watch resourceVersion expired (410)").await,
            Err(ConnectFailure::TooLarge(e)) => self.too_large(e).await,
            Err(
                ConnectFailure::Invalid(e) | ConnectFailure::Other(e) | ConnectFailure::Fatal(e),
            ) => Err(e),
        }
    }

    /// A `ResourceVersionTooLarge` answer (HTTP 504 on connect, or an `ERROR` event): a
    /// lagging replica; retry with backoff, and relist once the retries are spent.
    pub(super) async fn too_large(&mut self, err: Error) -> Result<Stage> {
        self.too_large += 1;
        if self.too_large > self.cfg.too_large_retries {
            return self
                .relist("resourceVersion too large, retries exhausted")
                .await;
        }
        Err(err)
    }

    pub(super) fn watch_status(&self, status: crate::sync::raw::StatusBody) -> Error {
        Error::WatchStatus {
            url: self.described(),
            resource_version: self.writer.state.last_synced.clone().unwrap_or_default(),
            code: status.code,
            reason: status.reason,
            message: status.message,
        }
    }

    /// Parse a burst of live watch lines on the CPU threads (CPU only, no disk), so that
    /// the disk thread only commits and a burst is parsed while the one before is written.
    async fn parse_watch(ingest: Ingest, lines: Vec<Line>) -> Result<Parsed> {
        compute(move || ingest.lines(lines, false))
            .await
            .ok_or_else(|| Error::Protocol {
                context: "WATCH".into(),
                detail: "parsing a burst of watch events panicked".into(),
            })
    }

    /// One step of a live watch: commit a burst on the disk thread and, if the next burst
    /// arrives before that commit ends, parse it meanwhile and carry it to the next step
    /// (at most two bursts in memory; their events are emitted in order).
    async fn watch_step(&mut self, mut conn: WatchConn, deferred: Deferred) -> Result<Stage> {
        let max = self.cfg.page_size as usize;
        let (mut parsed, ended) = match deferred {
            Deferred::Parsed(ahead) => (ahead.parsed, ahead.ended),
            Deferred::Lines(lines) => (Self::parse_watch(self.ingest.clone(), lines).await?, false),
            Deferred::Nothing => {
                let burst = conn.burst(max, None, WATCH_LINGER).await?;
                let parsed = Self::parse_watch(self.ingest.clone(), burst.lines).await?;
                (parsed, burst.ended)
            }
        };
        if let Some(why) = parsed.lost.take() {
            // Nothing of this burst is committed: the checkpoint stays before the lost event.
            return self
                .relist(&format!("a watch event could not be read ({why})"))
                .await;
        }
        let ops = std::mem::take(&mut parsed.ops);
        let (last_rv, checkpoint) = (
            parsed.last_rv.clone(),
            self.writer.state.last_synced.clone(),
        );
        let emit = self.emit;
        let commit = self.writer.start(move |w| {
            let moved = last_rv.is_some();
            match last_rv.or(checkpoint) {
                Some(rv) if !ops.is_empty() || moved => w.watch_burst(ops, rv, emit),
                _ => Ok(Vec::new()),
            }
        });
        let mut commit = std::pin::pin!(commit);
        let read_on = parsed.error.is_none() && !ended;
        let ingest = self.ingest.clone();
        let (done, next) = if read_on {
            tokio::select! {
                biased;
                done = &mut commit => (done, None),
                // Cancel-safe: if the commit ends first, lines read so far stay in `conn`.
                burst = conn.burst(max, None, WATCH_LINGER) => match burst {
                    Ok(b) => {
                        let (done, next) = tokio::join!(&mut commit, Self::parse_watch(ingest, b.lines));
                        (done, Some(next.map(|parsed| PendingBurst { parsed, ended: b.ended })))
                    }
                    Err(e) => (commit.await, Some(Err(e))),
                },
            }
        } else {
            (commit.await, None)
        };
        let changes = self.writer.finish(done)?;
        self.push_changes(changes);
        self.push_rejected(std::mem::take(&mut parsed.rejected));
        if let Some(checkpoint) = &self.writer.state.last_synced {
            self.catch_up.after_burst(checkpoint, parsed.bookmarks);
        }
        if parsed.delivered > 0 {
            // A healthy connection: later errors start their backoff from the minimum.
            self.backoff.reset();
            self.too_large = 0;
            self.pacing.watch_progress();
        }
        if let Some(status) = parsed.error {
            match status.kind() {
                StatusKind::Gone => return self.relist("watch ERROR 410 Gone").await,
                StatusKind::TooLarge => return self.too_large(self.watch_status(status)).await,
                StatusKind::Invalid | StatusKind::Refused | StatusKind::Other => {}
            }
            if self.pacing.watch_error() {
                let why = format!(
                    "watch ERROR {} {} ({}) {} times in a row from the same checkpoint",
                    status.code,
                    status.reason,
                    status.message,
                    crate::sync::pacing::WATCH_ERRORS_BEFORE_RELIST
                );
                return self.relist(&why).await;
            }
            return Err(self.watch_status(status));
        }
        if ended {
            if let (Some((lasted, quiet)), Some(checkpoint)) =
                (conn.ended_after(), &self.writer.state.last_synced)
            {
                self.catch_up.watch_ended(checkpoint, lasted, quiet);
            }
            tracing::debug!(stream = %self.stream, url = %self.url(), "watch stream ended; reconnecting from the checkpoint");
            self.set_live(false);
            return Ok(Stage::Watching {
                conn: None,
                deferred: Deferred::Nothing,
            });
        }
        Ok(Stage::Watching {
            conn: Some(conn),
            deferred: match next.transpose()? {
                Some(ahead) => Deferred::Parsed(Box::new(ahead)),
                None => Deferred::Nothing,
            },
        })
    }
}
