//! Waiting with a deadline: polling a condition until it holds.

use std::time::Duration;

pub const WAIT: Duration = Duration::from_secs(60);

/// Poll `f` (every 10 ms, to pace the loop) until it holds; panics after [`WAIT`].
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
