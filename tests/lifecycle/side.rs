//! The side stream of the lifecycle model: a second ConfigMap stream in the run's `Db`, of
//! a configuration of its own drawn from the part of the matrix the controller's stream
//! cannot take (a controller reads whole objects): keys-only and metadata-only stores (and
//! whole ones), each with its own label and field selectors, uid shard, transform,
//! streaming lists, page size and relist mode (drawn again at every reopen). It runs beside
//! each run in this process (a killed child leaves it waiting in the `Db`), with a consumer
//! that takes every event of its watcher at once.
//!
//! Invariants, once quiescent: the store is `Synced` and live at the server's version and
//! equals the server's selection object by object (keys-only: its length, and a verify by
//! key and resourceVersion); what the consumer holds equals it too (it reads the store
//! again at `Resumed` and `Init`, as a consumer does; a keys-only consumer has no store to
//! read and is not checked so); no event ever gives the consumer an object outside the
//! selection (by the object's own metadata); and a transformed store holds only
//! transformed objects.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::core::PartialObjectMeta;
use kube_persist::{Db, Event, Reader, RelistMode, StreamConfig, SyncPhase, Verdict, Watcher};
use rand::Rng;
use tokio::task::JoinHandle;

use super::Model;
use crate::app::NS;
use crate::checks::{self, Found, found};
use crate::select::{Fields, Labels, Meta, Sel, TRANSFORM};

/// The side stream's name in the `Db`.
pub const SIDE: &str = "side";

/// What a side store keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Whole,
    KeysOnly,
    MetadataOnly,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Whole => "whole",
            Kind::KeysOnly => "keys-only",
            Kind::MetadataOnly => "metadata-only",
        }
    }
}

/// The side stream's configuration.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SideCfg {
    kind: Kind,
    sel: Sel,
    transform: bool,
    streaming: bool,
    page: u32,
    pub(super) relist: RelistMode,
}

impl std::fmt::Display for SideCfg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} of {}{}{}, page {}, {:?}",
            self.kind,
            self.sel,
            if self.transform { ", transformed" } else { "" },
            if self.streaming { ", streaming" } else { "" },
            self.page,
            self.relist
        )
    }
}

impl SideCfg {
    /// A configuration of the matrix; `created` objects so far (a field selector may name
    /// one of them).
    pub(super) fn draw(r: &mut rand::rngs::StdRng, created: usize) -> SideCfg {
        let kind = [Kind::Whole, Kind::KeysOnly, Kind::MetadataOnly][r.random_range(0..3)];
        let shard = match r.random_range(0..4) {
            0 => Some((r.random_range(0..2), 2)),
            1 => Some((r.random_range(0..3), 3)),
            _ => None,
        };
        SideCfg {
            kind,
            sel: Sel {
                labels: Labels::draw(r),
                fields: Fields::draw(r, created),
                shard,
            },
            transform: r.random_bool(0.4),
            streaming: r.random_bool(0.3),
            page: r.random_range(5..60),
            relist: super::delta::draw_mode(r),
        }
    }

    /// This run's stream configuration.
    fn config(&self) -> StreamConfig {
        let mut c = StreamConfig::default()
            .page_size(self.page)
            .relist_mode(self.relist)
            .backoff(Duration::from_millis(20), Duration::from_millis(300))
            .relist_jitter(Duration::from_millis(20));
        if self.streaming {
            c = c.streaming_lists();
        }
        c = self.sel.apply(c);
        if self.transform {
            c = c.transform(TRANSFORM, crate::select::transform);
        }
        if self.kind == Kind::KeysOnly {
            c = c.keys_only();
        }
        c
    }
}

/// The side store's reader: of whole objects (also keys-only, which reads none) or of
/// their metadata.
enum SideReader {
    Whole(Reader<ConfigMap>),
    Metadata(Reader<PartialObjectMeta<ConfigMap>>),
}

impl SideReader {
    fn status(&self) -> (SyncPhase, bool, Option<String>) {
        match self {
            SideReader::Whole(r) => (r.phase(), r.is_live(), r.checkpoint()),
            SideReader::Metadata(r) => (r.phase(), r.is_live(), r.checkpoint()),
        }
    }

    fn len(&self) -> usize {
        match self {
            SideReader::Whole(r) => r.len(),
            SideReader::Metadata(r) => r.len(),
        }
    }

    /// `name -> metadata` of the stored objects (`None`: keys-only, nothing to read).
    fn objects(&self, kind: Kind) -> Option<BTreeMap<String, Meta>> {
        let meta = |m: Meta| (m.name.clone(), m);
        Some(match self {
            SideReader::Whole(_) if kind == Kind::KeysOnly => return None,
            SideReader::Whole(r) => r
                .iter()
                .filter_map(|o| o.ok())
                .map(|c| {
                    let blob = c.data.as_ref().is_some_and(|d| d.contains_key("blob"));
                    meta(Meta::of(&c.metadata, blob))
                })
                .collect(),
            SideReader::Metadata(r) => r
                .iter()
                .filter_map(|o| o.ok())
                .map(|c| meta(Meta::of(&c.metadata, false)))
                .collect(),
        })
    }
}

/// What the side stream's consumer saw.
#[derive(Default)]
struct Seen {
    /// `name -> resourceVersion` of what it holds.
    held: Mutex<BTreeMap<String, String>>,
    /// Objects it was given outside the selection.
    outside: Mutex<Vec<String>>,
}

/// The side stream of a run.
pub(super) struct Side {
    cfg: SideCfg,
    reader: Arc<SideReader>,
    task: JoinHandle<()>,
    seen: Arc<Seen>,
}

/// Takes every event of `watcher`: what the consumer holds (read again from `read` at
/// `Init` and `Resumed`), and what it was given outside `sel`.
async fn consume<K>(
    watcher: Watcher<K>,
    read: impl Fn() -> Option<BTreeMap<String, String>> + Send,
    sel: Sel,
    seen: Arc<Seen>,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let mut events = std::pin::pin!(watcher.stream());
    let reread = || {
        if let Some(now) = read() {
            *seen.held.lock().unwrap() = now;
        }
    };
    while let Some(ev) = events.next().await {
        let Ok(ev) = ev else { continue };
        match ev {
            Event::Init | Event::Resumed { .. } => reread(),
            Event::InitDone => {}
            Event::Apply(o) | Event::InitApply(o) => {
                let m = Meta::of(o.meta(), false);
                if !sel.selects(&m) {
                    seen.outside.lock().unwrap().push(format!(
                        "{} at {} (tier {:?}, mode {:?}, uid {})",
                        m.name, m.rv, m.tier, m.mode, m.uid
                    ));
                }
                seen.held.lock().unwrap().insert(m.name, m.rv);
            }
            Event::Delete(o) => {
                let name = o.meta().name.clone().unwrap_or_default();
                seen.held.lock().unwrap().remove(&name);
            }
            Event::DeleteKey(k) => {
                seen.held.lock().unwrap().remove(&k.name);
            }
            _ => panic!("an event this test does not know"),
        }
    }
}

fn versions(objects: &BTreeMap<String, Meta>) -> BTreeMap<String, String> {
    objects
        .iter()
        .map(|(k, m)| (k.clone(), m.rv.clone()))
        .collect()
}

impl Side {
    /// Opens the side stream of `cfg` in `db` and its consumer.
    fn open(db: &Db, client: kube::Client, cfg: SideCfg) -> kube_persist::Result<Side> {
        let api = Api::<ConfigMap>::namespaced(client, NS);
        let seen = Arc::new(Seen::default());
        let (sel, kind) = (cfg.sel, cfg.kind);
        let (reader, task) = match kind {
            Kind::MetadataOnly => {
                let (r, w) = db.metadata_store(SIDE, api, cfg.config())?;
                let reader = Arc::new(SideReader::Metadata(r));
                let read = reader.clone();
                let read = move || read.objects(kind).map(|o| versions(&o));
                (reader, tokio::spawn(consume(w, read, sel, seen.clone())))
            }
            _ => {
                let (r, w) = db.store(SIDE, api, cfg.config())?;
                let reader = Arc::new(SideReader::Whole(r));
                let read = reader.clone();
                let read = move || read.objects(kind).map(|o| versions(&o));
                (reader, tokio::spawn(consume(w, read, sel, seen.clone())))
            }
        };
        let now = reader.objects(kind).map(|o| versions(&o));
        *seen.held.lock().unwrap() = now.unwrap_or_default();
        Ok(Side {
            cfg,
            reader,
            task,
            seen,
        })
    }

    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }

    /// The side stream's invariants, once the server is quiescent (`server`: its objects).
    async fn check(
        &self,
        db: &Db,
        client: kube::Client,
        h: &kube_persist_testkit::ServerHandle,
    ) -> Vec<Found> {
        let mut out = Vec::new();
        let deadline = Instant::now() + checks::SYNC_WAIT;
        loop {
            let server = h.resource_version();
            let (phase, live, at) = self.reader.status();
            if phase == SyncPhase::Synced && live && at.as_deref() == Some(&server) {
                break;
            }
            if Instant::now() > deadline {
                out.push(found(
                    "the side stream is Synced and live at the server's resourceVersion",
                    format!(
                        "{}: phase {phase:?}, live {live}, checkpoint {at:?}, server {server}",
                        self.cfg
                    ),
                ));
                return out;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let server = checks::server_objects(h);
        let want: BTreeMap<String, String> = server
            .iter()
            .filter(|(_, o)| self.cfg.sel.selects(&o.meta))
            .map(|(n, o)| (n.clone(), o.rv.clone()))
            .collect();
        match self.reader.objects(self.cfg.kind) {
            Some(stored) => {
                let have = versions(&stored);
                if have != want {
                    out.push(found(
                        "the side store equals the server's selection",
                        format!(
                            "{}: {}",
                            self.cfg,
                            crate::common::diff("store", &have, &want)
                        ),
                    ));
                }
                let outside: Vec<&String> = stored
                    .iter()
                    .filter(|(_, m)| !self.cfg.sel.selects(m))
                    .map(|(k, _)| k)
                    .collect();
                if !outside.is_empty() {
                    out.push(found(
                        "no side store holds an object outside its selection",
                        format!("{}: {outside:?}", self.cfg),
                    ));
                }
                let raw: Vec<&String> = stored
                    .iter()
                    .filter(|(_, m)| self.cfg.transform && (!m.transformed || m.has_blob))
                    .map(|(k, _)| k)
                    .collect();
                if !raw.is_empty() {
                    out.push(found(
                        "every stored object went through the transform",
                        format!("side {}: {raw:?}", self.cfg),
                    ));
                }
            }
            None if self.reader.len() != want.len() => out.push(found(
                "the side store equals the server's selection",
                format!(
                    "{}: {} keys stored, {} selected",
                    self.cfg,
                    self.reader.len(),
                    want.len()
                ),
            )),
            None => {}
        }
        if self.cfg.kind != Kind::KeysOnly {
            // The consumer takes the last events a moment after the store has them.
            let by = Instant::now() + Duration::from_secs(2);
            loop {
                let held = self.seen.held.lock().unwrap().clone();
                if held == want {
                    break;
                }
                if Instant::now() > by {
                    out.push(found(
                        "a consumer of a stream holds exactly its selection once caught up",
                        format!(
                            "side {}: {}",
                            self.cfg,
                            crate::common::diff("held", &held, &want)
                        ),
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let given = std::mem::take(&mut *self.seen.outside.lock().unwrap());
        if !given.is_empty() {
            out.push(found(
                "no consumer of a stream is given an object outside its selection",
                format!(
                    "side {}: {} {:?}",
                    self.cfg,
                    given.len(),
                    &given[..given.len().min(5)]
                ),
            ));
        }
        match db.verify(SIDE, client, 5).await {
            Ok(v) if v.verdict == Verdict::Differs => out.push(found(
                "verify finds no difference in a synced store",
                format!("side {}: {v:?}", self.cfg),
            )),
            _ => {}
        }
        out
    }
}

impl Model {
    /// The side stream of a new run (its relist mode drawn again; the rest as before, or
    /// drawn anew when `redraw`): the one before stopped first.
    pub(super) async fn open_side(&mut self, client: kube::Client) {
        self.stop_side().await;
        let mut cfg = self.side_cfg.clone();
        cfg.relist = super::delta::draw_mode(&mut self.rng);
        self.side_cfg = cfg.clone();
        self.history.push(format!("(side: {cfg})"));
        *self.side_opened.entry(cfg.kind.name()).or_default() += 1;
        let Some((db, _)) = self.db.as_ref() else {
            return;
        };
        match Side::open(db, client, cfg) {
            Ok(side) => self.side = Some(side),
            Err(e) => {
                let f = found("the side stream opens", e.to_string());
                self.report(self.step, f);
            }
        }
    }

    pub(super) async fn stop_side(&mut self) {
        if let Some(side) = self.side.take() {
            side.stop().await;
        }
    }

    /// The side stream's invariants, once the server is quiescent (what they found).
    pub(super) async fn side_found(&self) -> Vec<Found> {
        let (Some(side), Some((db, _))) = (self.side.as_ref(), self.db.as_ref()) else {
            return Vec::new();
        };
        side.check(db, self.server.client(), &self.h).await
    }
}
