//! The collector of IPv6's embryonic table (`map_names::CONNTRACK6_NEW`, 4-way buckets as
//! IPv4's): nothing leaves it by itself, so the flows that never complete (a SYN never answered,
//! a UDP query answered once) are deleted here once every entry is idle past its timeout (TCP
//! 60 s, UDP the plain UDP timeout, as IPv4's embryonic flows: `Timeouts`). One batch a round,
//! and only what it read: an entry that changed since is kept. IPv6's assured table is an LRU,
//! which evicts its idle flows itself.
use proxy_common::{CtKey6, CtValue6, CT_DIR_EGRESS, CT_DIR_INGRESS};

use crate::dataplane::ebpf::{
    bpf_batch::Batch,
    conntrack::Timeouts,
    maps::{MapError, Table},
};

/// The IPv6 embryonic table, for its collector.
pub trait Embryonic6 {
    /// Up to `max` entries from `cursor` on (None: the start), and the cursor to go on from.
    fn read_batch(&self, cursor: Option<u32>, max: usize) -> Result<Batch<CtKey6, CtValue6>, MapError>;
    fn get(&self, key: &CtKey6) -> Result<Option<CtValue6>, MapError>;
    /// Deletes `key` if it still holds `expected`; returns whether it did.
    fn delete_if(&mut self, key: &CtKey6, expected: &CtValue6) -> Result<bool, MapError>;
}

/// In-memory, for tests.
impl Embryonic6 for std::collections::BTreeMap<CtKey6, CtValue6> {
    fn read_batch(&self, cursor: Option<u32>, max: usize) -> Result<Batch<CtKey6, CtValue6>, MapError> {
        Ok(crate::dataplane::ebpf::maps::fake_batch(self, cursor, max))
    }
    fn get(&self, key: &CtKey6) -> Result<Option<CtValue6>, MapError> {
        Ok(std::collections::BTreeMap::get(self, key).copied())
    }
    fn delete_if(&mut self, key: &CtKey6, expected: &CtValue6) -> Result<bool, MapError> {
        if std::collections::BTreeMap::get(self, key) != Some(expected) {
            return Ok(false);
        }
        Ok(self.remove(key).is_some())
    }
}

/// The collector's cursor.
#[derive(Debug)]
pub struct Gc6 {
    pub batch: usize,
    cursor: Option<u32>,
}

impl Gc6 {
    pub fn new(batch: usize) -> Self {
        Self { batch, cursor: None }
    }

    /// One round: the next batch. Returns the flows deleted (a flow's two entries, or an entry
    /// whose other one is gone).
    pub fn round(&mut self, t: &mut dyn Embryonic6, timeouts: &Timeouts, now_ns: u64) -> Result<usize, MapError> {
        let (batch, next) = t.read_batch(self.cursor, self.batch)?;
        self.cursor = next;
        let mut flows = 0;
        for (k, v) in batch {
            let timeout = timeouts.of(Table::Embryonic, k.proto, false);
            let idle = |v: &CtValue6| now_ns.saturating_sub(v.last_seen_ns) > timeout;
            if !idle(&v) {
                continue;
            }
            // The flow's other entry: a forward entry's leads to its reply's, and back.
            let forward = k.is_forward(&v);
            let other_key = CtKey6::reversed_of(&v, k.proto, if forward { CT_DIR_EGRESS } else { CT_DIR_INGRESS });
            let other = t.get(&other_key)?.filter(|o| CtKey6::reversed_of(o, k.proto, k.dir) == k);
            match other {
                // The other direction is still live: the flow stays.
                Some(o) if !idle(&o) => {}
                Some(o) => {
                    if t.delete_if(&k, &v)? {
                        t.delete_if(&other_key, &o)?;
                        flows += 1;
                    }
                }
                None => flows += usize::from(t.delete_if(&k, &v)?),
            }
        }
        Ok(flows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::{CT_F_REPLY, PROTO_TCP, PROTO_UDP};

    /// A flow's two entries: client port `port` to a frontend, balanced to a backend.
    fn flow(proto: u8, port: u16, forward_seen: u64, reply_seen: u64) -> [(CtKey6, CtValue6); 2] {
        let (c, f, b) = ([1, 0, 0, 1], [2, 0, 0, 2], [3, 0, 0, 3]);
        let (p, fp, bp) = (port.to_be(), 80u16.to_be(), 8080u16.to_be());
        let fwd = CtKey6 { saddr: c, daddr: f, sport: p, dport: fp, proto, dir: CT_DIR_INGRESS, _pad: 0 };
        let fv = CtValue6 { last_seen_ns: forward_seen, new_saddr: c, new_daddr: b, new_sport: p, new_dport: bp, ..Default::default() };
        let rev = CtKey6::reversed_of(&fv, proto, CT_DIR_EGRESS);
        let rv = CtValue6 { last_seen_ns: reply_seen, new_saddr: f, new_daddr: c, new_sport: fp, new_dport: p, flags: CT_F_REPLY, ..Default::default() };
        [(fwd, fv), (rev, rv)]
    }

    /// Idle flows go whole, by their timeouts (TCP 60 s, UDP 30 s); a flow with one live
    /// direction stays; an entry whose other one is gone goes alone; rounds are bounded.
    #[test]
    fn idle_embryonic_ipv6_flows_are_deleted_whole_in_bounded_rounds() {
        let s = 1_000_000_000u64;
        let mut t = std::collections::BTreeMap::new();
        let tcp_idle = flow(PROTO_TCP, 1000, 0, 0);
        let tcp_young = flow(PROTO_TCP, 1001, 0, 20 * s);
        let udp_idle = flow(PROTO_UDP, 1002, 0, 0);
        let orphan = flow(PROTO_UDP, 1003, 0, 0)[1];
        t.extend(tcp_idle.iter().chain(&tcp_young).chain(&udp_idle).copied());
        t.insert(orphan.0, orphan.1);
        let (timeouts, mut gc) = (Timeouts::default(), Gc6::new(2));
        let mut flows = 0;
        for _ in 0..8 {
            let before = t.len();
            flows += gc.round(&mut t, &timeouts, 45 * s).unwrap();
            assert!(before - t.len() <= 2 * 2, "a round reads one batch");
        }
        assert_eq!(flows, 2, "the UDP flow past 30 s and the orphan");
        assert!(t.contains_key(&tcp_idle[0].0) && t.contains_key(&tcp_young[0].0), "TCP waits 60 s");
        assert!(!t.contains_key(&udp_idle[0].0) && !t.contains_key(&udp_idle[1].0) && !t.contains_key(&orphan.0));
        for _ in 0..8 {
            gc.round(&mut t, &timeouts, 79 * s).unwrap();
        }
        assert!(!t.contains_key(&tcp_idle[0].0) && !t.contains_key(&tcp_idle[1].0), "idle past 60 s");
        assert_eq!(t.len(), 2, "the flow whose reply came at 20 s stays whole");
    }

    /// An entry the data path changed between the read and the delete is kept.
    #[test]
    fn an_entry_stamped_since_the_read_is_kept() {
        struct Stamping(std::collections::BTreeMap<CtKey6, CtValue6>);
        impl Embryonic6 for Stamping {
            fn read_batch(&self, c: Option<u32>, max: usize) -> Result<Batch<CtKey6, CtValue6>, MapError> {
                self.0.read_batch(c, max)
            }
            fn get(&self, key: &CtKey6) -> Result<Option<CtValue6>, MapError> {
                Embryonic6::get(&self.0, key)
            }
            fn delete_if(&mut self, key: &CtKey6, expected: &CtValue6) -> Result<bool, MapError> {
                // A packet arrives just before each delete.
                if let Some(v) = self.0.get_mut(key) {
                    v.last_seen_ns += 1;
                }
                self.0.delete_if(key, expected)
            }
        }
        let mut t = Stamping(flow(PROTO_UDP, 1000, 0, 0).into_iter().collect());
        let deleted = Gc6::new(16).round(&mut t, &Timeouts::default(), 100 * 1_000_000_000).unwrap();
        assert_eq!((deleted, t.0.len()), (0, 2));
    }
}
