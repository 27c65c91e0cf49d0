//! Expired sessionAffinity entries: an entry older than its service's timeout is deleted (the
//! data path already ignores it; this returns the memory). Runs on the collector's thread.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use aya::maps::{HashMap as AyaHashMap, MapData};
use proxy_common::{map_names, AffinityKey, AffinityValue, ServiceKey, ServiceValue};

use crate::{
    dataplane::ebpf::kernel_maps::{collect, del, open_typed},
    dataplane::ebpf::maps::MapError,
};

/// The maps the collector reads, opened from their pins.
type Maps = (AyaHashMap<MapData, ServiceKey, ServiceValue>, AyaHashMap<MapData, AffinityKey, AffinityValue>);

pub struct AffinityGc {
    pin_dir: PathBuf,
    maps: Option<Maps>,
}

impl AffinityGc {
    pub fn new(pin_dir: &Path) -> Self {
        Self { pin_dir: pin_dir.into(), maps: None }
    }

    fn maps(&mut self) -> Result<&mut Maps, MapError> {
        if self.maps.is_none() {
            self.maps = Some((open_typed(&self.pin_dir, map_names::SERVICES)?, open_typed(&self.pin_dir, map_names::AFFINITY)?));
        }
        Ok(self.maps.as_mut().expect("opened above"))
    }

    /// Deletes expired entries; returns how many.
    pub fn collect(&mut self, now_ns: u64) -> Result<usize, MapError> {
        let (services, affinity) = self.maps()?;
        let timeouts: HashMap<u32, u32> =
            collect(map_names::SERVICES, services.iter())?.into_iter().map(|(_, v)| (v.service_id, v.affinity_timeout_s)).collect();
        let mut n = 0;
        for (k, v) in collect(map_names::AFFINITY, affinity.iter())? {
            let t = timeouts.get(&k.service_id).copied().unwrap_or(0);
            if now_ns.saturating_sub(v.last_used_ns) > u64::from(t) * 1_000_000_000 {
                del(map_names::AFFINITY, affinity.remove(&k))?;
                n += 1;
            }
        }
        Ok(n)
    }
}

impl crate::dataplane::ebpf::endpoint_cleanup::Affinity for AffinityGc {
    fn purge(&mut self, pairs: &std::collections::BTreeSet<(u32, u32)>) -> Result<usize, MapError> {
        let (_, affinity) = self.maps()?;
        let mut n = 0;
        for (k, v) in collect(map_names::AFFINITY, affinity.iter())? {
            if pairs.contains(&(k.service_id, v.backend_id)) {
                del(map_names::AFFINITY, affinity.remove(&k))?;
                n += 1;
            }
        }
        Ok(n)
    }
}
