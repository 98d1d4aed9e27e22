//! What the tool prints of a store: text escaped for a terminal, and a warning before the
//! objects of a sensitive kind.
//!
//! A store holds what the cluster's users wrote (object bodies, names, annotations) and
//! what a disk gives back: an escape sequence in any of it must not reach a terminal as
//! one (moving the cursor, rewriting earlier lines, setting the window title). Every
//! control character but newline and tab is printed as a JSON escape (`\u001b`), which in
//! JSON output stays the same string.

use std::borrow::Cow;
use std::io::Write;

use kube_persist::StreamInfo;

/// `s` with every control character (C0 but `\n` and `\t`, DEL, C1) as `\uXXXX`.
pub(crate) fn escape(s: &str) -> Cow<'_, str> {
    let unsafe_char = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if unsafe_char(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Bytes of the store (a stored body), escaped: invalid UTF-8 as U+FFFD.
pub(crate) fn escape_bytes(b: &[u8]) -> Cow<'_, str> {
    match String::from_utf8_lossy(b) {
        Cow::Borrowed(s) => escape(s),
        Cow::Owned(s) => Cow::Owned(escape(&s).into_owned()),
    }
}

/// Text output gathered, then printed escaped ([`Text::print`]).
#[derive(Default)]
pub(crate) struct Text(Vec<u8>);

impl Write for Text {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Text {
    /// Write what was gathered to stdout, escaped.
    pub(crate) fn print(self) -> std::io::Result<()> {
        let mut out = std::io::stdout().lock();
        out.write_all(escape_bytes(&self.0).as_bytes())?;
        out.flush()
    }
}

/// Whether `stream` keeps the values of a sensitive kind (core/v1 Secrets) in the bodies
/// it stores: not keys-only, not metadata-only, not written with `drop_secret_data`.
pub(crate) fn holds_secret_values(stream: &StreamInfo) -> bool {
    let path = stream.url.split('?').next().unwrap_or_default();
    let secrets = (stream.kind == "Secret" && stream.api_version == "v1")
        || (path.starts_with("/api/") && path.ends_with("/secrets"));
    let dropped = stream
        .transform
        .as_deref()
        .is_some_and(|t| t.split('+').any(|t| t == "drop-secret-data"));
    secrets && !stream.keys_only && !stream.metadata_only && !dropped
}

/// Warn on stderr, before any of its objects is printed, that `stream` holds secret values.
pub(crate) fn warn_if_sensitive(stream: Option<&StreamInfo>) {
    if let Some(s) = stream.filter(|s| holds_secret_values(s)) {
        eprintln!(
            "warning: stream {:?} holds {} objects with their values (sensitive); they are printed in clear",
            escape(&s.name),
            escape(&s.kind)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape("plain\tline\n"), "plain\tline\n");
        assert_eq!(
            escape("a\u{1b}[31mred\r\u{7f}\u{9b}2J"),
            "a\\u001b[31mred\\u000d\\u007f\\u009b2J"
        );
        assert_eq!(
            escape_bytes(b"x\x1b]0;t\x07\xff"),
            "x\\u001b]0;t\\u0007\u{fffd}"
        );
        // JSON stays JSON, with the same strings.
        let v: serde_json::Value = serde_json::from_str(&escape("{\"k\": \"\u{9b}31m\"}")).unwrap();
        assert_eq!(v["k"], "\u{9b}31m");
    }
}
