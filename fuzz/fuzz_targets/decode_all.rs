//! Every decoder of bytes the store reads from disk, on the fuzzer's bytes: an error is
//! fine, an abort (an allocation a damaged length claims) or a panic is a bug.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kube_persist::fuzz::decode_all(data);
});
