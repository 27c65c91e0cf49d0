//! What the maps hold, as far as the syncer is concerned: the mirror a sync diffs against, and
//! the read it is built from.
use std::collections::BTreeSet;

use foldhash::HashMap as FastMap;

use proxy_common::{limits::MAX_BACKENDS_PER_SERVICE, Backend, DatapathConfig, ServiceKey, ServiceValue, SlotKey};

use crate::dataplane::ebpf::{
    ids::{IdSet, Ids},
    maps::{DatapathMaps, MapError, SrcRange},
};

/// What the maps hold, as far as the syncer is concerned.
#[derive(Debug, Default)]
pub(super) struct Mirror {
    pub(super) config: DatapathConfig,
    pub(super) services: FastMap<ServiceKey, ServiceValue>,
    pub(super) backends: HeldBackends,
    pub(super) slots: FastMap<u32, Slots>,
    /// Slots past any a service may have (written by hand): deleted by the next full sync.
    pub(super) stray_slots: Vec<SlotKey>,
    pub(super) ranges: BTreeSet<SrcRange>,
}

/// A service's slots as the maps hold them: slot n's backend id at index n - 1 (0: none; no
/// backend has id 0). 40 bytes for ten, where a B-tree node took 112.
#[derive(Debug, Default, Clone)]
pub(super) struct Slots(Vec<u32>);

impl Slots {
    pub(super) fn get(&self, slot: u32) -> Option<u32> {
        self.0.get((slot as usize).wrapping_sub(1)).copied().filter(|id| *id != 0)
    }

    pub(super) fn reserve(&mut self, slots: usize) {
        self.0.reserve_exact(slots.saturating_sub(self.0.len()));
    }

    /// `slot` is 1..=MAX_BACKENDS_PER_SERVICE.
    pub(super) fn insert(&mut self, slot: u32, id: u32) {
        let i = slot as usize - 1;
        if self.0.len() <= i {
            self.0.resize(i + 1, 0);
        }
        self.0[i] = id;
    }

    pub(super) fn remove(&mut self, slot: u32) {
        if let Some(id) = self.0.get_mut((slot as usize).wrapping_sub(1)) {
            *id = 0;
        }
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
    }

    pub(super) fn len(&self) -> usize {
        self.ids().count()
    }

    /// The slot numbers held.
    pub(super) fn numbers(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().filter(|(_, id)| **id != 0).map(|(i, _)| i as u32 + 1)
    }

    pub(super) fn numbers_past(&self, n: u32) -> Vec<u32> {
        self.numbers().filter(|s| *s > n).collect()
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied().filter(|id| *id != 0)
    }

    /// The ids of slots 1..=count that are held.
    pub(super) fn ids_upto(&self, count: u32) -> Vec<u32> {
        self.0.iter().take(count as usize).copied().filter(|id| *id != 0).collect()
    }
}

/// What the service, slot, backend and source-range maps hold, as read: what a full sync
/// starts from, before the ids are taken over from it.
pub struct MapsRead {
    pub(super) services: Vec<(ServiceKey, ServiceValue)>,
    pub(super) backends: Vec<(u32, Backend)>,
    pub(super) slots: FastMap<u32, Slots>,
    pub(super) stray_slots: Vec<SlotKey>,
    pub(super) ranges: BTreeSet<SrcRange>,
}

impl MapsRead {
    pub fn read(maps: &dyn DatapathMaps) -> Result<Self, MapError> {
        let mut slots: FastMap<u32, Slots> = FastMap::default();
        let mut stray_slots = Vec::new();
        for (k, id) in maps.slots()? {
            if (1..=MAX_BACKENDS_PER_SERVICE).contains(&k.slot) && id != 0 {
                slots.entry(k.service_id).or_default().insert(k.slot, id);
            } else {
                stray_slots.push(k);
            }
        }
        slots.values_mut().for_each(|s| s.0.shrink_to_fit());
        Ok(Self { services: maps.services()?, backends: maps.backends()?, slots, stray_slots, ranges: maps.source_ranges()?.into_iter().collect() })
    }
}

impl Mirror {
    /// The mirror of what was read; the ids in it are taken over first, after a restart.
    pub(super) fn build(read: MapsRead, config: DatapathConfig, ids: &mut Ids) -> Self {
        let MapsRead { services, backends, slots, stray_slots, ranges } = read;
        if !ids.seeded {
            ids.seed(&services, &backends);
        }
        let mut held = HeldBackends::default();
        for (id, b) in backends {
            held.set(ids, id, b);
        }
        Self { config, services: services.into_iter().collect(), backends: held, slots, stray_slots, ranges }
    }
}

/// The backend map's entries, without a second copy of a million backends: an entry that holds
/// what the id table gives its id to (every entry, but for drift) is a bit; any other is kept
/// whole. The id table changes an id's backend only once the id is free, and an id is freed
/// only after its entry left the map (`Ids::retain_backends`, `release_backend`).
#[derive(Debug, Default)]
pub(super) struct HeldBackends {
    pub(super) as_given: IdSet,
    pub(super) other: FastMap<u32, Backend>,
}

impl HeldBackends {
    pub(super) fn get(&self, ids: &Ids, id: u32) -> Option<Backend> {
        match self.other.get(&id) {
            Some(b) => Some(*b),
            None if self.as_given.contains(id) => ids.backend_of(id),
            None => None,
        }
    }

    pub(super) fn set(&mut self, ids: &Ids, id: u32, b: Backend) {
        if ids.backend_of(id) == Some(b) {
            self.as_given.insert(id);
            self.other.remove(&id);
        } else {
            self.as_given.remove(id);
            self.other.insert(id, b);
        }
    }

    pub(super) fn remove(&mut self, id: u32) {
        self.as_given.remove(id);
        self.other.remove(&id);
    }

    pub(super) fn contains(&self, id: u32) -> bool {
        self.as_given.contains(id) || self.other.contains_key(&id)
    }

    pub(super) fn len(&self) -> usize {
        self.as_given.len() + self.other.len()
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.as_given.iter().chain(self.other.keys().copied())
    }
}
