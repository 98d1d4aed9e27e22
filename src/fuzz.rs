//! Entry points of the fuzz targets (`fuzz/`, built by cargo-fuzz with `--cfg fuzzing`):
//! every decoder of bytes the library reads from disk, by the layer that owns it. Not part
//! of the public API (hidden, and compiled only for fuzzing and the unit tests).

/// Decode `bytes` as every kind of record the store keeps: object records (owned, head,
/// borrowed, bodies of every codec), the stream's state, identity and index entries, a
/// controller's identity, counts, object records and passes, and the plain values of the
/// other metadata keys. Returns normally whatever the bytes are: damage is an error inside,
/// never an abort or a panic.
///
/// ```ignore
/// kube_persist::fuzz::decode_all(&[0xFD, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x3F]);
/// ```
pub fn decode_all(bytes: &[u8]) {
    crate::disk::record::fuzz_decode(bytes);
    crate::store::fuzz_decode(bytes);
    crate::controller::keyspace::fuzz_decode(bytes);
}

#[cfg(test)]
mod tests {
    /// The corpus the fuzz target starts from (`fuzz/corpus/decode_all`), and damage of
    /// each seed at every byte: every decoder returns.
    #[test]
    fn the_decoders_return_on_damaged_seeds() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = root.join("fuzz/corpus/decode_all");
        if !root.join("fuzz").exists() {
            // The published package has no fuzz/ folder (a package of its own): the
            // repository's test command always has it.
            println!("no fuzz/ folder beside the crate (a packaged crate): nothing to replay");
            return;
        }
        let mut seeds = 0;
        for e in std::fs::read_dir(&dir).expect("the fuzz corpus") {
            let seed = std::fs::read(e.unwrap().path()).unwrap();
            super::decode_all(&seed);
            for at in 0..seed.len() {
                for b in [0x00, 0xFD, 0xFF] {
                    let mut d = seed.clone();
                    d[at] = b;
                    super::decode_all(&d);
                }
                super::decode_all(&seed[..at]);
            }
            seeds += 1;
        }
        assert!(seeds > 0, "no seeds in {}", dir.display());
    }
}
