//! One shared copy of the values a cluster repeats across its objects: node and zone names,
//! the values of a small set (types, policies, protocols, port names), endpoints' places.
use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

/// Node and zone names, the values of a small set (types, policies, protocols, port names) and
/// endpoints' places, one copy each. Values nothing holds any more are dropped when the table
/// has doubled since it was last pruned, so node churn does not grow it for ever.
pub(crate) struct Interner<T: ?Sized> {
    names: HashSet<Arc<T>>,
    pruned_at: usize,
}

impl<T: ?Sized> Default for Interner<T> {
    fn default() -> Self {
        Self { names: HashSet::new(), pruned_at: 0 }
    }
}

impl<T: ?Sized + std::hash::Hash + Eq> Interner<T> {
    fn get(&self, value: &T) -> Option<Arc<T>> {
        self.names.get(value).cloned()
    }

    fn insert(&mut self, new: Arc<T>) -> Arc<T> {
        if self.names.len() >= (self.pruned_at * 2).max(1024) {
            self.names.retain(|n| Arc::strong_count(n) > 1);
            self.pruned_at = self.names.len();
        }
        self.names.insert(new.clone());
        new
    }
}

impl Interner<str> {
    fn intern(&mut self, name: String) -> Arc<str> {
        self.get(&name).unwrap_or_else(|| self.insert(name.into()))
    }
}

pub(crate) fn intern(name: String) -> Arc<str> {
    static NAMES: Mutex<Option<Interner<str>>> = Mutex::new(None);
    NAMES.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get_or_insert_with(Interner::default).intern(name)
}

pub(crate) fn intern_in<T: std::hash::Hash + Eq>(table: &Mutex<Option<Interner<T>>>, value: T) -> Arc<T> {
    let mut table = table.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let table = table.get_or_insert_with(Interner::default);
    table.get(&value).unwrap_or_else(|| table.insert(Arc::new(value)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_stored_once_and_dropped_once_unused() {
        let mut table: Interner<str> = Interner::default();
        let first = table.intern("node-a".to_string());
        assert!(Arc::ptr_eq(&first, &table.intern("node-a".to_string())), "the second endpoint on a node shares its name");
        drop(first);
        let held: Vec<Arc<str>> = (0..1023).map(|i| table.intern(format!("node-{i}"))).collect();
        assert_eq!(table.names.len(), 1024, "no prune below 1,024 names");
        // The 1,025th name prunes: node-a, which nothing holds, goes; the names in use stay.
        let _next = table.intern("node-b".to_string());
        assert_eq!((table.names.len(), table.pruned_at), (1024, 1023));
        assert!(!table.names.contains("node-a") && held.iter().all(|n| table.names.contains(n)));
    }
}
