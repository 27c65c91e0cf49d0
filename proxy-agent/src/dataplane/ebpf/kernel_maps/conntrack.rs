//! The conntrack tables' implementations, for the collectors and the views: IPv4's two tables
//! with the flow cache's generation (`ConntrackTables`), IPv6's embryonic table
//! (`Embryonic6`). A hash map's delete takes the entry out and puts it back when it no longer
//! matches what the caller read (`take_if`); the embryonic buckets check it under the bucket's
//! lock (buckets.rs).
use std::path::Path;

use aya::maps::{Array, HashMap, MapData};
use proxy_common::{map_names, CtBucket, CtBucket6, CtBuckets, CtKey, CtKey6, CtValue, CtValue6};

use super::{buckets::Buckets, hint::Hint, is_enoent, op, open_typed};
use crate::dataplane::ebpf::{
    bpf_batch::{self, Batch},
    hint::AssuredKeys,
    maps::{same_flow, ConntrackTables, MapError, Table},
};

/// The conntrack tables and the flow cache's generation, opened from their pins (the garbage
/// collector's thread has its own).
pub struct KernelConntrack {
    assured: HashMap<MapData, CtKey, CtValue>,
    /// The assured table's hint: a key put back is noted (see proxy_common::CtHinted).
    hint: Hint<CtBucket>,
    embryonic: Buckets<CtBucket>,
    flow_cache_gen: Array<MapData, u64>,
}

impl KernelConntrack {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self {
            assured: open_typed(pin_dir, map_names::CONNTRACK)?,
            hint: Hint::open(pin_dir)?,
            embryonic: Buckets::open(pin_dir, map_names::CONNTRACK_NEW)?,
            flow_cache_gen: open_typed(pin_dir, map_names::FLOW_CACHE_GEN)?,
        })
    }

    /// Deletes `key` from `table` if `delete` holds for its entry.
    fn delete_when(&mut self, table: Table, key: &CtKey, delete: impl Fn(&CtValue) -> bool) -> Result<bool, MapError> {
        match table {
            Table::Assured => take_if(table.map_name(), aya::maps::IterableMap::map(&self.assured), &self.hint, key, delete),
            Table::Embryonic => self.embryonic.delete_if(key, delete),
        }
    }
}

/// Takes `key` out of the assured table `map` if `keep_out` holds for its entry; else puts the
/// entry back (unless the data path wrote a newer one in the moment it was out), its hint's
/// bits set around the insert as the data path's inserts set them (a rebuild of the hint may
/// have read the table while the key was out). Returns whether it stayed out.
fn take_if<B: CtBuckets<Key: bytemuck::Pod>, V: bytemuck::Pod>(
    name: &'static str,
    map: &MapData,
    hint: &Hint<B>,
    key: &B::Key,
    keep_out: impl Fn(&V) -> bool,
) -> Result<bool, MapError> {
    let fd = map.fd();
    let taken: Option<V> = bpf_batch::lookup_and_delete(fd, key).map_err(|source| MapError::Op { map: name, op: "lookup and delete", source })?;
    match taken {
        None => Ok(false),
        Some(v) if keep_out(&v) => Ok(true),
        Some(v) => {
            hint.noting(key, || bpf_batch::insert_new(fd, key, &v)).map_err(|source| MapError::Op { map: name, op: "update", source })?;
            Ok(false)
        }
    }
}

/// An assured table (IPv4's KPR_CT_V3, IPv6's KPR_CT6_V1), read in batches for the
/// collector's rebuild of its hint.
pub struct KernelAssured<K, V> {
    name: &'static str,
    map: HashMap<MapData, K, V>,
}

impl<K: aya::Pod, V: aya::Pod> KernelAssured<K, V> {
    pub fn open(pin_dir: &Path, name: &'static str) -> Result<Self, MapError> {
        Ok(Self { name, map: open_typed(pin_dir, name)? })
    }
}

impl<K: aya::Pod + bytemuck::Pod, V: aya::Pod + bytemuck::Pod> AssuredKeys<K, V> for KernelAssured<K, V> {
    fn read_batch(&self, cursor: Option<u32>, max: usize) -> Result<Batch<K, V>, MapError> {
        read_batch(self.name, aya::maps::IterableMap::map(&self.map), cursor, max)
    }
}

/// KPR_CT6_NEW_V3, for its collector (conntrack6.rs).
pub struct KernelEmbryonic6(Buckets<CtBucket6>);

impl KernelEmbryonic6 {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self(Buckets::open(pin_dir, map_names::CONNTRACK6_NEW)?))
    }
}

/// One batch of a hash map's entries (see bpf_batch::lookup_batch), its errors naming the map.
fn read_batch<K: bytemuck::Pod, V: bytemuck::Pod>(name: &'static str, map: &MapData, cursor: Option<u32>, max: usize) -> Result<Batch<K, V>, MapError> {
    bpf_batch::lookup_batch(map.fd(), cursor, max).map_err(|source| MapError::Op { map: name, op: "lookup batch", source })
}

/// A hash map's entry for `key`, None where there is none.
fn lookup<K: aya::Pod, V: aya::Pod>(name: &'static str, map: &HashMap<MapData, K, V>, key: &K) -> Result<Option<V>, MapError> {
    match map.get(key, 0) {
        Ok(v) => Ok(Some(v)),
        Err(e) if is_enoent(&e) => Ok(None),
        Err(e) => Err(op(name, "lookup", e)),
    }
}

impl crate::dataplane::ebpf::conntrack6::Embryonic6 for KernelEmbryonic6 {
    fn read_batch(&self, cursor: Option<u32>, max: usize) -> Result<Batch<CtKey6, CtValue6>, MapError> {
        Ok(self.0.read_batch(cursor, max))
    }
    fn get(&self, key: &CtKey6) -> Result<Option<CtValue6>, MapError> {
        Ok(self.0.get(key))
    }
    fn delete_if(&mut self, key: &CtKey6, expected: &CtValue6) -> Result<bool, MapError> {
        self.0.delete_if(key, |v| v == expected)
    }
}

impl ConntrackTables for KernelConntrack {
    fn read_batch(&self, table: Table, cursor: Option<u32>, max: usize) -> Result<Batch<CtKey, CtValue>, MapError> {
        match table {
            Table::Assured => read_batch(table.map_name(), aya::maps::IterableMap::map(&self.assured), cursor, max),
            Table::Embryonic => Ok(self.embryonic.read_batch(cursor, max)),
        }
    }
    fn get(&self, table: Table, key: &CtKey) -> Result<Option<CtValue>, MapError> {
        match table {
            Table::Assured => lookup(table.map_name(), &self.assured, key),
            Table::Embryonic => Ok(self.embryonic.get(key)),
        }
    }
    fn set_flags_if(&mut self, table: Table, key: &CtKey, expected: &CtValue, flags: u16) -> Result<bool, MapError> {
        if table == Table::Embryonic {
            return self.embryonic.change_if(key, |v| same_flow(v, expected).then_some(CtValue { flags: v.flags | flags, ..*v }));
        }
        let Some(mut v) = self.get(table, key)?.filter(|v| same_flow(v, expected)) else {
            return Ok(false);
        };
        v.flags |= flags;
        let fd = aya::maps::IterableMap::map(&self.assured).fd();
        bpf_batch::update_existing(fd, key, &v).map_err(|source| MapError::Op { map: table.map_name(), op: "update", source })
    }
    fn delete_if(&mut self, table: Table, key: &CtKey, expected: &CtValue) -> Result<bool, MapError> {
        self.delete_when(table, key, |v| v == expected)
    }
    fn delete_if_same_flow(&mut self, table: Table, key: &CtKey, expected: &CtValue) -> Result<bool, MapError> {
        self.delete_when(table, key, |v| same_flow(v, expected))
    }
    fn invalidate_flow_cache(&mut self) -> Result<(), MapError> {
        let name = map_names::FLOW_CACHE_GEN;
        let g = self.flow_cache_gen.get(&0, 0).map_err(|e| op(name, "lookup", e))?;
        // Past any of the data path's own (32-bit) steps: never a value an entry holds.
        self.flow_cache_gen.set(0, g.wrapping_add(1 << 33), 0).map_err(|e| op(name, "update", e))
    }
}
