//! Sync by difference: desired state vs. what the maps hold now. Ids are stable: a backend keeps
//! its id while it exists anywhere, a frontend keeps its service id while it exists, and both
//! are recovered from the maps after a restart.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use foldhash::{HashMap as FastMap, HashSet as FastSet};

use proxy_common::{
    limits::{MAGLEV_ROWS, MAX_BACKENDS, MAX_BACKENDS_PER_SERVICE, MAX_SERVICES},
    map_names, Backend, DatapathConfig, ServiceKey, ServiceValue, SlotKey, SourceRangeKey, SCHED_MAGLEV, SCHED_RANDOM,
};

use crate::{
    dataplane::ebpf::maps::{DatapathMaps, MapError, SrcRange},
    dataplane::ebpf::{
        ids::{ById, IdSet, Ids},
        maglev, wire,
    },
    model::{DesiredState, Frontend, FrontendKey},
};

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Map(#[from] MapError),
}

/// One sync's figures: the plane's common ones (reached through Deref), and the backends that
/// left a frontend, which only the eBPF plane acts on.
#[derive(Debug, Default, Clone)]
pub struct SyncStats {
    pub plane: crate::dataplane::SyncStats,
    /// Backends that left a frontend: their sessionAffinity entries go at once, and a UDP
    /// frontend's flows are ended (a UDP client has no handshake that would move it elsewhere).
    pub removed: BTreeSet<RemovedBackend>,
}

impl std::ops::Deref for SyncStats {
    type Target = crate::dataplane::SyncStats;
    fn deref(&self) -> &Self::Target {
        &self.plane
    }
}

impl std::ops::DerefMut for SyncStats {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.plane
    }
}

/// A backend that left a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RemovedBackend {
    pub service_id: u32,
    pub backend_id: u32,
    pub frontend: ServiceKey,
    pub backend: Backend,
}

/// Deletes the slots of services no frontend holds (nor `keep_services`), then the backends no
/// slot points to and no frontend wants: the deletes that cannot break a flow. Returns the
/// backend ids the remaining slots point to.
fn delete_unreferenced(
    maps: &mut dyn DatapathMaps,
    ids: &mut Ids,
    m: &mut Mirror,
    keep_services: &FastSet<u32>,
    live_backends: &IdSet,
    st: &mut SyncStats,
) -> Result<IdSet, SyncError> {
    let held: FastSet<u32> = m.services.values().map(|v| v.service_id).chain(keep_services.iter().copied()).collect();
    let dead: Vec<u32> = m.slots.keys().filter(|id| !held.contains(id)).copied().collect();
    for service_id in dead {
        for slot in m.slots.remove(&service_id).unwrap_or_default().numbers() {
            maps.del_slot(SlotKey { service_id, slot })?;
            st.deletes += 1;
        }
    }
    for k in std::mem::take(&mut m.stray_slots) {
        maps.del_slot(k)?;
        st.deletes += 1;
    }
    let referenced: IdSet = m.slots.values().flat_map(Slots::ids).collect();
    let gone: Vec<u32> = m.backends.ids().filter(|id| !live_backends.contains(*id) && !referenced.contains(*id)).collect();
    for id in gone {
        maps.del_backend(id)?;
        m.backends.remove(id);
        ids.release_backend(id);
        st.deletes += 1;
    }
    Ok(referenced)
}

/// The backends a frontend had (its slots up to its count).
fn current_ids(m: &Mirror, key: &ServiceKey) -> Vec<u32> {
    match m.services.get(key) {
        Some(v) => m.slots.get(&v.service_id).map(|s| s.ids_upto(v.backend_count)).unwrap_or_default(),
        None => Vec::new(),
    }
}

fn note_removed(st: &mut SyncStats, ids: &Ids, m: &Mirror, key: &ServiceKey, service_id: u32, old: &[u32], new: &[u32]) {
    for id in old.iter().filter(|id| !new.contains(id)) {
        if let Some(backend) = m.backends.get(ids, *id) {
            st.removed.insert(RemovedBackend { service_id, backend_id: *id, frontend: *key, backend });
        }
    }
}

pub struct Syncer {
    ids: Ids,
    /// Maglev row -> the table last written there.
    maglev_written: HashMap<u32, Vec<u32>>,
    /// What the maps hold after the last successful sync (None: list them next time).
    mirror: Option<Mirror>,
    /// The maps as read before the first sync (`set_read_ahead`), taken by the next full read.
    read_ahead: Option<MapsRead>,
    /// Backend id -> frontends whose slots use it (a backend is deleted when unused).
    backend_refs: ById<u32>,
    /// Backend ids are below this (the smallest capacity of the maps indexed by them:
    /// `kernel::backend_id_limit`).
    max_backends: u32,
    /// Frontends programmed as given here rather than as the desired state has them (outlier
    /// ejection leaves backends out of a few): set before each sync (`set_overrides`).
    overrides: std::sync::Arc<HashMap<FrontendKey, Frontend>>,
}

impl Default for Syncer {
    fn default() -> Self {
        Self::new(MAX_SERVICES, MAX_BACKENDS, MAGLEV_ROWS)
    }
}

fn range_key(service_id: u32, net: &ipnet::IpNet) -> SrcRange {
    let k = SourceRangeKey::lpm(service_id, net.addr(), net.prefix_len());
    (k.prefix_len(), k.data())
}

impl Syncer {
    /// The service id given to a frontend, once synced.
    pub fn service_id(&self, k: &crate::model::FrontendKey) -> Option<u32> {
        self.ids.service_of(&crate::dataplane::ebpf::wire::service_key(k))
    }

    /// Frontends the next syncs program as given here in place of the desired state's: their
    /// slots, and which backends stay live (one that no programmed frontend uses leaves the
    /// backend map, as it did when the whole desired state was copied).
    pub fn set_overrides(&mut self, overrides: HashMap<FrontendKey, Frontend>) {
        if !(overrides.is_empty() && self.overrides.is_empty()) {
            self.overrides = std::sync::Arc::new(overrides);
        }
    }

    pub fn new(max_services: u32, max_backends: u32, maglev_rows: u32) -> Self {
        Self {
            ids: Ids::new(max_services, max_backends, maglev_rows),
            maglev_written: HashMap::new(),
            mirror: None,
            read_ahead: None,
            backend_refs: ById::new(max_backends),
            max_backends,
            overrides: Default::default(),
        }
    }

    /// Takes `key`'s service id back; what was written to its Maglev row is forgotten.
    fn release_service_id(&mut self, key: &ServiceKey) {
        if let Some(row) = self.ids.release_service(key) {
            self.maglev_written.remove(&row);
        }
    }

    /// What the maps held when they were read on another thread while the API server listed
    /// (at 100,000 Services a restart's read is a few tenths of a second, a fresh start's about
    /// a quarter: the backend array is read whole). The next full sync takes it in place of
    /// reading them: the syncer is the only writer of these maps, and it has not written yet.
    /// Every later full sync reads them itself and so repairs any drift.
    pub fn set_read_ahead(&mut self, read: MapsRead) {
        if self.mirror.is_none() {
            self.read_ahead = Some(read);
        }
    }

    /// Full sync: lists what the maps hold now (the first one: as read ahead), then writes the
    /// difference. Repairs any drift (an entry deleted or changed by hand).
    pub fn sync(&mut self, maps: &mut dyn DatapathMaps, desired: &DesiredState, config: DatapathConfig) -> Result<SyncStats, SyncError> {
        self.mirror = None;
        let read = match self.read_ahead.take() {
            Some(r) => r,
            None => MapsRead::read(maps)?,
        };
        let actual = Mirror::build(read, maps.config()?, &mut self.ids);
        tracing::debug!(services = actual.services.len(), backends = actual.backends.len(), "maps read");
        self.apply(maps, desired, config, actual, true)
    }

    fn apply(
        &mut self,
        maps: &mut dyn DatapathMaps,
        desired: &DesiredState,
        config: DatapathConfig,
        mut m: Mirror,
        full: bool,
    ) -> Result<SyncStats, SyncError> {
        let mut st = SyncStats::default();
        if m.config != config {
            maps.set_config(config)?;
            m.config = config;
            st.writes += 1;
        }

        // What stays: every backend and frontend the desired state names.
        let overrides = std::sync::Arc::clone(&self.overrides);
        let wanted: FastSet<ServiceKey> = desired.frontends.keys().map(wire::service_key).collect();
        // Their ids too, in the frontends' order, for the writes below: a million backends'
        // ids looked up once (0: none was free, the backend map is full).
        let slots_wanted: usize = desired.frontends.iter().map(|(k, f)| effective(&overrides, k, f).backends.len()).sum();
        let mut ids_in_order: Vec<u32> = Vec::with_capacity(slots_wanted);
        // The frontends of a port share one backend list: counted once, the lists come close
        // to the distinct backends (a table reserved for every slot would keep that room).
        let mut lists = FastSet::default();
        let distinct: usize = desired
            .frontends
            .iter()
            .map(|(k, f)| &effective(&overrides, k, f).backends)
            .filter(|b| lists.insert(std::sync::Arc::as_ptr(b) as *const u8 as usize))
            .map(|b| b.len())
            .sum();
        self.ids.reserve_backends(distinct);
        let mut live_backends = IdSet::default();
        for (k, f) in &desired.frontends {
            for b in effective(&overrides, k, f).backends.iter() {
                let id = self.ids.backend(wire::backend(b));
                ids_in_order.push(id.unwrap_or(0));
                live_backends.extend(id);
            }
        }
        st.backends = live_backends.len();
        tracing::debug!(backends = st.backends, "backend ids assigned");

        // Everything fits even before the deletes make room: the puts may be held back and
        // written map by map (a few system calls instead of one per entry: the initial sync of
        // a large cluster). Whatever happens, what was held is written, as it would have been
        // entry by entry.
        let slots_held: usize = m.slots.values().map(Slots::len).sum::<usize>() + m.stray_slots.len();
        let fits = |map: &'static str, have: usize, more: usize| maps.capacity(map).is_none_or(|cap| have + more <= cap);
        let bulk = fits(map_names::SERVICES, m.services.len(), desired.frontends.len())
            && fits(map_names::BACKENDS, m.backends.len(), live_backends.len())
            && fits(map_names::SLOTS, slots_held, slots_wanted);
        if bulk {
            maps.begin_bulk();
        }
        let programmed = self.program_all(maps, desired, m, st, &wanted, &live_backends, &ids_in_order, &overrides, full);
        tracing::debug!("writes handed on");
        let written = if bulk { maps.end_bulk() } else { Ok(()) };
        if written.is_err() {
            // The mirror counts puts that may not be in: the next sync lists the maps again.
            self.mirror = None;
        }
        let st = programmed?;
        written?;
        Ok(st)
    }

    /// `apply` after its preparations: the deletes and writes.
    #[allow(clippy::too_many_arguments)]
    fn program_all(
        &mut self,
        maps: &mut dyn DatapathMaps,
        desired: &DesiredState,
        mut m: Mirror,
        mut st: SyncStats,
        wanted: &FastSet<ServiceKey>,
        live_backends: &IdSet,
        ids_in_order: &[u32],
        overrides: &HashMap<FrontendKey, Frontend>,
        full: bool,
    ) -> Result<SyncStats, SyncError> {
        // Deletes that cannot break anything go first, so a full map makes room before the
        // inserts: frontends nobody wants (and their slots), and backends no slot points to.
        let stale: Vec<(ServiceKey, ServiceValue)> = m.services.iter().filter(|(k, _)| !wanted.contains(k)).map(|(k, v)| (*k, *v)).collect();
        for (key, v) in stale {
            let old = current_ids(&m, &key);
            note_removed(&mut st, &self.ids, &m, &key, v.service_id, &old, &[]);
            maps.del_service(key)?;
            m.services.remove(&key);
            st.deletes += 1;
            if self.ids.service_of(&key) == Some(v.service_id) {
                self.release_service_id(&key);
            }
        }
        delete_unreferenced(maps, &mut self.ids, &mut m, &Default::default(), live_backends, &mut st)?;

        let mut desired_ranges: BTreeSet<SrcRange> = BTreeSet::new();
        let mut live_services: FastSet<u32> = FastSet::default();
        // Frontends that met a full map: tried again once the rest made room.
        let mut retry: Vec<(&FrontendKey, &Frontend)> = Vec::new();
        let mut in_slots = IdSet::default();
        for pass in 0..2 {
            let todo: Vec<(&FrontendKey, &Frontend)> =
                if pass == 0 { desired.frontends.iter().map(|(k, f)| (k, effective(overrides, k, f))).collect() } else { std::mem::take(&mut retry) };
            let mut known_ids = ids_in_order;
            for (fk, f) in todo {
                // Its backends first: a slot must never point to a backend that is not there.
                let ids = if pass == 0 {
                    let (ids, rest) = known_ids.split_at(f.backends.len());
                    known_ids = rest;
                    if ids.contains(&0) {
                        Err(SyncError::Map(MapError::Full { map: map_names::BACKENDS }))
                    } else {
                        Self::put_known_backends(maps, &self.ids, &mut m, f, ids.to_vec(), &mut st)
                    }
                } else {
                    self.put_backends(maps, &mut m, f, &mut st)
                };
                let programmed = ids.and_then(|ids| self.program_frontend(maps, &mut m, fk, f, ids, full, &mut st, &mut desired_ranges));
                match programmed {
                    Ok(Some((service_id, _))) => {
                        live_services.insert(service_id);
                    }
                    Ok(None) => {}
                    Err(SyncError::Map(e)) if e.full_map().is_some() && pass == 0 => retry.push((fk, f)),
                    Err(SyncError::Map(e)) if e.full_map().is_some() => {
                        st.full.push((e.full_map().unwrap_or("-"), f.service.to_string()));
                        st.errors.push(format!("{} {}:{}: {e}", f.service, fk.ip, fk.port));
                    }
                    Err(e) => return Err(e),
                }
                // A frontend left as it was keeps its slots (and backends) alive.
                if let Some(v) = m.services.get(&wire::service_key(fk)) {
                    live_services.insert(v.service_id);
                }
            }
            // What the programmed frontends no longer point to goes now, before the retries.
            in_slots = delete_unreferenced(maps, &mut self.ids, &mut m, &live_services, live_backends, &mut st)?;
            if retry.is_empty() {
                break;
            }
        }
        // An id the backend map still holds, or a slot names (a frontend left as it was after a
        // full map), stays given out until its entry is deleted.
        self.ids.retain_backends(|id| live_backends.contains(id) || m.backends.contains(id) || in_slots.contains(id));

        let old_ranges = std::mem::take(&mut m.ranges);
        for r in old_ranges.difference(&desired_ranges) {
            maps.del_source_range(*r)?;
            st.deletes += 1;
        }
        for r in desired_ranges.difference(&old_ranges) {
            maps.put_source_range(*r)?;
            st.writes += 1;
        }
        m.ranges = desired_ranges;

        // Affinity to a backend that left the service is void (full syncs; between them the
        // data path already ignores affinity to a backend that no longer exists).
        if full {
            for (k, v) in maps.affinity()? {
                self.ids.note_generation(v.generation);
                let keep = m.slots.get(&k.service_id).is_some_and(|slots| slots.ids().any(|id| id == v.backend_id));
                if !keep {
                    maps.del_affinity(k)?;
                    st.deletes += 1;
                }
            }
        }
        // Each backend's frontends, as the maps now have them: what an incremental sync takes
        // off when it rewrites a frontend (a frontend left as it was counts too).
        let mut refs: ById<u32> = ById::new(self.max_backends);
        for v in m.services.values() {
            for id in m.slots.get(&v.service_id).map(|s| s.ids_upto(v.backend_count)).unwrap_or_default() {
                refs.set(id, refs.get(id).unwrap_or(0) + 1);
            }
        }
        self.backend_refs = refs;
        self.mirror = Some(m);
        Ok(st)
    }

    /// Writes the backends `f` needs that the maps do not hold yet; returns their ids, in `f`'s
    /// order.
    fn put_backends(&mut self, maps: &mut dyn DatapathMaps, m: &mut Mirror, f: &Frontend, st: &mut SyncStats) -> Result<Vec<u32>, SyncError> {
        let full = || SyncError::Map(MapError::Full { map: map_names::BACKENDS });
        let ids = f.backends.iter().map(|b| self.ids.backend(wire::backend(b)).ok_or_else(full)).collect::<Result<_, _>>()?;
        Self::put_known_backends(maps, &self.ids, m, f, ids, st)
    }

    /// `put_backends` with their ids already given out (`ids`, in `f`'s order).
    fn put_known_backends(
        maps: &mut dyn DatapathMaps,
        given: &Ids,
        m: &mut Mirror,
        f: &Frontend,
        ids: Vec<u32>,
        st: &mut SyncStats,
    ) -> Result<Vec<u32>, SyncError> {
        for (b, id) in f.backends.iter().zip(&ids) {
            let wire = wire::backend(b);
            if m.backends.get(given, *id) != Some(wire) {
                maps.put_backend(*id, wire)?;
                m.backends.set(given, *id, wire);
                st.writes += 1;
            }
        }
        Ok(ids)
    }

    /// Programs one frontend against the mirror. Returns its service id and backend ids, or
    /// None when it could not get an id (reported in `st.errors`).
    #[allow(clippy::too_many_arguments)]
    fn program_frontend(
        &mut self,
        maps: &mut dyn DatapathMaps,
        m: &mut Mirror,
        fk: &FrontendKey,
        f: &Frontend,
        ids: Vec<u32>,
        full: bool,
        st: &mut SyncStats,
        desired_ranges: &mut BTreeSet<SrcRange>,
    ) -> Result<Option<(u32, Vec<u32>)>, SyncError> {
        let key = wire::service_key(fk);
        // Every frontend has its own id and the services map holds as many entries as there
        // are ids: no free id is a full services map (retried once deletes made room).
        let Some(service_id) = self.ids.service(key) else {
            return Err(SyncError::Map(MapError::Full { map: proxy_common::map_names::SERVICES }));
        };
        let mut scheduler = wire::scheduler(f.scheduler);
        let mut maglev_row = 0;
        if scheduler == SCHED_MAGLEV {
            match self.ids.maglev_row(service_id) {
                Some(row) => {
                    let idents: Vec<(Vec<u8>, u32)> = f.backends.iter().zip(&ids).map(|(b, id)| (format!("{}:{}", b.ip, b.port).into_bytes(), *id)).collect();
                    let table = maglev::table(&idents);
                    let same = match self.maglev_written.get(&row) {
                        Some(t) if !full => t == &table,
                        _ => maps.maglev_row(row)? == table,
                    };
                    if !same {
                        maps.put_maglev_row(row, &table)?;
                        st.writes += 1;
                    }
                    self.maglev_written.insert(row, table);
                    maglev_row = row;
                }
                None => {
                    st.errors.push(format!("{}: all {} Maglev rows in use; using random", f.service, self.ids.maglev_rows_total()));
                    scheduler = SCHED_RANDOM;
                }
            }
        }
        let old = current_ids(m, &key);
        note_removed(st, &self.ids, m, &key, service_id, &old, &ids);
        // Make before break: new slots, then the count, then the slots past the count.
        let slots = m.slots.entry(service_id).or_default();
        slots.reserve(ids.len());
        for (i, id) in ids.iter().enumerate() {
            let slot = i as u32 + 1;
            if slots.get(slot) != Some(*id) {
                maps.put_slot(SlotKey { service_id, slot }, *id)?;
                slots.insert(slot, *id);
                st.writes += 1;
            }
        }
        let value = ServiceValue {
            service_id,
            backend_count: ids.len() as u32,
            affinity_timeout_s: f.affinity_timeout_s,
            maglev_row,
            scheduler,
            flags: wire::service_flags(fk, f),
            generation: self.ids.generation(service_id),
        };
        if m.services.get(&key) != Some(&value) {
            maps.put_service(key, value)?;
            m.services.insert(key, value);
            st.writes += 1;
        }
        for slot in slots.numbers_past(ids.len() as u32) {
            maps.del_slot(SlotKey { service_id, slot })?;
            slots.remove(slot);
            st.deletes += 1;
        }
        for net in &f.source_ranges {
            desired_ranges.insert(range_key(service_id, net));
        }
        st.frontends += 1;
        Ok(Some((service_id, ids)))
    }

    /// Syncs only the `touched` frontends (those of changed services, before and after the
    /// change) against the mirror: the event path, whose cost does not grow with the number of
    /// services. Falls back to a full sync without a mirror.
    pub fn sync_subset(
        &mut self,
        maps: &mut dyn DatapathMaps,
        desired: &DesiredState,
        config: DatapathConfig,
        touched: &BTreeSet<FrontendKey>,
    ) -> Result<SyncStats, SyncError> {
        let Some(m) = self.mirror.take() else {
            return self.sync(maps, desired, config);
        };
        match self.apply_subset(maps, desired, config, touched, m) {
            // A full map: the full sync makes room (deletes first) and reports what still
            // does not fit, per frontend.
            Err(SyncError::Map(e)) if e.full_map().is_some() => self.sync(maps, desired, config),
            r => r,
        }
    }

    fn apply_subset(
        &mut self,
        maps: &mut dyn DatapathMaps,
        desired: &DesiredState,
        config: DatapathConfig,
        touched: &BTreeSet<FrontendKey>,
        mut m: Mirror,
    ) -> Result<SyncStats, SyncError> {
        let mut st = SyncStats::default();
        if m.config != config {
            maps.set_config(config)?;
            m.config = config;
            st.writes += 1;
        }
        // Backends first; their ids, by frontend, for the programming below.
        let overrides = std::sync::Arc::clone(&self.overrides);
        let mut backend_ids: HashMap<&FrontendKey, Vec<u32>> = HashMap::new();
        for (fk, f) in touched.iter().filter_map(|fk| desired.frontends.get(fk).map(|f| (fk, effective(&overrides, fk, f)))) {
            backend_ids.insert(fk, self.put_backends(maps, &mut m, f, &mut st)?);
        }
        // Each entry once: a port's frontend for both scopes and its internal one (the port
        // before or after a change of its traffic policy) are one entry, written as the
        // desired state has it.
        let mut entries: BTreeMap<ServiceKey, &FrontendKey> = BTreeMap::new();
        for fk in touched {
            let e = entries.entry(wire::service_key(fk)).or_insert(fk);
            if desired.frontends.contains_key(fk) {
                *e = fk;
            }
        }
        let mut released: BTreeSet<u32> = BTreeSet::new();
        for (key, fk) in entries {
            let old = m.services.get(&key).copied();
            if let Some(v) = old {
                let old_ids: Vec<u32> = m.slots.get(&v.service_id).map(|s| s.ids_upto(v.backend_count)).unwrap_or_default();
                for id in old_ids {
                    if let Some(r) = self.backend_refs.get(id) {
                        self.backend_refs.set(id, r - 1);
                        if r == 1 {
                            released.insert(id);
                        }
                    }
                }
            }
            let sid = old.map(|v| v.service_id).or_else(|| self.ids.service_of(&key));
            let old_ranges: BTreeSet<SrcRange> = match sid {
                Some(sid) => m.ranges.iter().filter(|r| r.1.service_id_be == sid.to_be()).copied().collect(),
                None => BTreeSet::new(),
            };
            let mut new_ranges = BTreeSet::new();
            match desired.frontends.get(fk).map(|f| effective(&overrides, fk, f)) {
                Some(f) => {
                    let ids = backend_ids.remove(fk).expect("the loop above put the backends of every touched frontend the desired state has");
                    if let Some((_, ids)) = self.program_frontend(maps, &mut m, fk, f, ids, false, &mut st, &mut new_ranges)? {
                        for id in ids {
                            self.backend_refs.set(id, self.backend_refs.get(id).unwrap_or(0) + 1);
                            released.remove(&id);
                        }
                    }
                }
                None => {
                    if let Some(v) = old {
                        let old_ids = current_ids(&m, &key);
                        note_removed(&mut st, &self.ids, &m, &key, v.service_id, &old_ids, &[]);
                        maps.del_service(key)?;
                        m.services.remove(&key);
                        st.deletes += 1;
                        for slot in m.slots.remove(&v.service_id).unwrap_or_default().numbers() {
                            maps.del_slot(SlotKey { service_id: v.service_id, slot })?;
                            st.deletes += 1;
                        }
                        self.release_service_id(&key);
                    }
                }
            }
            for r in old_ranges.difference(&new_ranges) {
                maps.del_source_range(*r)?;
                m.ranges.remove(r);
                st.deletes += 1;
            }
            for r in new_ranges.difference(&old_ranges) {
                maps.put_source_range(*r)?;
                m.ranges.insert(*r);
                st.writes += 1;
            }
        }
        released.retain(|id| self.backend_refs.get(*id).is_none());
        for id in &released {
            maps.del_backend(*id)?;
            m.backends.remove(*id);
            self.ids.release_backend(*id);
            st.deletes += 1;
        }
        st.backends = m.backends.len();
        self.mirror = Some(m);
        Ok(st)
    }
}

/// The frontend to program for `k`: its override, else the desired state's `f`.
fn effective<'a>(overrides: &'a HashMap<FrontendKey, Frontend>, k: &FrontendKey, f: &'a Frontend) -> &'a Frontend {
    overrides.get(k).unwrap_or(f)
}

/// What the maps hold, as far as the syncer is concerned.
#[derive(Debug, Default)]
struct Mirror {
    config: DatapathConfig,
    services: FastMap<ServiceKey, ServiceValue>,
    backends: HeldBackends,
    slots: FastMap<u32, Slots>,
    /// Slots past any a service may have (written by hand): deleted by the next full sync.
    stray_slots: Vec<SlotKey>,
    ranges: BTreeSet<SrcRange>,
}

/// A service's slots as the maps hold them: slot n's backend id at index n - 1 (0: none; no
/// backend has id 0). 40 bytes for ten, where a B-tree node took 112.
#[derive(Debug, Default, Clone)]
struct Slots(Vec<u32>);

impl Slots {
    fn get(&self, slot: u32) -> Option<u32> {
        self.0.get((slot as usize).wrapping_sub(1)).copied().filter(|id| *id != 0)
    }

    fn reserve(&mut self, slots: usize) {
        self.0.reserve_exact(slots.saturating_sub(self.0.len()));
    }

    /// `slot` is 1..=MAX_BACKENDS_PER_SERVICE.
    fn insert(&mut self, slot: u32, id: u32) {
        let i = slot as usize - 1;
        if self.0.len() <= i {
            self.0.resize(i + 1, 0);
        }
        self.0[i] = id;
    }

    fn remove(&mut self, slot: u32) {
        if let Some(id) = self.0.get_mut((slot as usize).wrapping_sub(1)) {
            *id = 0;
        }
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
    }

    fn len(&self) -> usize {
        self.ids().count()
    }

    /// The slot numbers held.
    fn numbers(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().filter(|(_, id)| **id != 0).map(|(i, _)| i as u32 + 1)
    }

    fn numbers_past(&self, n: u32) -> Vec<u32> {
        self.numbers().filter(|s| *s > n).collect()
    }

    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied().filter(|id| *id != 0)
    }

    /// The ids of slots 1..=count that are held.
    fn ids_upto(&self, count: u32) -> Vec<u32> {
        self.0.iter().take(count as usize).copied().filter(|id| *id != 0).collect()
    }
}

/// What the service, slot, backend and source-range maps hold, as read: what a full sync
/// starts from, before the ids are taken over from it.
pub struct MapsRead {
    services: Vec<(ServiceKey, ServiceValue)>,
    backends: Vec<(u32, Backend)>,
    slots: FastMap<u32, Slots>,
    stray_slots: Vec<SlotKey>,
    ranges: BTreeSet<SrcRange>,
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
    fn build(read: MapsRead, config: DatapathConfig, ids: &mut Ids) -> Self {
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
struct HeldBackends {
    as_given: IdSet,
    other: FastMap<u32, Backend>,
}

impl HeldBackends {
    fn get(&self, ids: &Ids, id: u32) -> Option<Backend> {
        match self.other.get(&id) {
            Some(b) => Some(*b),
            None if self.as_given.contains(id) => ids.backend_of(id),
            None => None,
        }
    }

    fn set(&mut self, ids: &Ids, id: u32, b: Backend) {
        if ids.backend_of(id) == Some(b) {
            self.as_given.insert(id);
            self.other.remove(&id);
        } else {
            self.as_given.remove(id);
            self.other.insert(id, b);
        }
    }

    fn remove(&mut self, id: u32) {
        self.as_given.remove(id);
        self.other.remove(&id);
    }

    fn contains(&self, id: u32) -> bool {
        self.as_given.contains(id) || self.other.contains_key(&id)
    }

    fn len(&self) -> usize {
        self.as_given.len() + self.other.len()
    }

    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.as_given.iter().chain(self.other.keys().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::ebpf::maps::FakeMaps,
        model::{Frontend, FrontendKey, FrontendKind, Protocol, Scheduler},
    };

    fn frontend(backends: &[(&str, u16)], sched: Scheduler) -> Frontend {
        Frontend {
            scheduler: sched,
            source_ranges: vec!["198.18.0.0/24".parse().unwrap()],
            ..Frontend::for_test(FrontendKind::ClusterIp, backends, Protocol::Tcp)
        }
    }

    fn key(ip: &str) -> FrontendKey {
        FrontendKey { ip: ip.parse().unwrap(), port: 80, proto: Protocol::Tcp, scope: crate::model::Scope::Internal }
    }

    fn state(frontends: &[(&str, &[(&str, u16)])]) -> DesiredState {
        let mut d = DesiredState::default();
        for (vip, backends) in frontends {
            let mut f = frontend(backends, Scheduler::Random);
            f.service = format!("ns/{vip}:http").into();
            f.source_ranges.clear();
            d.frontends.insert(key(vip), f);
        }
        d
    }

    /// One list shared by the two scopes' frontends of 10.96.0.3, and 10.96.0.2's own (synced
    /// first: keys sort by address).
    fn shared_state() -> DesiredState {
        let mut d = DesiredState::default();
        let shared = frontend(&[("10.244.1.1", 80), ("10.244.1.2", 80)], Scheduler::Random);
        for scope in [crate::model::Scope::Internal, crate::model::Scope::External] {
            d.frontends.insert(FrontendKey { scope, ..key("10.96.0.3") }, shared.clone());
        }
        d.frontends.insert(key("10.96.0.2"), frontend(&[("10.244.2.1", 80)], Scheduler::Random));
        d
    }

    #[test]
    fn frontends_that_share_a_backend_list_each_get_it_whole() {
        let d = shared_state();
        let mut maps = FakeMaps::default();
        let st = Syncer::default().sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!((st.frontends, st.backends, maps.backends.len()), (3, 3, 3));
        let addrs = |ips: &[&str]| -> Vec<[u32; 4]> { ips.iter().map(|ip| proxy_common::user::addr_words(ip.parse().unwrap())).collect() };
        let got: Vec<Vec<[u32; 4]>> = view(&maps).into_values().collect();
        assert_eq!(got.iter().filter(|b| **b == addrs(&["10.244.1.1", "10.244.1.2"])).count(), 2, "{got:?}");
        assert_eq!(got.iter().filter(|b| **b == addrs(&["10.244.2.1"])).count(), 1, "{got:?}");
    }

    #[test]
    fn a_shared_list_that_did_not_fit_is_not_taken_as_written() {
        let mut maps = FakeMaps::default();
        maps.capacity.insert(proxy_common::map_names::BACKENDS, 2);
        let st = Syncer::default().sync(&mut maps, &shared_state(), DatapathConfig::default()).unwrap();
        // 10.96.0.2's backend and one of the shared list's fit: the first scope of 10.96.0.3
        // fails on the second, and the other scope must fail too, not take the list as written.
        assert_eq!(st.full.len(), 2, "{st:?}");
        assert_eq!(view(&maps).len(), 1);
        assert!(maps.slots.values().all(|id| maps.backends.contains_key(id)));
    }

    #[test]
    fn a_full_backend_map_makes_room_before_it_inserts() {
        let mut maps = FakeMaps::default();
        maps.capacity.insert(proxy_common::map_names::BACKENDS, 4);
        let mut s = Syncer::default();
        let before = state(&[("10.96.0.1", &[("10.244.1.1", 80), ("10.244.1.2", 80)]), ("10.96.0.2", &[("10.244.2.1", 80), ("10.244.2.2", 80)])]);
        s.sync(&mut maps, &before, DatapathConfig::default()).unwrap();
        assert_eq!(maps.backends.len(), 4);
        assert_eq!(maps.bulks, 1, "into empty maps, everything fits: the puts may be held");
        // One service shrinks, the other grows: the total fits, but only once the shrinking
        // one's backend is gone; the growing one (written first) meets a full map.
        let after = state(&[("10.96.0.1", &[("10.244.1.1", 80)]), ("10.96.0.2", &[("10.244.2.1", 80), ("10.244.2.2", 80), ("10.244.2.3", 80)])]);
        for incremental in [false, true] {
            let (from, to) = if incremental { (&after, &before) } else { (&before, &after) };
            let st = if incremental {
                s.sync_subset(&mut maps, to, DatapathConfig::default(), &[key("10.96.0.1"), key("10.96.0.2")].into()).unwrap()
            } else {
                s.sync(&mut maps, to, DatapathConfig::default()).unwrap()
            };
            assert!(st.errors.is_empty() && st.full.is_empty(), "{:?}", st.errors);
            let mut fresh = FakeMaps::default();
            Syncer::default().sync(&mut fresh, to, DatapathConfig::default()).unwrap();
            assert_eq!(maps.backends.len(), fresh.backends.len(), "{from:?} -> {to:?}");
            assert_eq!(maps.services.len(), 2);
        }
        // Past the capacity unless the deletes go first: no held puts (a held put cannot say
        // "full" for its frontend).
        assert_eq!(maps.bulks, 1);
    }

    #[test]
    fn a_backend_that_a_frontend_left_as_it_was_points_to_keeps_its_id() {
        // Two ids (1..3). Both services use A; then s1 wants two more backends than there are
        // ids, so it stays as it was (pointing to A), and s2 leaves: A's id must not be freed
        // and given to another backend while s1's slot names it.
        let mut maps = FakeMaps::default();
        let mut s = Syncer::new(16, 3, 2);
        s.ids.reuse_backend_ids_at_once();
        let a = ("10.244.1.1", 80);
        s.sync(&mut maps, &state(&[("10.96.0.1", &[a]), ("10.96.0.2", &[a])]), DatapathConfig::default()).unwrap();
        let grown = state(&[("10.96.0.1", &[a, ("10.244.1.2", 80), ("10.244.1.3", 80)]), ("10.96.0.2", &[a])]);
        let st = s.sync(&mut maps, &grown, DatapathConfig::default()).unwrap();
        assert_eq!(st.full.len(), 1, "{:?}", st.errors);
        let left = state(&[("10.96.0.1", &[a, ("10.244.1.2", 80), ("10.244.1.3", 80)])]);
        s.sync_subset(&mut maps, &left, DatapathConfig::default(), &[key("10.96.0.2")].into()).unwrap();
        let then = state(&[("10.96.0.1", &[a, ("10.244.1.2", 80), ("10.244.1.3", 80)]), ("10.96.0.3", &[("10.244.9.9", 80)])]);
        s.sync_subset(&mut maps, &then, DatapathConfig::default(), &[key("10.96.0.3")].into()).unwrap();
        let a_addr = proxy_common::user::addr_words(a.0.parse().unwrap());
        let s1 = programmed(&maps)[&proxy_common::user::addr_words("10.96.0.1".parse().unwrap())].clone();
        assert_eq!(s1, vec![a_addr], "s1 still reaches A, not the newcomer");
    }

    #[test]
    fn slots_written_by_hand_past_any_service_are_deleted() {
        let d = state(&[("10.96.0.1", &[("10.244.1.1", 80)])]);
        let mut maps = FakeMaps::default();
        let mut s = Syncer::default();
        s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        let sid = maps.services.values().next().unwrap().service_id;
        let id = *maps.slots.values().next().unwrap();
        for slot in [0, MAX_BACKENDS_PER_SERVICE + 1, u32::MAX] {
            maps.slots.insert(SlotKey { service_id: sid, slot }, id);
        }
        maps.slots.insert(SlotKey { service_id: sid, slot: 2 }, 0);
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!((st.deletes, maps.slots.len()), (4, 1), "{:?}", maps.slots);
        assert_eq!(programmed(&maps).values().next().unwrap().len(), 1);
    }

    #[test]
    fn backend_ids_stay_below_the_limit_through_churn() {
        // Ids 1..8 (the per-backend arrays' size), and 60 backends that come and go: pods
        // rescheduled with new addresses, as on a node that runs for months.
        let mut maps = FakeMaps::default();
        let mut s = Syncer::new(16, 8, 2);
        s.ids.reuse_backend_ids_at_once();
        for round in 0..20u8 {
            let (a, b) = (format!("10.244.{round}.1"), format!("10.244.{round}.2"));
            let (c, keep) = (format!("10.244.{round}.3"), "10.244.200.1".to_string());
            let d = state(&[("10.96.0.1", &[(&a, 80), (&b, 80), (&keep, 80)]), ("10.96.0.2", &[(&c, 80)])]);
            let st = if round % 3 == 0 {
                s.sync(&mut maps, &d, DatapathConfig::default()).unwrap()
            } else {
                s.sync_subset(&mut maps, &d, DatapathConfig::default(), &[key("10.96.0.1"), key("10.96.0.2")].into()).unwrap()
            };
            assert!(st.errors.is_empty() && st.full.is_empty(), "round {round}: {:?} {:?}", st.errors, st.full);
            assert!(maps.backends.keys().all(|id| (1..8).contains(id)), "round {round}: {:?}", maps.backends.keys());
            let mut fresh = FakeMaps::default();
            Syncer::default().sync(&mut fresh, &d, DatapathConfig::default()).unwrap();
            assert_eq!(programmed(&maps), programmed(&fresh), "round {round}");
            assert_eq!(maps.backends.len(), 4, "round {round}: the old backends are deleted");
        }
    }

    /// Each service (by VIP) -> the backend addresses its slots point to, sorted.
    fn programmed(maps: &FakeMaps) -> BTreeMap<[u32; 4], Vec<[u32; 4]>> {
        maps.services
            .iter()
            .map(|(k, v)| {
                let mut bes: Vec<[u32; 4]> =
                    (1..=v.backend_count).map(|slot| maps.backends[&maps.slots[&SlotKey { service_id: v.service_id, slot }]].addr).collect();
                bes.sort();
                (k.addr, bes)
            })
            .collect()
    }

    #[test]
    fn overridden_frontends_are_programmed_as_overridden_in_full_and_incremental_syncs() {
        let d = state(&[("10.96.0.1", &[("10.244.1.1", 80), ("10.244.1.2", 80)]), ("10.96.0.2", &[("10.244.1.2", 80), ("10.244.2.2", 80)])]);
        // Outlier ejection leaves 10.244.1.2 out of the first frontend only.
        let mut left = d.clone();
        let first = left.frontends.get_mut(&key("10.96.0.1")).unwrap();
        first.backends = first.backends.iter().filter(|b| b.ip != "10.244.1.2".parse::<std::net::IpAddr>().unwrap()).copied().collect();
        let overrides: HashMap<FrontendKey, Frontend> = [(key("10.96.0.1"), left.frontends[&key("10.96.0.1")].clone())].into();
        let mut want = FakeMaps::default();
        Syncer::default().sync(&mut want, &left, DatapathConfig::default()).unwrap();
        let mut plain = FakeMaps::default();
        Syncer::default().sync(&mut plain, &d, DatapathConfig::default()).unwrap();
        assert_ne!(programmed(&want), programmed(&plain));
        for incremental in [false, true] {
            let (mut maps, mut s) = (FakeMaps::default(), Syncer::default());
            s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
            s.set_overrides(overrides.clone());
            let touched: BTreeSet<FrontendKey> = [key("10.96.0.1")].into();
            if incremental {
                s.sync_subset(&mut maps, &d, DatapathConfig::default(), &touched).unwrap();
            } else {
                s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
            }
            assert_eq!(programmed(&maps), programmed(&want), "incremental: {incremental}");
            // The ejection ends: the desired state's own frontend again.
            s.set_overrides(HashMap::new());
            if incremental {
                s.sync_subset(&mut maps, &d, DatapathConfig::default(), &touched).unwrap();
            } else {
                s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
            }
            assert_eq!(programmed(&maps), programmed(&plain), "incremental: {incremental}");
        }
    }

    #[test]
    fn the_service_ids_are_the_configured_capacity_and_running_out_is_a_full_services_map() {
        let mut maps = FakeMaps::default();
        // Ids 1..=2 (id 0 is never given out).
        let mut s = Syncer::new(3, MAX_BACKENDS, 2);
        let d = state(&[("10.96.0.1", &[("10.244.1.1", 80)]), ("10.96.0.2", &[("10.244.1.1", 80)]), ("10.96.0.3", &[("10.244.1.1", 80)])]);
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!(st.full, vec![(proxy_common::map_names::SERVICES, "ns/10.96.0.3:http".to_string())]);
        assert_eq!(maps.services.len(), 2);
        // One leaves: its id goes to the one that did not fit.
        let d = state(&[("10.96.0.2", &[("10.244.1.1", 80)]), ("10.96.0.3", &[("10.244.1.1", 80)])]);
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert!(st.full.is_empty(), "{:?}", st.full);
        assert_eq!(maps.services.len(), 2);
    }

    #[test]
    fn what_does_not_fit_is_reported_per_frontend_and_the_rest_is_programmed() {
        let mut maps = FakeMaps::default();
        maps.capacity.insert(proxy_common::map_names::BACKENDS, 3);
        let mut s = Syncer::default();
        let d = state(&[("10.96.0.1", &[("10.244.1.1", 80), ("10.244.1.2", 80)]), ("10.96.0.2", &[("10.244.2.1", 80), ("10.244.2.2", 80)])]);
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!(st.full, vec![(proxy_common::map_names::BACKENDS, "ns/10.96.0.2:http".to_string())]);
        assert_eq!(maps.services.len(), 1, "the first service is programmed");
        // Room appears (the capacity is raised): the next sync programs the rest.
        maps.capacity.insert(proxy_common::map_names::BACKENDS, 4);
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert!(st.full.is_empty());
        assert_eq!(maps.services.len(), 2);
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
    fn subset_sync_trusts_its_mirror_and_full_sync_repairs_drift() {
        let mut maps = FakeMaps::default();
        let mut s = Syncer::default();
        let mut d = DesiredState::default();
        d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random));
        s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        d.frontends.insert(key("10.96.0.2"), frontend(&[("10.0.0.3", 80)], Scheduler::Random));
        d.frontends.remove(&key("10.96.0.1"));
        let all: BTreeSet<FrontendKey> = [key("10.96.0.1"), key("10.96.0.2")].into_iter().collect();
        let st = s.sync_subset(&mut maps, &d, DatapathConfig::default(), &all).unwrap();
        assert!(st.writes > 0 && st.deletes > 0);
        let mut reference = FakeMaps::default();
        Syncer::default().sync(&mut reference, &d, DatapathConfig::default()).unwrap();
        assert_eq!(maps.services.len(), reference.services.len());
        assert_eq!(maps.slots.len(), reference.slots.len());
        assert_eq!(maps.backends.len(), reference.backends.len());
        // Drift: an entry deleted by hand. The cached sync trusts its mirror; the full one repairs.
        maps.slots.clear();
        assert_eq!(s.sync_subset(&mut maps, &d, DatapathConfig::default(), &all).unwrap().writes, 0);
        assert!(maps.slots.is_empty());
        s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!(maps.slots.len(), 1);
    }

    #[test]
    fn the_first_full_sync_takes_the_maps_read_ahead_and_later_ones_read_them() {
        // What a previous agent left.
        let mut maps = FakeMaps::default();
        let mut d = DesiredState::default();
        d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random));
        Syncer::default().sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        let kept = programmed(&maps);

        // A restart reads ahead: the sync takes over the ids from that read and writes nothing.
        let mut s = Syncer::default();
        s.set_read_ahead(MapsRead::read(&maps).unwrap());
        // Proof that it is that read the sync uses: a slot deleted after it is not seen.
        let slot = *maps.slots.keys().next().unwrap();
        let slot_id = maps.slots.remove(&slot).unwrap();
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");
        // The next full sync reads the maps and repairs the slot, with its backend id.
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!(st.writes, 1);
        assert_eq!(maps.slots.get(&slot), Some(&slot_id));
        assert_eq!(programmed(&maps), kept);

        // Once a sync has a mirror, a read ahead is not taken: it may be older than the mirror.
        s.set_read_ahead(MapsRead::read(&FakeMaps::default()).unwrap());
        let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");
    }

    /// Frontend -> backend addresses, as the maps say.
    fn view(m: &FakeMaps) -> BTreeMap<ServiceKey, Vec<[u32; 4]>> {
        m.services
            .iter()
            .map(|(k, v)| {
                let bes = (1..=v.backend_count).map(|slot| m.backends[&m.slots[&SlotKey { service_id: v.service_id, slot }]].addr).collect();
                (*k, bes)
            })
            .collect()
    }

    #[test]
    fn subset_sync_equals_a_full_sync() {
        let mut maps = FakeMaps::default();
        let mut s = Syncer::default();
        let mut d = DesiredState::default();
        d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random));
        d.frontends.insert(key("10.96.0.2"), frontend(&[("10.0.0.2", 80), ("10.0.0.3", 80)], Scheduler::Random));
        d.frontends.insert(key("10.96.0.3"), frontend(&[("10.0.0.9", 80)], Scheduler::Maglev));
        s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        // Change one, remove one (its backend 10.0.0.9 must go), add one sharing a backend.
        let mut d2 = d.clone();
        d2.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.4", 80)], Scheduler::Random));
        d2.frontends.remove(&key("10.96.0.3"));
        let mut f4 = frontend(&[("10.0.0.3", 80)], Scheduler::Random);
        f4.source_ranges = vec!["203.0.113.0/24".parse().unwrap()];
        d2.frontends.insert(key("10.96.0.4"), f4);
        let touched: BTreeSet<FrontendKey> = [key("10.96.0.1"), key("10.96.0.3"), key("10.96.0.4")].into_iter().collect();
        s.sync_subset(&mut maps, &d2, DatapathConfig::default(), &touched).unwrap();
        let mut reference = FakeMaps::default();
        Syncer::default().sync(&mut reference, &d2, DatapathConfig::default()).unwrap();
        assert_eq!(view(&maps), view(&reference));
        assert_eq!(maps.backends.len(), reference.backends.len(), "unused backends deleted: {:?}", maps.backends);
        assert_eq!(maps.slots.len(), reference.slots.len());
        assert_eq!(maps.source_ranges.len(), reference.source_ranges.len());
        // And a full sync afterwards finds nothing to do.
        let st = s.sync(&mut maps, &d2, DatapathConfig::default()).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");
    }

    /// A port whose two scopes become different (externalTrafficPolicy set to Local) and then
    /// the same again: its frontend for both and its internal one are one map entry, and each
    /// subset sync leaves what a full sync writes.
    #[test]
    fn a_port_whose_scopes_split_and_join_again_keeps_its_entry() {
        use crate::model::Scope;
        let at = |scope| FrontendKey { scope, ..key("10.96.0.1") };
        let both = frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random);
        let mut joined = DesiredState::default();
        joined.frontends.insert(at(Scope::Both), both.clone());
        let mut split = DesiredState::default();
        split.frontends.insert(at(Scope::Internal), both.clone());
        split.frontends.insert(at(Scope::External), Frontend { preserve_source: true, ..frontend(&[("10.0.0.2", 80)], Scheduler::Random) });
        let touched: BTreeSet<FrontendKey> = [at(Scope::Internal), at(Scope::External), at(Scope::Both)].into();
        let mut maps = FakeMaps::default();
        let mut s = Syncer::default();
        s.sync(&mut maps, &joined, DatapathConfig::default()).unwrap();
        let id = s.service_id(&at(Scope::Both)).unwrap();
        for d in [&split, &joined, &split] {
            s.sync_subset(&mut maps, d, DatapathConfig::default(), &touched).unwrap();
            let mut reference = FakeMaps::default();
            Syncer::default().sync(&mut reference, d, DatapathConfig::default()).unwrap();
            assert_eq!(view(&maps), view(&reference));
            assert_eq!(maps.services.len(), d.frontends.len());
            assert_eq!(s.service_id(&at(Scope::Internal)), Some(id), "the entry (and its flows' service id) stays");
            let st = s.sync(&mut maps, d, DatapathConfig::default()).unwrap();
            assert_eq!((st.writes, st.deletes), (0, 0), "a full sync after it finds nothing to do: {st:?}");
        }
    }

    #[test]
    fn maglev_row_is_written_once_and_freed() {
        let mut maps = FakeMaps::default();
        let mut s = Syncer::new(16, MAX_BACKENDS, 2);
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
