//! The actions on the local store only: preparing the indexes, a shard's prune, an index
//! build, a list's new epoch and the sweep at its end. Each is one atomic batch on the disk
//! thread.

use super::super::indexers::Decode;
use super::core::Core;
use super::transition::Returned;
use crate::model::Result;

/// Reconcile the configured indexes with those on disk; is a prune pending?
pub(super) async fn prepare(core: &mut Core) -> Result<Returned> {
    let configured = core.cfg.index_names();
    let (build, prune) = core
        .writer
        .run(move |w| {
            Ok((
                w.prepare_indexes(&configured)?,
                w.prune_pending()?.is_some(),
            ))
        })
        .await?;
    Ok(Returned::Prepared { build, prune })
}

/// One chunk of the prune of a narrowed shard (one atomic batch with its cursor).
pub(super) async fn prune(core: &mut Core) -> Result<Returned> {
    let Some(shard) = core.cfg.get_shard().cloned() else {
        return Ok(Returned::Chunk { done: true });
    };
    let page = core.cfg.page_size as usize;
    let done = core.writer.run(move |w| w.prune_step(&shard, page)).await?;
    Ok(Returned::Chunk { done })
}

/// One chunk of an index build, after the key `after`.
pub(super) async fn build_index(core: &mut Core, after: Option<Vec<u8>>) -> Result<Returned> {
    let Some(inspect) = core.ingest.validate.clone() else {
        return Ok(Returned::Indexed { after: None });
    };
    let page = core.cfg.page_size as usize;
    let names = core.cfg.index_names();
    core.writer
        .run(move |w| {
            let last = w.index_chunk(after, page, &|b| {
                inspect(b, Decode::Check).map(|i| i.entries)
            })?;
            if last.is_none() {
                tracing::info!(indexes = ?names, "indexes built");
                w.set_built_indexes(&names)?;
            }
            Ok(Returned::Indexed { after: last })
        })
        .await
}

/// Start a list with a new epoch (whatever it does not see is swept at its end); `init`:
/// give `Init` first.
pub(super) async fn begin_list(core: &mut Core, init: bool) -> Result<Returned> {
    core.status.live(false);
    core.catch_up.list_began();
    core.writer.run(|w| w.begin_list()).await?;
    if init {
        core.push(super::RawEvent::Init);
    }
    Ok(Returned::ListBegun)
}

/// One chunk of the sweep of what the last list did not see.
pub(super) async fn sweep(core: &mut Core) -> Result<Returned> {
    let (page, emit) = (core.cfg.page_size as usize, core.emit);
    let (changes, done) = core.writer.run(move |w| w.sweep_step(page, emit)).await?;
    core.push_changes(changes);
    Ok(Returned::Chunk { done })
}
