//! `kube-persist`: look inside, check, measure and remove kube-persist store directories.
//!
//! ```text
//! kube-persist inspect DIR                        streams, kinds, checkpoints, object counts
//! kube-persist stats DIR [--json]                 per stream: objects, checkpoint, phase, bytes
//! kube-persist get DIR STREAM [NAMESPACE/]NAME    one object as JSON
//! kube-persist dump DIR STREAM                    every object, one JSON document per line
//! kube-persist verify DIR STREAM [--context NAME] compare a stream with the cluster
//! kube-persist destroy DIR [--yes]                remove a store (the next start lists again)
//! ```
//! Encrypted stores need their key: `--key-file PATH` or the `KUBE_PERSIST_KEY` environment
//! variable (64 hex characters). A store must not be open in another process. Stores of
//! either engine (redb or sled) are opened with the engine recorded in them.

mod read;
mod verify;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kube_persist::{Db, DbConfig, EncryptionKey, Engine};

/// Look inside, check, measure and remove kube-persist store directories.
#[derive(Parser)]
#[command(name = "kube-persist", version, about, long_about = None)]
struct Cli {
    /// File holding the store's encryption key (64 hex characters). Without it, the key
    /// comes from the KUBE_PERSIST_KEY environment variable, if set.
    #[arg(long, global = true, value_name = "PATH")]
    key_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
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
        /// Print one JSON document instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print one stored object as JSON.
    Get {
        /// The store directory.
        dir: PathBuf,
        /// The stream's name.
        stream: String,
        /// `NAMESPACE/NAME`, or `NAME` for a cluster-scoped object.
        object: String,
    },
    /// Print every stored object of a stream, one JSON document per line.
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
    /// Exit status: 0 when the store equals the server at its checkpoint, or is behind only
    /// by changes newer than it (the output says which); 1 when it differs, or when the
    /// server no longer has the checkpoint (compacted) to tell; 2 on errors.
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
    /// Remove a store directory, after confirmation.
    ///
    /// The next start of its controller lists from scratch. Refuses a directory that is not
    /// a store, or a store that is open (in this or another process).
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
    /// The command ran and its answer is "no" (verify found differences, destroy was not
    /// confirmed): exit status 1, the details are already printed.
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
    match &cli.command {
        Command::Inspect { dir } => read::inspect(&open(dir, config()?)?),
        Command::Stats { dir, json } => read::stats(&open(dir, config()?)?, *json),
        Command::Get {
            dir,
            stream,
            object,
        } => read::get(&open(dir, config()?)?, stream, object),
        Command::Dump { dir, stream } => read::dump(&open(dir, config()?)?, stream),
        Command::Verify {
            dir,
            stream,
            context,
            max_differences,
        } => verify::verify(
            open(dir, config()?)?,
            stream,
            context.clone(),
            *max_differences,
        ),
        Command::Destroy { dir, yes } => destroy(dir, *yes),
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
    match std::env::var_os("KUBE_PERSIST_KEY") {
        // from_env wipes its copy of the variable's value once parsed.
        Some(_) => EncryptionKey::from_env("KUBE_PERSIST_KEY")
            .map(Some)
            .map_err(|e| Failure::Error(format!("KUBE_PERSIST_KEY: {e}"))),
        None => Ok(None),
    }
}

fn destroy(dir: &Path, yes: bool) -> Outcome {
    let engine = Engine::of_store(dir)?
        .ok_or_else(|| format!("no kube-persist store at {}", dir.display()))?;
    if !yes {
        let mut err = std::io::stderr().lock();
        write!(
            err,
            "remove the {} store at {} and everything in it? its controller will list from \
             scratch. Type 'yes' to confirm: ",
            engine.name(),
            dir.display()
        )?;
        err.flush()?;
        let mut answer = String::new();
        std::io::stdin()
            .read_line(&mut answer)
            .map_err(|e| format!("reading the confirmation: {e}"))?;
        if answer.trim() != "yes" {
            eprintln!("not confirmed; nothing removed");
            return Err(Failure::No);
        }
    }
    Db::destroy(dir)?;
    writeln!(std::io::stdout(), "destroyed {}", dir.display())?;
    Ok(())
}
