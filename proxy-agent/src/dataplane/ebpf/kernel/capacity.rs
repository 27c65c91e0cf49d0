//! The maps' capacities: what each sized map is created with (the embryonic tables hold
//! buckets of CT_BUCKET_WAYS, the others an entry a value), and the checks of pinned maps
//! against the settings (a pinned map keeps its size) and against the node's CPUs (an LRU map
//! too small for them evicts early).
use std::path::Path;

use proxy_common::{map_names, CtBucket, CtBucket6};

use crate::{dataplane::ebpf::kernel_maps::HintedFamily, settings::Capacities};

/// The maps whose capacity the settings give, with it.
pub(super) fn sized_maps(caps: &Capacities) -> [(&'static str, u32); 11] {
    [
        (map_names::SERVICES, caps.services),
        (map_names::RR_STATE, caps.services),
        (map_names::BACKENDS, caps.backends),
        (map_names::BACKEND_NEW, caps.backends),
        (map_names::BACKEND_ACTIVE, caps.backends),
        (map_names::SLOTS, caps.slots),
        (map_names::CONNTRACK, caps.conntrack),
        (map_names::CONNTRACK_NEW, caps.conntrack_new),
        (map_names::CONNTRACK6, caps.conntrack6),
        (map_names::CONNTRACK6_NEW, caps.conntrack6_new),
        (map_names::AFFINITY, caps.affinity),
    ]
}

/// The maps indexed by backend id: the backends and their per-backend counters.
const BY_BACKEND_ID: [&str; 3] = [map_names::BACKENDS, map_names::BACKEND_NEW, map_names::BACKEND_ACTIVE];

/// How many backend ids the pinned maps hold (at most `wanted`): each map indexed by backend id
/// keeps its capacity when it is pinned (a larger setting applies after `kpr cleanup`), and an
/// upgrade may have replaced one of them at the new size while the others stayed, so the ids
/// stay below the smallest. A count past an array's end would be dropped without a word.
pub fn backend_id_limit(pin_dir: &Path, wanted: u32) -> u32 {
    BY_BACKEND_ID.iter().filter_map(|name| aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok()).fold(wanted, |limit, info| limit.min(info.max_entries()))
}

/// An embryonic table: an array of buckets of CT_BUCKET_WAYS, which also holds its family's
/// assured table's hint (proxy_common::CtHinted).
struct BucketTable {
    map: &'static str,
    /// The assured table it hints.
    assured: &'static str,
    /// The data path's global that holds its bucket mask (proxy-ebpf's embryonic.rs).
    mask_global: &'static str,
    capacity: fn(&Capacities) -> u32,
}

const BUCKET_TABLES: [BucketTable; 2] = [
    BucketTable { map: CtBucket::EMBRYONIC, assured: CtBucket::ASSURED, mask_global: "CT_NEW_BUCKET_MASK", capacity: |c| c.conntrack_new },
    BucketTable { map: CtBucket6::EMBRYONIC, assured: CtBucket6::ASSURED, mask_global: "CT6_NEW_BUCKET_MASK", capacity: |c| c.conntrack6_new },
];

/// Each embryonic table's bucket mask, for its data-path global: of the pinned array where
/// there is one (a pinned map keeps its size), else of the settings' capacity.
pub(super) fn bucket_masks(pin_dir: &Path, caps: &Capacities) -> Vec<(&'static str, u32)> {
    BUCKET_TABLES
        .iter()
        .map(|t| {
            let buckets =
                aya::maps::MapInfo::from_pin(pin_dir.join(t.map)).map(|i| i.max_entries()).unwrap_or_else(|_| max_entries_for(t.map, (t.capacity)(caps)));
            (t.mask_global, buckets.saturating_sub(1))
        })
        .collect()
}

/// The share of an assured table's hint bits set when the table holds `assured` keys: each
/// sets one bit a half, of 32 x CT_HINT_WORDS a half in each of the embryonic table's
/// `buckets`. It is the share of new flows that look the assured table up for their tuple.
pub fn hint_share_set(assured: u32, buckets: u32) -> f64 {
    let bits = f64::from(buckets.max(1)) * (32 * proxy_common::CT_HINT_WORDS) as f64;
    1.0 - (-f64::from(assured) / bits).exp()
}

/// The pinned assured tables whose hint, once the table is full, would send more than half of
/// new flows to the table anyway (an embryonic table small beside its assured one): (assured
/// map, its capacity, embryonic map, its capacity, the share).
pub fn coarse_hints(pin_dir: &Path) -> Vec<(&'static str, u32, &'static str, u32, f64)> {
    let max_entries = |name: &str| aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok().map(|i| i.max_entries());
    BUCKET_TABLES
        .iter()
        .filter_map(|t| {
            let (assured, buckets) = (max_entries(t.assured)?, max_entries(t.map)?);
            let share = hint_share_set(assured, buckets);
            (share > 0.5).then(|| (t.assured, assured, t.map, capacity_of(t.map, buckets), share))
        })
        .collect()
}

/// Whether a map is an embryonic table.
fn is_bucket_array(map: &str) -> bool {
    BUCKET_TABLES.iter().any(|t| t.map == map)
}

/// A map's max_entries for a capacity of `entries`: the embryonic tables hold buckets of
/// CT_BUCKET_WAYS (a power of two of them), every other map one entry per value.
pub fn max_entries_for(map: &str, entries: u32) -> u32 {
    if is_bucket_array(map) {
        proxy_common::ct_buckets(entries)
    } else {
        entries
    }
}

/// A map's capacity in entries, from its max_entries (see `max_entries_for`).
pub fn capacity_of(map: &str, max_entries: u32) -> u32 {
    if is_bucket_array(map) {
        max_entries.saturating_mul(proxy_common::CT_BUCKET_WAYS as u32)
    } else {
        max_entries
    }
}

/// Each pinned map's capacity in entries, for `kpr_map_capacity`.
pub fn map_capacities(pin_dir: &Path) -> Vec<(&'static str, u32)> {
    map_names::ALL
        .iter()
        .chain(map_names::SETS.iter())
        .filter_map(|name| aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok().map(|i| (*name, capacity_of(name, i.max_entries()))))
        .collect()
}

/// The maps whose pinned copy holds a different capacity than the settings ask for: a pinned
/// map keeps its size (the object reuses it), so such a change needs `kpr cleanup` first. A
/// larger one that allocates per entry (BPF_F_NO_PREALLOC) costs nothing and is left out
/// (earlier releases made the services map twice the service ids).
pub fn capacity_mismatches(pin_dir: &Path, caps: &Capacities) -> Vec<(&'static str, u32, u32)> {
    sized_maps(caps)
        .into_iter()
        .filter_map(|(name, want)| {
            let info = aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok()?;
            let (have, want) = (capacity_of(name, info.max_entries()), capacity_of(name, max_entries_for(name, want)));
            let harmless = have > want && info.map_flags() & proxy_common::BPF_F_NO_PREALLOC != 0;
            (have != want && !harmless).then_some((name, have, want))
        })
        .collect()
}

/// How many free entries the kernel's LRU hash keeps on each CPU's own list, out of the other
/// CPUs' reach (`LOCAL_FREE_TARGET` in kernel/bpf/bpf_lru_list.c).
pub(super) const LRU_CPU_FREE: u32 = 128;

/// The fill at which an LRU map of `max_entries` may start evicting on a node of `cpus`
/// possible CPUs, where the CPUs' own free lists can hold a quarter of it or more (None: they
/// cannot, and the map fills before it evicts). A CPU whose list runs dry evicts rather than
/// take another CPU's free entries.
pub fn lru_evicts_early(max_entries: u32, cpus: u32) -> Option<u32> {
    let held = LRU_CPU_FREE.saturating_mul(cpus);
    (held.saturating_mul(4) >= max_entries).then(|| max_entries.saturating_sub(held))
}

/// The sized maps under `pin_dir` that are LRU hashes too small for `cpus` CPUs: (map, its
/// capacity, the fill at which it may evict).
pub fn small_lru_maps(pin_dir: &Path, cpus: u32) -> Vec<(&'static str, u32, u32)> {
    sized_maps(&Capacities::default())
        .into_iter()
        .filter_map(|(name, _)| {
            let info = aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok()?;
            let lru = matches!(info.map_type(), Ok(aya::maps::MapType::LruHash));
            let max = info.max_entries();
            lru.then(|| lru_evicts_early(max, cpus)).flatten().map(|from| (name, max, from))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_capacities_hint_well_and_a_small_embryonic_table_does_not() {
        let d = Capacities::default();
        let share = |assured: u32, embryonic: u32| hint_share_set(assured, proxy_common::ct_buckets(embryonic));
        // IPv4: 524,288 keys in 32,768 buckets of 128 bits a half; IPv6: 65,536 in 8,192.
        assert!((0.11..0.12).contains(&share(d.conntrack, d.conntrack_new)), "{}", share(d.conntrack, d.conntrack_new));
        assert!((0.05..0.07).contains(&share(d.conntrack6, d.conntrack6_new)), "{}", share(d.conntrack6, d.conntrack6_new));
        assert!(share(d.conntrack, 8_192) > 0.5, "an eighth of the buckets: most new flows look the table up");
        assert_eq!(share(0, d.conntrack_new), 0.0);
    }

    #[test]
    fn an_lru_map_evicts_early_where_the_cpus_free_lists_hold_a_quarter_of_it() {
        // The defaults on a 256-CPU node: 32,768 held, fills before it evicts.
        assert_eq!(lru_evicts_early(524_288, 256), None);
        // A 32,768-entry map there (IPv6's embryonic default, when it was an LRU): a quarter
        // and more is on the CPUs' lists.
        assert_eq!(lru_evicts_early(32_768, 256), Some(0));
        assert_eq!(lru_evicts_early(32_768, 64), Some(32_768 - 8_192));
        assert_eq!(lru_evicts_early(32_768, 63), None);
        assert_eq!(lru_evicts_early(64, 2), Some(0));
    }
}
