//! Where work runs: the process-wide CPU threads and each directory's disk thread with its
//! page budget (`worker.rs`).
//!
//! May import: `model`.

mod worker;

#[cfg(test)]
pub(crate) use worker::pages_in_flight;
pub(crate) use worker::{DiskWorker, ListingGuard, PagePermit, Threads, compute, cpu, cpu_threads};
