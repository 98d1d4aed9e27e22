//! The watch actions: connecting from the checkpoint, and committing bursts of live events
//! while the next burst is read and parsed.

use super::core::Core;
use super::transition::{Returned, Status, WatchBurst};
use super::{Deferred, Held, PendingBurst, WATCH_LINGER};
use crate::exec::compute;
use crate::model::{Error, Result};
use crate::store::Phase;
use crate::sync::conn::{ConnectFailure, Line, WatchConn};
use crate::sync::parse::{Ingest, Parsed};
use crate::sync::raw::{StatusBody, StatusKind};

/// Connect the watch from the checkpoint (the transition asks only for a synced store).
pub(super) async fn connect(core: &mut Core, conn: &mut Option<WatchConn>) -> Result<Returned> {
    let rv = match &core.writer.state.phase {
        Phase::Synced { resource_version } => resource_version.clone(),
        _ => {
            return Err(Error::Protocol {
                context: format!("WATCH {}", core.described()),
                detail: "a watch without a checkpoint".into(),
            });
        }
    };
    let timeout = core
        .catch_up
        .before_connect(&core.client, &core.request, &core.cfg, &core.stats, &rv)
        .await;
    match WatchConn::connect(&core.client, core.target(timeout), &rv, false).await {
        Ok(c) => {
            *conn = Some(c);
            Ok(Returned::Connected)
        }
        Err(failure) => Ok(connect_failed(core, failure)),
    }
}

/// A connect's failure as the transition sees it (its error held for the step).
pub(super) fn connect_failed(core: &mut Core, failure: ConnectFailure) -> Returned {
    let (status, e) = match failure {
        ConnectFailure::Gone => (
            Some(StatusKind::Gone),
            Error::Protocol {
                context: format!("WATCH {}", core.described()),
                detail: "410 Gone".into(),
            },
        ),
        ConnectFailure::TooLarge(e) => (Some(StatusKind::TooLarge), e),
        ConnectFailure::Invalid(e) => (Some(StatusKind::Invalid), e),
        ConnectFailure::Other(e) => (status_of(&e), e),
        ConnectFailure::Fatal(e) => (None, e),
    };
    let returned = Returned::Failed {
        status,
        fatal: e.stops_watcher(),
        detail: e.to_string(),
    };
    core.error = Some(e);
    returned
}

/// The class of a failed request's status ([`StatusKind::of`]), if the server answered one.
pub(super) fn status_of(e: &Error) -> Option<StatusKind> {
    match e {
        Error::Kube {
            source: kube::Error::Api(s),
            ..
        } => Some(StatusKind::of(s.code, crate::sync::conn::is_too_large(s))),
        _ => None,
    }
}

/// The error of a watch's `ERROR` event.
pub(super) fn watch_status(core: &Core, status: StatusBody) -> Error {
    Error::WatchStatus {
        url: core.described(),
        resource_version: core.writer.state.last_synced.clone().unwrap_or_default(),
        code: status.code,
        reason: status.reason,
        message: status.message,
    }
}

/// Parse a burst of live watch lines on the CPU threads (CPU only, no disk), so that
/// the disk thread only commits and a burst is parsed while the one before is written.
async fn parse(ingest: Ingest, lines: Vec<Line>) -> Result<Parsed> {
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
pub(super) async fn read(core: &mut Core, held: &mut Held) -> Result<Returned> {
    let Some(conn) = held.conn.as_mut() else {
        return Err(Error::Protocol {
            context: format!("WATCH {}", core.described()),
            detail: "no connection to read from".into(),
        });
    };
    let max = core.cfg.page_size as usize;
    let (mut parsed, ended) = this_burst(core, conn, std::mem::take(&mut held.deferred)).await?;
    if let Some(why) = parsed.lost.take() {
        // Nothing of this burst is committed: the checkpoint stays before the lost event.
        return Ok(Returned::Watch(WatchBurst {
            lost: Some(why),
            ..WatchBurst::default()
        }));
    }
    let ops = std::mem::take(&mut parsed.ops);
    let (last_rv, checkpoint) = (
        parsed.last_rv.clone(),
        core.writer.state.last_synced.clone(),
    );
    let emit = core.emit;
    let commit = core.writer.start(move |w| {
        let moved = last_rv.is_some();
        match last_rv.or(checkpoint) {
            Some(rv) if !ops.is_empty() || moved => w.watch_burst(ops, rv, emit),
            _ => Ok(Vec::new()),
        }
    });
    let mut commit = std::pin::pin!(commit);
    let read_on = parsed.error.is_none() && !ended;
    let ingest = core.ingest.clone();
    let (done, ahead) = if read_on {
        tokio::select! {
            biased;
            done = &mut commit => (done, None),
            // Cancel-safe: if the commit ends first, lines read so far stay in `conn`.
            burst = conn.burst(max, None, WATCH_LINGER) => match burst {
                Ok(b) => {
                    let (done, next) = tokio::join!(&mut commit, parse(ingest, b.lines));
                    (done, Some(next.map(|parsed| PendingBurst { parsed, ended: b.ended })))
                }
                Err(e) => (commit.await, Some(Err(e))),
            },
        }
    } else {
        (commit.await, None)
    };
    let changes = core.writer.finish(done)?;
    core.push_changes(changes);
    core.push_rejected(std::mem::take(&mut parsed.rejected));
    Ok(Returned::Watch(committed(core, held, parsed, ended, ahead)))
}

/// The burst to commit: the one parsed ahead, the lines a streaming list left, or the next
/// one read from `conn`; and whether the server ended the stream after it.
async fn this_burst(
    core: &Core,
    conn: &mut WatchConn,
    deferred: Deferred,
) -> Result<(Parsed, bool)> {
    Ok(match deferred {
        Deferred::Parsed(ahead) => (ahead.parsed, ahead.ended),
        Deferred::Lines(lines) => (parse(core.ingest.clone(), lines).await?, false),
        Deferred::Nothing => {
            let burst = conn
                .burst(core.cfg.page_size as usize, None, WATCH_LINGER)
                .await?;
            (parse(core.ingest.clone(), burst.lines).await?, burst.ended)
        }
    })
}

/// What a committed burst returned; the burst read ahead (or its failure) is kept in `held`.
fn committed(
    core: &mut Core,
    held: &mut Held,
    parsed: Parsed,
    ended: bool,
    ahead: Option<Result<PendingBurst>>,
) -> WatchBurst {
    if let Some(checkpoint) = &core.writer.state.last_synced {
        core.catch_up.after_burst(checkpoint, parsed.bookmarks);
    }
    let mut out = WatchBurst {
        delivered: parsed.delivered,
        ended,
        ..WatchBurst::default()
    };
    if let Some(status) = parsed.error {
        out.status = Some(Status {
            kind: status.kind(),
            detail: format!("{} {} ({})", status.code, status.reason, status.message),
        });
        core.error = Some(watch_status(core, status));
        return out;
    }
    if ended {
        let ended_after = held.conn.as_ref().and_then(|c| c.ended_after());
        if let (Some((lasted, quiet)), Some(checkpoint)) =
            (ended_after, &core.writer.state.last_synced)
        {
            core.catch_up.watch_ended(checkpoint, lasted, quiet);
        }
        tracing::debug!(stream = %core.stream, url = %core.url(), "watch stream ended; reconnecting from the checkpoint");
        return out;
    }
    match ahead.transpose() {
        Ok(Some(ahead)) => held.deferred = Deferred::Parsed(Box::new(ahead)),
        Ok(None) => {}
        Err(e) => {
            core.error = Some(e);
            out.ahead_failed = true;
        }
    }
    out
}
