//! The lowest layer: plain values every other layer speaks in, with no I/O of their own.
//!
//! The crate's [`Error`], the storage [`Engine`] as a value, the sharding of a collection
//! ([`Shard`], [`Shard::hash`]), the one ordering of resourceVersions ([`resource_version`]),
//! a stream's counters ([`Stats`], `Counters`) and the JSON decoders shared by the read and
//! write paths (`json`, and `lean` for a decode that only validates).
//!
//! May import: nothing of the crate (std and dependencies only).

mod engine;
mod error;
mod error_kind;
mod histogram;
mod json;
mod lean;
pub mod resource_version;
mod shard;
mod stats;

pub use engine::Engine;
pub use error::{Error, RequestKind, Result};
pub use error_kind::ErrorKind;
pub(crate) use histogram::Histogram;
#[cfg(feature = "metrics")]
pub(crate) use histogram::HistogramSnapshot;
pub(crate) use json::{decode_copy, decode_in_place, decode_lean, describe, unnamed};
#[cfg(test)]
pub(crate) use lean::without_fields_v1 as lean_fields_v1;
pub(crate) use shard::fnv1a64;
pub use shard::{Shard, ShardKey};
pub(crate) use stats::Counters;
pub use stats::Stats;
