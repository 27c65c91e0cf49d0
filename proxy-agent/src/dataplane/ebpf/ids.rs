//! Stable ids for the fast path's maps, Cilium's model: a service id per frontend, with a
//! generation that changes each time the id is given out again (so a flow of its previous owner
//! is never taken for the new one's); a backend id per backend; a Maglev row per Maglev service.
//! Recovered from the maps after a restart (`seed`), so a restart changes nothing that works.
use std::{
    collections::{BTreeSet, VecDeque},
    hash::BuildHasher,
    time::{Duration, Instant},
};

use foldhash::{fast::RandomState, HashMap};
use hashbrown::HashTable;

use proxy_common::{Backend, ServiceKey, ServiceValue, SCHED_MAGLEV};

mod by_id;
use by_id::{BackendsById, Packed};
pub(crate) use by_id::{ById, IdSet};

pub(crate) struct Ids {
    backends: BackendIds,
    services: HashMap<ServiceKey, u32>,
    /// Service id -> its ServiceValue::generation.
    generations: HashMap<u32, u16>,
    next_generation: u16,
    free_services: BTreeSet<u32>,
    next_service: u32,
    /// Service ids are 1..max_services (0 is never given out).
    max_services: u32,
    maglev_rows: HashMap<u32, u32>,
    free_maglev_rows: BTreeSet<u32>,
    /// Recovered from the maps once.
    pub seeded: bool,
}

/// Backend ids, 1..limit: below the backend map's capacity, so the per-backend arrays
/// (KPR_BE_NEW, KPR_BE_ACTIVE, as large as the backend map) have a slot for each, however many
/// pods a node sees come and go. Fresh ids first; once every id has been used, the one freed
/// longest ago, and never one freed less than `REUSE_AFTER` ago: the cleanup of a removed
/// backend's flows and affinity entries (by service and backend id, on the collector's thread
/// after the sync) must not meet its successor's.
///
/// Dense: at 100,000 Services a million backends are 8 bytes each here (IPv4's, packed:
/// `BackendsById`) and 4 bytes in the index, where a hash map of backend -> id took 29 bytes a
/// bucket with half the buckets empty.
struct BackendIds {
    /// id -> its backend (none where it is free).
    by_id: BackendsById,
    /// The ids in use, found by their backend.
    by_key: HashTable<u32>,
    hasher: RandomState,
    /// Freed ids and when, the oldest first (may name an id given out again since: skipped).
    free: VecDeque<(u32, Instant)>,
    /// Ids the backend map holds that the table does not give out (after a restart, a second
    /// id for a backend): freed when their entry is deleted, not before.
    orphans: IdSet,
    next: u32,
    limit: u32,
    reuse_after: Duration,
}

/// How long a freed backend id rests before it is given out again.
const REUSE_AFTER: Duration = Duration::from_secs(60);

impl BackendIds {
    fn new(limit: u32) -> Self {
        Self {
            by_id: BackendsById::default(),
            by_key: HashTable::new(),
            hasher: RandomState::default(),
            free: VecDeque::new(),
            orphans: IdSet::default(),
            next: 1,
            limit,
            reuse_after: REUSE_AFTER,
        }
    }

    fn in_use(&self, id: u32) -> bool {
        self.by_id.in_use(id)
    }

    fn hash(&self, b: &Backend) -> u64 {
        self.hasher.hash_one(b)
    }

    fn find(&self, hash: u64, b: &Backend) -> Option<u32> {
        let (by_id, want) = (&self.by_id, Packed::of(b));
        self.by_key.find(hash, |&id| by_id.holds(id, want, b)).copied()
    }

    fn get(&self, b: &Backend) -> Option<u32> {
        self.find(self.hash(b), b)
    }

    fn assign(&mut self, id: u32, b: Backend) {
        self.assign_hashed(id, b, self.hash(&b));
    }

    fn assign_hashed(&mut self, id: u32, b: Backend, hash: u64) {
        self.by_id.set(id, b, self.limit);
        let (by_id, hasher) = (&self.by_id, &self.hasher);
        self.by_key.insert_unique(hash, id, |&i| hasher.hash_one(by_id.expect(i)));
    }

    /// Room for `more` backends than the table holds now, without growing it step by step:
    /// each growth rehashes every entry, reading its backend at a random place of `by_id`.
    fn reserve(&mut self, more: usize) {
        let (by_id, hasher) = (&self.by_id, &self.hasher);
        self.by_key.reserve(more, |&i| hasher.hash_one(by_id.expect(i)));
        let ids = (self.by_key.len() + more + 1).min(self.limit as usize);
        self.by_id.reserve_up_to(ids);
    }

    /// `b`'s id, given out now if it has none; None when every id is in use.
    fn give(&mut self, b: Backend) -> Option<u32> {
        let hash = self.hash(&b);
        if let Some(id) = self.find(hash, &b) {
            return Some(id);
        }
        let id = if self.next < self.limit {
            self.next += 1;
            self.next - 1
        } else {
            loop {
                let (id, freed) = *self.free.front()?;
                if freed.elapsed() < self.reuse_after {
                    return None;
                }
                self.free.pop_front();
                if !self.in_use(id) {
                    break id;
                }
            }
        };
        self.assign_hashed(id, b, hash);
        Some(id)
    }

    /// Frees `id` (nothing if it is neither in use nor an orphan).
    fn release(&mut self, id: u32) {
        if self.orphans.contains(id) {
            self.orphans.remove(id);
        } else if let Some(b) = self.by_id.take(id) {
            if let Ok(entry) = self.by_key.find_entry(self.hasher.hash_one(b), |&i| i == id) {
                entry.remove();
            }
        } else {
            return;
        }
        self.free.push_back((id, Instant::now()));
    }
}

impl Ids {
    pub fn new(max_services: u32, max_backends: u32, maglev_rows: u32) -> Self {
        Ids {
            backends: BackendIds::new(max_backends),
            services: HashMap::default(),
            generations: HashMap::default(),
            next_generation: 1,
            free_services: BTreeSet::new(),
            next_service: 1,
            max_services,
            maglev_rows: HashMap::default(),
            free_maglev_rows: (0..maglev_rows).collect(),
            seeded: false,
        }
    }

    /// Recovers the ids a previous agent gave out, from its maps. A backend id at or above the
    /// limit (an agent before ids were bounded) is not taken over: the full sync gives that
    /// backend a new id and deletes the old entry once no slot points to it. Nor is a service id
    /// at or above `max_services` (a larger capacity before, or a damaged entry): the full sync
    /// gives the frontend a new id, and the free ids stay bounded by the capacity.
    pub fn seed(&mut self, services: &[(ServiceKey, ServiceValue)], backends: &[(u32, Backend)]) {
        let limit = self.backends.limit;
        for (id, b) in backends.iter().filter(|(id, _)| (1..limit).contains(id)) {
            // Every id the map holds stays out of use by another backend until deleted.
            self.backends.next = self.backends.next.max(id + 1);
            if *b != Backend::default() && self.backends.get(b).is_none() {
                self.backends.assign(*id, *b);
            } else {
                self.backends.orphans.insert(*id);
            }
        }
        // Free since before the restart: given out again without waiting.
        let long_ago = Instant::now().checked_sub(REUSE_AFTER).unwrap_or_else(Instant::now);
        let b = &self.backends;
        let free = (1..b.next).filter(|id| !b.in_use(*id) && !b.orphans.contains(*id)).map(|id| (id, long_ago)).collect();
        self.backends.free = free;
        let mut used = BTreeSet::new();
        let ids = 1..self.max_services;
        for (k, v) in services.iter().filter(|(_, v)| ids.contains(&v.service_id)) {
            self.services.insert(*k, v.service_id);
            self.generations.insert(v.service_id, v.generation);
            self.note_generation(v.generation);
            used.insert(v.service_id);
            if v.scheduler == SCHED_MAGLEV {
                self.maglev_rows.insert(v.service_id, v.maglev_row);
                self.free_maglev_rows.remove(&v.maglev_row);
            }
        }
        let max = used.iter().next_back().copied().unwrap_or(0);
        self.next_service = max + 1;
        self.free_services = (1..=max).filter(|i| !used.contains(i)).collect();
        self.seeded = true;
    }

    /// Generations handed out from now on are newer than `g` (wrapping, never 0): `g` was read
    /// from a map (a service's, or an affinity entry's that may outlive its service).
    pub fn note_generation(&mut self, g: u16) {
        if g.wrapping_sub(self.next_generation) < u16::MAX / 2 {
            self.next_generation = g.wrapping_add(1).max(1);
        }
    }

    /// `key`'s service id, given out now if it has none; None when every id is in use.
    pub fn service(&mut self, key: ServiceKey) -> Option<u32> {
        if let Some(id) = self.services.get(&key) {
            return Some(*id);
        }
        let id = match self.free_services.pop_first() {
            Some(id) => id,
            None if self.next_service < self.max_services => {
                self.next_service += 1;
                self.next_service - 1
            }
            None => return None,
        };
        self.services.insert(key, id);
        self.generations.insert(id, self.next_generation);
        self.next_generation = self.next_generation.wrapping_add(1).max(1);
        Some(id)
    }

    /// `key`'s service id, if it has one.
    pub fn service_of(&self, key: &ServiceKey) -> Option<u32> {
        self.services.get(key).copied()
    }

    pub fn generation(&self, service_id: u32) -> u16 {
        self.generations.get(&service_id).copied().unwrap_or(0)
    }

    /// Takes `key`'s service id back, with its Maglev row; returns the row, if it had one.
    pub fn release_service(&mut self, key: &ServiceKey) -> Option<u32> {
        let id = self.services.remove(key)?;
        self.free_services.insert(id);
        let row = self.maglev_rows.remove(&id)?;
        self.free_maglev_rows.insert(row);
        Some(row)
    }

    /// The backend `id` is given to, if it is.
    pub fn backend_of(&self, id: u32) -> Option<Backend> {
        self.backends.by_id.get(id)
    }

    /// `b`'s backend id, given out now if it has none; None when every id is in use (the
    /// backend map is full).
    pub fn backend(&mut self, b: Backend) -> Option<u32> {
        self.backends.give(b)
    }

    /// Room for `wanted` backends in all (about a sync's distinct ones), made at once when they
    /// are more than the ids held: the initial sync's million. Never past the id limit.
    pub fn reserve_backends(&mut self, wanted: usize) {
        let wanted = wanted.min(self.backends.limit as usize);
        let more = wanted.saturating_sub(self.backends.by_key.len());
        if more > 0 {
            self.backends.reserve(more);
        }
    }

    /// Frees the backend ids `keep` does not want. An id the backend map still holds must be
    /// kept: it is freed when its entry is deleted (`release_backend`).
    pub fn retain_backends(&mut self, keep: impl Fn(u32) -> bool) {
        for id in 1..self.backends.by_id.len() {
            if self.backends.in_use(id) && !keep(id) {
                self.backends.release(id);
            }
        }
    }

    /// Frees backend id `id`: its entry left the backend map.
    pub fn release_backend(&mut self, id: u32) {
        self.backends.release(id);
    }

    /// Freed backend ids are given out again at once (tests of churn past the limit).
    #[cfg(test)]
    pub fn reuse_backend_ids_at_once(&mut self) {
        self.backends.reuse_after = Duration::ZERO;
    }

    /// `service_id`'s Maglev row, given out now if it has none; None when every row is in use.
    pub fn maglev_row(&mut self, service_id: u32) -> Option<u32> {
        if let Some(row) = self.maglev_rows.get(&service_id) {
            return Some(*row);
        }
        let row = self.free_maglev_rows.pop_first()?;
        self.maglev_rows.insert(service_id, row);
        Some(row)
    }

    /// Maglev rows in all.
    pub fn maglev_rows_total(&self) -> usize {
        self.free_maglev_rows.len() + self.maglev_rows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(last: u32) -> ServiceKey {
        ServiceKey { addr: [u32::from_be_bytes([10, 96, 0, last as u8]), 0, 0, 0], port: 80u16.to_be(), proto: 6, scope: 0 }
    }

    fn backend(last: u8) -> Backend {
        Backend { addr: [u32::from_be_bytes([10, 244, 0, last]), 0, 0, 0], port: 8080u16.to_be(), proto: 6, flags: 0 }
    }

    #[test]
    fn room_is_made_for_the_backends_wanted_up_to_the_limit() {
        let mut ids = Ids::new(16, 64, 0);
        ids.reserve_backends(1_000_000);
        assert!(ids.backends.by_key.capacity() < 1_000, "never past the id limit: {}", ids.backends.by_key.capacity());
        let room = ids.backends.by_key.capacity();
        assert!(room >= 63);
        let given: Vec<u32> = (1..=40).map(|i| ids.backend(backend(i)).unwrap()).collect();
        assert_eq!(given, (1..=40).collect::<Vec<u32>>());
        assert_eq!(ids.backends.by_key.capacity(), room, "no growth while filling what was reserved");
        assert_eq!(ids.backend(backend(7)), Some(7), "found, not given again");
    }

    /// IPv4 backends are packed, others kept apart; both are found by value and by id, and
    /// freed whole.
    #[test]
    fn backends_of_either_family_keep_their_ids() {
        // Ids 1..5: the sixth backend takes a freed one.
        let mut ids = Ids::new(8, 6, 0);
        ids.reuse_backend_ids_at_once();
        let v6 = |last: u32| Backend { addr: [0xfd00_0000u32.to_be(), 0, 0, last.to_be()], port: 8080u16.to_be(), proto: 6, flags: 0 };
        let odd = Backend { proto: u8::MAX, ..backend(9) };
        let given: Vec<u32> = [backend(1), v6(1), odd, v6(2), backend(2)].iter().map(|b| ids.backend(*b).unwrap()).collect();
        assert_eq!(given, [1, 2, 3, 4, 5]);
        for (b, id) in [(backend(1), 1), (v6(1), 2), (odd, 3), (v6(2), 4), (backend(2), 5)] {
            assert_eq!((ids.backend(b), ids.backend_of(id)), (Some(id), Some(b)), "{b:?}");
        }
        assert_eq!(ids.backends.by_id.wide.len(), 3, "only what does not fit in a slot");
        ids.release_backend(2);
        assert_eq!((ids.backend_of(2), ids.backends.by_id.wide.len()), (None, 2));
        assert_eq!(ids.backend(v6(3)), Some(2), "the freed id, given to another IPv6 backend");
        assert_eq!((ids.backend_of(2), ids.backend(v6(1))), (Some(v6(3)), None), "v6(1) lost its id with its release, and every id is in use");
    }

    #[test]
    fn backend_ids_stay_below_the_limit_and_the_longest_free_is_given_out_first() {
        // Ids 1..4: the arrays of per-backend counters have four slots.
        let mut ids = Ids::new(8, 4, 0);
        ids.reuse_backend_ids_at_once();
        let [a, b, c] = [1, 2, 3].map(|i| ids.backend(backend(i)).unwrap());
        assert_eq!([a, b, c], [1, 2, 3]);
        assert_eq!(ids.backend(backend(2)), Some(b), "a known backend keeps its id");
        assert_eq!(ids.backend(backend(4)), None, "every id in use: the backend map is full");
        ids.release_backend(b);
        ids.release_backend(b);
        ids.release_backend(a);
        assert_eq!(ids.backend(backend(4)), Some(b), "freed first, given out first");
        assert_eq!(ids.backend(backend(5)), Some(a));
        assert_eq!(ids.backend(backend(6)), None, "the double release did not free b twice");
        // The full sync's pass frees what it does not keep.
        ids.retain_backends(|id| id != c);
        assert_eq!(ids.backend(backend(3)), Some(c), "backend 3 comes back with the id it just freed (the only free one)");
        assert_eq!(ids.backend(backend(2)), None);
    }

    #[test]
    fn a_freed_backend_id_rests_before_it_is_given_out_again() {
        let mut ids = Ids::new(8, 3, 0);
        let a = ids.backend(backend(1)).unwrap();
        ids.backend(backend(2)).unwrap();
        ids.release_backend(a);
        assert_eq!(ids.backend(backend(3)), None, "freed just now: the backend map counts as full");
    }

    #[test]
    fn a_restart_takes_over_backend_ids_below_the_limit_only() {
        let mut ids = Ids::new(8, 6, 0);
        // An agent before ids were bounded gave 9 out, and backend 3 a second id (5) that the
        // map still holds; 2 and 4 are free.
        ids.seed(&[], &[(1, backend(1)), (3, backend(3)), (5, backend(3)), (9, backend(9))]);
        assert_eq!((ids.backend(backend(1)), ids.backend(backend(3))), (Some(1), Some(3)));
        assert_eq!(ids.backend(backend(9)), Some(2), "re-ided below the limit, at once");
        assert_eq!(ids.backend(backend(4)), Some(4));
        assert_eq!(ids.backend(backend(6)), None, "5 is held by the map");
        ids.reuse_backend_ids_at_once();
        ids.release_backend(5);
        assert_eq!(ids.backend(backend(6)), Some(5), "its entry deleted: free");
    }

    #[test]
    fn a_restart_recovers_the_ids_and_hands_out_newer_generations() {
        let mut before = Ids::new(8, 16, 4);
        let (a, b) = (before.service(key(1)).unwrap(), before.service(key(2)).unwrap());
        let row = before.maglev_row(b).unwrap();
        let be = before.backend(backend(7)).unwrap();
        // What the maps would hold: a's id was released and b's kept.
        let value = |id: u32, ids: &Ids, maglev: bool| ServiceValue {
            service_id: id,
            generation: ids.generation(id),
            scheduler: if maglev { SCHED_MAGLEV } else { 0 },
            maglev_row: if maglev { row } else { 0 },
            ..ServiceValue::default()
        };
        let services = [(key(2), value(b, &before, true))];
        let mut after = Ids::new(8, 16, 4);
        after.seed(&services, &[(be, backend(7))]);
        assert_eq!((after.service_of(&key(2)), after.maglev_row(b)), (Some(b), Some(row)), "kept: same id, same row");
        assert_eq!(after.backend(backend(7)), Some(be));
        // The free id below the highest is given out again, with a generation newer than any seen.
        let again = after.service(key(3)).unwrap();
        assert_eq!(again, a);
        assert!(after.generation(again).wrapping_sub(before.generation(b)) < u16::MAX / 2 && after.generation(again) != before.generation(b));
        assert_eq!(after.maglev_rows_total(), 4);
        // A service id past the capacity (a damaged map, or a larger capacity before) is not
        // taken over: the frontend gets a new one, below it.
        let mut bounded = Ids::new(8, 16, 4);
        bounded.seed(&[(key(4), value(u32::MAX - 1, &before, false)), (key(2), value(b, &before, true))], &[]);
        assert_eq!(bounded.service_of(&key(4)), None);
        assert_eq!(bounded.service_of(&key(2)), Some(b));
        assert!(bounded.service(key(4)).is_some_and(|id| id < 8));
        // Out of ids: None, and a release makes one free.
        let mut small = Ids::new(2, 16, 0);
        assert!(small.service(key(1)).is_some() && small.service(key(2)).is_none());
        assert_eq!(small.release_service(&key(1)), None, "no Maglev row to give back");
        assert!(small.service(key(2)).is_some());
    }
}
