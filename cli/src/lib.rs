//! The `kube-persist` tool's commands: look inside, check, measure and remove kube-persist
//! store directories. The `kube-persist` binary of this package is [`main_from_args`] over
//! its own arguments; a controller can run the same commands from its own binary (e.g.
//! `my-operator kube-persist stats DIR`), built with its own kube-persist, so that the tool
//! always reads the store format the controller writes.
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
//! removal not confirmed), 2 an error (a usage error too: clap's status), 3 `verify` could
//! not tell (the server no longer has the store's checkpoint). `--help` lists them
//! (`EXIT_STATUS`, and per command where one has its own meaning of 1).
//!
//! Encrypted stores need their key: `--key-file PATH` or the `KUBE_PERSIST_KEY` environment
//! variable (64 hex characters). Stores of either engine (redb or sled) are opened with the
//! engine recorded in them. The reading commands never write to a store: they open a redb
//! store read-only, and work while a controller runs on the store if it writes with
//! `Durability::EveryBatch`; sled has no read-only mode, so they copy a sled store (under a
//! lock that keeps sled writers out meanwhile) into a private temporary directory, read the
//! copy and remove it (`read_store`). The removing commands need the store closed
//! elsewhere. A reading command never keeps a controller from starting: it holds a redb
//! store only while it reads (`dump` a piece of at most 1000 objects or 4 MiB at a time,
//! closed before it is written to stdout; `verify` one page's lookups at a time, closed
//! during its LISTs), and a controller that needs the store to itself waits for readers to
//! close (up to 30 s, `DbConfig::wait_for_readers`). A controller that opens the store
//! meanwhile makes the command's next read fail (exit status 2, "locked").

#![deny(unsafe_code)]

mod admin;
mod read;
mod read_store;
mod term;
mod verify;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use clap::{Parser, Subcommand, ValueEnum};
use kube_persist::{Db, DbConfig, EncryptionKey, Engine};

use read_store::ReadStore;

/// The exit statuses, in the top-level `--help` (`-h` too). They are the statuses `main`
/// returns for [`Failure`] (and clap's for a usage error); tests/cli.rs checks the text
/// against the tool.
const EXIT_STATUS: &str = "\
Exit status:
  0  done, or the answer is yes (also after --help or --version, and when the reader of
     stdout goes away, as with `| head`)
  1  the answer is no: `get` found no such object, `verify` found the store different
     from the cluster, a removal was not confirmed (nothing removed)
  2  an error (reported on stderr), a usage error (bad arguments) included, and a store
     locked by a controller
  3  `verify` could not tell (the server no longer has the store's checkpoint)";

/// `get`'s exit statuses.
const GET_EXIT_STATUS: &str = "\
Exit status:
  0  the object was printed
  1  the object is not in the stream (a line on stderr, nothing on stdout)
  2  an error";

/// `verify`'s exit statuses (see `verify::answer`).
const VERIFY_EXIT_STATUS: &str = "\
Exit status:
  0  the store equals the server at its checkpoint, or is behind it only by changes newer
     than the checkpoint (the output says which)
  1  the store differs from the server at its checkpoint, or the stream's object count
     differs from its records
  2  an error, a store locked by a controller (\"locked\") included
  3  undecided: the store differs from the server's current collection and the server no
     longer has the store's checkpoint (compacted) to tell whether the changes are newer";

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
    /// Per stream: kind, URL, selectors, encryption, phase, checkpoint, object count, format.
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
    /// The command ran and could not tell (verify: the server no longer has the store's
    /// checkpoint): exit status 3, the details are already printed.
    Undecided,
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

/// Runs the tool on `args` (the program's name first, as in [`std::env::args_os`]) and
/// returns its exit status: what the `kube-persist` binary does with its own arguments.
/// Output goes to stdout and stderr; `--help` and usage errors are printed as by the tool.
///
/// A controller can ship the commands in its own binary, built with its own kube-persist
/// (one store format for both), e.g. as a `kube-persist` subcommand: `my-operator
/// kube-persist stats DIR`. Build it with `default-features = false` so that the
/// controller's own Kubernetes version and TLS stack are used. The commands log to stderr
/// with a subscriber of their own (`RUST_LOG`, default `warn`) unless the process already
/// has one.
///
/// ```no_run
/// use std::process::ExitCode;
///
/// fn main() -> ExitCode {
///     let mut args = std::env::args_os();
///     if std::env::args_os().nth(1).is_some_and(|a| a == "kube-persist") {
///         // `my-operator kube-persist stats DIR`: the tool sees `kube-persist stats DIR`.
///         args.next();
///         return kube_persist_cli::main_from_args(args);
///     }
///     // ... the controller itself ...
///     ExitCode::SUCCESS
/// }
/// ```
pub fn main_from_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version (status 0) or a usage error (2), as clap prints them.
            let _ = e.print();
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
    };
    // Logs (e.g. RUST_LOG=kube_persist=debug) go to stderr, never into a dump. A
    // controller that embeds the commands may have set its own subscriber: it is kept.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    match run(cli) {
        Ok(()) | Err(Failure::Closed) => ExitCode::SUCCESS,
        Err(Failure::No) => ExitCode::from(1),
        Err(Failure::Error(e)) => {
            eprintln!("kube-persist: {e}");
            ExitCode::from(2)
        }
        Err(Failure::Undecided) => ExitCode::from(3),
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
    // The reading commands never write: redb stores are opened read-only (beside a running
    // controller), sled stores copied (see `read_store`).
    let reading = |dir: &Path| ReadStore::open(dir, config()?);
    match &cli.command {
        Command::Inspect { dir } => read::inspect(&reading(dir)?, output),
        Command::Stats { dir } => read::stats(&reading(dir)?, output),
        Command::Get {
            dir,
            stream,
            object,
        } => read::get(&reading(dir)?, stream, object, output),
        Command::Dump { dir, stream } => match Engine::of_store(dir)? {
            // Opened for each piece, closed while it is printed.
            Some(Engine::Redb) => read::dump(|| Ok(Rc::new(reading(dir)?)), stream),
            // Copied once, read piece by piece.
            _ => {
                let store = Rc::new(reading(dir)?);
                read::dump(|| Ok(store.clone()), stream)
            }
        },
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
