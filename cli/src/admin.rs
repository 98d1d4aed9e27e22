//! The commands that remove: a controller's state, a stream, a whole store. Each asks for
//! confirmation on the terminal unless `--yes`; an answer other than `yes` is a "no" (exit
//! status 1), and nothing is removed.

use std::io::Write;
use std::path::Path;

use kube_persist::{Db, Engine, Removed};
use serde_json::json;

use crate::{Failure, Outcome, Output};

/// Ask `question` on stderr; true if the answer is `yes`.
fn confirmed(question: &str) -> Result<bool, Failure> {
    let mut err = std::io::stderr().lock();
    write!(err, "{question} Type 'yes' to confirm: ")?;
    err.flush()?;
    let mut answer = String::new();
    std::io::stdin()
        .read_line(&mut answer)
        .map_err(|e| format!("reading the confirmation: {e}"))?;
    if answer.trim() == "yes" {
        return Ok(true);
    }
    eprintln!("not confirmed; nothing removed");
    Ok(false)
}

/// Print what was removed: `text` as is, or `{"removed": {what: name}}`.
fn removed(output: Output, what: &str, name: &str, text: String) -> Outcome {
    let mut out = std::io::stdout().lock();
    match output {
        Output::Text => writeln!(out, "{text}")?,
        Output::Json => writeln!(out, "{}", json!({ "removed": { what: name } }))?,
    }
    Ok(())
}

pub(crate) fn drop_stream(db: &Db, stream: &str, yes: bool, output: Output) -> Outcome {
    let question = format!(
        "remove stream {stream:?} and everything stored for it from {}? a controller that \
         opens it again lists it from scratch.",
        db.path().display()
    );
    if !yes && !confirmed(&question)? {
        return Err(Failure::No);
    }
    db.drop_stream(stream)?;
    removed(output, "stream", stream, format!("dropped stream {stream}"))
}

pub(crate) fn drop_controller_state(db: &Db, name: &str, yes: bool, output: Output) -> Outcome {
    let question = format!(
        "remove the reconcile state of controller {name:?} from {}? its next start is a cold \
         one (it reconciles every object).",
        db.path().display()
    );
    if !yes && !confirmed(&question)? {
        return Err(Failure::No);
    }
    db.drop_controller_state(name)?;
    let text = format!("dropped the state of controller {name}");
    removed(output, "controller_state", name, text)
}

pub(crate) fn destroy(dir: &Path, yes: bool, output: Output) -> Outcome {
    let engine = Engine::of_store(dir)?
        .ok_or_else(|| format!("no kube-persist store at {}", dir.display()))?;
    let question = format!(
        "remove the {} store at {} and everything in it? its controller will list from \
         scratch.",
        engine.name(),
        dir.display()
    );
    if !yes && !confirmed(&question)? {
        return Err(Failure::No);
    }
    let path = dir.display().to_string();
    let text = match Db::destroy(dir)? {
        // A link: the store is its target, whose files went; the link and directory stay.
        Removed::Target { target } => format!(
            "destroyed the store in {}, which {path} links to (kept the link and the empty \
             directory)",
            target.display()
        ),
        _ => format!("destroyed {path}"),
    };
    removed(output, "store", &path, text)
}
