//! `kube-persist`: look inside, check, measure and remove kube-persist store directories.
//!
//! ```text
//! kube-persist inspect DIR                        streams, kinds, checkpoints, object counts
//! kube-persist stats DIR                          per stream: objects, checkpoint, phase, bytes
//! kube-persist get DIR STREAM [NAMESPACE/]NAME    one object as JSON
//! kube-persist dump DIR STREAM                    every object, one JSON document per line
//! kube-persist verify DIR STREAM [--context NAME] compare a stream with the cluster
//! kube-persist controller-states DIR [--drop NAME] durable controllers' states (or remove one)
//! kube-persist drop-stream DIR STREAM [--yes]     remove one stream (it lists again next start)
//! kube-persist destroy DIR [--yes]                remove a store (the next start lists again)
//! ```
//! Every command takes `-o json` (one JSON document; `dump` prints JSON lines either way).
//! Exit status: 0 yes/done, 1 the answer is no (an object not found, differences found, a
//! removal not confirmed), 2 an error (a usage error too: clap's status). `--help` lists
//! them (`EXIT_STATUS`, and per command where one has its own meaning of 1).
//!
//! Encrypted stores need their key: `--key-file PATH` or the `KUBE_PERSIST_KEY` environment
//! variable (64 hex characters). Stores of either engine (redb or sled) are opened with the
//! engine recorded in them. The reading commands open a redb store read-only: nothing on
//! disk changes, and they work while a controller runs on the store if it writes with
//! `Durability::EveryBatch`. A sled store (no read-only mode), a redb store whose controller
//! uses periodic durability, and the removing commands need the store closed elsewhere.
//! A reading command never keeps a controller from starting: it holds a redb store only
//! while it reads (`dump` a piece of at most 1000 objects or 4 MiB at a time, closed
//! before it is written to stdout; `verify` one page's lookups at a time, closed during its
//! LISTs), and a controller that needs the store to itself waits for readers to close (up
//! to 30 s, `DbConfig::wait_for_readers`). A controller that opens the store meanwhile
//! makes the command's next read fail (exit status 2, "locked").

#![deny(unsafe_code)]

mod admin;
mod read;
mod term;
mod verify;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use kube_persist::{Db, DbConfig, EncryptionKey, Engine};

/// The exit statuses, in the top-level `--help` (`-h` too). They are the statuses `main`
/// returns for [`Failure`] (and clap's for a usage error); tests/cli.rs checks the text
/// against the tool.
const EXIT_STATUS: &str = "\
Exit status:
  0  done, or the answer is yes (also after --help or --version, and when the reader of
     stdout goes away, as with `| head`)
  1  the answer is no: `get` found no such object, `verify` found the store different
     from the cluster or could not tell, a removal was not confirmed (nothing removed)
  2  an error (reported on stderr), a usage error (bad arguments) included, and a store
     locked by a controller";

/// `get`'s exit statuses.
const GET_EXIT_STATUS: &str = "\
Exit status:
  0  the object was printed
  1  the object is not in the stream (a line on stderr, nothing on stdout)
  2  an error";

/// `verify`'s exit statuses (see `verify::passed`).
const VERIFY_EXIT_STATUS: &str = "\
Exit status:
  0  the store equals the server at its checkpoint, or is behind it only by changes newer
     than the checkpoint (the output says which)
  1  the store differs from the server at its checkpoint; or the server no longer has the
     checkpoint (compacted) to tell; or the stream's object count differs from its records
  2  an error, a store locked by a controller (\"locked\") included";

/// The exit statuses of the commands that remove after a confirmation.
const REMOVE_EXIT_STATUS: &str = "\
Exit status:
  0  removed
  1  not confirmed (an answer other than `yes`): nothing removed
  2  an error";

/// `controller-states`' exit statuses: those of a removal with `--drop`.
const CONTROLLER_STATES_EXIT_STATUS: &str = "\
Exit status:
  0  listed, or removed (--drop)
  1  a removal (--drop) not confirmed (an answer other than `yes`): nothing removed
  2  an error";

/// Look inside, check, measure and remove kube-persist store directories.
#[derive(Parser)]
#[command(name = "kube-persist", version, about, long_about = None, after_help = EXIT_STATUS)]
struct Cli {
    /// File holding the store's encryption key (64 hex characters). Without it, the key
    /// comes from the KUBE_PERSIST_KEY environment variable, if set.
    #[arg(long, global = true, value_name = "PATH")]
    key_file: Option<PathBuf>,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

/// How a command prints its answer.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    /// Lines for people.
    Text,
    /// One JSON document (JSON lines for `dump`).
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// List the streams of a store.
    ///
    /// Per stream: kind, URL, selectors, encryption, phase, checkpoint, object count.
    Inspect {
        /// The store directory.
        dir: PathBuf,
    },
    /// Figures per stream, as text or JSON.
    ///
    /// Per stream: objects, checkpoint, phase, bytes on disk, engine, format version and
    /// identity fields (kind, URL, selectors, shard, transform, encryption). Per durable
    /// controller: its kinds, objects tracked, pending requeues, the oldest due time.
    Stats {
        /// The store directory.
        dir: PathBuf,
    },
    /// Print one stored object as JSON.
    #[command(after_help = GET_EXIT_STATUS)]
    Get {
        /// The store directory.
        dir: PathBuf,
        /// The stream's name.
        stream: String,
        /// `NAMESPACE/NAME`, or `NAME` for a cluster-scoped object.
        object: String,
    },
    /// Print every stored object of a stream, one JSON document per line.
    ///
    /// Reads a redb store in pieces (at most 1000 objects or 4 MiB), each on a store opened
    /// for it and closed before it is printed: a pager that does not read never keeps a
    /// controller from starting. A controller that opens the store meanwhile (periodic
    /// durability) ends the dump after the objects printed so far, with exit status 2.
    Dump {
        /// The store directory.
        dir: PathBuf,
        /// The stream's name.
        stream: String,
    },
    /// Compare a stream with the cluster the kubeconfig points at.
    ///
    /// Lists the stream's collection (its group, version, resource, namespace, selectors
    /// and shard; paginated, metadata only) and compares it with the store object by
    /// object: missing, extra, different resourceVersion. When the store differs from the
    /// server's current state, the collection is listed again at the store's checkpoint
    /// (resourceVersionMatch=Exact) to tell a store that is behind from one that is wrong.
    ///
    /// A redb store is opened read-only for each page's lookups and closed during the
    /// LISTs, so a controller can start meanwhile; one that needs the store to itself
    /// (periodic durability) then ends the verification with exit status 2 ("locked").
    #[command(after_help = VERIFY_EXIT_STATUS)]
    Verify {
        /// The store directory.
        dir: PathBuf,
        /// The stream's name.
        stream: String,
        /// The kubeconfig context to use (default: the current context).
        #[arg(long, value_name = "NAME")]
        context: Option<String>,
        /// How many differences to print (all are counted).
        #[arg(long, value_name = "N", default_value_t = 20)]
        max_differences: usize,
    },
    /// List the durable controllers' reconcile states, or remove one (after confirmation).
    ///
    /// Per controller: its kinds, objects tracked, pending requeues, the oldest due time. A
    /// removed state makes the controller's next start a cold one.
    #[command(after_help = CONTROLLER_STATES_EXIT_STATUS)]
    ControllerStates {
        /// The store directory.
        dir: PathBuf,
        /// Remove this controller's state instead of listing.
        #[arg(long, value_name = "NAME")]
        drop: Option<String>,
        /// Do not ask for confirmation (for scripts).
        #[arg(long)]
        yes: bool,
    },
    /// Remove one stream and everything stored for it, after confirmation.
    ///
    /// Its space is freed for the store's other streams; a controller that opens the stream
    /// again lists it from scratch.
    #[command(after_help = REMOVE_EXIT_STATUS)]
    DropStream {
        /// The store directory.
        dir: PathBuf,
        /// The stream's name.
        stream: String,
        /// Do not ask for confirmation (for scripts).
        #[arg(long)]
        yes: bool,
    },
    /// Remove a store directory, after confirmation.
    ///
    /// The next start of its controller lists from scratch. Refuses a directory that is not
    /// a store, or a store that is open (in this or another process).
    #[command(after_help = REMOVE_EXIT_STATUS)]
    Destroy {
        /// The store directory.
        dir: PathBuf,
        /// Do not ask for confirmation (for scripts).
        #[arg(long)]
        yes: bool,
    },
}

/// Why a command stopped.
enum Failure {
    /// The reader of stdout went away (`| head`): not an error; exit quietly, like other
    /// Unix tools.
    Closed,
    /// An error to report (exit status 2).
    Error(String),
    /// The command ran and its answer is "no" (an object not found, verify found
    /// differences, a removal not confirmed): exit status 1, the details are already printed.
    No,
}

impl From<String> for Failure {
    fn from(e: String) -> Self {
        Failure::Error(e)
    }
}

impl From<kube_persist::Error> for Failure {
    fn from(e: kube_persist::Error) -> Self {
        Failure::Error(e.to_string())
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::BrokenPipe => Failure::Closed,
            _ => Failure::Error(format!("writing to stdout: {e}")),
        }
    }
}

type Outcome = Result<(), Failure>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs (e.g. RUST_LOG=kube_persist=debug) go to stderr, never into a dump.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(cli) {
        Ok(()) | Err(Failure::Closed) => ExitCode::SUCCESS,
        Err(Failure::No) => ExitCode::from(1),
        Err(Failure::Error(e)) => {
            eprintln!("kube-persist: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Outcome {
    let config = || -> Result<DbConfig, Failure> {
        let mut config = DbConfig::default();
        if let Some(k) = key(cli.key_file.as_deref())? {
            config = config.encryption_key(k);
        }
        Ok(config)
    };
    let output = cli.output;
    // The reading commands open redb stores read-only (beside a running controller).
    let reading = |dir: &Path| -> Result<Db, Failure> {
        match Engine::of_store(dir)? {
            Some(Engine::Redb) => Ok(Db::open_with(dir, config()?.read_only())?),
            // sled has no read-only mode.
            _ => open(dir, config()?),
        }
    };
    match &cli.command {
        Command::Inspect { dir } => read::inspect(&reading(dir)?, output),
        Command::Stats { dir } => read::stats(&reading(dir)?, output),
        Command::Get {
            dir,
            stream,
            object,
        } => read::get(&reading(dir)?, stream, object, output),
        Command::Dump { dir, stream } => read::dump(|| reading(dir), stream),
        Command::Verify {
            dir,
            stream,
            context,
            max_differences,
        } => verify::verify(
            match Engine::of_store(dir)? {
                // Opened for each read, closed during the LISTs.
                Some(Engine::Redb) => verify::Store::At(dir.clone(), config()?.read_only()),
                _ => verify::Store::Held(reading(dir)?),
            },
            stream,
            context.clone(),
            *max_differences,
            output,
        ),
        Command::ControllerStates { dir, drop, yes } => match drop {
            Some(name) => admin::drop_controller_state(&open(dir, config()?)?, name, *yes, output),
            None => read::controller_states(&reading(dir)?, output),
        },
        Command::DropStream { dir, stream, yes } => {
            admin::drop_stream(&open(dir, config()?)?, stream, *yes, output)
        }
        Command::Destroy { dir, yes } => admin::destroy(dir, *yes, output),
    }
}

/// Open an existing store (never create one), with whichever engine wrote it.
fn open(dir: &Path, config: DbConfig) -> Result<Db, Failure> {
    match Engine::of_store(dir)? {
        Some(_) => Ok(Db::open_with(dir, config)?),
        None => Err(format!("no kube-persist store at {}", dir.display()).into()),
    }
}

fn key(file: Option<&Path>) -> Result<Option<EncryptionKey>, Failure> {
    if let Some(path) = file {
        return Ok(Some(EncryptionKey::from_file(path)?));
    }
    // Unset: no key; set but empty: an error, as in the example operator (the library's
    // one rule, which also wipes its copy of the variable's value once parsed).
    Ok(EncryptionKey::from_env_optional("KUBE_PERSIST_KEY")?)
}
