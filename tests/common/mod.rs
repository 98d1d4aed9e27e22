//! Helpers shared by the integration tests (`tests/it`, the binaries apart, the e2e suite
//! and the tool's tests include this folder), one file per purpose:
//!
//! - `fixture.rs`: [`Fixture`], what a test starts with: a testkit server and a store
//!   directory;
//! - `server.rs`: the server's side: seeded Pods, changes, what it holds, HTTP requests;
//! - `store.rs`: stores on disk: opened, synced once, compared with the server;
//! - `events.rs`: a watcher driven on a task and its events, compact for assertions;
//! - `wait.rs`: polling until a condition holds, with a deadline;
//! - `disk.rs`: behind kube-persist's back: raw engine edits, file locks, tmpfs mounts;
//! - `child.rs`: this test binary as a child process, and what it prints;
//!
//! and here, what every test binary uses: `engine_tests!`, tracing, seeds of randomized
//! tests.
// Every binary that includes this folder uses a part of it (the re-exports below included).
#![allow(dead_code, unused_imports)]

mod child;
mod disk;
mod events;
mod fixture;
pub mod metric_names;
mod server;
mod store;
mod wait;

pub use child::*;
pub use disk::*;
pub use events::*;
pub use fixture::*;
pub use kube_persist::Engine;
pub use server::*;
pub use store::*;
pub use wait::*;

/// Runs each named scenario (`async fn name(engine: Engine)` or `fn name(engine: Engine)`)
/// once per storage engine, as tests `sled::name` and `redb::name`.
#[macro_export]
macro_rules! engine_tests {
    (async: $($a:ident),* $(,)? ; sync: $($s:ident),* $(,)?) => {
        $crate::engine_tests!(@mod sled, Sled, [$($a),*], [$($s),*]);
        $crate::engine_tests!(@mod redb, Redb, [$($a),*], [$($s),*]);
    };
    (async: $($a:ident),* $(,)?) => { $crate::engine_tests!(async: $($a),*; sync: ); };
    (@mod $m:ident, $engine:ident, [$($a:ident),*], [$($s:ident),*]) => {
        mod $m {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $a() {
                    super::$a(kube_persist::Engine::$engine).await
                }
            )*
            $(
                #[test]
                fn $s() {
                    super::$s(kube_persist::Engine::$engine)
                }
            )*
        }
    };
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kube_persist=info,warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A number from the environment (seeds, step counts).
pub fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// The seed of a randomized test. `name` set to a number replays that seed; set to `random`
/// it asks for a fresh random seed; otherwise (unset) the fixed `default`, so that a plain
/// `cargo test` runs the same schedule every time. Print the result with [`SeedReport`].
pub fn test_seed(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) if v.trim().eq_ignore_ascii_case("random") => {
            use rand::Rng;
            rand::rng().random()
        }
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            panic!("{name}={v:?}: expected a number (a seed to replay) or `random`")
        }),
        Err(_) => default,
    }
}

/// Prints how to replay a randomized test when it fails: keep it alive for the whole test;
/// if the test panics, dropping it (while unwinding) prints `what` to stderr.
pub struct SeedReport(pub String);

impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("FAILED with {}", self.0);
        }
    }
}
