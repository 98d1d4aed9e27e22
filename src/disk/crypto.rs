//! Optional encryption of stored object bodies: XChaCha20-Poly1305 (RustCrypto) with a fresh
//! random nonce per record. The record's key and envelope fields are authenticated data, so
//! a record moved to another key or edited on disk fails to open.
//!
//! Nothing is sealed with the configured key itself: each stream's keys are derived from it
//! ([`StoreKey::stream_cipher`], HMAC-SHA256) with the stream's name and the random id its
//! keyspace got when it was started clean, so a record copied to another stream, to the same
//! stream of another store sharing the key, or back into a stream after it was wiped, fails
//! to open. The same derivation keys the index values stored in place of the values an
//! index function returns ([`Cipher::index_token`]).
//!
//! The cipher is the `encryption` feature; keys (parsing, fingerprints) are always built, so
//! that configuration code compiles either way and a build without the feature refuses a key
//! with [`Error::FeatureNotBuilt`].

#[cfg(feature = "encryption")]
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
#[cfg(feature = "encryption")]
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
#[cfg(feature = "encryption")]
use hmac::{Hmac, Mac};
#[cfg(feature = "encryption")]
use rand::RngCore;
use sha2::{Digest, Sha256};
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use crate::model::{Error, Result};

#[cfg(feature = "encryption")]
const NONCE_LEN: usize = 24;

/// The bytes of an index token ([`Cipher::index_token`]): 128 bits, written as 32 hex
/// characters.
#[cfg(feature = "encryption")]
const TOKEN_BYTES: usize = 16;

/// HMAC-SHA256 under `key` of `label` and then each of `parts`, each preceded by its length
/// (so that no two lists of parts give the same input): the one derivation of every key and
/// token below.
#[cfg(feature = "encryption")]
fn prf(key: &[u8], label: &[u8], parts: &[&[u8]]) -> Zeroizing<[u8; 32]> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC-SHA256 takes a key of any length");
    mac.update(label);
    for part in parts {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part);
    }
    let mut out = Zeroizing::new([0u8; 32]);
    out.copy_from_slice(&mac.finalize().into_bytes());
    out
}

/// A 256-bit key for encrypting stored objects. Never written to disk; the store records
/// only a fingerprint to recognise it. Its bytes live in one heap allocation, which is
/// overwritten with zeros when the key (or a clone) is dropped; the hex text read by
/// [`EncryptionKey::from_file`] and [`EncryptionKey::from_env`] is wiped as well.
///
/// ```
/// use kube_persist::EncryptionKey;
/// let key = EncryptionKey::from_hex(&"11".repeat(32)).unwrap();
/// assert_eq!(key.fingerprint().len(), 16);
/// assert!(EncryptionKey::from_hex("too short").is_err());
/// ```
#[derive(Clone)]
pub struct EncryptionKey(Box<Zeroizing<[u8; 32]>>);

/// Dropping the `Box` drops the `Zeroizing` in place, which zeroes the bytes before the
/// allocation is freed. Boxed, the bytes are not copied when the key moves.
impl ZeroizeOnDrop for EncryptionKey {}

impl std::fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EncryptionKey(fingerprint {})", self.fingerprint())
    }
}

impl EncryptionKey {
    /// A key from 32 raw bytes (this function's copy of them is wiped; the caller's array
    /// is the caller's to wipe).
    ///
    /// ```
    /// use kube_persist::EncryptionKey;
    /// let key = EncryptionKey::from_bytes([0x11; 32]);
    /// // The same key as its 64 hex characters.
    /// let hex = EncryptionKey::from_hex(&"11".repeat(32)).unwrap();
    /// assert_eq!(key.fingerprint(), hex.fingerprint());
    /// ```
    pub fn from_bytes(mut bytes: [u8; 32]) -> Self {
        let mut key = Self::zeros();
        key.0.copy_from_slice(&bytes);
        bytes.zeroize();
        key
    }

    /// An all-zero key to fill in place.
    fn zeros() -> Self {
        EncryptionKey(Box::new(Zeroizing::new([0; 32])))
    }

    /// A key from 64 hexadecimal characters (surrounding whitespace is ignored), e.g. the
    /// content of a mounted Secret or an environment variable.
    ///
    /// ```
    /// use kube_persist::EncryptionKey;
    /// let key = EncryptionKey::from_hex(&format!("  {}\n", "ab".repeat(32))).unwrap();
    /// assert_eq!(key.fingerprint(), EncryptionKey::from_bytes([0xab; 32]).fingerprint());
    /// // Not 64 hexadecimal characters: a configuration error.
    /// let err = EncryptionKey::from_hex(&"zz".repeat(32)).unwrap_err();
    /// assert!(matches!(err, kube_persist::Error::InvalidKey { var: None, .. }));
    /// ```
    pub fn from_hex(text: &str) -> Result<Self> {
        let text = text.trim();
        let bad = || Error::InvalidKey {
            var: None,
            detail: "an encryption key must be 64 hexadecimal characters (32 bytes)".into(),
        };
        let mut key = Self::zeros();
        // Straight into the key's allocation. Any length but 64 characters, or a non-hex
        // character, is an error.
        hex::decode_to_slice(text, &mut key.0[..]).map_err(|_| bad())?;
        Ok(key)
    }

    /// Read a hex key from a file (e.g. a mounted Secret).
    ///
    /// ```
    /// use kube_persist::EncryptionKey;
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("key");
    /// std::fs::write(&path, format!("{}\n", "42".repeat(32))).unwrap();
    /// let key = EncryptionKey::from_file(&path).unwrap();
    /// assert_eq!(key.fingerprint(), EncryptionKey::from_bytes([0x42; 32]).fingerprint());
    /// assert!(EncryptionKey::from_file(dir.path().join("missing")).is_err());
    /// ```
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?);
        Self::from_hex(&text)
    }

    /// Read a hex key from an environment variable that must hold one. For a key that may
    /// be left out, [`EncryptionKey::from_env_optional`].
    ///
    /// ```
    /// use kube_persist::EncryptionKey;
    /// // An unset variable is a configuration error naming it.
    /// let err = EncryptionKey::from_env("KUBE_PERSIST_DOC_UNSET_KEY").unwrap_err();
    /// assert!(err.to_string().contains("KUBE_PERSIST_DOC_UNSET_KEY"));
    /// ```
    pub fn from_env(var: &str) -> Result<Self> {
        let text = Zeroizing::new(std::env::var(var).map_err(|_| Error::InvalidKey {
            var: Some(var.to_string()),
            detail: "the variable is not set".into(),
        })?);
        Self::from_hex(&text)
    }

    /// Read an optional hex key from an environment variable: no key (`Ok(None)`) only when
    /// the variable is unset, the key when it holds 64 hexadecimal characters (whitespace
    /// around them is ignored, as [`EncryptionKey::from_hex`] does), and an error naming the
    /// variable otherwise: [`Error::EmptyKeyVariable`] when it is set but empty or blank,
    /// [`Error::InvalidKey`] for another text or a value that is not UTF-8.
    ///
    /// A set but empty variable is an error, not "no key": it is what a failed key
    /// generation (`$(openssl rand -hex 32)` when openssl fails) or a Secret with an empty
    /// value gives, and taking it as no key would write the store in clear without anyone
    /// having asked for that. To run without encryption on purpose, leave it unset.
    ///
    /// This is what `KUBE_PERSIST_KEY` means to the `kube-persist` tool and to the example
    /// operator. Without a key a new store is written unencrypted (a writable open logs a
    /// warning saying so); a store written with one is refused without it
    /// ([`Error::Encryption`]), never read or wiped.
    ///
    /// ```
    /// use kube_persist::EncryptionKey;
    /// // Unset: no key, not an error (set to "", it would be Error::EmptyKeyVariable).
    /// assert!(EncryptionKey::from_env_optional("KUBE_PERSIST_DOC_UNSET_KEY")?.is_none());
    /// # Ok::<(), kube_persist::Error>(())
    /// ```
    pub fn from_env_optional(var: &str) -> Result<Option<Self>> {
        Self::from_optional_value(var, std::env::var_os(var))
    }

    /// [`EncryptionKey::from_env_optional`]'s rule on the variable's value (`None`: unset).
    fn from_optional_value(var: &str, value: Option<std::ffi::OsString>) -> Result<Option<Self>> {
        let Some(value) = value else {
            return Ok(None);
        };
        let text = Zeroizing::new(value.into_string().map_err(|raw| {
            // Wipe the bytes, which are not a key either.
            drop(Zeroizing::new(raw.into_encoded_bytes()));
            Error::InvalidKey {
                var: Some(var.to_string()),
                detail: "the variable's value is not UTF-8".into(),
            }
        })?);
        if text.trim().is_empty() {
            return Err(Error::EmptyKeyVariable {
                var: var.to_string(),
            });
        }
        Self::from_hex(&text).map(Some).map_err(|e| match e {
            Error::InvalidKey { var: None, detail } => Error::InvalidKey {
                var: Some(var.to_string()),
                detail,
            },
            e => e,
        })
    }

    /// A short, non-reversible identifier of the key (first 8 bytes of a domain-separated
    /// SHA-256, in hex), stored to detect a wrong key.
    ///
    /// ```
    /// use kube_persist::EncryptionKey;
    /// let fp = EncryptionKey::from_bytes([1; 32]).fingerprint();
    /// assert_eq!(fp.len(), 16);
    /// assert!(fp.chars().all(|c| c.is_ascii_hexdigit()));
    /// assert_ne!(fp, EncryptionKey::from_bytes([2; 32]).fingerprint());
    /// ```
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"kube-persist key fingerprint v1\0");
        h.update(&self.0[..]);
        hex::encode(&h.finalize()[..8])
    }

    /// The store's key, from which each stream's keys are derived; [`Error::FeatureNotBuilt`] in a
    /// build without the `encryption` feature.
    pub(crate) fn store_key(&self) -> Result<StoreKey> {
        #[cfg(feature = "encryption")]
        {
            // A copy of its own, zeroed on drop.
            Ok(StoreKey(Zeroizing::new(**self.0)))
        }
        #[cfg(not(feature = "encryption"))]
        Err(Error::FeatureNotBuilt {
            feature: "encryption",
            detail: "an encryption key".into(),
        })
    }
}

/// The configured key as an open store holds it. Nothing is sealed with it directly: each
/// stream has keys of its own, [`StoreKey::stream_cipher`].
#[cfg(feature = "encryption")]
pub(crate) struct StoreKey(Zeroizing<[u8; 32]>);

/// Without the `encryption` feature no key can be configured.
#[cfg(not(feature = "encryption"))]
pub(crate) enum StoreKey {}

#[cfg(feature = "encryption")]
impl StoreKey {
    /// The cipher of one stream: its keys derived (HMAC-SHA256) from the store's key, the
    /// stream's name and `id`, the random id its keyspace got when it was started clean
    /// (`keys::STREAM_ID_KEY`). A record sealed for one stream does not open in another, in
    /// the same stream of another store (whose id differs) or in the same stream after a
    /// wipe.
    pub(crate) fn stream_cipher(&self, stream: &str, id: &[u8]) -> Cipher {
        let stream_key = prf(
            &self.0[..],
            b"kube-persist stream key v1\0",
            &[stream.as_bytes(), id],
        );
        let seal = prf(&stream_key[..], b"kube-persist record seal v1\0", &[]);
        Cipher {
            // The AEAD keeps its own copy of the key, which it zeroes on drop.
            aead: XChaCha20Poly1305::new((&*seal).into()),
            index: prf(&stream_key[..], b"kube-persist index token v1\0", &[]),
        }
    }
}

#[cfg(not(feature = "encryption"))]
impl StoreKey {
    pub(crate) fn stream_cipher(&self, _: &str, _: &[u8]) -> Cipher {
        match *self {}
    }
}

/// One stream's keys: seals and opens its records and index entry lists, and turns index
/// values into tokens.
#[cfg(feature = "encryption")]
pub(crate) struct Cipher {
    aead: XChaCha20Poly1305,
    /// The HMAC key of [`Cipher::index_token`].
    index: Zeroizing<[u8; 32]>,
}

/// Without the `encryption` feature no cipher can exist (no store holds one).
#[cfg(not(feature = "encryption"))]
pub(crate) enum Cipher {}

#[cfg(not(feature = "encryption"))]
impl Cipher {
    pub(crate) fn seal(&self, _: &[u8], _: &[u8]) -> Vec<u8> {
        match *self {}
    }

    pub(crate) fn open(&self, _: &[u8], _: &[u8]) -> Option<Vec<u8>> {
        match *self {}
    }

    pub(crate) fn index_token(&self, _: &str, _: &str) -> String {
        match *self {}
    }
}

#[cfg(feature = "encryption")]
impl Cipher {
    /// What an encrypted stream stores in place of `value`, a value index `index`'s
    /// function returned: a keyed hash (HMAC-SHA256, truncated to 128 bits, in hex) under
    /// this stream's index key. Lookups need equality only, so a lookup hashes the value it
    /// is given the same way; the value itself is never on disk, and without the key a
    /// guessed value cannot be checked against it.
    pub(crate) fn index_token(&self, index: &str, value: &str) -> String {
        let mac = prf(&self.index[..], b"", &[index.as_bytes(), value.as_bytes()]);
        hex::encode(&mac[..TOKEN_BYTES])
    }

    /// `nonce || ciphertext` of `plain`, bound to `aad`.
    pub(crate) fn seal(&self, plain: &[u8], aad: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let ct = self
            .aead
            .encrypt(XNonce::from_slice(&nonce), Payload { msg: plain, aad })
            .expect("XChaCha20-Poly1305 encryption of an in-memory buffer cannot fail");
        let mut out = Vec::with_capacity(NONCE_LEN + ct.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        out
    }

    /// The plaintext, or `None` if the record was not sealed with this key and `aad`.
    pub(crate) fn open(&self, sealed: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < NONCE_LEN {
            return None;
        }
        let (nonce, ct) = sealed.split_at(NONCE_LEN);
        self.aead
            .decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad })
            .ok()
    }
}

#[cfg(all(test, feature = "encryption"))]
mod tests {
    use super::*;

    /// The cipher of stream `stream` with id `id` in a store of key `[b; 32]`.
    fn cipher(b: u8, stream: &str, id: &[u8]) -> Cipher {
        EncryptionKey::from_bytes([b; 32])
            .store_key()
            .unwrap()
            .stream_cipher(stream, id)
    }

    #[test]
    fn round_trip_and_tamper_detection() {
        let c = cipher(7, "pods", &[1; 16]);
        let sealed = c.seal(b"secret", b"key1");
        assert_eq!(c.open(&sealed, b"key1").as_deref(), Some(&b"secret"[..]));
        assert!(c.open(&sealed, b"key2").is_none(), "bound to its key");
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(c.open(&flipped, b"key1").is_none(), "tampering detected");
        let other = cipher(8, "pods", &[1; 16]);
        assert!(other.open(&sealed, b"key1").is_none(), "wrong key detected");
        assert_ne!(c.seal(b"secret", b"key1"), sealed, "fresh nonce per record");
    }

    /// Issue 60 item 4: each stream's keys are its own. A record sealed for one stream does
    /// not open in another stream, in the same stream of another store (another id), or
    /// under the configured key itself; index tokens are the same for the same stream,
    /// index and value only, and carry nothing of the value.
    #[test]
    fn each_stream_has_keys_of_its_own() {
        let c = cipher(7, "pods", &[1; 16]);
        let sealed = c.seal(b"secret", b"key1");
        assert_eq!(
            cipher(7, "pods", &[1; 16])
                .open(&sealed, b"key1")
                .as_deref(),
            Some(&b"secret"[..]),
            "derived again, the same keys"
        );
        for (what, other) in [
            ("another stream", cipher(7, "nodes", &[1; 16])),
            ("another store's stream", cipher(7, "pods", &[2; 16])),
            ("a name shifted into the id", cipher(7, "pod", b"s\x01")),
        ] {
            assert!(other.open(&sealed, b"key1").is_none(), "{what}");
        }
        let direct = XChaCha20Poly1305::new((&[7u8; 32]).into());
        let (nonce, ct) = sealed.split_at(NONCE_LEN);
        assert!(
            direct
                .decrypt(
                    XNonce::from_slice(nonce),
                    Payload {
                        msg: ct,
                        aad: b"key1"
                    }
                )
                .is_err(),
            "not sealed with the configured key itself"
        );

        let token = c.index_token("node", "node-1");
        assert_eq!(
            token,
            cipher(7, "pods", &[1; 16]).index_token("node", "node-1")
        );
        assert_eq!(token.len(), 2 * TOKEN_BYTES);
        assert!(!token.contains("node"));
        for other in [
            c.index_token("node", "node-2"),
            c.index_token("zone", "node-1"),
            c.index_token("nod", "enode-1"),
            cipher(7, "nodes", &[1; 16]).index_token("node", "node-1"),
            cipher(7, "pods", &[2; 16]).index_token("node", "node-1"),
            cipher(8, "pods", &[1; 16]).index_token("node", "node-1"),
        ] {
            assert_ne!(token, other);
        }
    }

    #[test]
    fn hex_keys() {
        let key = |s: &str| EncryptionKey::from_hex(s).map(|k| **k.0);
        assert_eq!(key(&"0a".repeat(32)).unwrap(), [10; 32]);
        assert_eq!(key(&format!(" {}\n", "Ff".repeat(32))).unwrap(), [255; 32]);
        for bad in [
            "",
            "0a",
            &"0a".repeat(31),
            &"0a".repeat(33),
            &"g0".repeat(32),
        ] {
            assert!(key(bad).is_err(), "{bad:?}");
        }
        assert!(key(&format!("{}é", "0a".repeat(31))).is_err(), "not ASCII");
        let fp = EncryptionKey::from_bytes([7; 32]).fingerprint();
        assert_eq!(fp.len(), 16);
        assert!(
            fp.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
    }

    /// Unset is no key; a key is a key; empty or blank is [`Error::EmptyKeyVariable`] (issue
    /// 60 item 2: it was no key, and the store was written in clear); anything else is an
    /// error naming the variable.
    #[test]
    fn optional_env_key() {
        use std::ffi::OsString;
        let key = |v: Option<&str>| {
            EncryptionKey::from_optional_value("KEY_VAR", v.map(OsString::from))
                .map(|k| k.map(|k| **k.0))
        };
        assert_eq!(key(None).unwrap(), None, "unset");
        for empty in ["", " \n", "\t"] {
            match key(Some(empty)) {
                Err(Error::EmptyKeyVariable { var }) => assert_eq!(var, "KEY_VAR"),
                other => panic!("{empty:?}: {other:?}"),
            }
        }
        let err = key(Some("")).unwrap_err().to_string();
        assert!(err.contains("KEY_VAR") && err.contains("empty"), "{err}");
        assert_eq!(key(Some(&"0a".repeat(32))).unwrap(), Some([10; 32]));
        for bad in ["0a", "no key", &"0a".repeat(33)] {
            let err = key(Some(bad)).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidKey { var: Some(v), .. } if v == "KEY_VAR"),
                "{bad:?}: {err}"
            );
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            let raw = OsString::from_vec(vec![0xff; 64]);
            let err = EncryptionKey::from_optional_value("KEY_VAR", Some(raw)).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidKey { var: Some(v), detail } if v == "KEY_VAR" && detail.contains("UTF-8")),
                "{err}"
            );
        }
    }

    // The crate denies unsafe code; this test reads a dropped key's bytes, which only
    // raw pointers can (see the SAFETY comment below).
    #[allow(unsafe_code)]
    #[test]
    fn key_bytes_are_zeroed_on_drop() {
        let key = EncryptionKey::from_hex(&"ab".repeat(32)).unwrap();
        assert_eq!(**key.0, [0xab; 32]);
        let copy = EncryptionKey::from_bytes(**key.0);
        assert_eq!(copy.fingerprint(), key.fingerprint());
        // Run exactly what dropping the key runs on its allocation (the `Zeroizing`'s
        // drop), but keep the allocation (leaked) so its bytes can still be read.
        let bytes: *mut Zeroizing<[u8; 32]> = Box::into_raw(key.0);
        // SAFETY: `bytes` comes from `Box::into_raw` and is never freed, so it stays valid
        // after its value is dropped in place; `Zeroizing` is `repr(transparent)` over
        // `[u8; 32]`, whose every bit pattern is valid, and its drop wrote all 32 bytes.
        let after = unsafe {
            std::ptr::drop_in_place(bytes);
            *(bytes as *const [u8; 32])
        };
        assert_eq!(after, [0; 32]);
    }
}
