//! The kernel write boundary for the fast path's maps: a small trait, a real implementation on
//! aya (kernel_maps.rs) and a fake on BTreeMaps for fast deterministic tests.
use std::collections::BTreeMap;

use proxy_common::{AffinityKey, AffinityValue, Backend, DatapathConfig, IfaceInfo, ServiceKey, ServiceValue, SlotKey, SourceRangeKey};

use proxy_common::{map_names, CtKey, CtKey6, CtValue, CtValue6};

#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("map {map}: {op} failed: {source}")]
    Op { map: &'static str, op: &'static str, source: std::io::Error },
    #[error("map {0} is missing from the object")]
    Missing(&'static str),
    #[error("map {map}: {message}")]
    Other { map: &'static str, message: String },
    /// An insert into a map at its capacity (E2BIG for hash maps, ENOSPC for LPM tries).
    #[error("map {map} is full: raise its capacity (see docs/configuration.md)")]
    Full { map: &'static str },
}

impl MapError {
    /// A failed update (one entry or a batch): an update of a hash map at capacity fails with
    /// E2BIG, of an LPM trie with ENOSPC.
    pub fn update_failed(map: &'static str, op: &'static str, source: std::io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::E2BIG | libc::ENOSPC) => MapError::Full { map },
            _ => MapError::Op { map, op, source },
        }
    }

    /// The map, when this error is its being full.
    pub fn full_map(&self) -> Option<&'static str> {
        match self {
            MapError::Full { map } => Some(map),
            _ => None,
        }
    }
}

pub type SrcRange = (u32, SourceRangeKey);

pub trait DatapathMaps {
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>, MapError>;
    fn put_service(&mut self, k: ServiceKey, v: ServiceValue) -> Result<(), MapError>;
    fn del_service(&mut self, k: ServiceKey) -> Result<(), MapError>;

    fn slots(&self) -> Result<Vec<(SlotKey, u32)>, MapError>;
    fn put_slot(&mut self, k: SlotKey, backend_id: u32) -> Result<(), MapError>;
    fn del_slot(&mut self, k: SlotKey) -> Result<(), MapError>;

    fn backends(&self) -> Result<Vec<(u32, Backend)>, MapError>;
    fn put_backend(&mut self, id: u32, b: Backend) -> Result<(), MapError>;
    fn del_backend(&mut self, id: u32) -> Result<(), MapError>;

    fn maglev_row(&self, row: u32) -> Result<Vec<u32>, MapError>;
    fn put_maglev_row(&mut self, row: u32, table: &[u32]) -> Result<(), MapError>;

    /// (prefix length, key) pairs.
    fn source_ranges(&self) -> Result<Vec<SrcRange>, MapError>;
    fn put_source_range(&mut self, r: SrcRange) -> Result<(), MapError>;
    fn del_source_range(&mut self, r: SrcRange) -> Result<(), MapError>;

    fn config(&self) -> Result<DatapathConfig, MapError>;
    fn set_config(&mut self, c: DatapathConfig) -> Result<(), MapError>;

    /// A map's capacity (max_entries), where known.
    fn capacity(&self, map: &'static str) -> Option<usize>;
    /// From here to `end_bulk`, puts of services, slots and backends may be held back and
    /// written map by map at `end_bulk` (or before a delete from those maps, or a Maglev row,
    /// which names backends): backends, then slots, then services, so no entry ever points to
    /// one not written yet. Reads in between see the maps without the held puts. The caller
    /// begins a bulk only when every put fits (a held put cannot report a full map).
    fn begin_bulk(&mut self) {}
    fn end_bulk(&mut self) -> Result<(), MapError> {
        Ok(())
    }

    /// The two conntrack tables (flows, garbage collection, targeted deletes).
    fn conntrack(&self) -> &dyn ConntrackTables;
    fn conntrack_mut(&mut self) -> &mut dyn ConntrackTables;

    /// Interface index -> what the data path needs to know of it (masquerade address, local
    /// pods): written to equal `want` exactly.
    fn set_ifaces(&mut self, want: &BTreeMap<u32, IfaceInfo>) -> Result<(), MapError>;
    fn affinity(&self) -> Result<Vec<(AffinityKey, AffinityValue)>, MapError>;
    fn del_affinity(&mut self, k: AffinityKey) -> Result<(), MapError>;

    /// The IPv6 packet path's flows in `table` (`map_names::CONNTRACK6`, `CONNTRACK6_NEW`): read
    /// by the views;
    /// the data path ages them.
    fn ipv6_flows(&self, table: Table) -> Result<Vec<(CtKey6, CtValue6)>, MapError>;

    /// Sum over CPUs of each counter.
    fn counters(&self) -> Result<Vec<u64>, MapError>;
    /// New connections sent to a backend since it got its id (sum over CPUs).
    fn backend_new_connections(&self, id: u32) -> Result<u64, MapError>;
}

/// In-memory maps with the kernel's semantics (deletes of missing keys succeed: idempotent).
#[derive(Debug, Default, Clone)]
pub struct FakeMaps {
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub slots: BTreeMap<SlotKey, u32>,
    pub backends: BTreeMap<u32, Backend>,
    pub maglev: BTreeMap<u32, Vec<u32>>,
    pub source_ranges: BTreeMap<(u32, SourceRangeKey), ()>,
    pub config: DatapathConfig,
    pub conntrack: FakeTables,
    pub ifaces: BTreeMap<u32, IfaceInfo>,
    pub affinity: BTreeMap<AffinityKey, AffinityValue>,
    pub ipv6_flows: BTreeMap<CtKey6, CtValue6>,
    pub ipv6_embryonic: BTreeMap<CtKey6, CtValue6>,
    pub writes: usize,
    /// Syncs that held their puts back (`begin_bulk`).
    pub bulks: usize,
    /// Capacities, by map name (absent: unbounded), as the kernel's max_entries.
    pub capacity: BTreeMap<&'static str, usize>,
}

impl FakeMaps {
    fn room(&self, map: &'static str, len: usize, new_key: bool) -> Result<(), MapError> {
        match self.capacity.get(map) {
            Some(cap) if new_key && len >= *cap => Err(MapError::Full { map }),
            _ => Ok(()),
        }
    }
}

impl DatapathMaps for FakeMaps {
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>, MapError> {
        Ok(self.services.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn put_service(&mut self, k: ServiceKey, v: ServiceValue) -> Result<(), MapError> {
        self.room(map_names::SERVICES, self.services.len(), !self.services.contains_key(&k))?;
        self.writes += 1;
        self.services.insert(k, v);
        Ok(())
    }
    fn del_service(&mut self, k: ServiceKey) -> Result<(), MapError> {
        self.writes += 1;
        self.services.remove(&k);
        Ok(())
    }
    fn slots(&self) -> Result<Vec<(SlotKey, u32)>, MapError> {
        Ok(self.slots.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn put_slot(&mut self, k: SlotKey, id: u32) -> Result<(), MapError> {
        self.room(map_names::SLOTS, self.slots.len(), !self.slots.contains_key(&k))?;
        self.writes += 1;
        self.slots.insert(k, id);
        Ok(())
    }
    fn del_slot(&mut self, k: SlotKey) -> Result<(), MapError> {
        self.writes += 1;
        self.slots.remove(&k);
        Ok(())
    }
    fn backends(&self) -> Result<Vec<(u32, Backend)>, MapError> {
        Ok(self.backends.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn put_backend(&mut self, id: u32, b: Backend) -> Result<(), MapError> {
        self.room(map_names::BACKENDS, self.backends.len(), !self.backends.contains_key(&id))?;
        self.writes += 1;
        self.backends.insert(id, b);
        Ok(())
    }
    fn del_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.writes += 1;
        self.backends.remove(&id);
        Ok(())
    }
    fn maglev_row(&self, row: u32) -> Result<Vec<u32>, MapError> {
        Ok(self.maglev.get(&row).cloned().unwrap_or_else(|| vec![0; proxy_common::limits::MAGLEV_TABLE_SIZE as usize]))
    }
    fn put_maglev_row(&mut self, row: u32, table: &[u32]) -> Result<(), MapError> {
        self.writes += 1;
        self.maglev.insert(row, table.to_vec());
        Ok(())
    }
    fn source_ranges(&self) -> Result<Vec<SrcRange>, MapError> {
        Ok(self.source_ranges.keys().copied().collect())
    }
    fn put_source_range(&mut self, r: SrcRange) -> Result<(), MapError> {
        self.writes += 1;
        self.source_ranges.insert(r, ());
        Ok(())
    }
    fn del_source_range(&mut self, r: SrcRange) -> Result<(), MapError> {
        self.writes += 1;
        self.source_ranges.remove(&r);
        Ok(())
    }
    fn config(&self) -> Result<DatapathConfig, MapError> {
        Ok(self.config)
    }
    fn set_config(&mut self, c: DatapathConfig) -> Result<(), MapError> {
        self.config = c;
        Ok(())
    }
    fn capacity(&self, map: &'static str) -> Option<usize> {
        self.capacity.get(map).copied()
    }
    // Writes at once: the final state is what held puts give, and counting bulks lets tests see
    // which syncs may hold them.
    fn begin_bulk(&mut self) {
        self.bulks += 1;
    }
    fn conntrack(&self) -> &dyn ConntrackTables {
        &self.conntrack
    }
    fn conntrack_mut(&mut self) -> &mut dyn ConntrackTables {
        &mut self.conntrack
    }
    fn set_ifaces(&mut self, want: &BTreeMap<u32, IfaceInfo>) -> Result<(), MapError> {
        self.ifaces = want.clone();
        Ok(())
    }
    fn affinity(&self) -> Result<Vec<(AffinityKey, AffinityValue)>, MapError> {
        Ok(self.affinity.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn del_affinity(&mut self, k: AffinityKey) -> Result<(), MapError> {
        self.affinity.remove(&k);
        Ok(())
    }
    fn ipv6_flows(&self, table: Table) -> Result<Vec<(CtKey6, CtValue6)>, MapError> {
        let flows = if table == Table::Assured { &self.ipv6_flows } else { &self.ipv6_embryonic };
        Ok(flows.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn counters(&self) -> Result<Vec<u64>, MapError> {
        Ok(vec![0; proxy_common::counter::COUNT as usize])
    }
    fn backend_new_connections(&self, _id: u32) -> Result<u64, MapError> {
        Ok(0)
    }
}

/// The two conntrack maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// UDP flows and TCP flows past their handshake (`map_names::CONNTRACK`).
    Assured,
    /// Flows not yet assured: TCP before its handshake completed, UDP before its client sent
    /// after an answer (`map_names::CONNTRACK_NEW`).
    Embryonic,
}

impl Table {
    pub const ALL: [Table; 2] = [Table::Assured, Table::Embryonic];
    pub fn map_name(self) -> &'static str {
        match self {
            Table::Assured => map_names::CONNTRACK,
            Table::Embryonic => map_names::CONNTRACK_NEW,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Table::Assured => "assured",
            Table::Embryonic => "embryonic",
        }
    }
}

/// KPR_BE_ACTIVE_V1: the active-flow counts least-connection and P2C compare (kernel_maps.rs,
/// and a fake below).
pub trait BackendLoads {
    fn set(&mut self, backend_id: u32, active: u32) -> Result<(), MapError>;
}

#[derive(Debug, Default)]
pub struct FakeBackendLoads(pub std::collections::BTreeMap<u32, u32>);

impl BackendLoads for FakeBackendLoads {
    fn set(&mut self, backend_id: u32, active: u32) -> Result<(), MapError> {
        self.0.insert(backend_id, active);
        Ok(())
    }
}

/// Writes every count of a pass, whatever the map holds: the data path adds and subtracts as
/// flows open and close, and the count is what corrects its drift (flows that ended without
/// a close it saw, adds two CPUs made at once). A backend counted before but not now gets 0.
/// `written` holds the backends last written non-zero. Returns how many it wrote.
pub fn write_loads(
    maps: &mut dyn BackendLoads,
    written: &mut std::collections::HashMap<u32, u32>,
    now: &std::collections::HashMap<u32, u32>,
) -> Result<usize, MapError> {
    let mut n = 0;
    for (id, active) in now {
        maps.set(*id, *active)?;
        n += 1;
    }
    let gone: Vec<u32> = written.keys().filter(|id| !now.contains_key(id)).copied().collect();
    for id in gone {
        maps.set(id, 0)?;
        n += 1;
    }
    *written = now.clone();
    Ok(n)
}

#[cfg(test)]
mod load_tests {
    use super::*;

    #[test]
    fn every_count_of_a_pass_is_written_and_a_backend_no_longer_counted_gets_zero() {
        let mut maps = FakeBackendLoads::default();
        let mut written = std::collections::HashMap::new();
        write_loads(&mut maps, &mut written, &[(1, 4), (2, 1)].into_iter().collect()).unwrap();
        // The data path drifted (a close it never saw): the same count is written again.
        maps.0.insert(1, 9);
        assert_eq!(write_loads(&mut maps, &mut written, &[(1, 4)].into_iter().collect()).unwrap(), 2);
        assert_eq!(maps.0, [(1, 4), (2, 0)].into_iter().collect());
    }
}

/// Sets or clears `flag` in KPR_CFG's flags (a handover's), writing only a change.
pub fn set_config_flag(maps: &mut dyn DatapathMaps, flag: u32, on: bool) -> Result<(), MapError> {
    let cfg = maps.config()?;
    let flags = if on { cfg.flags | flag } else { cfg.flags & !flag };
    if flags != cfg.flags {
        maps.set_config(DatapathConfig { flags, ..cfg })?;
    }
    Ok(())
}

/// Do two entries belong to one flow (the same service and backend), whatever their stamps?
pub fn same_flow(a: &CtValue, b: &CtValue) -> bool {
    (a.service_id, a.backend_id) == (b.service_id, b.backend_id)
}

/// What the collector needs from the conntrack maps: a kernel implementation (kernel_maps.rs)
/// and a fake (below) for deterministic tests.
pub trait ConntrackTables {
    /// Up to `max` entries of `table` from `cursor` on (None: the start), and the cursor to go on
    /// from (None: that was the end).
    fn read_batch(&self, table: Table, cursor: Option<u32>, max: usize) -> Result<crate::dataplane::ebpf::bpf_batch::Batch<CtKey, CtValue>, MapError>;
    fn get(&self, table: Table, key: &CtKey) -> Result<Option<CtValue>, MapError>;
    /// Deletes `key` if it still holds `expected`. An entry that changed meanwhile is kept (put
    /// back if it was taken out). Returns whether it was deleted.
    fn delete_if(&mut self, table: Table, key: &CtKey, expected: &CtValue) -> Result<bool, MapError>;
    /// Deletes `key` if it still belongs to the flow of `expected` (same service and backend),
    /// however the data path stamped it meanwhile: a flow that must go however busy it is. A
    /// new flow in the key is kept (put back). Returns whether it was deleted.
    fn delete_if_same_flow(&mut self, table: Table, key: &CtKey, expected: &CtValue) -> Result<bool, MapError>;
    /// Sets `flags` on `key`'s entry if it still belongs to the flow of `expected` (same service
    /// and backend). Returns whether it did. The data path may stamp the entry meanwhile: the
    /// stamp written back is at most one round old.
    fn set_flags_if(&mut self, table: Table, key: &CtKey, expected: &CtValue, flags: u16) -> Result<bool, MapError>;
    /// After deleting flows that may still carry packets: no CPU's flow cache may answer for
    /// them any more.
    fn invalidate_flow_cache(&mut self) -> Result<(), MapError>;

    /// Every entry of `table`, batch by batch.
    fn entries(&self, table: Table) -> Result<Vec<(CtKey, CtValue)>, MapError> {
        let mut out = Vec::new();
        let mut cursor = None;
        loop {
            let (mut batch, next) = self.read_batch(table, cursor, 4096)?;
            out.append(&mut batch);
            match next {
                Some(c) => cursor = Some(c),
                None => return Ok(out),
            }
        }
    }
}

/// A batch read of an in-memory table: up to `max` entries from position `cursor` on, and
/// the position to go on from (None: that was the end), as BPF_MAP_LOOKUP_BATCH pages.
pub fn fake_batch<K: Copy, V: Copy>(m: &BTreeMap<K, V>, cursor: Option<u32>, max: usize) -> crate::dataplane::ebpf::bpf_batch::Batch<K, V> {
    let start = cursor.unwrap_or(0) as usize;
    let batch: Vec<(K, V)> = m.iter().skip(start).take(max).map(|(k, v)| (*k, *v)).collect();
    let end = start + batch.len();
    (batch, (end < m.len()).then_some(end as u32))
}

/// In-memory conntrack tables with the kernel's semantics, for tests. `reused` simulates the
/// data path writing a new flow into a key between the collector's read and its delete.
#[derive(Debug, Default, Clone)]
pub struct FakeTables {
    pub assured: std::collections::BTreeMap<CtKey, CtValue>,
    pub embryonic: std::collections::BTreeMap<CtKey, CtValue>,
    pub reused: std::collections::BTreeMap<CtKey, CtValue>,
    pub flow_cache_generation: u64,
    /// Single-key lookups so far (each a system call on the real tables).
    pub gets: std::cell::Cell<usize>,
}

impl FakeTables {
    pub fn table(&self, t: Table) -> &std::collections::BTreeMap<CtKey, CtValue> {
        match t {
            Table::Assured => &self.assured,
            Table::Embryonic => &self.embryonic,
        }
    }
    pub fn table_mut(&mut self, t: Table) -> &mut std::collections::BTreeMap<CtKey, CtValue> {
        match t {
            Table::Assured => &mut self.assured,
            Table::Embryonic => &mut self.embryonic,
        }
    }

    /// Deletes `key` if `delete` holds for its entry, after the data path's simulated write
    /// (`reused`) landed. Returns whether it did.
    fn take_if(&mut self, table: Table, key: &CtKey, delete: impl Fn(&CtValue) -> bool) -> bool {
        if let Some(v) = self.reused.remove(key) {
            self.table_mut(table).insert(*key, v);
        }
        let m = self.table_mut(table);
        let hit = m.get(key).is_some_and(delete);
        if hit {
            m.remove(key);
        }
        hit
    }
}

impl ConntrackTables for FakeTables {
    fn read_batch(&self, table: Table, cursor: Option<u32>, max: usize) -> Result<crate::dataplane::ebpf::bpf_batch::Batch<CtKey, CtValue>, MapError> {
        Ok(fake_batch(self.table(table), cursor, max))
    }
    fn get(&self, table: Table, key: &CtKey) -> Result<Option<CtValue>, MapError> {
        self.gets.set(self.gets.get() + 1);
        Ok(self.table(table).get(key).copied())
    }
    fn delete_if(&mut self, table: Table, key: &CtKey, expected: &CtValue) -> Result<bool, MapError> {
        Ok(self.take_if(table, key, |v| v == expected))
    }
    fn delete_if_same_flow(&mut self, table: Table, key: &CtKey, expected: &CtValue) -> Result<bool, MapError> {
        Ok(self.take_if(table, key, |v| same_flow(v, expected)))
    }
    fn set_flags_if(&mut self, table: Table, key: &CtKey, expected: &CtValue, flags: u16) -> Result<bool, MapError> {
        match self.table_mut(table).get_mut(key) {
            Some(v) if same_flow(v, expected) => {
                v.flags |= flags;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn invalidate_flow_cache(&mut self) -> Result<(), MapError> {
        self.flow_cache_generation += 1;
        Ok(())
    }
}
