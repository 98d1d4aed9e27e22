//! The next LIST page's request, sent as soon as the page before names its continue token
//! (in the head of its body, see `sync::list_head`): the server works on page N+1 while
//! the client reads, parses and writes page N, and their times overlap instead of adding up.
//!
//! Only the request and the response's head are ahead: the body stays with the HTTP
//! client, which reads from the socket only when the body is polled (hyper's buffer, then
//! TCP flow control stop the server), so a page read ahead costs no page of memory and no
//! place in the page budget until the next step reads it.
//!
//! A request ahead is used only by the read that asks for exactly its continue token and
//! shape (full or metadata only); any other read drops it, and dropping it aborts the
//! request (a failed, expired or abandoned list leaves nothing running).

use std::pin::Pin;

use tracing::Instrument;

/// A LIST response's body, as kube's client streams it.
pub(crate) type Body = Pin<Box<dyn futures::AsyncBufRead + Send>>;

/// The response of a LIST request, with or without its body yet.
type Response = std::result::Result<Body, kube::Error>;

/// A LIST request sent ahead of the read that will want it.
pub(crate) struct Ahead {
    token: String,
    metadata: bool,
    response: tokio::task::JoinHandle<Response>,
}

impl Ahead {
    /// Send `request` (the page at continue token `token`; `metadata`: as metadata only)
    /// on its own task, in the calling span.
    pub(crate) fn send(
        client: &kube::Client,
        request: http::Request<Vec<u8>>,
        token: String,
        metadata: bool,
    ) -> Ahead {
        let client = client.clone();
        let response = tokio::spawn(
            async move {
                let body = client.request_stream(request).await?;
                Ok(Box::pin(body) as Body)
            }
            .in_current_span(),
        );
        Ahead {
            token,
            metadata,
            response,
        }
    }

    /// Whether this is the request of the page at `token` in this shape.
    pub(crate) fn is_for(&self, token: &str, metadata: bool) -> bool {
        self.token == token && self.metadata == metadata
    }

    /// Its response; `None` if the task ended without one (a panic in the HTTP client).
    pub(crate) async fn response(mut self) -> Option<Response> {
        (&mut self.response).await.ok()
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        self.response.abort();
    }
}
