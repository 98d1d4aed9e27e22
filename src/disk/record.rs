//! How records are stored: the object envelope and the bincode codec of every value (the
//! store layer's state and identity records among them, which it defines). Values are
//! bincode-encoded; an object body is the server's JSON (after the stream's transforms),
//! packed by its `Codec` and sealed when the store is encrypted.

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use std::path::Path;

use crate::disk::Cipher;
use crate::disk::Compression;
use crate::disk::keys;
use crate::model::Error;

/// Version of the on-disk format. Part of the store identity: a store written with a
/// format version this one cannot read is not resumed but rebuilt.
///
/// 5: issue 57's format, made for a move to redb 5 (not made: BENCHMARKS.md, *redb 4.6 and
/// 5.0*). Records and keys are laid out as in format 4, but a stream of an older format is
/// not resumed: it starts clean and is listed again once (a sled stream too: the version is
/// the stream's, whatever its engine), so that the next engine move needs no reader of
/// older records. The test
/// `format_fixture` opens a committed store of format 4 written by redb 4.6.
/// 4: an encrypted stream seals with keys of its own, derived from the store's key, its
/// name and the random id its keyspace got when it was started clean
/// (`keys::STREAM_ID_KEY`); its index keys hold keyed hashes of the values, not the values,
/// and its index entry lists are sealed. An unencrypted stream is laid out as in format 3.
/// 3: bodies are compressed with LZ4 (codec byte 2). 2: with zstd; its records are the
/// same layout (codec byte 1 was its `compressed: true`).
pub(crate) const FORMAT_VERSION: u32 = 5;

/// Older format versions whose unencrypted streams this version reads and resumes without a
/// relist (they are written in [`FORMAT_VERSION`] from then on): none since format 5, which
/// relists every older stream once (formats 2 and 3 were resumed by format 4). An encrypted
/// stream of a format before [`BOUND_FORMAT`] is never read: its records were sealed with
/// the store's key itself and its index values are in clear, so opening it for writing
/// rebuilds it (a relist under the new keys) and reading it without a writer is
/// [`Error::Encryption`].
pub(crate) const READABLE_FORMATS: &[u32] = &[];

/// The first format whose encrypted streams seal with keys of their own (bound to their
/// stream and store) and keep index values off disk: such a stream's records are read by
/// the tool whatever the format it resumes from.
pub(crate) const BOUND_FORMAT: u32 = 4;

/// The largest body a record may claim to decompress to (guards against corrupt sizes):
/// far above any object the API server stores (etcd's limit is 1.5 MiB by default).
const MAX_BODY_BYTES: usize = 256 << 20;

/// The most an LZ4 block can expand: a run of one byte encodes 255 bytes per byte of
/// block, plus a few bytes of literals around it.
const LZ4_MAX_RATIO: usize = 256;

/// How a stored body is packed before encryption: one byte in the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Codec {
    /// The JSON as received.
    Plain = 0,
    /// zstd frame, level 1 (what format 2 wrote; written with `Compression::Zstd`).
    Zstd = 1,
    /// LZ4 block with its size in front: ~2x smaller Pod JSON, about 2x faster than zstd
    /// level 1 to compress and 5x faster to decompress
    /// ([BENCHMARKS.md](https://github.com/kube-persist/kube-persist/blob/main/BENCHMARKS.md#lookups-iteration-and-apply), the body codec table).
    Lz4 = 2,
}

impl Codec {
    fn from_byte(b: u8) -> Result<Codec, String> {
        match b {
            0 => Ok(Codec::Plain),
            1 => Ok(Codec::Zstd),
            2 => Ok(Codec::Lz4),
            other => Err(format!("unknown body codec {other}")),
        }
    }
}

/// One stored object: the few fields the store needs plus the JSON body.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Record {
    pub(crate) resource_version: String,
    pub(crate) uid: String,
    /// The list epoch in which this version was written (the store's `State::epoch`).
    pub(crate) epoch: u64,
    /// How `body` is packed (a [`Codec`], before encryption).
    pub(crate) codec: u8,
    /// Written as one length-prefixed slice, not byte by byte (the same bytes on disk).
    #[serde(with = "serde_bytes")]
    pub(crate) body: Vec<u8>,
}

/// The leading fields of a [`Record`] (same field order), decoded without copying the body:
/// what the writer needs to decide whether an incoming object changed.
#[derive(Debug, Deserialize)]
pub(crate) struct RecordHead {
    pub(crate) resource_version: String,
    pub(crate) uid: String,
    pub(crate) epoch: u64,
}

/// A [`Record`] viewed in place: every field borrowed from the encoded bytes (same
/// layout: bincode writes a `Vec<u8>` as a length and the bytes, as it writes `&[u8]`).
/// Reading an object copies nothing until its body is decompressed or decoded.
#[derive(Debug, Deserialize)]
pub(crate) struct RecordRef<'a> {
    #[serde(borrow)]
    pub(crate) resource_version: &'a str,
    #[serde(borrow)]
    pub(crate) uid: &'a str,
    pub(crate) epoch: u64,
    pub(crate) codec: u8,
    #[serde(borrow)]
    pub(crate) body: &'a [u8],
}

/// View an encoded [`Record`] without copying it.
pub(crate) fn decode_ref(bytes: &[u8]) -> Result<RecordRef<'_>, String> {
    match bincode::serde::borrow_decode_from_slice(bytes, bincode::config::standard()) {
        Ok((v, used)) if used == bytes.len() => Ok(v),
        Ok((_, used)) => Err(format!("record has {} trailing bytes", bytes.len() - used)),
        Err(e) => Err(e.to_string()),
    }
}

thread_local! {
    /// One zstd decompression context per thread, reused by every read on it.
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

thread_local! {
    /// One zstd compression context per thread (the disk thread), reused for every record:
    /// creating one per object cost more than compressing it (measured with perf).
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Compress one body into a zstd frame (level 1) that records its size.
fn zstd_body(plain: &[u8]) -> Option<Vec<u8>> {
    COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = zstd::bulk::Compressor::new(1).ok();
        }
        c.as_mut()?.compress(plain).ok()
    })
}

/// Decompress one zstd frame with this thread's context.
fn unzstd(data: &[u8]) -> Result<Vec<u8>, String> {
    let size = zstd::zstd_safe::get_frame_content_size(data)
        .map_err(|e| format!("compressed body has no valid frame header: {e:?}"))?
        .ok_or("compressed body does not record its size")?;
    let size = usize::try_from(size)
        .ok()
        .filter(|&n| n <= MAX_BODY_BYTES)
        .ok_or_else(|| format!("compressed body claims {size} bytes"))?;
    let mut out = Vec::with_capacity(size);
    DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?);
        }
        let d = d.as_mut().ok_or("no zstd context")?;
        d.decompress_to_buffer(data, &mut out)
            .map(|_| out)
            .map_err(|e| format!("compressed body does not decompress: {e}"))
    })
}

/// Decompress one LZ4 block with its size in front.
fn unlz4(data: &[u8]) -> Result<Vec<u8>, String> {
    let (size, block) = lz4_flex::block::uncompressed_size(data)
        .map_err(|e| format!("compressed body has no valid size: {e}"))?;
    // LZ4 expands a block at most ~255 times: a larger claim is damage, refused before
    // anything is allocated for it.
    if size > MAX_BODY_BYTES || size > block.len().saturating_mul(LZ4_MAX_RATIO) + 16 {
        return Err(format!(
            "compressed body of {} bytes claims {size} bytes",
            block.len()
        ));
    }
    let mut out = vec![0; size];
    let n = lz4_flex::block::decompress_into(block, &mut out)
        .map_err(|e| format!("compressed body does not decompress: {e}"))?;
    if n != size {
        return Err(format!(
            "compressed body is {n} bytes, not the {size} it claims"
        ));
    }
    Ok(out)
}

/// The plaintext of a (decrypted) body packed with `codec`.
fn unpack<'a>(
    codec: u8,
    data: std::borrow::Cow<'a, [u8]>,
) -> Result<std::borrow::Cow<'a, [u8]>, String> {
    use std::borrow::Cow;
    match Codec::from_byte(codec)? {
        Codec::Plain => Ok(data),
        Codec::Zstd => unzstd(&data).map(Cow::Owned),
        Codec::Lz4 => unlz4(&data).map(Cow::Owned),
    }
}

impl<'a> RecordRef<'a> {
    /// The plaintext JSON body: borrowed from the record when it is stored plain, else
    /// decompressed (and decrypted) into a new buffer of exactly its size.
    pub(crate) fn open(
        &self,
        key: &[u8],
        cipher: Option<&Cipher>,
    ) -> Result<std::borrow::Cow<'a, [u8]>, String> {
        use std::borrow::Cow;
        let data: Cow<'a, [u8]> = match cipher {
            None => Cow::Borrowed(self.body),
            Some(c) => {
                let aad = aad(key, self.resource_version, self.uid, self.epoch, self.codec);
                Cow::Owned(c.open(self.body, &aad).ok_or_else(|| {
                    "encrypted record fails authentication (wrong key, or modified on disk)"
                        .to_string()
                })?)
            }
        };
        unpack(self.codec, data)
    }
}

/// Authenticated data binding an encrypted body to its key and envelope.
fn aad(key: &[u8], resource_version: &str, uid: &str, epoch: u64, codec: u8) -> Vec<u8> {
    let mut aad = Vec::with_capacity(key.len() + resource_version.len() + uid.len() + 10);
    aad.extend_from_slice(key);
    aad.push(0);
    aad.extend_from_slice(resource_version.as_bytes());
    aad.push(0);
    aad.extend_from_slice(uid.as_bytes());
    aad.extend_from_slice(&epoch.to_be_bytes());
    aad.push(codec);
    aad
}

/// Authenticated data of a sealed value ([`encode_sealed`]): its key, under a label no
/// object record's authenticated data starts with.
fn value_aad(key: &[u8]) -> Vec<u8> {
    let mut aad = b"kube-persist sealed value v1\0".to_vec();
    aad.extend_from_slice(key);
    aad
}

/// A stored value other than an object record (an object's index entry list) as it is
/// written: [`encode`]d, then, when the stream is encrypted, sealed with its cipher and
/// bound to `key`, so that it neither shows its contents nor opens under another key.
pub(crate) fn encode_sealed<T: Serialize>(
    value: &T,
    key: &[u8],
    cipher: Option<&Cipher>,
) -> Vec<u8> {
    let plain = encode(value);
    match cipher {
        Some(c) => c.seal(&plain, &value_aad(key)),
        None => plain,
    }
}

/// The value [`encode_sealed`] wrote at `key`, or why it cannot be read (it does not
/// decode, or, sealed, fails authentication: another key, another stream, or modified).
pub(crate) fn decode_sealed<T: DeserializeOwned>(
    bytes: &[u8],
    key: &[u8],
    cipher: Option<&Cipher>,
) -> Result<T, String> {
    match cipher {
        Some(c) => {
            let plain = c.open(bytes, &value_aad(key)).ok_or_else(|| {
                "sealed value fails authentication (wrong key, another stream's, or modified on disk)"
                    .to_string()
            })?;
            decode(&plain)
        }
        None => decode(bytes),
    }
}

/// Decode the head of an encoded [`Record`], ignoring the body that follows. Bounded like
/// [`decode`].
pub(crate) fn decode_head(bytes: &[u8]) -> Result<RecordHead, String> {
    bounded_decode(bytes).map(|(head, _)| head)
}

/// A body compressed for its record: the codec and the compressed bytes, or `None` when
/// compression is off or does not make it smaller (the body is then stored as it is).
#[derive(Debug)]
pub(crate) struct Packed(Option<(Codec, Vec<u8>)>);

impl Packed {
    /// Compress `plain` with `compress`. Compression comes before encryption (ciphertext
    /// does not compress), and does not depend on the record's key or epoch, so it can run
    /// before the batch is written, on another thread.
    pub(crate) fn new(plain: &[u8], compress: Compression) -> Packed {
        Packed(
            match compress {
                Compression::Lz4 => {
                    Some((Codec::Lz4, lz4_flex::block::compress_prepend_size(plain)))
                }
                Compression::Zstd => zstd_body(plain).map(|z| (Codec::Zstd, z)),
                Compression::Off => None,
            }
            .filter(|(_, c)| c.len() < plain.len()),
        )
    }
}

/// What an object record is made of, for [`Record::sealed`].
pub(crate) struct Sealing<'a> {
    /// The record's key: encrypted bodies are bound to it.
    pub(crate) key: &'a [u8],
    pub(crate) resource_version: String,
    pub(crate) uid: String,
    /// The list epoch that writes it.
    pub(crate) epoch: u64,
    /// The plaintext JSON body (empty for a keys-only store).
    pub(crate) plain: &'a [u8],
    /// The body already compressed with `compress` ([`Packed::new`], done where the object
    /// was parsed), or `None` to compress it here.
    pub(crate) packed: Option<Packed>,
    /// The store's cipher, if it is encrypted.
    pub(crate) cipher: Option<&'a Cipher>,
    pub(crate) compress: Compression,
}

impl Record {
    /// Authenticated data binding an encrypted body to its key and envelope.
    fn aad(&self, key: &[u8]) -> Vec<u8> {
        aad(
            key,
            &self.resource_version,
            &self.uid,
            self.epoch,
            self.codec,
        )
    }

    /// The record [`Sealing`] describes: its body packed and sealed with its cipher (if
    /// the store is encrypted).
    pub(crate) fn sealed(sealing: Sealing<'_>) -> Record {
        let Sealing {
            key,
            resource_version,
            uid,
            epoch,
            plain,
            packed,
            cipher,
            compress,
        } = sealing;
        let packed = packed.unwrap_or_else(|| Packed::new(plain, compress)).0;
        let mut rec = Record {
            resource_version,
            uid,
            epoch,
            codec: packed.as_ref().map_or(Codec::Plain, |(c, _)| *c) as u8,
            body: Vec::new(),
        };
        rec.body = match (cipher, packed) {
            (Some(c), packed) => {
                let data = packed.as_ref().map_or(plain, |(_, z)| z.as_slice());
                c.seal(data, &rec.aad(key))
            }
            (None, Some((_, z))) => z,
            (None, None) => plain.to_vec(),
        };
        rec
    }

    /// The plaintext JSON body, or why it cannot be read (wrong key or tampering).
    pub(crate) fn open(self, key: &[u8], cipher: Option<&Cipher>) -> Result<Vec<u8>, String> {
        let data = match cipher {
            None => self.body,
            Some(c) => c.open(&self.body, &self.aad(key)).ok_or_else(|| {
                "encrypted record fails authentication (wrong key, or modified on disk)".to_string()
            })?,
        };
        unpack(self.codec, std::borrow::Cow::Owned(data)).map(std::borrow::Cow::into_owned)
    }
}

/// The one "corrupt record" error: the value at `key` (a whole key, tag first) of stream
/// `stream` in the store at `path` does not decode or does not open.
pub(crate) fn corrupt(
    path: &Path,
    stream: &str,
    key: &[u8],
    detail: impl std::fmt::Display,
) -> Error {
    corrupt_in(path, &format!("stream {stream:?}"), key, detail)
}

/// [`corrupt`] for a record of a named keyspace (`stream "pods"`, `controller state "x"`),
/// where the error should name it.
pub(crate) fn corrupt_in(
    path: &Path,
    keyspace: &str,
    key: &[u8],
    detail: impl std::fmt::Display,
) -> Error {
    Error::Corrupt {
        path: path.to_path_buf(),
        detail: format!("{keyspace}: {}: {detail}", describe(key)),
    }
}

/// [`corrupt_in`] with the key already named (by a layer that knows its own key tags).
pub(crate) fn corrupt_named(
    path: &Path,
    keyspace: &str,
    key: &str,
    detail: impl std::fmt::Display,
) -> Error {
    Error::Corrupt {
        path: path.to_path_buf(),
        detail: format!("{keyspace}: {key}: {detail}"),
    }
}

/// A key named for people: an object's records as `namespace/name`, metadata by its name.
/// (A controller's keyspace names its own keys; see `controller/keyspace.rs`.)
pub(crate) fn describe(key: &[u8]) -> String {
    match key.split_first() {
        Some((&keys::ENTRIES, suffix)) => format!("index entries of {}", keys::display(suffix)),
        Some((&(keys::OBJECT | keys::SEEN), suffix)) => {
            format!("record {}", keys::display(suffix))
        }
        Some((b'm', name)) => String::from_utf8_lossy(name).into_owned(),
        _ => format!("key {:?}", String::from_utf8_lossy(key)),
    }
}

pub(crate) fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
        .expect("encoding plain structs into a Vec cannot fail")
}

/// Decode a whole value read from disk (any trailing byte is an error).
///
/// Bounded: bincode allocates the length a string or byte buffer claims before it reads
/// it, so one damaged length prefix (`0xFD` and eight bytes claim ~4e18 bytes) would abort
/// the process on the failed allocation, which no unwinding catches. Every decode runs with
/// bincode's limit on what a value may claim: the bytes of its strings and buffers, and the
/// in-memory size of each integer (8 bytes for a `u64`, even when its varint is one byte).
/// A valid encoding of `n` bytes so claims at most `16 n` (a `u128` in one byte), and the
/// limit is the smallest [`LIMITS`] step at or above `16 n + 64`: a damaged claim fails with
/// "limit exceeded" instead of allocating more than 64 times the value's size. Sequences
/// are preallocated by serde's cautious size hint (at most 1 MiB each).
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    match bounded_decode(bytes) {
        Ok((v, used)) if used == bytes.len() => Ok(v),
        Ok((_, used)) => Err(format!("record has {} trailing bytes", bytes.len() - used)),
        Err(e) => Err(e),
    }
}

/// The largest value [`decode`] reads: far above any record this crate writes (an object
/// body is at most `StreamConfig::max_object_bytes`, 16 MiB by default, and a body never
/// decompresses past [`MAX_BODY_BYTES`]).
const MAX_RECORD_BYTES: usize = MAX_BODY_BYTES;

/// The most a valid encoding may claim per byte of it ([`decode`]).
const CLAIM_PER_BYTE: usize = 16;

/// The last [`LIMITS`] step: what a [`MAX_RECORD_BYTES`] value may claim (4 GiB; no limit
/// where `usize` cannot hold it).
const TOP_LIMIT: usize = if usize::BITS > 32 {
    (1u64 << 32) as usize
} else {
    usize::MAX
};

/// The limits [`decode`] picks from (powers of four from 256 bytes to 1 GiB, then
/// [`TOP_LIMIT`]): bincode takes its limit as a constant.
const LIMITS: [usize; 13] = [
    1 << 8,
    1 << 10,
    1 << 12,
    1 << 14,
    1 << 16,
    1 << 18,
    1 << 20,
    1 << 22,
    1 << 24,
    1 << 26,
    1 << 28,
    1 << 30,
    TOP_LIMIT,
];

/// Decode `T` from the front of `bytes` with bincode's limit at the [`LIMITS`] step that
/// holds what `bytes` may claim: the value and the bytes it used.
fn bounded_decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<(T, usize), String> {
    fn with<T: DeserializeOwned, const N: usize>(bytes: &[u8]) -> Result<(T, usize), String> {
        bincode::serde::decode_from_slice(bytes, bincode::config::standard().with_limit::<N>())
            .map_err(|e| e.to_string())
    }
    if bytes.len() > MAX_RECORD_BYTES {
        return Err(format!(
            "record is {} bytes, above the {MAX_RECORD_BYTES} any record may be",
            bytes.len()
        ));
    }
    let claims = bytes.len() * CLAIM_PER_BYTE + 64;
    match LIMITS.iter().position(|&l| claims <= l) {
        Some(0) => with::<T, { LIMITS[0] }>(bytes),
        Some(1) => with::<T, { LIMITS[1] }>(bytes),
        Some(2) => with::<T, { LIMITS[2] }>(bytes),
        Some(3) => with::<T, { LIMITS[3] }>(bytes),
        Some(4) => with::<T, { LIMITS[4] }>(bytes),
        Some(5) => with::<T, { LIMITS[5] }>(bytes),
        Some(6) => with::<T, { LIMITS[6] }>(bytes),
        Some(7) => with::<T, { LIMITS[7] }>(bytes),
        Some(8) => with::<T, { LIMITS[8] }>(bytes),
        Some(9) => with::<T, { LIMITS[9] }>(bytes),
        Some(10) => with::<T, { LIMITS[10] }>(bytes),
        Some(11) => with::<T, { LIMITS[11] }>(bytes),
        _ => with::<T, { LIMITS[12] }>(bytes),
    }
}

/// Every decoder of this module on arbitrary bytes, as read from disk: the record envelope
/// (owned, head, borrowed, and its body opened with every codec, sealed or not) and the
/// plain values other records are made of. For the fuzz targets (`fuzz/`); an error is
/// fine, an abort or a panic is the bug.
#[cfg(any(fuzzing, test))]
pub(crate) fn fuzz_decode(bytes: &[u8]) {
    let _ = decode::<Record>(bytes).map(|r| r.open(b"o\0k", None));
    let _ = decode_head(bytes);
    if let Ok(view) = decode_ref(bytes) {
        let _ = view.open(b"o\0k", None);
        #[cfg(feature = "encryption")]
        if let Ok(k) = crate::disk::EncryptionKey::from_bytes([7; 32]).store_key() {
            let c = k.stream_cipher("pods", &[1; 16]);
            let _ = view.open(b"o\0k", Some(&c));
            let _ = decode_sealed::<Vec<(String, String)>>(bytes, b"x\0k", Some(&c));
        }
    }
    for codec in [Codec::Plain, Codec::Zstd, Codec::Lz4] {
        let _ = unpack(codec as u8, std::borrow::Cow::Borrowed(bytes));
    }
    let _ = decode::<String>(bytes);
    let _ = decode::<Option<Vec<u8>>>(bytes);
    let _ = decode::<Vec<String>>(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_reject_garbage() {
        let r = Record {
            resource_version: "42".into(),
            uid: "u".into(),
            epoch: 3,
            codec: Codec::Plain as u8,
            body: br#"{"a":1}"#.to_vec(),
        };
        let back: Record = decode(&encode(&r)).unwrap();
        assert_eq!(back.resource_version, "42");
        assert_eq!(back.body, r.body);
        assert!(decode::<Record>(b"\xff\xff\xff").is_err());
        let head = decode_head(&encode(&r)).unwrap();
        assert_eq!((head.resource_version.as_str(), head.epoch), ("42", 3));
        let bytes = encode(&r);
        let view = decode_ref(&bytes).unwrap();
        assert_eq!(
            (view.resource_version, view.uid, view.epoch),
            ("42", "u", 3)
        );
        assert_eq!(view.body, r.body.as_slice());
    }

    /// Valid records of every size around the limit steps decode: bincode counts each
    /// integer at its in-memory size (a one-byte varint claims 8 for a `u64`), so a limit
    /// at the value's own length refused valid records just below a step (seen against
    /// kube-apiserver: "LimitExceeded" for 10 KB Pods).
    #[test]
    fn valid_records_of_every_size_decode() {
        for len in (0..300)
            .chain(900..1100)
            .chain(16_300..16_400)
            .chain(65_400..65_600)
        {
            let r = Record {
                resource_version: "123456".into(),
                uid: "0f6a4c4e-8d8c-4c1e-9a51-1a2b3c4d5e6f".into(),
                epoch: 7,
                codec: Codec::Lz4 as u8,
                body: vec![b'x'; len],
            };
            let bytes = encode(&r);
            let back: Record = decode(&bytes).unwrap_or_else(|e| panic!("body of {len}: {e}"));
            assert_eq!(back.body.len(), len);
            decode_head(&bytes).unwrap_or_else(|e| panic!("head, body of {len}: {e}"));
            let small: Vec<u64> = (0..len as u64 % 200).collect();
            assert_eq!(decode::<Vec<u64>>(&encode(&small)).unwrap(), small);
        }
    }

    /// A length prefix claiming ~4e18 bytes (varint tag 0xFD, then a u64) in front of any
    /// string or buffer: refused as an error, never allocated (which aborts the process).
    #[test]
    fn damaged_length_prefixes_are_errors_not_allocations() {
        let r = Record {
            resource_version: "42".into(),
            uid: "u".into(),
            epoch: 3,
            codec: Codec::Lz4 as u8,
            body: vec![7; 40],
        };
        let good = encode(&r);
        let huge = [0xFD, 0, 0, 0, 0, 0, 0, 0, 0x3F];
        // Each field's length prefix in turn (rv at 0, uid at 3, body's after epoch/codec).
        for at in [0, 3, 7] {
            let mut bad = good[..at].to_vec();
            bad.extend_from_slice(&huge);
            bad.extend_from_slice(&good[at + 1..]);
            assert!(decode::<Record>(&bad).is_err(), "prefix at {at}");
            assert!(
                decode_head(&bad).is_err() || at == 7,
                "head, prefix at {at}"
            );
            assert!(decode_ref(&bad).is_err(), "borrowed, prefix at {at}");
        }
        assert!(decode::<String>(&huge).is_err());
        assert!(decode::<Vec<String>>(&[0xFD, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0]).is_err());
        assert!(
            decode::<Option<Vec<u8>>>(&[1, 0xFD, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F])
                .is_err()
        );
        // A small LZ4 block claiming 200 MiB (under the body cap) is refused before allocating.
        let mut lz = (200u32 << 20).to_le_bytes().to_vec();
        lz.extend_from_slice(&[0x1F, 0x41, 1, 0, 0xFF, 0xFF]);
        let err = unpack(Codec::Lz4 as u8, std::borrow::Cow::Borrowed(&lz)).unwrap_err();
        assert!(err.contains("claims"), "{err}");
    }

    #[test]
    #[cfg(feature = "encryption")]
    fn borrowed_records_open_like_owned_ones() {
        let json = br#"{"metadata":{"name":"a"},"spec":{"x":"yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"}}"#;
        let key = b"o\0a";
        let cipher = crate::disk::EncryptionKey::from_bytes([3; 32])
            .store_key()
            .unwrap()
            .stream_cipher("pods", &[1; 16]);
        for (compress, c) in [
            (Compression::Off, None),
            (Compression::Lz4, None),
            (Compression::Zstd, None),
            (Compression::Off, Some(&cipher)),
            (Compression::Lz4, Some(&cipher)),
            (Compression::Zstd, Some(&cipher)),
        ] {
            let rec = Record::sealed(Sealing {
                key,
                resource_version: "7".into(),
                uid: "u".into(),
                epoch: 1,
                plain: json,
                packed: None,
                cipher: c,
                compress,
            });
            let bytes = encode(&rec);
            let view = decode_ref(&bytes).unwrap();
            assert_eq!(&*view.open(key, c).unwrap(), json, "compress {compress:?}");
            assert_eq!(rec.open(key, c).unwrap(), json);
        }
    }
}
