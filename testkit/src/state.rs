//! Objects, the global revision, the bounded event history and snapshot reads.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::Arc;

use crate::object::{self, Key, Prepared, Stamp, StoredObject};
use crate::resource::ResourceType;
use crate::rv;
use crate::selectors::{FieldSelector, LabelSelector, ShardSelector};
use crate::status::ApiError;

/// Kind of a change recorded in the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    Added,
    Modified,
    Deleted,
}

/// One write, as retained in the history and replayed to watches.
#[derive(Debug)]
pub(crate) struct HistoryEvent {
    pub rev: u64,
    /// Index of the resource type.
    pub ty: usize,
    pub kind: EventKind,
    /// New state; for deletions the last state stamped with the deletion revision.
    pub obj: Arc<StoredObject>,
    /// State before this event (`None` for creations).
    pub prev: Option<Arc<StoredObject>>,
}

/// Selection applied to lists and watches.
#[derive(Debug, Clone, Default)]
pub(crate) struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    /// `shardSelector`, when the server has the `ShardedListAndWatch` feature.
    pub shard: Option<ShardSelector>,
}

impl Filter {
    pub(crate) fn matches(&self, o: &StoredObject) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == o.namespace)
            && self.labels.matches(&o.labels)
            && match self.fields.uses_node_name() {
                true => {
                    let node = o.value()["spec"]["nodeName"].as_str().map(str::to_string);
                    self.fields
                        .matches_on(&o.namespace, &o.name, node.as_deref().unwrap_or(""))
                }
                false => self.fields.matches(&o.namespace, &o.name),
            }
            && self
                .shard
                .as_ref()
                .is_none_or(|s| s.matches(&o.uid, &o.namespace))
    }

    /// Whether the filter is only a namespace restriction (or nothing).
    pub(crate) fn is_trivial(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty() && self.shard.is_none()
    }
}

/// One page of a snapshot list.
pub(crate) struct Page {
    pub items: Vec<Arc<StoredObject>>,
    /// Key of the last returned item, when more matching items remain.
    pub next_after: Option<Key>,
    /// Number of objects of the type at the snapshot in the list's scope (its namespace,
    /// if any, else cluster-wide).
    pub total: usize,
}

/// All server data. Guarded by one mutex in [`crate::shared::Shared`].
#[derive(Debug)]
pub(crate) struct State {
    /// Current global revision (0 before any write).
    pub revision: u64,
    types: Vec<ResourceType>,
    index: HashMap<ResourceType, usize>,
    collections: Vec<BTreeMap<Key, Arc<StoredObject>>>,
    history: VecDeque<Arc<HistoryEvent>>,
    history_cap: usize,
    /// Lowest revision R such that every event with rev > R is retained.
    pub floor: u64,
    /// Number of `compact()` calls; continue tokens carry it.
    pub compactions: u64,
    /// Whether resourceVersions are rendered opaque (see [`crate::rv`]).
    pub opaque: bool,
}

impl State {
    pub(crate) fn new(history_cap: usize, opaque: bool) -> Self {
        let mut s = Self {
            revision: 0,
            types: Vec::new(),
            index: HashMap::new(),
            collections: Vec::new(),
            history: VecDeque::new(),
            history_cap: history_cap.max(1),
            floor: 0,
            compactions: 0,
            opaque,
        };
        for rt in ResourceType::builtin() {
            s.register(&rt);
        }
        s
    }

    /// Registers a resource type (idempotent) and returns its index.
    pub(crate) fn register(&mut self, rt: &ResourceType) -> usize {
        if let Some(&i) = self.index.get(rt) {
            return i;
        }
        self.types.push(rt.clone());
        self.collections.push(BTreeMap::new());
        self.index.insert(rt.clone(), self.types.len() - 1);
        self.types.len() - 1
    }

    /// A revision as the server renders it in `resourceVersion` fields.
    pub(crate) fn rv(&self, rev: u64) -> String {
        rv::render(rev, self.opaque)
    }

    /// Finds a type by URL coordinates.
    pub(crate) fn lookup(&self, group: &str, version: &str, plural: &str) -> Option<usize> {
        self.types
            .iter()
            .position(|t| t.group == group && t.version == version && t.plural == plural)
    }

    pub(crate) fn resource_type(&self, ty: usize) -> &ResourceType {
        &self.types[ty]
    }

    pub(crate) fn get(&self, ty: usize, ns: &str, name: &str) -> Option<Arc<StoredObject>> {
        self.collections[ty]
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    /// All current objects of a type matching `filter`, in key order.
    pub(crate) fn current(&self, ty: usize, filter: &Filter) -> Vec<Arc<StoredObject>> {
        let coll = &self.collections[ty];
        let iter: Box<dyn Iterator<Item = &Arc<StoredObject>>> = match &filter.namespace {
            Some(ns) => Box::new(
                coll.range((ns.clone(), String::new())..)
                    .take_while(move |((n, _), _)| n == ns)
                    .map(|(_, v)| v),
            ),
            None => Box::new(coll.values()),
        };
        iter.filter(|o| filter.matches(o)).cloned().collect()
    }

    /// Keys of all objects of a type (used by churn to pick random victims).
    pub(crate) fn keys(&self, ty: usize) -> Vec<Key> {
        self.collections[ty].keys().cloned().collect()
    }

    fn push(&mut self, ev: HistoryEvent) {
        self.revision = ev.rev;
        self.history.push_back(Arc::new(ev));
        while self.history.len() > self.history_cap {
            if let Some(old) = self.history.pop_front() {
                self.floor = self.floor.max(old.rev);
            }
        }
    }

    /// Creates an object (409 AlreadyExists if present).
    pub(crate) fn create(&mut self, ty: usize, p: Prepared) -> Result<Arc<StoredObject>, ApiError> {
        let key = (p.namespace.clone(), p.name.clone());
        if self.collections[ty].contains_key(&key) {
            return Err(ApiError::already_exists(
                &self.types[ty].qualified(),
                &p.name,
            ));
        }
        let rev = self.revision + 1;
        let (uid, created) = (object::new_uid(), object::now_rfc3339());
        let rv = self.rv(rev);
        let stamp = Stamp {
            rev,
            rv: &rv,
            uid: &uid,
            created: &created,
            generation: 1,
        };
        let obj = Arc::new(object::finalize(&self.types[ty], p, stamp));
        self.collections[ty].insert(key, obj.clone());
        self.push(HistoryEvent {
            rev,
            ty,
            kind: EventKind::Added,
            obj: obj.clone(),
            prev: None,
        });
        Ok(obj)
    }

    /// Inserts a new object already stamped with `revision + 1` (the fast seeding path).
    /// Returns false, storing nothing, if the key exists or the revision is not the next one.
    pub(crate) fn insert_created(&mut self, ty: usize, obj: StoredObject) -> bool {
        let key = obj.key();
        if obj.rev != self.revision + 1 || self.collections[ty].contains_key(&key) {
            return false;
        }
        let obj = Arc::new(obj);
        self.collections[ty].insert(key, obj.clone());
        self.push(HistoryEvent {
            rev: obj.rev,
            ty,
            kind: EventKind::Added,
            obj,
            prev: None,
        });
        true
    }

    /// Replaces an object (404 if absent, 409 Conflict on a stale resourceVersion, 400 on a
    /// resourceVersion the server would not have rendered). With `check_rv == false` the
    /// sent resourceVersion is ignored.
    pub(crate) fn replace(
        &mut self,
        ty: usize,
        p: Prepared,
        check_rv: bool,
    ) -> Result<Arc<StoredObject>, ApiError> {
        let key = (p.namespace.clone(), p.name.clone());
        let Some(old) = self.collections[ty].get(&key).cloned() else {
            return Err(ApiError::not_found(&self.types[ty].qualified(), &p.name));
        };
        if let (true, Some(sent)) = (check_rv, &p.resource_version) {
            let sent = rv::parse(sent, self.opaque).ok_or_else(|| rv::invalid(sent))?;
            if sent != old.rev {
                return Err(ApiError::conflict(&self.types[ty].qualified(), &p.name));
            }
        }
        let rev = self.revision + 1;
        let rv = self.rv(rev);
        let stamp = Stamp {
            rev,
            rv: &rv,
            uid: &old.uid,
            created: &old.created,
            // As kube-apiserver: the generation counts changes of the desired state, not of
            // metadata (labels, annotations, ...) or status.
            generation: if object::same_desired_state(&old, &p.value) {
                old.generation
            } else {
                old.generation + 1
            },
        };
        let obj = Arc::new(object::finalize(&self.types[ty], p, stamp));
        self.collections[ty].insert(key, obj.clone());
        self.push(HistoryEvent {
            rev,
            ty,
            kind: EventKind::Modified,
            obj: obj.clone(),
            prev: Some(old),
        });
        Ok(obj)
    }

    /// Deletes an object; returns its last state stamped with the deletion revision.
    pub(crate) fn delete(&mut self, ty: usize, ns: &str, name: &str) -> Option<Arc<StoredObject>> {
        let old = self.collections[ty].remove(&(ns.to_string(), name.to_string()))?;
        let rev = self.revision + 1;
        let obj = Arc::new(object::deletion_state(&old, rev, &self.rv(rev)));
        self.push(HistoryEvent {
            rev,
            ty,
            kind: EventKind::Deleted,
            obj: obj.clone(),
            prev: Some(old),
        });
        Some(obj)
    }

    /// Forgets all history: only revisions >= now remain readable.
    pub(crate) fn compact(&mut self) {
        self.history.clear();
        self.floor = self.revision;
        self.compactions += 1;
    }

    /// Up to `max` retained events with `rev > cursor`; `Err(floor)` if some were forgotten.
    pub(crate) fn events_after(
        &self,
        cursor: u64,
        max: usize,
    ) -> Result<Vec<Arc<HistoryEvent>>, u64> {
        if cursor < self.floor {
            return Err(self.floor);
        }
        let Some(front) = self.history.front() else {
            return Ok(Vec::new());
        };
        let start = (cursor + 1).saturating_sub(front.rev) as usize;
        Ok(self.history.iter().skip(start).take(max).cloned().collect())
    }

    /// State of each key changed after `snapshot`, as it was at `snapshot`.
    fn overlay(&self, ty: usize, snapshot: u64) -> BTreeMap<Key, Option<Arc<StoredObject>>> {
        let mut overlay = BTreeMap::new();
        if let Some(front) = self.history.front() {
            let start = (snapshot + 1).saturating_sub(front.rev) as usize;
            for ev in self.history.iter().skip(start).filter(|e| e.ty == ty) {
                overlay
                    .entry(ev.obj.key())
                    .or_insert_with(|| ev.prev.clone());
            }
        }
        overlay
    }

    /// One page of the list of `ty` as it was at `snapshot` (caller checks `snapshot >= floor`),
    /// starting after `after`, at most `limit` matching items.
    pub(crate) fn list_page(
        &self,
        ty: usize,
        snapshot: u64,
        after: Option<&Key>,
        limit: Option<usize>,
        filter: &Filter,
    ) -> Page {
        let overlay = if snapshot < self.revision {
            self.overlay(ty, snapshot)
        } else {
            BTreeMap::new()
        };
        let coll = &self.collections[ty];
        // Objects in the list's scope (the namespace, if any) at `snapshot`, for
        // `remainingItemCount` (kube-apiserver gives it for namespaced lists too).
        let in_scope = |k: &Key| filter.namespace.as_ref().is_none_or(|ns| *ns == k.0);
        let now = match &filter.namespace {
            None => coll.len(),
            Some(ns) => coll
                .range::<Key, _>((
                    Bound::Included((ns.clone(), String::new())),
                    Bound::Unbounded,
                ))
                .take_while(|(k, _)| k.0 == *ns)
                .count(),
        };
        let total = overlay
            .iter()
            .filter(|(k, _)| in_scope(k))
            .fold(now, |n, (k, then)| {
                match (then.is_some(), coll.contains_key(k)) {
                    (true, false) => n + 1,
                    (false, true) => n - 1,
                    _ => n,
                }
            });
        let start: Bound<Key> = match (after, &filter.namespace) {
            (Some(k), _) => Bound::Excluded(k.clone()),
            (None, Some(ns)) => Bound::Included((ns.clone(), String::new())),
            (None, None) => Bound::Unbounded,
        };
        let range = (start, Bound::Unbounded);
        let mut cur = coll.range::<Key, _>(range.clone()).peekable();
        let mut ov = overlay.range::<Key, _>(range).peekable();
        let limit = limit.unwrap_or(usize::MAX);
        let mut items = Vec::new();
        let mut next_after = None;
        loop {
            let ck: Option<&Key> = cur.peek().map(|(k, _)| *k);
            let ok: Option<&Key> = ov.peek().map(|(k, _)| *k);
            let from_current = match (ck, ok) {
                (None, None) => break,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(c), Some(o)) => {
                    if c == o {
                        cur.next();
                    }
                    c < o
                }
            };
            let (key, obj): (&Key, Option<&Arc<StoredObject>>) = if from_current {
                let Some((k, v)) = cur.next() else { break };
                (k, Some(v))
            } else {
                let Some((k, v)) = ov.next() else { break };
                (k, v.as_ref())
            };
            if filter.namespace.as_ref().is_some_and(|ns| *ns != key.0) {
                break;
            }
            let Some(obj) = obj else { continue };
            if !filter.matches(obj) {
                continue;
            }
            if items.len() == limit {
                next_after = items.last().map(|o: &Arc<StoredObject>| o.key());
                break;
            }
            items.push(obj.clone());
        }
        Page {
            items,
            next_after,
            total,
        }
    }
}
