//! What a [`Controller`](super::Controller) run reports besides successful reconciles.

use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;

/// An item of error in a [`Controller::run`](super::Controller::run) stream.
///
/// Like kube-runtime's `controller::Error`, none of these stops the controller: they are
/// reported for diagnostics (log them), and the run goes on.
///
/// ```no_run
/// # async fn demo(stream: impl futures::Stream<Item = Result<(kube::runtime::reflector::ObjectRef<k8s_openapi::api::core::v1::Pod>, kube::runtime::controller::Action), kube_persist::controller::ControllerError<std::io::Error>>>) {
/// use futures::StreamExt;
/// use kube_persist::controller::ControllerError;
/// stream
///     .for_each(|res| async move {
///         match res {
///             Ok((obj, action)) => println!("reconciled {obj}: {action:?}"),
///             Err(ControllerError::ReconcilerFailed(e, obj)) => eprintln!("{obj} failed: {e}"),
///             Err(other) => eprintln!("controller: {other}"),
///         }
///     })
///     .await;
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControllerError<E: 'static> {
    /// A reconcile was scheduled for an object that is not in the store (any more): usually
    /// a deletion, or a mapper pointing at an object that does not exist. Not retried.
    #[error("tried to reconcile object {0} that was not found in the store")]
    ObjectNotFound(Box<ObjectRef<DynamicObject>>),

    /// The reconciler failed; the error policy's [`Action`](kube::runtime::controller::Action)
    /// decided when it runs again.
    #[error("reconciler for object {1} failed: {0}")]
    ReconcilerFailed(#[source] E, Box<ObjectRef<DynamicObject>>),

    /// The object to reconcile could not be read from the store (disk or decode failure).
    /// The read is retried with backoff (200 ms, doubling, at most 5 minutes) until it
    /// succeeds or the object is gone; the trigger is not lost.
    #[error("cannot read object {1} from the store: {0}")]
    ReadFailed(#[source] crate::model::Error, Box<ObjectRef<DynamicObject>>),

    /// A persistent watcher feeding the controller (the main kind's or a related kind's)
    /// reported an error. It retries with backoff by itself; this is for diagnostics.
    #[error("persistent watcher error: {0}")]
    Store(#[source] crate::model::Error),

    /// A trigger stream given to [`Controller::watches_stream`](super::Controller::watches_stream)
    /// or [`Controller::owns_stream`](super::Controller::owns_stream) reported an error.
    #[error("trigger stream error: {0}")]
    Watcher(#[source] kube::runtime::watcher::Error),

    /// A builder step that opens a stream ([`Controller::owns`](super::Controller::owns),
    /// [`Controller::watches`](super::Controller::watches)) failed: the controller did not
    /// start. `run` yields this error alone, then ends.
    #[error("controller setup failed: {0}")]
    Setup(#[source] crate::model::Error),
}

/// An error of a trigger stream, before it becomes a [`ControllerError`].
#[derive(Debug)]
pub(crate) enum TriggerError {
    Store(crate::model::Error),
    Watcher(kube::runtime::watcher::Error),
}

impl<E> From<TriggerError> for ControllerError<E> {
    fn from(e: TriggerError) -> Self {
        match e {
            TriggerError::Store(e) => ControllerError::Store(e),
            TriggerError::Watcher(e) => ControllerError::Watcher(e),
        }
    }
}
