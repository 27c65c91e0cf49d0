//! The aya implementations of the map seams (`DatapathMaps`; the conntrack tables in
//! conntrack.rs; the collectors' per-backend maps; the balanced sockets' reverse map), opened
//! from their pins: the agent's and the CLI's way to the maps.
//! Loading, pinning and attaching the object is kernel.rs.
use std::{io, path::Path};

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, MapError as AyaMapError, PerCpuArray};
use proxy_common::{
    limits, map_names, AffinityKey, AffinityValue, Backend, CtKey6, CtValue6, DatapathConfig, ServiceKey, ServiceValue, SlotKey, SourceRangeKey,
};

use crate::dataplane::ebpf::{
    bulk::Bulk,
    maps::{ConntrackTables, DatapathMaps, MapError, SrcRange, Table},
};

mod buckets;
mod conntrack;
mod hint;
mod mapped;
pub use buckets::Buckets;
pub use conntrack::{KernelAssured, KernelConntrack, KernelEmbryonic6};
pub use hint::{rebuild_hints_now, Hint, HintedFamily};

pub(crate) fn op(map: &'static str, op: &'static str, e: AyaMapError) -> MapError {
    let source = match e {
        // An array's index past its capacity (aya checks before the kernel would: E2BIG).
        AyaMapError::OutOfBounds { .. } if op == "update" => return MapError::Full { map },
        AyaMapError::SyscallError(s) if op == "update" => return MapError::update_failed(map, op, s.io_error),
        AyaMapError::SyscallError(s) => s.io_error,
        other => io::Error::other(other.to_string()),
    };
    MapError::Op { map, op, source }
}

fn is_enoent(e: &AyaMapError) -> bool {
    match e {
        AyaMapError::KeyNotFound => true,
        AyaMapError::SyscallError(s) => s.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// The fast path's maps, opened from their pins (works for the agent and for the CLI).
pub struct KernelMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    slots: HashMap<MapData, SlotKey, u32>,
    backends: Array<MapData, Backend>,
    maglev: Array<MapData, u32>,
    source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    config: Array<MapData, DatapathConfig>,
    conntrack: KernelConntrack,
    conntrack6: HashMap<MapData, CtKey6, CtValue6>,
    conntrack6_new: Buckets<proxy_common::CtBucket6>,
    ifaces: HashMap<MapData, u32, proxy_common::IfaceInfo>,
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    counters: PerCpuArray<MapData, u64>,
    backend_new: Array<MapData, u64>,
    /// Puts held back between `begin_bulk` and `end_bulk`.
    bulk: Option<Bulk>,
}

/// KPR_BE_ACTIVE_V1, written by the collector.
pub struct KernelBackendLoads(Array<MapData, u32>);

impl KernelBackendLoads {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self(open_typed(pin_dir, map_names::BACKEND_ACTIVE)?))
    }
}

impl crate::dataplane::ebpf::maps::BackendLoads for KernelBackendLoads {
    fn set(&mut self, backend_id: u32, active: u32) -> Result<(), MapError> {
        self.0.set(backend_id, active, 0).map_err(|e| op(map_names::BACKEND_ACTIVE, "update", e))
    }
}

/// KPR_BE_FAIL_V1, for the collector's outlier detection.
pub struct KernelFailureCounts {
    fails: HashMap<MapData, u32, u32>,
}

impl KernelFailureCounts {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self { fails: open_typed(pin_dir, map_names::BACKEND_FAIL)? })
    }
}

/// KPR_BE_V3 read by id (which backend a failure count is about).
pub struct KernelBackendNames(Array<MapData, Backend>);

impl KernelBackendNames {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self(open_typed(pin_dir, map_names::BACKENDS)?))
    }

    /// The backend an id names, if it still exists.
    pub fn get(&self, id: u32) -> Option<Backend> {
        self.0.get(&id, 0).ok().filter(Backend::is_present)
    }
}

impl crate::dataplane::ebpf::outlier::FailureCounts for KernelFailureCounts {
    fn all(&self) -> Result<Vec<(u32, u32)>, MapError> {
        read_all(map_names::BACKEND_FAIL, aya::maps::IterableMap::map(&self.fails), all)
    }
    fn add(&mut self, backend_id: u32, n: u32) -> Result<(), MapError> {
        let now: u32 = match self.fails.get(&backend_id, 0) {
            Ok(v) => v,
            Err(e) if is_enoent(&e) => 0,
            Err(e) => return Err(op(map_names::BACKEND_FAIL, "lookup", e)),
        };
        self.fails.insert(backend_id, now.saturating_add(n), 0).map_err(|e| op(map_names::BACKEND_FAIL, "update", e))
    }
    fn clear(&mut self, backend_id: u32) -> Result<(), MapError> {
        del(map_names::BACKEND_FAIL, self.fails.remove(&backend_id))
    }
}

/// KPR_SOCK_REV_V1: which sockets connect-time balancing sent where.
pub struct KernelSockRev(HashMap<MapData, proxy_common::SockRevKey, proxy_common::SockRevValue>);

impl KernelSockRev {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self(open_typed(pin_dir, map_names::SOCK_REV)?))
    }
}

impl crate::dataplane::ebpf::endpoint_cleanup::BalancedSockets for KernelSockRev {
    fn cookies_to(&self, addr: std::net::IpAddr, port: u16) -> Result<std::collections::BTreeSet<u64>, MapError> {
        let (want_addr, want_port) = (proxy_common::user::addr_words(addr), port.to_be());
        let to_it = |(k, _): &(proxy_common::SockRevKey, proxy_common::SockRevValue)| k.addr == want_addr && k.port == want_port;
        Ok(read_all(map_names::SOCK_REV, aya::maps::IterableMap::map(&self.0), to_it)?.into_iter().map(|(k, _)| k.cookie).collect())
    }
}

pub(crate) fn open(pin_dir: &Path, name: &'static str) -> Result<Map, MapError> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(|e| MapError::Other {
        map: name,
        message: format!("not pinned under {} ({e}); is the agent running / was `kpr run` started?", pin_dir.display()),
    })?;
    Map::from_map_data(data).map_err(|e| op(name, "open", e))
}

/// A pinned map, checked to be of the type `T` expects.
pub fn open_typed<T: TryFrom<Map, Error = AyaMapError>>(pin_dir: &Path, name: &'static str) -> Result<T, MapError> {
    open(pin_dir, name)?.try_into().map_err(|e| op(name, "type check", e))
}

impl KernelMaps {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self {
            services: open_typed(pin_dir, map_names::SERVICES)?,
            slots: open_typed(pin_dir, map_names::SLOTS)?,
            backends: open_typed(pin_dir, map_names::BACKENDS)?,
            maglev: open_typed(pin_dir, map_names::MAGLEV)?,
            source_ranges: open_typed(pin_dir, map_names::SOURCE_RANGES)?,
            config: open_typed(pin_dir, map_names::CONFIG)?,
            conntrack: KernelConntrack::open(pin_dir)?,
            conntrack6: open_typed(pin_dir, map_names::CONNTRACK6)?,
            conntrack6_new: Buckets::open(pin_dir, map_names::CONNTRACK6_NEW)?,
            ifaces: open_typed(pin_dir, map_names::IFACES)?,
            affinity: open_typed(pin_dir, map_names::AFFINITY)?,
            counters: open_typed(pin_dir, map_names::COUNTERS)?,
            backend_new: open_typed(pin_dir, map_names::BACKEND_NEW)?,
            bulk: None,
        })
    }

    /// Writes the held puts before a delete from their maps or a write that points into them.
    fn held_written(&mut self) -> Result<(), MapError> {
        self.bulk.as_mut().map_or(Ok(()), Bulk::barrier)
    }
}

/// The entries of a hash map or an array that `keep` keeps, many per system call: a million
/// entries in a few hundred calls, where an iteration makes two calls per entry. Filtered batch
/// by batch, so an array's empty entries are never all held at once.
pub(crate) fn read_all<K: bytemuck::Pod, V: bytemuck::Pod>(name: &'static str, map: &MapData, keep: impl Fn(&(K, V)) -> bool) -> Result<Vec<(K, V)>, MapError> {
    // The kernel writes key_size and value_size bytes an entry into the buffers: a pin of
    // another layout must not be read into these types.
    let info = map.info().map_err(|e| op(name, "info", e))?;
    if (info.key_size() as usize, info.value_size() as usize) != (std::mem::size_of::<K>(), std::mem::size_of::<V>()) {
        return Err(MapError::Op { map: name, op: "lookup batch", source: io::Error::from_raw_os_error(libc::EINVAL) });
    }
    let fd = map.fd();
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let (batch, next): (Vec<(K, V)>, _) =
            crate::dataplane::ebpf::bpf_batch::lookup_batch(fd, cursor, 16_384).map_err(|source| MapError::Op { map: name, op: "lookup batch", source })?;
        out.extend(batch.into_iter().filter(&keep));
        match next {
            Some(c) => cursor = Some(c),
            None => return Ok(out),
        }
    }
}

/// `read_all`'s filter that keeps every entry.
fn all<T>(_: &T) -> bool {
    true
}

/// The backends KPR_BE_V3 holds (its ids without one hold zeros).
fn backends_of(name: &'static str, map: &MapData) -> Result<Vec<(u32, Backend)>, MapError> {
    read_all(name, map, |(_, b): &(u32, Backend)| b.is_present())
}

pub(crate) fn collect<K, V, I: Iterator<Item = Result<(K, V), AyaMapError>>>(name: &'static str, it: I) -> Result<Vec<(K, V)>, MapError> {
    let mut out = Vec::new();
    for r in it {
        match r {
            Ok(kv) => out.push(kv),
            // An entry deleted (LRU, data path) while we walked: skip it.
            Err(e) if is_enoent(&e) => continue,
            Err(e) => return Err(op(name, "iterate", e)),
        }
    }
    Ok(out)
}

pub(crate) fn del<R>(name: &'static str, r: Result<R, AyaMapError>) -> Result<(), MapError> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if is_enoent(&e) => Ok(()),
        Err(e) => Err(op(name, "delete", e)),
    }
}

impl DatapathMaps for KernelMaps {
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>, MapError> {
        read_all(map_names::SERVICES, aya::maps::IterableMap::map(&self.services), all)
    }
    fn put_service(&mut self, k: ServiceKey, v: ServiceValue) -> Result<(), MapError> {
        if let Some(bulk) = self.bulk.as_mut() {
            return bulk.put_service(k, v);
        }
        self.services.insert(k, v, 0).map_err(|e| op(map_names::SERVICES, "update", e))
    }
    fn del_service(&mut self, k: ServiceKey) -> Result<(), MapError> {
        self.held_written()?;
        del(map_names::SERVICES, self.services.remove(&k))
    }
    fn slots(&self) -> Result<Vec<(SlotKey, u32)>, MapError> {
        read_all(map_names::SLOTS, aya::maps::IterableMap::map(&self.slots), all)
    }
    fn put_slot(&mut self, k: SlotKey, id: u32) -> Result<(), MapError> {
        if let Some(bulk) = self.bulk.as_mut() {
            return bulk.put_slot(k, id);
        }
        self.slots.insert(k, id, 0).map_err(|e| op(map_names::SLOTS, "update", e))
    }
    fn del_slot(&mut self, k: SlotKey) -> Result<(), MapError> {
        self.held_written()?;
        del(map_names::SLOTS, self.slots.remove(&k))
    }
    fn backends(&self) -> Result<Vec<(u32, Backend)>, MapError> {
        backends_of(map_names::BACKENDS, aya::maps::IterableMap::map(&self.backends))
    }
    fn put_backend(&mut self, id: u32, b: Backend) -> Result<(), MapError> {
        if let Some(bulk) = self.bulk.as_mut() {
            return bulk.put_backend(id, b);
        }
        self.backends.set(id, b, 0).map_err(|e| op(map_names::BACKENDS, "update", e))
    }
    fn del_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.held_written()?;
        // Protocol 0 is no backend. Only that byte changes: an array write is a copy in place,
        // not a swap, so a flow choosing the backend meanwhile reads it whole or absent, never
        // half zeroed. Idempotent, as a delete is; an id past the array holds nothing.
        let b = match self.backends.get(&id, 0) {
            Ok(b) if b.is_present() => b,
            Ok(_) | Err(AyaMapError::OutOfBounds { .. }) => return Ok(()),
            Err(e) => return Err(op(map_names::BACKENDS, "lookup", e)),
        };
        self.backends.set(id, Backend { proto: 0, ..b }, 0).map_err(|e| op(map_names::BACKENDS, "delete", e))
    }
    fn maglev_row(&self, row: u32) -> Result<Vec<u32>, MapError> {
        // One batch from the row's first index (an array's batch goes on after the index it is
        // given): a call where a lookup per entry made 1,021.
        let m = limits::MAGLEV_TABLE_SIZE;
        let fd = aya::maps::IterableMap::map(&self.maglev).fd();
        let after = (row > 0).then(|| row * m - 1);
        let (entries, _): (Vec<(u32, u32)>, _) = crate::dataplane::ebpf::bpf_batch::lookup_batch(fd, after, m as usize).map_err(|source| MapError::Op {
            map: map_names::MAGLEV,
            op: "lookup batch",
            source,
        })?;
        if entries.len() != m as usize || entries.first().map(|e| e.0) != Some(row * m) {
            return Err(MapError::Op { map: map_names::MAGLEV, op: "lookup batch", source: io::Error::from_raw_os_error(libc::ERANGE) });
        }
        Ok(entries.into_iter().map(|(_, id)| id).collect())
    }
    fn put_maglev_row(&mut self, row: u32, table: &[u32]) -> Result<(), MapError> {
        // A row names backend ids: theirs must be in first (a Service may use the row already).
        self.held_written()?;
        let base = row * limits::MAGLEV_TABLE_SIZE;
        for (i, id) in table.iter().enumerate() {
            self.maglev.set(base + i as u32, id, 0).map_err(|e| op(map_names::MAGLEV, "update", e))?;
        }
        Ok(())
    }
    fn source_ranges(&self) -> Result<Vec<SrcRange>, MapError> {
        Ok(collect(map_names::SOURCE_RANGES, self.source_ranges.iter())?.into_iter().map(|(k, _)| (k.prefix_len(), k.data())).collect())
    }
    fn put_source_range(&mut self, r: SrcRange) -> Result<(), MapError> {
        let k = aya::maps::lpm_trie::Key::new(r.0, r.1);
        self.source_ranges.insert(&k, 1, 0).map_err(|e| op(map_names::SOURCE_RANGES, "update", e))
    }
    fn del_source_range(&mut self, r: SrcRange) -> Result<(), MapError> {
        let k = aya::maps::lpm_trie::Key::new(r.0, r.1);
        del(map_names::SOURCE_RANGES, self.source_ranges.remove(&k))
    }
    fn config(&self) -> Result<DatapathConfig, MapError> {
        self.config.get(&0, 0).map_err(|e| op(map_names::CONFIG, "lookup", e))
    }
    fn set_config(&mut self, c: DatapathConfig) -> Result<(), MapError> {
        self.config.set(0, c, 0).map_err(|e| op(map_names::CONFIG, "update", e))
    }
    fn capacity(&self, map: &'static str) -> Option<usize> {
        use aya::maps::IterableMap;
        let data = match map {
            map_names::SERVICES => self.services.map(),
            map_names::SLOTS => self.slots.map(),
            map_names::BACKENDS => self.backends.map(),
            _ => return None,
        };
        data.info().ok().map(|i| i.max_entries() as usize)
    }
    fn begin_bulk(&mut self) {
        use aya::maps::IterableMap;
        use std::os::fd::AsFd;
        if self.bulk.is_none() {
            self.bulk = Bulk::start(self.backends.map().fd().as_fd(), self.slots.map().fd().as_fd(), self.services.map().fd().as_fd());
        }
    }
    fn end_bulk(&mut self) -> Result<(), MapError> {
        self.bulk.take().map_or(Ok(()), Bulk::finish)
    }
    fn conntrack(&self) -> &dyn ConntrackTables {
        &self.conntrack
    }
    fn conntrack_mut(&mut self) -> &mut dyn ConntrackTables {
        &mut self.conntrack
    }
    fn set_ifaces(&mut self, want: &std::collections::BTreeMap<u32, proxy_common::IfaceInfo>) -> Result<(), MapError> {
        let name = map_names::IFACES;
        let have: Vec<(u32, proxy_common::IfaceInfo)> = collect(name, self.ifaces.iter())?;
        for (ifindex, _) in have.iter().filter(|(i, _)| !want.contains_key(i)) {
            del(name, self.ifaces.remove(ifindex))?;
        }
        for (ifindex, info) in want {
            if !have.contains(&(*ifindex, *info)) {
                self.ifaces.insert(*ifindex, *info, 0).map_err(|e| op(name, "update", e))?;
            }
        }
        Ok(())
    }
    fn affinity(&self) -> Result<Vec<(AffinityKey, AffinityValue)>, MapError> {
        read_all(map_names::AFFINITY, aya::maps::IterableMap::map(&self.affinity), all)
    }
    fn del_affinity(&mut self, k: AffinityKey) -> Result<(), MapError> {
        del(map_names::AFFINITY, self.affinity.remove(&k))
    }
    fn backend_new_connections(&self, id: u32) -> Result<u64, MapError> {
        self.backend_new.get(&id, 0).map_err(|e| op(map_names::BACKEND_NEW, "lookup", e))
    }
    fn ipv6_flows(&self, table: Table) -> Result<Vec<(CtKey6, CtValue6)>, MapError> {
        match table {
            Table::Assured => read_all(map_names::CONNTRACK6, aya::maps::IterableMap::map(&self.conntrack6), all),
            Table::Embryonic => Ok(self.conntrack6_new.read_all()),
        }
    }
    fn counters(&self) -> Result<Vec<u64>, MapError> {
        (0..proxy_common::counter::COUNT).map(|i| self.counters.get(&i, 0).map(|v| v.iter().sum()).map_err(|e| op(map_names::COUNTERS, "lookup", e))).collect()
    }
}
