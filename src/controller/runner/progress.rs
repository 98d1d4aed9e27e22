//! How far a pass is done: the objects it asked to reconcile, in its order, and the
//! position up to which every one of them has been reconciled (or needed nothing).
//!
//! A durable controller records that position after each reconcile ([`Progress::moved`]),
//! so that a restart, graceful or not, resumes the pass there: an object is counted done
//! only once a reconcile (or a read) dispatched after the pass asked for it has finished
//! (or failed), so a crash reconciles it again rather than skipping it.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use crate::controller::scan::Position;

/// Where one object of a pass is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Item {
    /// Not dispatched yet.
    Waiting,
    /// Being read or reconciled.
    Dispatched,
    Done,
}

enum Entry<R> {
    Object {
        obj: R,
        at: Position,
        item: Item,
    },
    /// Every key up to here that is not an earlier `Object` needed nothing.
    Through(Position),
}

/// The objects of one pass still owed, in pass order, and the position done.
pub(crate) struct Progress<R> {
    entries: VecDeque<Entry<R>>,
    /// Sequence number of `entries[0]`.
    base: u64,
    /// The entry of each object still owed.
    index: HashMap<R, u64>,
    done: Position,
    moved: bool,
    waiting: usize,
}

impl<R: Clone + Eq + Hash> Progress<R> {
    /// A pass done up to `done`.
    pub(crate) fn new(done: Position) -> Self {
        Progress {
            entries: VecDeque::new(),
            base: 0,
            index: HashMap::new(),
            done,
            moved: false,
            waiting: 0,
        }
    }

    fn entry(&mut self, obj: &R) -> Option<&mut Item> {
        let seq = *self.index.get(obj)?;
        // The index points only at entries still owed: one that `advance` settled (and
        // popped) is removed from it, or replaced by the object's later entry.
        debug_assert!(
            seq >= self.base,
            "entry {seq} of an object settled (the first owed is {})",
            self.base
        );
        match self.entries.get_mut((seq - self.base) as usize) {
            Some(Entry::Object { item, .. }) => Some(item),
            _ => None,
        }
    }

    /// The pass asks for `obj` (at `at` in its order).
    pub(crate) fn push(&mut self, obj: R, at: Position) {
        // A key comes once per circle; an entry still owed from before is settled by the
        // same reconcile as this one.
        let mut was_waiting = false;
        if let Some(item) = self.entry(&obj) {
            was_waiting = *item == Item::Waiting;
            *item = Item::Done;
        }
        if was_waiting {
            self.waiting -= 1;
        }
        let seq = self.base + self.entries.len() as u64;
        self.index.insert(obj.clone(), seq);
        self.entries.push_back(Entry::Object {
            obj,
            at,
            item: Item::Waiting,
        });
        self.waiting += 1;
        debug_assert!(
            self.waiting <= self.index.len(),
            "{} objects waiting, {} owed",
            self.waiting,
            self.index.len()
        );
    }

    /// Every key up to `at` not asked for needed nothing.
    pub(crate) fn through(&mut self, at: Position) {
        self.entries.push_back(Entry::Through(at));
        self.advance();
    }

    /// A reconcile of `obj` was dispatched (read, then reconciled).
    pub(crate) fn dispatched(&mut self, obj: &R) {
        if let Some(item) = self.entry(obj)
            && *item == Item::Waiting
        {
            *item = Item::Dispatched;
            self.waiting -= 1;
        }
    }

    /// A dispatched reconcile of `obj` finished (or was skipped, or found no object, or
    /// its read failed).
    pub(crate) fn finished(&mut self, obj: &R) {
        if let Some(item) = self.entry(obj)
            && *item == Item::Dispatched
        {
            *item = Item::Done;
            self.advance();
        }
    }

    fn advance(&mut self) {
        while let Some(front) = self.entries.front() {
            match front {
                Entry::Object {
                    item: Item::Waiting | Item::Dispatched,
                    ..
                } => break,
                Entry::Object { .. } => {
                    let Some(Entry::Object { obj, at, .. }) = self.entries.pop_front() else {
                        unreachable!("matched above");
                    };
                    if self.index.get(&obj) == Some(&self.base) {
                        self.index.remove(&obj);
                    }
                    debug_assert!(
                        at.at_or_after(&self.done),
                        "a pass position only moves forward"
                    );
                    self.done = at;
                }
                Entry::Through(_) => {
                    let Some(Entry::Through(at)) = self.entries.pop_front() else {
                        unreachable!("matched above");
                    };
                    debug_assert!(
                        at.at_or_after(&self.done),
                        "a pass position only moves forward"
                    );
                    self.done = at;
                }
            }
            self.base += 1;
            self.moved = true;
        }
    }

    /// The new position done, if it moved since the last call.
    pub(crate) fn moved(&mut self) -> Option<Position> {
        std::mem::take(&mut self.moved).then(|| self.done.clone())
    }

    /// Whether `obj` is asked for and not dispatched yet.
    pub(crate) fn owes(&self, obj: &R) -> bool {
        let Some(&seq) = self.index.get(obj) else {
            return false;
        };
        debug_assert!(seq >= self.base, "entry {seq} of an object settled");
        matches!(
            self.entries.get((seq - self.base) as usize),
            Some(Entry::Object {
                item: Item::Waiting,
                ..
            })
        )
    }

    /// Entries still kept: from the first object not done to the last one asked for.
    pub(crate) fn owed(&self) -> usize {
        self.entries.len()
    }

    /// Objects asked for and not dispatched yet.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting
    }

    /// Whether every object asked for so far is done.
    pub(crate) fn settled(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(key: &str) -> Position {
        Position {
            after: Some(key.as_bytes().to_vec()),
            wrapped: false,
        }
    }

    #[test]
    fn the_position_moves_only_past_finished_objects() {
        let mut p = Progress::new(Position::default());
        for k in ["a", "b", "c"] {
            p.push(k, at(k));
        }
        p.through(at("d"));
        assert_eq!(p.waiting(), 3);
        assert_eq!(p.moved(), None);
        for k in ["a", "b", "c"] {
            p.dispatched(&k);
        }
        // b finishes first: nothing moves while a runs.
        p.finished(&"b");
        assert_eq!(p.moved(), None);
        p.finished(&"a");
        assert_eq!(p.moved(), Some(at("b")));
        // A finish without a dispatch after the pass asked does not count (a reconcile
        // that started before it).
        p.push("e", at("e"));
        p.finished(&"e");
        assert_eq!(p.waiting(), 1);
        p.dispatched(&"e");
        // A failed read counts as an attempt (the request keeps its own retry).
        p.finished(&"c");
        assert_eq!(p.moved(), Some(at("d")));
        p.finished(&"e");
        assert_eq!(p.moved(), Some(at("e")));
        assert!(p.settled());
    }

    #[test]
    fn an_object_asked_for_again_is_settled_once() {
        let mut p = Progress::new(Position::default());
        p.push("a", at("a"));
        p.push("a", at("a2"));
        assert_eq!(p.waiting(), 1);
        p.dispatched(&"a");
        p.finished(&"a");
        assert_eq!(p.moved(), Some(at("a2")));
        assert!(p.settled());
    }
}
