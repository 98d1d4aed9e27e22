//! The compact stored form of an object and the JSON helpers that build it.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::resource::ResourceType;
use crate::status::ApiError;

/// `(namespace, name)`; the namespace is `""` for cluster-scoped objects. Orders lists.
pub(crate) type Key = (String, String);

/// One object version as stored: serialized JSON plus the fields selectors and writes need.
#[derive(Debug)]
pub(crate) struct StoredObject {
    /// Revision that produced this version (its `metadata.resourceVersion`).
    pub rev: u64,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub created: String,
    pub generation: i64,
    /// Labels as `(key, value)` pairs.
    pub labels: Vec<(String, String)>,
    /// The full object, serialized.
    pub json: Bytes,
}

impl StoredObject {
    /// The `(namespace, name)` key.
    pub(crate) fn key(&self) -> Key {
        (self.namespace.clone(), self.name.clone())
    }

    /// Parses the stored JSON back into a value (always succeeds for data we serialized).
    pub(crate) fn value(&self) -> Value {
        serde_json::from_slice(&self.json).unwrap_or(Value::Null)
    }
}

/// A validated incoming object, not yet stamped with server fields.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub value: Map<String, Value>,
    pub namespace: String,
    pub name: String,
    pub labels: Vec<(String, String)>,
    /// `metadata.resourceVersion` sent by the client, if any.
    pub resource_version: Option<String>,
}

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(422, "Invalid", msg)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | ':'))
}

/// Validates an incoming object. `path_ns` is the namespace from the URL, if any;
/// a namespaced object without namespace lands in `default`.
pub(crate) fn prepare(
    rt: &ResourceType,
    obj: Value,
    path_ns: Option<&str>,
) -> Result<Prepared, ApiError> {
    let Value::Object(mut value) = obj else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    let meta = value
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(meta) = meta else {
        return Err(invalid("metadata must be an object"));
    };
    let name = match meta.get("name") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => match meta.get("generateName") {
            Some(Value::String(prefix)) if !prefix.is_empty() => {
                let name = format!("{prefix}{}", random_suffix());
                meta.insert("name".into(), Value::String(name.clone()));
                name
            }
            _ => {
                return Err(invalid(
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
        },
        Some(_) => return Err(invalid("metadata.name must be a string")),
    };
    if !valid_name(&name) {
        return Err(invalid(format!("metadata.name: Invalid value: {name:?}")));
    }
    let namespace = if rt.namespaced {
        let body_ns = match meta.get("namespace") {
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            None | Some(Value::Null) => None,
            Some(Value::String(_)) => None,
            Some(_) => return Err(invalid("metadata.namespace must be a string")),
        };
        let ns = match (body_ns, path_ns) {
            (Some(b), Some(p)) if b != p => {
                return Err(ApiError::bad_request(format!(
                    "the namespace of the provided object ({b}) does not match the namespace sent on the request ({p})"
                )));
            }
            (Some(b), _) => b,
            (None, Some(p)) => p.to_string(),
            (None, None) => "default".to_string(),
        };
        if !valid_name(&ns) {
            return Err(invalid(format!(
                "metadata.namespace: Invalid value: {ns:?}"
            )));
        }
        meta.insert("namespace".into(), Value::String(ns.clone()));
        ns
    } else {
        meta.remove("namespace");
        String::new()
    };
    let labels = match meta.get("labels") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(m)) => {
            let mut labels = Vec::with_capacity(m.len());
            for (k, v) in m {
                let Value::String(v) = v else {
                    return Err(invalid(format!("metadata.labels[{k}] must be a string")));
                };
                labels.push((k.clone(), v.clone()));
            }
            labels
        }
        Some(_) => return Err(invalid("metadata.labels must be an object")),
    };
    let resource_version = match meta.get("resourceVersion") {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    };
    Ok(Prepared {
        value,
        namespace,
        name,
        labels,
        resource_version,
    })
}

/// Whether `new` has the same content as `old` besides metadata and status (and the type
/// fields): a write that does not change the generation.
pub(crate) fn same_desired_state(old: &StoredObject, new: &Map<String, Value>) -> bool {
    const IGNORED: [&str; 4] = ["metadata", "status", "apiVersion", "kind"];
    let Value::Object(old) = old.value() else {
        return false;
    };
    let strip = |m: &Map<String, Value>| -> Map<String, Value> {
        m.iter()
            .filter(|(k, _)| !IGNORED.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    strip(&old) == strip(new)
}

/// Server-assigned fields for one write.
pub(crate) struct Stamp<'a> {
    pub rev: u64,
    /// `rev` as the server renders it.
    pub rv: &'a str,
    pub uid: &'a str,
    pub created: &'a str,
    pub generation: i64,
}

/// Stamps server fields onto a prepared object and serializes it.
pub(crate) fn finalize(rt: &ResourceType, mut p: Prepared, stamp: Stamp<'_>) -> StoredObject {
    p.value
        .insert("apiVersion".into(), Value::String(rt.api_version()));
    p.value
        .insert("kind".into(), Value::String(rt.kind.clone()));
    if let Some(Value::Object(meta)) = p.value.get_mut("metadata") {
        meta.insert(
            "resourceVersion".into(),
            Value::String(stamp.rv.to_string()),
        );
        meta.insert("uid".into(), Value::String(stamp.uid.to_string()));
        meta.insert(
            "creationTimestamp".into(),
            Value::String(stamp.created.to_string()),
        );
        meta.insert("generation".into(), Value::from(stamp.generation));
        meta.remove("generateName");
    }
    let json = serde_json::to_vec(&p.value).unwrap_or_default();
    StoredObject {
        rev: stamp.rev,
        namespace: p.namespace,
        name: p.name,
        uid: stamp.uid.to_string(),
        created: stamp.created.to_string(),
        generation: stamp.generation,
        labels: p.labels,
        json: Bytes::from(json),
    }
}

/// The last state of a deleted object, re-stamped with the deletion's revision (`rv` is
/// `rev` as the server renders it).
pub(crate) fn deletion_state(old: &StoredObject, rev: u64, rv: &str) -> StoredObject {
    let mut value = old.value();
    if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
    }
    StoredObject {
        rev,
        namespace: old.namespace.clone(),
        name: old.name.clone(),
        uid: old.uid.clone(),
        created: old.created.clone(),
        generation: old.generation,
        labels: old.labels.clone(),
        json: Bytes::from(serde_json::to_vec(&value).unwrap_or_default()),
    }
}

/// A random lowercase 5-character suffix for `generateName`.
fn random_suffix() -> String {
    const CHARS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| CHARS[rand::random_range(0..CHARS.len())] as char)
        .collect()
}

/// A random RFC 4122 version-4 UID.
pub(crate) fn new_uid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    uuid_string(&b)
}

/// Formats 16 bytes as a UUID string.
pub(crate) fn uuid_string(b: &[u8; 16]) -> String {
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The current UTC time as RFC 3339 with second precision (`2024-01-02T03:04:05Z`).
pub(crate) fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs)
}

/// Formats seconds since the Unix epoch as RFC 3339 UTC.
pub(crate) fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn prepare_rejects_bad_input() {
        let rt = ResourceType::pods();
        assert!(prepare(&rt, serde_json::json!([1]), None).is_err());
        assert!(prepare(&rt, serde_json::json!({"metadata": {"name": 5}}), None).is_err());
        assert!(
            prepare(
                &rt,
                serde_json::json!({"metadata": {"name": "a", "labels": {"x": 1}}}),
                None
            )
            .is_err()
        );
        let p = prepare(
            &rt,
            serde_json::json!({"metadata": {"generateName": "x-"}}),
            Some("ns"),
        )
        .unwrap();
        assert!(p.name.starts_with("x-"));
        assert_eq!(p.namespace, "ns");
    }
}
