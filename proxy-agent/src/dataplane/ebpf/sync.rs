//! Sync by difference: desired state vs. what the maps hold now. Ids are stable: a backend keeps
//! its id while it exists anywhere, a frontend keeps its service id while it exists, and both
//! are recovered from the maps after a restart.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use foldhash::HashSet as FastSet;

use proxy_common::{
    limits::{MAGLEV_ROWS, MAX_BACKENDS, MAX_SERVICES},
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

mod mirror;

pub use mirror::MapsRead;
use mirror::{Mirror, Slots};

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

/// The data path's configuration, written when it changed (both sync paths start with it).
fn write_config(maps: &mut dyn DatapathMaps, m: &mut Mirror, config: DatapathConfig, st: &mut SyncStats) -> Result<(), SyncError> {
    if m.config != config {
        maps.set_config(config)?;
        m.config = config;
        st.writes += 1;
    }
    Ok(())
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
        write_config(maps, &mut m, config, &mut st)?;

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
        let distinct: usize =
            desired.frontends.iter().map(|(k, f)| &effective(&overrides, k, f).backends).filter(|b| lists.insert(b.shared_id())).map(|b| b.len()).sum();
        self.ids.reserve_backends(distinct);
        let mut live_backends = IdSet::default();
        for (k, f) in &desired.frontends {
            for b in effective(&overrides, k, f).backends.iter() {
                let id = self.ids.backend(wire::backend(&b));
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
        let ids = f.backends.iter().map(|b| self.ids.backend(wire::backend(&b)).ok_or_else(full)).collect::<Result<_, _>>()?;
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
            let wire = wire::backend(&b);
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
                None => scheduler = SCHED_RANDOM,
            }
        }
        // Reported once the frontend is programmed (below): a try that meets a full map is
        // tried again, and may get a row then.
        let maglev_fallback = wire::scheduler(f.scheduler) == SCHED_MAGLEV && scheduler == SCHED_RANDOM;
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
        if maglev_fallback {
            let message = format!("all {} Maglev rows in use: balanced at random instead", self.ids.maglev_rows_total());
            st.errors.push(format!("{}: {message}", f.service));
            st.failed.push(crate::model::errors::service_port_error(&f.service, message, crate::model::errors::MAP_FULL));
            st.fallback.push((map_names::MAGLEV, f.service.to_string()));
        }
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
        write_config(maps, &mut m, config, &mut st)?;
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

#[cfg(test)]
mod tests;
