//! The integration tests, one module per subject, in one test binary (`cargo test --test
//! it`; one module: `cargo test --test it store::`): each runs against the testkit API
//! server over real HTTP with real stores on disk. A test that needs a process of its own
//! starts this binary again with its name (`common::spawn_self("store::…")`).
//!
//! Apart, in binaries of their own: the suites with their own harness (`fidelity`,
//! `fresh`, `lifecycle`, `e2e`), `layers` (reads the sources, std only) and
//! `watcher_rules` (installs the process's one global tracing subscriber and counts the
//! threads of every commit in the process).

// The helpers every test binary shares (tests/common/); `engine_tests!` for every module below.
#[path = "../common/mod.rs"]
#[macro_use]
mod common;

/// The `deploy/` manifests as the e2e suite reads them (`tests/e2e/deploy.rs`); it includes
/// the example operator (`examples/operator.rs`), which `controller` and `sigterm` run too.
#[path = "../e2e/deploy.rs"]
#[allow(dead_code)]
mod deploy;

use deploy::operator;

mod at_rest;
mod budget;
mod ci_script;
mod controller;
mod crash;
mod damage;
mod debounce;
mod default_features;
mod delta_fetch;
mod delta_relist;
mod delta_seams;
mod deploy_manifests;
mod faults;
mod format_fixture;
mod held_pass;
mod indexes;
mod kube_shapes;
mod list_bound;
mod logs;
#[cfg(feature = "metrics")]
mod metrics;
mod msrv;
mod nonblocking;
mod operator_encryption;
mod pass_restarts;
mod passes;
mod ported_examples;
mod reads;
mod reconcile_state;
mod recreate;
mod relist_seams;
mod restart_relist;
mod shard;
mod shared;
mod sigterm;
mod store;
mod tool_live;
mod triggers;
mod unsafe_code;
mod verify;
