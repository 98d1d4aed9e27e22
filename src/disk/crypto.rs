//! Optional encryption of stored object bodies: XChaCha20-Poly1305 (RustCrypto) with a fresh
//! random nonce per record. The record's key and envelope fields are authenticated data, so
//! a record moved to another key or edited on disk fails to open.
//!
//! The cipher is the `encryption` feature; keys (parsing, fingerprints) are always built, so
//! that configuration code compiles either way and a build without the feature refuses a key
//! with [`Error::Config`].

#[cfg(feature = "encryption")]
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
#[cfg(feature = "encryption")]
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
#[cfg(feature = "encryption")]
use rand::RngCore;
use sha2::{Digest, Sha256};
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use crate::model::{Error, Result};

#[cfg(feature = "encryption")]
const NONCE_LEN: usize = 24;

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
    /// assert!(matches!(err, kube_persist::Error::Config(_)));
    /// ```
    pub fn from_hex(text: &str) -> Result<Self> {
        let text = text.trim();
        let bad = || {
            Error::Config("an encryption key must be 64 hexadecimal characters (32 bytes)".into())
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
        let text = Zeroizing::new(
            std::env::var(var)
                .map_err(|_| Error::Config(format!("environment variable {var} is not set")))?,
        );
        Self::from_hex(&text)
    }

    /// Read an optional hex key from an environment variable: no key (`Ok(None)`) when the
    /// variable is unset or empty, the key when it holds 64 hexadecimal characters, and
    /// [`Error::Config`] naming the variable otherwise (another text, or not UTF-8).
    /// Whitespace around the key is ignored, as [`EncryptionKey::from_hex`] does, so a
    /// value of whitespace alone is empty.
    ///
    /// This is what `KUBE_PERSIST_KEY` means to the `kube-persist` tool and to the example
    /// operator: in Kubernetes the variable comes from an optional Secret
    /// (`secretKeyRef` with `optional: true`, as in `deploy/statefulset.yaml`), which leaves
    /// it unset when the Secret is missing, and a Secret whose value is empty gives no key
    /// either. Without a key a new store is written unencrypted; a store written with one
    /// is refused without it ([`Error::Encryption`]), never read or wiped.
    ///
    /// ```
    /// use kube_persist::EncryptionKey;
    /// // Unset (or empty): no key, not an error.
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
            Error::Config(format!("environment variable {var} is not UTF-8"))
        })?);
        if text.trim().is_empty() {
            return Ok(None);
        }
        Self::from_hex(&text).map(Some).map_err(|e| match e {
            Error::Config(why) => Error::Config(format!("environment variable {var}: {why}")),
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

    /// The cipher of this key; [`Error::Config`] in a build without the `encryption` feature.
    pub(crate) fn cipher(&self) -> Result<Cipher> {
        #[cfg(feature = "encryption")]
        {
            // The cipher keeps its own copy of the key, which it zeroes on drop.
            Ok(Cipher(XChaCha20Poly1305::new((&**self.0).into())))
        }
        #[cfg(not(feature = "encryption"))]
        Err(Error::Config(
            "an encryption key needs kube-persist's `encryption` feature, which this build leaves out".into(),
        ))
    }
}

/// Seals and opens record bodies.
#[cfg(feature = "encryption")]
pub(crate) struct Cipher(XChaCha20Poly1305);

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
}

#[cfg(feature = "encryption")]
impl Cipher {
    /// `nonce || ciphertext` of `plain`, bound to `aad`.
    pub(crate) fn seal(&self, plain: &[u8], aad: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let ct = self
            .0
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
        self.0
            .decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad })
            .ok()
    }
}

#[cfg(all(test, feature = "encryption"))]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_tamper_detection() {
        let c = EncryptionKey::from_bytes([7; 32]).cipher().unwrap();
        let sealed = c.seal(b"secret", b"key1");
        assert_eq!(c.open(&sealed, b"key1").as_deref(), Some(&b"secret"[..]));
        assert!(c.open(&sealed, b"key2").is_none(), "bound to its key");
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(c.open(&flipped, b"key1").is_none(), "tampering detected");
        let other = EncryptionKey::from_bytes([8; 32]).cipher().unwrap();
        assert!(other.open(&sealed, b"key1").is_none(), "wrong key detected");
        assert_ne!(c.seal(b"secret", b"key1"), sealed, "fresh nonce per record");
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

    /// Unset, empty and whitespace are no key; a key is a key; anything else is an error
    /// naming the variable.
    #[test]
    fn optional_env_key() {
        use std::ffi::OsString;
        let key = |v: Option<&str>| {
            EncryptionKey::from_optional_value("KEY_VAR", v.map(OsString::from))
                .map(|k| k.map(|k| **k.0))
        };
        for none in [None, Some(""), Some(" \n")] {
            assert_eq!(key(none).unwrap(), None, "{none:?}");
        }
        assert_eq!(key(Some(&"0a".repeat(32))).unwrap(), Some([10; 32]));
        for bad in ["0a", "no key", &"0a".repeat(33)] {
            let err = key(Some(bad)).unwrap_err();
            assert!(
                matches!(&err, Error::Config(m) if m.contains("KEY_VAR")),
                "{bad:?}: {err}"
            );
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            let raw = OsString::from_vec(vec![0xff; 64]);
            let err = EncryptionKey::from_optional_value("KEY_VAR", Some(raw)).unwrap_err();
            assert!(err.to_string().contains("KEY_VAR is not UTF-8"), "{err}");
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
