//! Bytes on disk, and nothing about Kubernetes: the storage engines behind [`Storage`] and
//! [`Backend`] (`engine/`), the key layout of a keyspace (`keys`), the record envelope and
//! codec (`record`), encryption of bodies (`crypto`), file permissions (`perms`),
//! one writer per keyspace (`lease`) and the directory's options ([`DbConfig`]).
//!
//! May import: `model`, `exec`.

mod config;
mod crypto;
mod engine;
pub(crate) mod keys;
mod lease;
mod perms;
pub(crate) mod record;

pub use config::{Compression, DbConfig, Durability};
pub use crypto::EncryptionKey;
pub(crate) use crypto::{Cipher, StoreKey};
#[cfg(feature = "metrics")]
pub(crate) use engine::OpenReads;
pub(crate) use engine::{
    Backend, CONTROLLERS, Entry, STREAMS, Storage, WriteBatch, check_removable,
    open as open_storage, refuse_foreign, remove_own_files, wait_released,
};
pub(crate) use lease::{LeaseCloser, Leases, Refused, StreamLease};
pub(crate) use perms::{check_owner, create_private_dir, resolve_root, tighten, too_open};
