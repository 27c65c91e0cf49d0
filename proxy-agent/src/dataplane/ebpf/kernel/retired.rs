//! Earlier releases' maps at load: a retired pin is removed, and where its entries must keep
//! their meaning they move into the successor first (the backend ids, the handshakes under
//! way, the data path's counts).
use std::path::Path;

use aya::{
    maps::{MapData, PerCpuArray, PerCpuValues},
    Ebpf,
};
use proxy_common::map_names;

use crate::dataplane::ebpf::{
    kernel_maps::{op, open_typed},
    maps::MapError,
};

use super::Capacities;

/// What a load takes from earlier releases' pins: read before the object loads, written once it
/// has (`carry_into`).
pub(super) struct Retired {
    backends: Option<Carry<u32, proxy_common::Backend>>,
    /// IPv4's embryonic flows: from the LRU (V1) or the preallocated hash (V2).
    embryonic: [Option<Carry<proxy_common::CtKey, proxy_common::CtValue>>; 2],
    /// IPv6's, the same.
    embryonic6: [Option<Carry<proxy_common::CtKey6, proxy_common::CtValue6>>; 2],
    counters: Option<CarryCounts>,
}

impl Retired {
    /// Reads the entries to carry over, and removes the pins of the other retired maps.
    pub(super) fn take(pin_dir: &Path, caps: &Capacities) -> Self {
        let retired = Self {
            backends: earlier_backends(pin_dir, caps.backends),
            embryonic: [map_names::CONNTRACK_NEW_V1, map_names::CONNTRACK_NEW_V2]
                .map(|from| earlier_embryonic(pin_dir, from, map_names::CONNTRACK_NEW, caps.conntrack_new)),
            embryonic6: [map_names::CONNTRACK6_NEW_V1, map_names::CONNTRACK6_NEW_V2]
                .map(|from| earlier_embryonic(pin_dir, from, map_names::CONNTRACK6_NEW, caps.conntrack6_new)),
            counters: CarryCounts::read(pin_dir),
        };
        map_names::RETIRED.into_iter().filter(|n| !map_names::CARRIED.contains(n)).for_each(|n| unpin(pin_dir, n));
        retired
    }

    /// Writes the entries into the loaded object's maps, then removes their old pins.
    pub(super) fn carry_into(self, ebpf: &Ebpf, pin_dir: &Path) {
        if let Some(c) = self.backends {
            c.write(ebpf, pin_dir);
        }
        for c in self.embryonic.into_iter().flatten() {
            c.write_buckets::<proxy_common::CtBucket>(ebpf, pin_dir);
        }
        for c in self.embryonic6.into_iter().flatten() {
            c.write_buckets::<proxy_common::CtBucket6>(ebpf, pin_dir);
        }
        if let Some(c) = self.counters {
            c.add_into(pin_dir);
        }
    }
}

/// The data path's counts of an earlier release's counters map (KPR_CNT_V6), each CPU's by
/// index: they are added into the new map's, so an upgrade resets no counter. Added, not
/// written: after a rollback and a second upgrade, the new map holds the counts from before the
/// rollback and the old one those since. What the old programs count between this read and
/// their replacement is lost.
struct CarryCounts(Vec<(u32, PerCpuValues<u64>)>);

impl CarryCounts {
    fn read(pin_dir: &Path) -> Option<Self> {
        let from = map_names::COUNTERS_V6;
        if !pin_dir.join(from).exists() {
            return None;
        }
        let read = open_typed::<PerCpuArray<MapData, u64>>(pin_dir, from)
            .and_then(|m| (0..m.len()).map(|i| m.get(&i, 0).map(|v| (i, v)).map_err(|e| op(from, "lookup", e))).collect::<Result<Vec<_>, _>>());
        Some(Self(read.unwrap_or_else(|err| {
            tracing::warn!(map = from, error = %err, "cannot read an earlier release's counters: they start again from zero");
            Vec::new()
        })))
    }

    fn add_into(self, pin_dir: &Path) {
        let (from, to) = (map_names::COUNTERS_V6, map_names::COUNTERS);
        let added = open_typed::<PerCpuArray<MapData, u64>>(pin_dir, to).and_then(|mut m| {
            for (i, old) in &self.0 {
                let now = m.get(i, 0).map_err(|e| op(to, "lookup", e))?;
                let sum: Vec<u64> = now.iter().zip(old.iter()).map(|(a, b)| a.wrapping_add(*b)).collect();
                let sum = PerCpuValues::try_from(sum).map_err(|e| MapError::Other { map: to, message: e.to_string() })?;
                m.set(*i, sum, 0).map_err(|e| op(to, "update", e))?;
            }
            Ok(())
        });
        match added {
            Ok(()) => tracing::info!(counters = self.0.len(), from, to, "carried an earlier release's counts over"),
            Err(err) => tracing::warn!(from, to, error = %err, "carrying an earlier release's counts over failed: they start again from zero"),
        }
        unpin(pin_dir, from);
    }
}

/// An earlier release's map whose entries move into its successor at load, so an upgrade keeps
/// them: read before the object loads, written once it has, and only then unpinned (a load that
/// failed leaves it for the next one). Best effort: a failure is logged, and the sync (or, for
/// flows, the clients) make up for what is lost.
struct Carry<K, V> {
    from: &'static str,
    to: &'static str,
    entries: Vec<(K, V)>,
}

impl<K: bytemuck::Pod, V: bytemuck::Pod> Carry<K, V> {
    /// The entries of `from`'s pin that `keep` keeps, if it is pinned.
    fn read(pin_dir: &Path, from: &'static str, to: &'static str, keep: impl Fn(&(K, V)) -> bool) -> Option<Self> {
        if !pin_dir.join(from).exists() {
            return None;
        }
        let read = crate::dataplane::ebpf::kernel_maps::open(pin_dir, from).and_then(|m| match map_data(&m) {
            Some(d) => crate::dataplane::ebpf::kernel_maps::read_all(from, d, keep),
            None => Ok(Vec::new()),
        });
        let entries = read.unwrap_or_else(|err| {
            tracing::warn!(map = from, error = %err, "cannot read an earlier release's map: its entries are not carried over");
            Vec::new()
        });
        Some(Self { from, to, entries })
    }

    fn write(self, ebpf: &Ebpf, pin_dir: &Path) {
        if !self.entries.is_empty() {
            if let Some(map) = ebpf.map(self.to).and_then(map_data) {
                let (keys, values): (Vec<K>, Vec<V>) = self.entries.into_iter().unzip();
                match crate::dataplane::ebpf::bpf_batch::update_batch(map.fd(), &keys, &values) {
                    Ok(()) => tracing::info!(entries = keys.len(), from = self.from, to = self.to, "carried an earlier release's entries over"),
                    Err((i, err)) => {
                        tracing::warn!(written = i, of = keys.len(), from = self.from, to = self.to, error = %err, "carrying an earlier release's entries over failed")
                    }
                }
            }
        }
        unpin(pin_dir, self.from);
    }

    /// `write` for an embryonic table, whose entries go into buckets (KPR_CT_NEW_V3,
    /// KPR_CT6_NEW_V3): an entry whose bucket is full stays behind, and its flow starts over.
    fn write_buckets<B: proxy_common::CtBuckets<Key = K, Value = V>>(self, ebpf: &Ebpf, pin_dir: &Path) {
        if !self.entries.is_empty() {
            let mapped = match ebpf.map(self.to).and_then(map_data) {
                Some(d) => crate::dataplane::ebpf::kernel_maps::Buckets::<B>::map(self.to, d),
                None => Err(MapError::Missing(self.to)),
            };
            match mapped {
                Ok(buckets) => {
                    let written = self.entries.iter().filter(|(k, v)| buckets.insert(k, v)).count();
                    tracing::info!(entries = written, of = self.entries.len(), from = self.from, to = self.to, "carried an earlier release's entries over");
                }
                Err(err) => tracing::warn!(from = self.from, to = self.to, error = %err, "carrying an earlier release's entries over failed"),
            }
        }
        unpin(pin_dir, self.from);
    }
}

fn unpin(pin_dir: &Path, name: &'static str) {
    if std::fs::remove_file(pin_dir.join(name)).is_ok() {
        tracing::info!(map = name, "removed the pin of a map an earlier version used");
    }
}

/// The backends of an earlier release's hash map (KPR_BE_V2), if it is pinned: they move into
/// the array with their ids, so the next sync takes the ids over (the flows in conntrack and the
/// per-backend counters name them). Ids past the new capacity stay behind: the sync gives their
/// backends new ones. A pinned KPR_BE_V2 is always the newer data (this release unpins it once
/// carried over), so a KPR_BE_V3 beside it is a leftover of an upgrade that a rollback undid:
/// it is unpinned, to be made anew. Without the entries the sync re-ids every backend, as it
/// does after `kpr cleanup`.
fn earlier_backends(pin_dir: &Path, capacity: u32) -> Option<Carry<u32, proxy_common::Backend>> {
    let v2 = map_names::BACKENDS_V2;
    if pin_dir.join(v2).exists() && std::fs::remove_file(pin_dir.join(map_names::BACKENDS)).is_ok() {
        tracing::warn!(stale = map_names::BACKENDS, newer = v2, "an older release ran after this one: its backend map replaces the one this release left");
    }
    Carry::read(pin_dir, v2, map_names::BACKENDS, |(id, b): &(u32, proxy_common::Backend)| *id < capacity && b.is_present())
}

/// The embryonic flows of an earlier release's table (KPR_CT_NEW_V1 and V2, KPR_CT6_NEW_V1 and
/// V2): handshakes
/// under way at the upgrade, whose next packet would otherwise be picked up as a new flow and
/// maybe meet another backend. Up to the new table's capacity; the collector times them out as
/// any.
fn earlier_embryonic<K: bytemuck::Pod, V: bytemuck::Pod>(pin_dir: &Path, from: &'static str, to: &'static str, capacity: u32) -> Option<Carry<K, V>> {
    let mut carry = Carry::read(pin_dir, from, to, |_| true)?;
    carry.entries.truncate(capacity as usize);
    Some(carry)
}

/// The descriptor side of the kinds the carry-over touches.
fn map_data(m: &aya::maps::Map) -> Option<&aya::maps::MapData> {
    match m {
        aya::maps::Map::Array(d) | aya::maps::Map::HashMap(d) | aya::maps::Map::LruHashMap(d) => Some(d),
        _ => None,
    }
}
