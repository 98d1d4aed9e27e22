//! The selection matrix of the lifecycle model's streams (issue 49, item 9): a label
//! selector over the objects' `tier` (and `mode`) labels, a field selector on
//! `metadata.namespace` and `metadata.name` (all the testkit serves), and an even uid shard,
//! each drawn per stream and changed between runs. [`Sel::selects`] says, from an object's
//! own metadata, whether the stream's selection holds it: the model's expectation of what a
//! store holds once caught up, and of what any consumer of the stream may ever be given.

use kube_persist::{Shard, ShardKey};
use rand::Rng;

/// The label every model object carries, `a`, `b` or `c`: moved between them to move an
/// object in or out of a label selection.
pub const TIER: &str = "tier";
pub const TIERS: [&str; 3] = ["a", "b", "c"];

/// A label selector (its string form is [`Labels::selector`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Labels {
    All,
    /// `tier!=c`
    NotC,
    /// `tier in (a,b)`
    InAB,
    /// `tier notin (b)`
    NotInB,
    /// `mode!=fail,tier!=a`: on two labels, one of which never changes for a uid.
    NoFailNotA,
}

impl Labels {
    const ALL: [Labels; 5] = [
        Labels::All,
        Labels::NotC,
        Labels::InAB,
        Labels::NotInB,
        Labels::NoFailNotA,
    ];

    pub fn draw(r: &mut impl Rng) -> Labels {
        Self::ALL[r.random_range(0..Self::ALL.len())]
    }

    pub fn selector(self) -> Option<&'static str> {
        match self {
            Labels::All => None,
            Labels::NotC => Some("tier!=c"),
            Labels::InAB => Some("tier in (a,b)"),
            Labels::NotInB => Some("tier notin (b)"),
            Labels::NoFailNotA => Some("mode!=fail,tier!=a"),
        }
    }

    fn matches(self, tier: Option<&str>, mode: Option<&str>) -> bool {
        match self {
            Labels::All => true,
            Labels::NotC => tier != Some("c"),
            Labels::InAB => matches!(tier, Some("a" | "b")),
            Labels::NotInB => tier != Some("b"),
            Labels::NoFailNotA => mode != Some("fail") && tier != Some("a"),
        }
    }

    /// A tier outside this selection (if one is), else any.
    pub fn outside(self, r: &mut impl Rng) -> &'static str {
        let out: Vec<&str> = TIERS
            .into_iter()
            .filter(|t| !self.matches(Some(t), None))
            .collect();
        if out.is_empty() {
            TIERS[r.random_range(0..3)]
        } else {
            out[r.random_range(0..out.len())]
        }
    }

    /// A tier inside this selection (for an object whose mode it selects).
    pub fn inside(self, r: &mut impl Rng) -> &'static str {
        let ins: Vec<&str> = TIERS
            .into_iter()
            .filter(|t| self.matches(Some(t), None))
            .collect();
        ins[r.random_range(0..ins.len())]
    }

    fn code(self) -> usize {
        Self::ALL.iter().position(|l| *l == self).unwrap_or(0)
    }
}

/// A field selector on what the testkit serves (`metadata.namespace`, `metadata.name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fields {
    All,
    /// `metadata.namespace=<the model's>`: everything the namespaced collection holds.
    Namespace,
    /// `metadata.name!=cm-<n>`: one name never selected (whatever its uid).
    NotName(usize),
    /// Both.
    NamespaceNotName(usize),
}

impl Fields {
    /// A field selector; `names` objects were created so far (one of them may be excluded).
    pub fn draw(r: &mut impl Rng, names: usize) -> Fields {
        let n = r.random_range(0..names.max(1));
        match r.random_range(0..5) {
            0 | 1 => Fields::All,
            2 => Fields::Namespace,
            3 => Fields::NotName(n),
            _ => Fields::NamespaceNotName(n),
        }
    }

    pub fn selector(self) -> Option<String> {
        let ns = crate::app::NS;
        match self {
            Fields::All => None,
            Fields::Namespace => Some(format!("metadata.namespace={ns}")),
            Fields::NotName(n) => Some(format!("metadata.name!=cm-{n}")),
            Fields::NamespaceNotName(n) => {
                Some(format!("metadata.namespace={ns},metadata.name!=cm-{n}"))
            }
        }
    }

    fn matches(self, namespace: &str, name: &str) -> bool {
        let excluded = |n: usize| name == format!("cm-{n}");
        match self {
            Fields::All => true,
            Fields::Namespace => namespace == crate::app::NS,
            Fields::NotName(n) => !excluded(n),
            Fields::NamespaceNotName(n) => namespace == crate::app::NS && !excluded(n),
        }
    }

    fn code(self) -> String {
        match self {
            Fields::All => "-".into(),
            Fields::Namespace => "ns".into(),
            Fields::NotName(n) => format!("x{n}"),
            Fields::NamespaceNotName(n) => format!("nsx{n}"),
        }
    }

    fn decode(s: &str) -> Fields {
        if let Some(n) = s.strip_prefix("nsx") {
            Fields::NamespaceNotName(n.parse().unwrap())
        } else if let Some(n) = s.strip_prefix('x') {
            Fields::NotName(n.parse().unwrap())
        } else if s == "ns" {
            Fields::Namespace
        } else {
            Fields::All
        }
    }
}

/// What an object's own metadata says of it, for [`Sel::selects`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub rv: String,
    /// `metadata.generation` (the testkit counts changes besides metadata, as for a kind
    /// with a spec: a move to another tier keeps it).
    pub generation: i64,
    pub tier: Option<String>,
    pub mode: Option<String>,
    /// The model's transform marked it (annotation [`TRANSFORMED`]), and `data.blob` is
    /// absent (it drops it).
    pub transformed: bool,
    pub has_blob: bool,
}

/// The annotation the model's transform sets.
pub const TRANSFORMED: &str = "lc-transformed";
/// The transform's name (part of the store identity).
pub const TRANSFORM: &str = "lc-strip-blob-v1";

/// The model's transform: drops `data.blob`, marks the object.
pub fn transform(v: &mut serde_json::Value) {
    if let Some(data) = v.get_mut("data").and_then(|d| d.as_object_mut()) {
        data.remove("blob");
    }
    if let Some(meta) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        let ann = meta
            .entry("annotations")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(a) = ann.as_object_mut() {
            a.insert(TRANSFORMED.into(), "v1".into());
        }
    }
}

impl Meta {
    /// From an object's JSON (a server object, a raw stored one).
    pub fn of_json(o: &serde_json::Value) -> Meta {
        let m = &o["metadata"];
        let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let label = |k: &str| m["labels"][k].as_str().map(String::from);
        Meta {
            namespace: s(&m["namespace"]),
            name: s(&m["name"]),
            uid: s(&m["uid"]),
            rv: s(&m["resourceVersion"]),
            generation: m["generation"].as_i64().unwrap_or_default(),
            tier: label(TIER),
            mode: label("mode"),
            transformed: m["annotations"][TRANSFORMED] == "v1",
            has_blob: !o["data"]["blob"].is_null(),
        }
    }

    /// From typed metadata (a stored or given object); `has_blob` from its data, if any.
    pub fn of(m: &kube::api::ObjectMeta, has_blob: bool) -> Meta {
        let label = |k: &str| m.labels.as_ref().and_then(|l| l.get(k)).cloned();
        Meta {
            namespace: m.namespace.clone().unwrap_or_default(),
            name: m.name.clone().unwrap_or_default(),
            uid: m.uid.clone().unwrap_or_default(),
            rv: m.resource_version.clone().unwrap_or_default(),
            generation: m.generation.unwrap_or_default(),
            tier: label(TIER),
            mode: label("mode"),
            transformed: m
                .annotations
                .as_ref()
                .and_then(|a| a.get(TRANSFORMED))
                .is_some_and(|v| v == "v1"),
            has_blob,
        }
    }
}

/// A stream's selection: label and field selectors and a uid shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sel {
    pub labels: Labels,
    pub fields: Fields,
    /// `(index, count)` of an even uid shard, or everything.
    pub shard: Option<(u32, u32)>,
}

impl Sel {
    pub const ALL: Sel = Sel {
        labels: Labels::All,
        fields: Fields::All,
        shard: None,
    };

    pub fn shard(&self) -> Option<Shard> {
        self.shard
            .map(|(i, n)| Shard::even(ShardKey::Uid, i, n).expect("a valid shard"))
    }

    /// Whether the object with this uid is in the shard.
    pub fn owns(&self, uid: &str) -> bool {
        self.shard()
            .is_none_or(|s| s.contains(Some(uid), Some(crate::app::NS)))
    }

    /// Whether the selection holds the object `m` describes.
    pub fn selects(&self, m: &Meta) -> bool {
        self.selectors_match(m) && self.owns(&m.uid)
    }

    /// Whether the label and field selectors match `m` (whatever its shard).
    pub fn selectors_match(&self, m: &Meta) -> bool {
        self.labels.matches(m.tier.as_deref(), m.mode.as_deref())
            && self.fields.matches(&m.namespace, &m.name)
    }

    /// The selectors into a stream configuration.
    pub fn apply(&self, mut c: kube_persist::StreamConfig) -> kube_persist::StreamConfig {
        if let Some(l) = self.labels.selector() {
            c = c.labels(l);
        }
        if let Some(f) = self.fields.selector() {
            c = c.fields(&f);
        }
        if let Some(shard) = self.shard() {
            c = c.shard(shard);
        }
        c
    }

    /// A narrower shard (`None` -> half, half -> quarter), or the same.
    pub fn narrowed(shard: Option<(u32, u32)>, r: &mut impl Rng) -> Option<(u32, u32)> {
        match shard {
            None => Some((r.random_range(0..2), 2)),
            Some((i, 2)) => Some((2 * i + r.random_range(0..2), 4)),
            other => other,
        }
    }

    /// The form passed to a child process (no spaces).
    pub fn encode(&self) -> String {
        let shard = match self.shard {
            Some((i, n)) => format!("{i}/{n}"),
            None => "all".into(),
        };
        format!("{},{},{shard}", self.labels.code(), self.fields.code())
    }

    pub fn decode(s: &str) -> Sel {
        let f: Vec<&str> = s.split(',').collect();
        Sel {
            labels: Labels::ALL[f[0].parse::<usize>().unwrap()],
            fields: Fields::decode(f[1]),
            shard: f[2]
                .split_once('/')
                .map(|(i, n)| (i.parse().unwrap(), n.parse().unwrap())),
        }
    }
}

impl std::fmt::Display for Sel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(l) = self.labels.selector() {
            parts.push(format!("labels {l:?}"));
        }
        if let Some(s) = self.fields.selector() {
            parts.push(format!("fields {s:?}"));
        }
        if let Some((i, n)) = self.shard {
            parts.push(format!("shard {i}/{n}"));
        }
        if parts.is_empty() {
            return f.write_str("everything");
        }
        f.write_str(&parts.join(", "))
    }
}
