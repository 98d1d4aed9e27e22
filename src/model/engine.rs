//! Which embedded database a store directory is kept in: the value only (its name, parsing,
//! display). Telling which engine wrote a directory is the disk layer's (`disk/engine/`).

use crate::model::{Error, Result};

/// The embedded database a store directory is kept in.
///
/// redb is always built; sled is built with the opt-in `sled` cargo feature (off by
/// default: sled 0.34's upstream is dormant, its last release of 2021 and its last commit
/// of May 2025, and it brings two crates RustSec lists as unmaintained), and a build
/// without it refuses a sled store, or [`Engine::Sled`], with [`Error::FeatureNotBuilt`]. Both
/// keep the same invariants (one atomic batch per page or event burst, the checkpoint in
/// the same batch, one process per directory, corruption reported as [`Error::Corrupt`]);
/// they differ in memory, speed and disk use
/// ([BENCHMARKS.md](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#storage-engines-why-redb-is-the-default)).
/// New stores use [`Engine::Redb`] ([`Engine::default`]) unless
/// [`DbConfig::engine`](crate::DbConfig::engine) chooses otherwise.
///
/// A directory remembers which engine wrote it, and [`Db::open`](crate::Db::open) reopens it
/// with that engine; only an explicit [`DbConfig::engine`](crate::DbConfig::engine) naming the other one is
/// [`Error::EngineMismatch`] (never a silent wipe).
///
/// ```
/// use kube_persist::{DbConfig, Engine};
/// assert_eq!(Engine::default(), Engine::Redb);
/// assert_eq!("sled".parse::<Engine>().unwrap(), Engine::Sled);
/// // No choice: a new store gets redb, an existing one keeps the engine that wrote it.
/// assert_eq!(DbConfig::default().get_engine(), None);
/// let cfg = DbConfig::default().engine(Engine::Sled);
/// assert_eq!(cfg.get_engine(), Some(Engine::Sled));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Engine {
    /// [redb](https://docs.rs/redb) 5: the default for new stores. Its memory stays flat under
    /// reads where sled's grows with what was read, it syncs at less than half of sled's
    /// peak, and a warm restart is ready sooner (the figures:
    /// [BENCHMARKS.md, *Storage engines: why redb is the default*](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#storage-engines-why-redb-is-the-default)).
    #[default]
    Redb,
    /// [sled](https://docs.rs/sled) 0.34 (the opt-in `sled` feature): chosen with
    /// `DbConfig::engine(Engine::Sled)`, and used for every store sled wrote. Its page
    /// cache grows with what was read, regardless of
    /// [`DbConfig::cache_capacity`](crate::DbConfig::cache_capacity).
    Sled,
}

impl Engine {
    /// Every engine this crate knows, whether or not this build has it (sled needs the
    /// `sled` feature).
    ///
    /// ```
    /// use kube_persist::Engine;
    /// assert!(Engine::ALL.contains(&Engine::default()));
    /// for engine in Engine::ALL {
    ///     assert_eq!(engine.name().parse::<Engine>().unwrap(), engine);
    /// }
    /// ```
    pub const ALL: [Engine; 2] = [Engine::Sled, Engine::Redb];

    /// The engine's name, as written in a store's `engine` file and accepted by `parse`.
    ///
    /// ```
    /// use kube_persist::Engine;
    /// assert_eq!(Engine::Redb.name(), "redb");
    /// assert_eq!(Engine::Sled.name(), "sled");
    /// assert_eq!(Engine::Sled.to_string(), Engine::Sled.name());
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Engine::Sled => "sled",
            Engine::Redb => "redb",
        }
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Engine {
    type Err = Error;

    fn from_str(s: &str) -> Result<Engine> {
        Engine::ALL
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| Error::UnknownEngine {
                name: s.to_string(),
            })
    }
}
