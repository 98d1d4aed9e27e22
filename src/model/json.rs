//! JSON decoding for the hot paths (validating incoming objects, reading stored ones):
//! simd-json with this thread's reused working buffers, and serde_json only to report (or,
//! should simd-json ever refuse valid JSON, to decode) what simd-json did not accept.
//! Both decode every Kubernetes type identically (a unit test in `store/reader/mod.rs` checks).

use std::cell::RefCell;

use serde::de::DeserializeOwned;

thread_local! {
    /// simd-json's working buffers (tape, strings, padded input), reused by every decode on
    /// this thread instead of allocated per object.
    static SIMD_BUFFERS: RefCell<simd_json::Buffers> =
        RefCell::new(simd_json::Buffers::new(16 << 10));
    /// A scratch copy of the input for [`decode_copy`] (simd-json rewrites its input).
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Decode `buf` with simd-json, which rewrites it in place. On an error, the caller decodes
/// the original bytes with serde_json for an error message users know.
pub(crate) fn decode_in_place<T: DeserializeOwned>(
    buf: &mut [u8],
) -> std::result::Result<T, simd_json::Error> {
    SIMD_BUFFERS.with(|b| simd_json::serde::from_slice_with_buffers::<T>(buf, &mut b.borrow_mut()))
}

/// Decode `json` into `T` without touching it: simd-json on a reused scratch copy, then
/// serde_json on the original when simd-json refuses (for its error message).
pub(crate) fn decode_copy<T: DeserializeOwned>(json: &[u8]) -> Result<T, serde_json::Error> {
    let fast = SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        s.clear();
        s.extend_from_slice(json);
        let t = decode_in_place::<T>(&mut s);
        // Do not keep a rare huge object's buffer alive for the thread's lifetime.
        if s.capacity() > 1 << 20 {
            *s = Vec::new();
        }
        t
    });
    match fast {
        Ok(t) => Ok(t),
        Err(simd) => {
            let t = serde_json::from_slice::<T>(json)?;
            tracing::debug!(error = %simd, "simd-json refused JSON that serde_json accepts");
            Ok(t)
        }
    }
}
