//! Stable ids for the fast path's maps, Cilium's model: a service id per frontend, with a
//! generation that changes each time the id is given out again (so a flow of its previous owner
//! is never taken for the new one's); a backend id per backend; a Maglev row per Maglev service.
//! Recovered from the maps after a restart (`seed`), so a restart changes nothing that works.
use std::collections::BTreeSet;

use foldhash::HashMap;

use proxy_common::{Backend, ServiceKey, ServiceValue, SCHED_MAGLEV};

pub(crate) struct Ids {
    backends: HashMap<Backend, u32>,
    next_backend: u32,
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

impl Ids {
    pub fn new(max_services: u32, maglev_rows: u32) -> Self {
        Ids {
            backends: HashMap::default(),
            next_backend: 1,
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

    /// Recovers the ids a previous agent gave out, from its maps.
    pub fn seed(&mut self, services: &[(ServiceKey, ServiceValue)], backends: &[(u32, Backend)]) {
        for (id, b) in backends {
            self.backends.insert(*b, *id);
            self.next_backend = self.next_backend.max(id + 1);
        }
        let mut used = BTreeSet::new();
        for (k, v) in services {
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

    /// `b`'s backend id, given out now if it has none.
    pub fn backend(&mut self, b: Backend) -> u32 {
        let next = &mut self.next_backend;
        *self.backends.entry(b).or_insert_with(|| {
            *next += 1;
            *next - 1
        })
    }

    /// Keeps the backend ids `keep` says.
    pub fn retain_backends(&mut self, keep: impl Fn(u32) -> bool) {
        self.backends.retain(|_, id| keep(*id));
    }

    /// Forgets `b`'s id if it is `id` (by key: a pass over the table would cost a million steps
    /// at 100,000 Services).
    pub fn forget_backend(&mut self, b: &Backend, id: u32) {
        if self.backends.get(b) == Some(&id) {
            self.backends.remove(b);
        }
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

    #[test]
    fn a_restart_recovers_the_ids_and_hands_out_newer_generations() {
        let mut before = Ids::new(8, 4);
        let (a, b) = (before.service(key(1)).unwrap(), before.service(key(2)).unwrap());
        let row = before.maglev_row(b).unwrap();
        let be = before.backend(Backend { addr: [7, 0, 0, 0], port: 8080, ..Backend::default() });
        // What the maps would hold: a's id was released and b's kept.
        let value = |id: u32, ids: &Ids, maglev: bool| ServiceValue {
            service_id: id,
            generation: ids.generation(id),
            scheduler: if maglev { SCHED_MAGLEV } else { 0 },
            maglev_row: if maglev { row } else { 0 },
            ..ServiceValue::default()
        };
        let services = [(key(2), value(b, &before, true))];
        let mut after = Ids::new(8, 4);
        after.seed(&services, &[(be, Backend { addr: [7, 0, 0, 0], port: 8080, ..Backend::default() })]);
        assert_eq!((after.service_of(&key(2)), after.maglev_row(b)), (Some(b), Some(row)), "kept: same id, same row");
        assert_eq!(after.backend(Backend { addr: [7, 0, 0, 0], port: 8080, ..Backend::default() }), be);
        // The free id below the highest is given out again, with a generation newer than any seen.
        let again = after.service(key(3)).unwrap();
        assert_eq!(again, a);
        assert!(after.generation(again).wrapping_sub(before.generation(b)) < u16::MAX / 2 && after.generation(again) != before.generation(b));
        assert_eq!(after.maglev_rows_total(), 4);
        // Out of ids: None, and a release makes one free.
        let mut small = Ids::new(2, 0);
        assert!(small.service(key(1)).is_some() && small.service(key(2)).is_none());
        assert_eq!(small.release_service(&key(1)), None, "no Maglev row to give back");
        assert!(small.service(key(2)).is_some());
    }
}
