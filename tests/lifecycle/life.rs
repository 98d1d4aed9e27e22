//! A run's life in the lifecycle model: its `Db` (with a busy second stream), its start
//! (the controller, the shared stream's consumers, the side stream), restart and graceful
//! stop, and the checks at quiescence after every step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube_persist::Db;
use rand::Rng;

use super::{Live, Model, Poke, delta, ready_outside};
use crate::app;
use crate::checks::{self, Found, Rec, RunChecks};
use crate::select::Meta;

impl Model {
    pub(super) fn sink(&self, run: usize) -> app::Sink {
        let log = self.log.clone();
        Arc::new(move |seen, meta: &Meta| {
            let mut log = log.lock().unwrap();
            let rec = Rec {
                seen,
                at: Instant::now(),
                run,
                name: meta.name.clone(),
                rv: meta.rv.clone(),
                meta: meta.clone(),
            };
            log.push(rec);
        })
    }

    pub(super) async fn open_db(&mut self) -> &Db {
        if self.db.is_none() {
            let db = self
                .cfg
                .open_db(self.engine, self.dir.path())
                .expect("open the store");
            // A second stream on the same Db, so that the disk thread has other work queued.
            let api = Api::<Pod>::all(self.server.client());
            let (_, watcher) = db
                .store("busy", api, kube_persist::StreamConfig::default())
                .unwrap();
            self.db = Some((db, tokio::spawn(watcher.run())));
        }
        &self.db.as_ref().unwrap().0
    }

    pub(super) async fn close_db(&mut self) {
        self.stop_side().await;
        if let Some((db, busy)) = self.db.take() {
            busy.abort();
            let _ = busy.await;
            db.flush().unwrap();
        }
    }

    /// A new run of the controller in this process, at once.
    pub(super) async fn start_run(&mut self) {
        self.run += 1;
        self.run_started_at_step = self.history.len();
        self.rc = RunChecks {
            owned_upto: self.log.lock().unwrap().len(),
            ..RunChecks::default()
        };
        // Requests queued in a run that stopped are lost with it, as in kube-runtime; a tick
        // whose pass it stopped is not (`recreate.rs`).
        self.carry_ticks();
        self.churned = None;
        let client = self.cfg.client(&self.server.url());
        let (cfg, sink) = (self.cfg.clone(), self.sink(self.run));
        self.run_faults();
        self.open_db().await;
        self.open_side(client.clone()).await;
        let db = &self.db.as_ref().expect("open").0;
        let mut refused = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        let (requests, requests_rx) = futures::channel::mpsc::unbounded();
        let (ticks, ticks_rx) = futures::channel::mpsc::unbounded();
        let mut inputs = Some(app::Inputs {
            requests: requests_rx.boxed(),
            ticks: ticks_rx.boxed(),
        });
        let c = loop {
            let i = inputs.take().unwrap_or_else(app::Inputs::none);
            match app::controller(db, client.clone(), &cfg, i) {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    refused.get_or_insert(e.to_string());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("the controller does not open: {e}"),
            }
        };
        if let Some(e) = refused {
            self.report(
                self.step,
                Found {
                    invariant: "a stream and controller reopen in the same Db at once",
                    detail: format!("refused at first (then opened on a retry): {e}"),
                },
            );
        }
        let reader = c.0.store();
        let stats = c.0.stats();
        let consumed = Arc::new(app::Consumed::new(cfg.sel));
        let view = delta::RunView::open(&reader, &consumed);
        self.history.push(format!(
            "(run {} opens {:?}, ready {})",
            self.run,
            reader.phase(),
            reader.is_ready()
        ));
        let outside = tokio::spawn(app::outside_at_ready(reader.clone(), cfg));
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(app::run(c, client, sink, consumed.clone(), async move {
            let _ = rx.await;
        }));
        self.live = Some(Live {
            reader,
            requests,
            ticks,
            stats,
            task,
            stop,
            outside_at_ready: Some(outside),
            view,
            consumed,
            started: Instant::now(),
        });
    }

    pub(super) async fn restart(&mut self, _step: usize) {
        self.restarts += 1;
        self.start_run().await;
        // Half the restarts get a trigger at once: during the startup pass or the wait for
        // the store to catch up.
        if self.rng.random_bool(0.5) {
            let poke = Poke::draw(&mut self.rng);
            self.history.push(format!("(at start: {poke:?})"));
            self.poke(poke).await;
        }
    }

    pub(super) async fn stop_graceful(&mut self, step: usize) {
        let live = self.live.take().expect("a run");
        let _ = live.stop.send(());
        let mut task = live.task;
        if tokio::time::timeout(Duration::from_secs(20), &mut task)
            .await
            .is_err()
        {
            self.report(
                step,
                Found {
                    invariant: "a graceful stop finishes",
                    detail: "the controller still ran 20 s after its shutdown signal".into(),
                },
            );
            task.abort();
            let _ = task.await;
        }
    }

    /// The invariants, once the server is quiescent (nothing changes it during the check).
    pub(super) async fn check(&mut self, step: usize) {
        let Some(live) = &mut self.live else { return };
        let reader = live.reader.clone();
        let consumed = live.consumed.clone();
        let run_started = live.started;
        let at_ready = match live.outside_at_ready.take_if(|t| t.is_finished()) {
            Some(t) => t.await.ok().flatten(),
            None => None,
        };
        if let Some(n) = at_ready.filter(|n| *n > 0) {
            self.report(step, ready_outside(n));
        }
        if let Some((at, rv)) = self.churned.take()
            && let Some(f) = checks::watch_not_held(&reader, at, &rv).await
        {
            self.report(step, f);
        }
        let cfg = self.cfg.clone();
        let t = Instant::now();
        let quiet = self.quiesce(&reader, &cfg).await;
        self.timed("quiesce", t);
        match quiet {
            Err(f) => self.report(step, f),
            Ok(()) => {
                let since = Instant::now();
                let server = checks::server_objects(&self.h);
                for f in checks::store_matches(&reader, &cfg, &server) {
                    self.report(step, f);
                }
                for f in checks::async_reads_match(&reader).await {
                    self.report(step, f);
                }
                self.timed("store checks", since);
                // The controller's, the consumers' and the side stream's checks wait (for
                // reconciles, a slow consumer, the side store) side by side.
                let t = Instant::now();
                let log = self.log.clone();
                let mut rc = std::mem::take(&mut self.rc);
                let mut triggers = std::mem::take(&mut self.triggers);
                let db = self.db.as_ref().map(|(db, _)| db.clone());
                let controller = async {
                    let mut out = checks::reconciled(&log, &cfg, &server, since, &mut rc).await;
                    out.extend(checks::triggered(&log, &cfg, &server, &mut triggers).await);
                    if let Some(db) = &db {
                        out.extend(checks::records(db, &reader).await);
                    }
                    out
                };
                let consumers = async {
                    let started = checks::consumers_started(&consumed, run_started).await;
                    let mut out: Vec<Found> = started.into_iter().collect();
                    out.extend(checks::consumers_hold(&consumed, &cfg, &server).await);
                    out
                };
                let ((a, ta), (b, tb), (c, tc)) =
                    tokio::join!(took(controller), took(consumers), took(self.side_found()));
                for (what, d) in [("(controller)", ta), ("(consumers)", tb), ("(side)", tc)] {
                    *self.timing.entry(what).or_default() += d;
                }
                self.rc = rc;
                for f in a.into_iter().chain(b).chain(c) {
                    self.report(step, f);
                }
                self.timed("checks after quiescence", t);
                self.check_delta(step);
            }
        }
        if let Some(f) = checks::given_outside(&consumed) {
            self.report(step, f);
        }
        let mut rc = std::mem::take(&mut self.rc);
        let found = checks::owned_only(&self.log, self.run, &cfg, &mut rc);
        self.rc = rc;
        for f in found {
            self.report(step, f);
        }
    }
}

/// What `f` found, and how long it took.
async fn took(f: impl std::future::Future<Output = Vec<Found>>) -> (Vec<Found>, Duration) {
    let t = Instant::now();
    let out = f.await;
    (out, t.elapsed())
}
