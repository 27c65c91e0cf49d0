//! kube-proxy's change trackers: what changed of one kind of object since the last sync.
use std::collections::BTreeMap;

use crate::model::objects::ObjectName;

/// Pending changes of one kind of object since the last sync, collapsed: an object changed and
/// changed back is no change; several updates are one.
#[derive(Debug)]
pub struct Tracker<T> {
    pending: BTreeMap<ObjectName, (Option<T>, Option<T>)>,
    pub total: u64,
}

impl<T> Default for Tracker<T> {
    fn default() -> Self {
        Self { pending: BTreeMap::new(), total: 0 }
    }
}

impl<T: PartialEq> Tracker<T> {
    pub fn record(&mut self, name: ObjectName, previous: Option<T>, current: Option<T>) {
        // Every real change counts (kube-proxy's *_changes_total); pending ones collapse.
        if previous != current {
            self.total += 1;
        }
        if let Some(entry) = self.pending.get_mut(&name) {
            entry.1 = current;
            if entry.0 == entry.1 {
                self.pending.remove(&name);
            }
        } else if previous != current {
            self.pending.insert(name, (previous, current));
        }
    }
    /// `record` for many objects, each named once. On an empty tracker (the first list, or a
    /// re-list after a sync took the changes) the pending map is built in one pass: 100,000
    /// inserts one by one walked down the map comparing names, on the way to the first sync.
    pub fn record_all(&mut self, mut changes: Vec<(ObjectName, Option<T>, Option<T>)>) {
        if !self.pending.is_empty() {
            for (name, previous, current) in changes {
                self.record(name, previous, current);
            }
            return;
        }
        changes.retain(|(_, previous, current)| previous != current);
        self.total += changes.len() as u64;
        self.pending = changes.into_iter().map(|(name, previous, current)| (name, (previous, current))).collect();
    }
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
    pub fn take(&mut self) -> Vec<ObjectName> {
        std::mem::take(&mut self.pending).into_keys().collect()
    }
    /// The pending changes with their previous and current state.
    pub fn take_entries(&mut self) -> Vec<(ObjectName, Option<T>, Option<T>)> {
        std::mem::take(&mut self.pending).into_iter().map(|(n, (p, c))| (n, p, c)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_collapses() {
        let mut t: Tracker<u32> = Tracker::default();
        let n = ("ns".to_string(), "a".to_string());
        t.record(n.clone(), Some(1), Some(2));
        t.record(n.clone(), Some(2), Some(3));
        assert_eq!(t.pending(), 1);
        t.record(n.clone(), Some(3), Some(1));
        assert_eq!(t.pending(), 0, "changed back: nothing pending");
        t.record(n.clone(), None, Some(5));
        assert_eq!(t.take(), vec![n]);
        assert_eq!(t.pending(), 0);
    }

    #[test]
    fn recording_many_at_once_is_recording_each() {
        let n = |s: &str| ("ns".to_string(), s.to_string());
        let changes = || vec![(n("b"), None, Some(1)), (n("a"), Some(1), Some(2)), (n("c"), Some(3), None), (n("d"), Some(4), Some(4))];
        let entries = |t: &mut Tracker<u32>| (t.total, t.take_entries());
        // An empty tracker (built in one pass) and one with changes pending (one by one).
        for pending in [None, Some((n("a"), Some(2), Some(1)))] {
            let (mut at_once, mut each) = (Tracker::default(), Tracker::default());
            for t in [&mut at_once, &mut each] {
                if let Some((name, p, c)) = pending.clone() {
                    t.record(name, p, c);
                }
            }
            at_once.record_all(changes());
            for (name, p, c) in changes() {
                each.record(name, p, c);
            }
            assert_eq!(entries(&mut at_once), entries(&mut each), "pending before: {pending:?}");
        }
        let mut t = Tracker::default();
        t.record_all(changes());
        assert_eq!(t.take(), vec![n("a"), n("b"), n("c")], "in name order, the unchanged one left out");
    }
}
