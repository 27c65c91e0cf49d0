//! Sync by difference: desired state vs. what the maps hold now. Ids are stable: a backend keeps
//! its id while it exists anywhere, a frontend keeps its service id while it exists, and both
//! are recovered from the maps after a restart.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use proxy_common::{
    limits::{MAGLEV_ROWS, MAX_SERVICES},
    Backend, DatapathConfig, ServiceKey, ServiceValue, SlotKey, SourceRangeKey, SCHED_MAGLEV,
    SCHED_RANDOM,
};

use crate::{
    maglev,
    maps::{DatapathMaps, MapError, SrcRange},
    model::DesiredState,
};

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Map(#[from] MapError),
}

#[derive(Debug, Default, Clone)]
pub struct SyncStats {
    pub frontends: usize,
    pub backends: usize,
    pub writes: usize,
    pub deletes: usize,
    /// Per-frontend failures; the other frontends were still programmed.
    pub errors: Vec<String>,
}

pub struct Syncer {
    backend_ids: HashMap<Backend, u32>,
    next_backend_id: u32,
    service_ids: HashMap<ServiceKey, u32>,
    free_service_ids: BTreeSet<u32>,
    next_service_id: u32,
    max_services: u32,
    maglev_rows: HashMap<u32, u32>,
    free_maglev_rows: BTreeSet<u32>,
    maglev_written: HashMap<u32, Vec<u32>>,
    seeded: bool,
}

impl Default for Syncer {
    fn default() -> Self {
        Self::new(MAX_SERVICES, MAGLEV_ROWS)
    }
}

fn range_key(service_id: u32, net: &ipnet::IpNet) -> SrcRange {
    let k = SourceRangeKey::lpm(service_id, net.addr(), net.prefix_len());
    (k.prefix_len(), k.data())
}

impl Syncer {
    pub fn new(max_services: u32, maglev_rows: u32) -> Self {
        Self {
            backend_ids: HashMap::new(),
            next_backend_id: 1,
            service_ids: HashMap::new(),
            free_service_ids: BTreeSet::new(),
            next_service_id: 1,
            max_services,
            maglev_rows: HashMap::new(),
            free_maglev_rows: (0..maglev_rows).collect(),
            maglev_written: HashMap::new(),
            seeded: false,
        }
    }

    /// Recovers ids from a previous agent's maps, so a restart changes nothing that works.
    fn seed(&mut self, services: &[(ServiceKey, ServiceValue)], backends: &[(u32, Backend)]) {
        for (id, b) in backends {
            self.backend_ids.insert(*b, *id);
            self.next_backend_id = self.next_backend_id.max(id + 1);
        }
        let mut used = BTreeSet::new();
        for (k, v) in services {
            self.service_ids.insert(*k, v.service_id);
            used.insert(v.service_id);
            if v.scheduler == SCHED_MAGLEV {
                self.maglev_rows.insert(v.service_id, v.maglev_row);
                self.free_maglev_rows.remove(&v.maglev_row);
            }
        }
        let max = used.iter().next_back().copied().unwrap_or(0);
        self.next_service_id = max + 1;
        self.free_service_ids = (1..=max).filter(|i| !used.contains(i)).collect();
        self.seeded = true;
    }

    fn alloc_service_id(&mut self, key: ServiceKey) -> Option<u32> {
        if let Some(id) = self.service_ids.get(&key) {
            return Some(*id);
        }
        let id = match self.free_service_ids.pop_first() {
            Some(id) => id,
            None if self.next_service_id < self.max_services => {
                self.next_service_id += 1;
                self.next_service_id - 1
            }
            None => return None,
        };
        self.service_ids.insert(key, id);
        Some(id)
    }

    fn release_service_id(&mut self, key: &ServiceKey) {
        if let Some(id) = self.service_ids.remove(key) {
            self.free_service_ids.insert(id);
            if let Some(row) = self.maglev_rows.remove(&id) {
                self.free_maglev_rows.insert(row);
                self.maglev_written.remove(&row);
            }
        }
    }

    fn backend_id(&mut self, b: Backend) -> u32 {
        if let Some(id) = self.backend_ids.get(&b) {
            return *id;
        }
        let id = self.next_backend_id;
        self.next_backend_id += 1;
        self.backend_ids.insert(b, id);
        id
    }

    pub fn sync(
        &mut self,
        maps: &mut dyn DatapathMaps,
        desired: &DesiredState,
        config: DatapathConfig,
    ) -> Result<SyncStats, SyncError> {
        let mut st = SyncStats::default();
        let actual_services: HashMap<ServiceKey, ServiceValue> = maps.services()?.into_iter().collect();
        let actual_backends_list = maps.backends()?;
        if !self.seeded {
            let svcs: Vec<_> = actual_services.iter().map(|(k, v)| (*k, *v)).collect();
            self.seed(&svcs, &actual_backends_list);
        }
        let actual_backends: HashMap<u32, Backend> = actual_backends_list.into_iter().collect();
        let mut actual_slots: HashMap<u32, BTreeMap<u32, u32>> = HashMap::new();
        for (k, id) in maps.slots()? {
            actual_slots.entry(k.service_id).or_default().insert(k.slot, id);
        }

        if maps.config()? != config {
            maps.set_config(config)?;
            st.writes += 1;
        }

        // Backends first: a slot must never point to a backend that is not there yet.
        let mut live_backends: BTreeSet<u32> = BTreeSet::new();
        for f in desired.frontends.values() {
            for b in &f.backends {
                let wire = b.wire();
                let id = self.backend_id(wire);
                if live_backends.insert(id) && actual_backends.get(&id) != Some(&wire) {
                    maps.put_backend(id, wire)?;
                    st.writes += 1;
                }
            }
        }
        st.backends = live_backends.len();

        let mut desired_ranges: BTreeSet<SrcRange> = BTreeSet::new();
        let mut live_ids: HashMap<u32, BTreeSet<u32>> = HashMap::new();
        for (fk, f) in &desired.frontends {
            let key = fk.wire();
            let Some(service_id) = self.alloc_service_id(key) else {
                st.errors.push(format!("{} {}:{}: no free service id (capacity {})", f.service, fk.ip, fk.port, self.max_services));
                continue;
            };
            let ids: Vec<u32> = f.backends.iter().map(|b| self.backend_ids[&b.wire()]).collect();
            live_ids.insert(service_id, ids.iter().copied().collect());
            let mut scheduler = f.scheduler.code();
            let mut maglev_row = 0;
            if scheduler == SCHED_MAGLEV {
                let row = match self.maglev_rows.get(&service_id) {
                    Some(r) => Some(*r),
                    None => self.free_maglev_rows.pop_first().inspect(|r| {
                        self.maglev_rows.insert(service_id, *r);
                    }),
                };
                match row {
                    Some(row) => {
                        let idents: Vec<(Vec<u8>, u32)> = f
                            .backends
                            .iter()
                            .zip(&ids)
                            .map(|(b, id)| (format!("{}:{}", b.ip, b.port).into_bytes(), *id))
                            .collect();
                        let table = maglev::table(&idents);
                        let written = match self.maglev_written.get(&row) {
                            Some(t) => Some(t == &table),
                            None => None,
                        };
                        let same = match written {
                            Some(same) => same,
                            None => maps.maglev_row(row)? == table,
                        };
                        if !same {
                            maps.put_maglev_row(row, &table)?;
                            st.writes += 1;
                        }
                        self.maglev_written.insert(row, table);
                        maglev_row = row;
                    }
                    None => {
                        st.errors.push(format!("{}: all {} Maglev rows in use; using random", f.service, self.free_maglev_rows.len() + self.maglev_rows.len()));
                        scheduler = SCHED_RANDOM;
                    }
                }
            }
            // Make before break: new slots, then the count, then the slots past the count.
            let slots = actual_slots.remove(&service_id).unwrap_or_default();
            for (i, id) in ids.iter().enumerate() {
                let slot = i as u32 + 1;
                if slots.get(&slot) != Some(id) {
                    maps.put_slot(SlotKey { service_id, slot }, *id)?;
                    st.writes += 1;
                }
            }
            let value = ServiceValue {
                service_id,
                backend_count: ids.len() as u32,
                affinity_timeout_s: f.affinity_timeout_s,
                maglev_row,
                scheduler,
                flags: f.flags,
                _pad: [0; 2],
            };
            if actual_services.get(&key) != Some(&value) {
                maps.put_service(key, value)?;
                st.writes += 1;
            }
            for slot in slots.keys().filter(|s| **s > ids.len() as u32) {
                maps.del_slot(SlotKey { service_id, slot: *slot })?;
                st.deletes += 1;
            }
            for net in &f.source_ranges {
                desired_ranges.insert(range_key(service_id, net));
            }
            st.frontends += 1;
        }

        // Stale frontends, then their slots, then slots of nothing.
        let wanted: std::collections::HashSet<ServiceKey> = desired.frontends.keys().map(|fk| fk.wire()).collect();
        for (key, v) in &actual_services {
            if !wanted.contains(key) {
                maps.del_service(*key)?;
                st.deletes += 1;
                if self.service_ids.get(key) == Some(&v.service_id) {
                    self.release_service_id(key);
                }
            }
        }
        for (service_id, slots) in actual_slots {
            for slot in slots.keys() {
                maps.del_slot(SlotKey { service_id, slot: *slot })?;
                st.deletes += 1;
            }
        }
        for id in actual_backends.keys() {
            if !live_backends.contains(id) {
                maps.del_backend(*id)?;
                st.deletes += 1;
            }
        }
        self.backend_ids.retain(|_, id| live_backends.contains(id));

        for r in maps.source_ranges()? {
            if !desired_ranges.remove(&r) {
                maps.del_source_range(r)?;
                st.deletes += 1;
            }
        }
        for r in desired_ranges {
            maps.put_source_range(r)?;
            st.writes += 1;
        }

        // Affinity to a backend that left the service is void at once.
        for (k, v) in maps.affinity()? {
            let keep = live_ids.get(&k.service_id).is_some_and(|ids| ids.contains(&v.backend_id));
            if !keep {
                maps.del_affinity(k)?;
                st.deletes += 1;
            }
        }
        Ok(st)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        maps::FakeMaps,
        model::{BackendKey, Frontend, FrontendKey, FrontendKind, Proto, Scheduler},
    };

    fn frontend(backends: &[(&str, u16)], sched: Scheduler) -> Frontend {
        Frontend {
            service: "ns/web:http".into(),
            kind: FrontendKind::ClusterIp,
            scheduler: sched,
            affinity_timeout_s: 0,
            flags: 0,
            source_ranges: vec!["198.18.0.0/24".parse().unwrap()],
            backends: backends
                .iter()
                .map(|(ip, port)| BackendKey { ip: ip.parse().unwrap(), port: *port, proto: Proto::Tcp })
                .collect(),
        }
    }

    fn key(ip: &str) -> FrontendKey {
        FrontendKey { ip: ip.parse().unwrap(), port: 80, proto: Proto::Tcp, scope: 0 }
    }

    #[test]
    fn stable_ids_minimal_writes_and_cleanup() {
        let mut maps = FakeMaps::default();
        let mut s = Syncer::default();
        let mut d = DesiredState::default();
        d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 8080), ("10.0.0.2", 8080)], Scheduler::Random));
        s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!(maps.services.len(), 1);
        assert_eq!(maps.slots.len(), 2);
        assert_eq!(maps.backends.len(), 2);
        assert_eq!(maps.source_ranges.len(), 1);
        let id_of = |m: &FakeMaps, ip: &str| {
            let w = proxy_common::user::addr_words(ip.parse().unwrap());
            *m.backends.iter().find(|(_, b)| b.addr == w).unwrap().0
        };
        let id2 = id_of(&maps, "10.0.0.2");

        // Same state again: nothing to write.
        let before = maps.writes;
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0));
        assert_eq!(maps.writes, before);

        // Replace backend 1: backend 2 keeps its id.
        d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.2", 8080), ("10.0.0.3", 8080)], Scheduler::Random));
        s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!(id_of(&maps, "10.0.0.2"), id2);
        assert_eq!(maps.backends.len(), 2);

        // A restarted agent (fresh Syncer) writes nothing for an unchanged state.
        let mut s2 = Syncer::default();
        let st = s2.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");

        // Everything removed: nothing left.
        s2.sync(&mut maps, &DesiredState::default(), DatapathConfig::default()).unwrap();
        assert!(maps.services.is_empty() && maps.slots.is_empty() && maps.backends.is_empty());
        assert!(maps.source_ranges.is_empty());
    }

    #[test]
    fn maglev_row_is_written_once_and_freed() {
        let mut maps = FakeMaps::default();
        let mut s = Syncer::new(16, 2);
        let mut d = DesiredState::default();
        d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80)], Scheduler::Maglev));
        d.frontends.insert(key("10.96.0.2"), frontend(&[("10.0.0.1", 80)], Scheduler::Maglev));
        d.frontends.insert(key("10.96.0.3"), frontend(&[("10.0.0.1", 80)], Scheduler::Maglev));
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        // Two rows only: the third frontend falls back to random and says so.
        assert_eq!(maps.maglev.len(), 2);
        assert_eq!(st.errors.len(), 1);
        let v = maps.services.values().filter(|v| v.scheduler == SCHED_RANDOM).count();
        assert_eq!(v, 1);
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!(st.writes, 0);
    }
}
