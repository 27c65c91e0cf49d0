//! The data path's conntrack from user space: flows assembled from their entries (see
//! proxy_common::CtKey), the garbage collector, and deletes of the flows of removed backends.
//!
//! The collector does bounded work per round (one batch of each table, read with
//! BPF_MAP_LOOKUP_BATCH), on its own thread, and deletes only what it read: an entry that changed
//! between the read and the delete (traffic came, or the tuple now carries a new flow) is kept.
use std::collections::{BTreeSet, HashMap};

use proxy_common::{CtKey, CtRole, CtValue, CT_DIR_EGRESS, CT_DIR_INGRESS, CT_F_CLOSING, CT_F_SNAT_PENDING, PROTO_TCP};

use crate::dataplane::ebpf::{
    maps::{ConntrackTables, MapError, Table},
    observations::Observations,
};

/// One flow's entries as they are now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    pub forward: Option<(CtKey, CtValue)>,
    pub reverse_dnat: Option<(CtKey, CtValue)>,
    pub snat: Option<(CtKey, CtValue)>,
    pub reverse_snat: Option<(CtKey, CtValue)>,
}

impl Flow {
    pub fn entries(&self) -> impl Iterator<Item = &(CtKey, CtValue)> {
        [&self.forward, &self.reverse_dnat, &self.snat, &self.reverse_snat].into_iter().flatten()
    }
    /// The last packet any direction saw.
    pub fn last_seen_ns(&self) -> u64 {
        self.entries().map(|(_, v)| v.last_seen_ns).max().unwrap_or(0)
    }
    pub fn closing(&self) -> bool {
        self.entries().any(|(_, v)| v.flags & CT_F_CLOSING != 0)
    }
    pub fn proto(&self) -> u8 {
        self.entries().next().map(|(k, _)| k.proto).unwrap_or(0)
    }
    /// (service id, backend id).
    pub fn ids(&self) -> (u32, u32) {
        self.entries().next().map(|(_, v)| (v.service_id, v.backend_id)).unwrap_or((0, 0))
    }
    fn put(&mut self, k: CtKey, v: CtValue) {
        let slot = match k.role(&v) {
            CtRole::Forward => &mut self.forward,
            CtRole::ReverseDnat => &mut self.reverse_dnat,
            CtRole::Snat => &mut self.snat,
            CtRole::ReverseSnat => &mut self.reverse_snat,
        };
        *slot = Some((k, v));
    }
}

/// The keys of a flow's other entries, from its forward entry: reverse DNAT, and for a
/// masqueraded flow its SNAT key.
pub fn keys_of_forward(k: &CtKey, v: &CtValue) -> (CtKey, Option<CtKey>) {
    let rev = CtKey::reversed_of(v, k.proto, CT_DIR_EGRESS);
    let snat = (v.flags & proxy_common::CT_F_SNAT != 0).then(|| CtKey::straight_of(v, k.proto, CT_DIR_EGRESS));
    (rev, snat)
}

/// The reverse-SNAT key of an SNAT entry whose address was chosen.
pub fn reverse_snat_key(snat_key: &CtKey, v: &CtValue) -> Option<CtKey> {
    (v.flags & CT_F_SNAT_PENDING == 0).then(|| CtKey::reversed_of(v, snat_key.proto, CT_DIR_INGRESS))
}

/// The reverse-DNAT key every non-forward entry leads to (or the forward key, for a reverse-DNAT
/// entry). None for a forward entry.
fn toward_forward(k: &CtKey, v: &CtValue) -> Option<CtKey> {
    match k.role(v) {
        CtRole::Forward => None,
        CtRole::ReverseDnat => Some(CtKey::reversed_of(v, k.proto, CT_DIR_INGRESS)),
        CtRole::Snat => Some(k.reversed(CT_DIR_EGRESS)),
        CtRole::ReverseSnat => Some(CtKey::straight_of(v, k.proto, CT_DIR_EGRESS)),
    }
}

/// Assembles a table's entries into flows; entries whose forward entry is gone come out as
/// flows without one.
pub fn assemble(entries: &[(CtKey, CtValue)]) -> Vec<Flow> {
    let by_key: HashMap<CtKey, CtValue> = entries.iter().copied().collect();
    let mut used: BTreeSet<CtKey> = BTreeSet::new();
    let mut flows = Vec::new();
    for (k, v) in entries.iter().filter(|(k, v)| k.role(v) == CtRole::Forward) {
        let mut f = Flow::default();
        f.put(*k, *v);
        used.insert(*k);
        let (rev, snat) = keys_of_forward(k, v);
        for key in std::iter::once(rev).chain(snat) {
            if let Some(sv) = by_key.get(&key) {
                // Only this flow's: a stale forward's keys may now belong to another flow.
                if key.role(sv) != CtRole::Forward && sv.backend_id == v.backend_id && sv.service_id == v.service_id {
                    f.put(key, *sv);
                    used.insert(key);
                }
            }
        }
        if let Some((sk, sv)) = f.snat {
            if let Some(rk) = reverse_snat_key(&sk, &sv) {
                if let Some(rv) = by_key.get(&rk).filter(|rv| rv.backend_id == v.backend_id) {
                    f.put(rk, *rv);
                    used.insert(rk);
                }
            }
        }
        flows.push(f);
    }
    for (k, v) in entries.iter().filter(|(k, _)| !used.contains(k)) {
        let mut f = Flow::default();
        f.put(*k, *v);
        flows.push(f);
    }
    flows
}

/// Idle timeouts (seconds).
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub tcp: u32,
    pub udp: u32,
    /// TCP after FIN or RST.
    pub closing: u32,
    /// TCP before its handshake completed.
    pub embryonic: u32,
}

impl Default for Timeouts {
    fn default() -> Self {
        // kube-proxy's conntrack defaults (tcpEstablishedTimeout 24h, tcpCloseWaitTimeout 1h is
        // the kernel's; a closed flow here only waits for its last packets), the kernel's
        // SYN_RECV timeout for embryonic flows.
        Self { tcp: 86_400, udp: 120, closing: 10, embryonic: 60 }
    }
}

impl Timeouts {
    /// The fast path's, from the agent's conntrack settings (both modes write them to
    /// KPR_CFG: IPVS mode for a draining fast path).
    pub fn from_settings(c: &crate::settings::ConntrackSettings) -> Self {
        let secs = |d: std::time::Duration| d.as_secs().clamp(1, u64::from(u32::MAX)) as u32;
        Self { tcp: secs(c.tcp_established), udp: secs(c.fast_path_udp()), closing: secs(c.tcp_closing), ..Default::default() }
    }

    /// The shortest timeout a flow of `proto` in `table` can have, closing or not.
    fn shortest(&self, table: Table, proto: u8) -> u64 {
        self.of(table, proto, false).min(self.of(table, proto, true))
    }

    fn of(&self, table: Table, proto: u8, closing: bool) -> u64 {
        let s = match (table, proto == PROTO_TCP, closing) {
            (Table::Embryonic, _, _) => self.embryonic,
            (_, true, true) => self.closing,
            (_, true, false) => self.tcp,
            (_, false, _) => self.udp,
        };
        u64::from(s) * 1_000_000_000
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcStats {
    /// Entries read this round.
    pub read: usize,
    /// Flows whose forward entry was deleted.
    pub flows: usize,
    /// Entries deleted (a flow has up to four).
    pub entries: usize,
    /// Entries kept because they changed between the read and the delete.
    pub kept: usize,
    /// Flows marked as past their Service's maximum connection age (the data path then resets
    /// a TCP one at its next packet and re-balances a UDP one).
    pub aged: usize,
    /// A pass over a table ended this round: `Gc::active_flows` has a new count.
    pub pass_done: bool,
    /// Backend ids of new TCP flows whose SYN went unanswered for `outlier::SYN_TIMEOUT` (each
    /// flow once): outlier detection counts them as failures.
    pub syn_timeouts: Vec<u32>,
}

/// The collector: a cursor per table, one batch of each per round.
#[derive(Debug)]
pub struct Gc {
    pub timeouts: Timeouts,
    pub batch: usize,
    cursors: HashMap<Table, Option<u32>>,
    /// What the passes learn of the flows they keep.
    observed: Observations,
}

impl Gc {
    pub fn new(timeouts: Timeouts, batch: usize) -> Self {
        Self { timeouts, batch, cursors: HashMap::new(), observed: Observations::default() }
    }

    /// Open flows by backend id at the last whole pass over each table (what least-connection
    /// and P2C compare).
    pub fn active_flows(&self) -> HashMap<u32, u32> {
        self.observed.active_flows()
    }

    /// Flows in both tables at their last whole pass (closing ones too); None before a whole
    /// pass over each.
    pub fn live_flows(&self) -> Option<usize> {
        self.observed.live_flows()
    }

    /// The Services with a maximum connection age, by service id (seconds).
    pub fn set_max_ages(&mut self, ages: HashMap<u32, u32>) {
        self.observed.set_max_ages(ages);
    }

    /// One round: the next batch of each table; idle flows (every entry idle past its timeout)
    /// and idle entries of flows whose forward entry is gone are deleted.
    pub fn round(&mut self, t: &mut dyn ConntrackTables, now_ns: u64) -> Result<GcStats, MapError> {
        let mut st = GcStats::default();
        for table in Table::ALL {
            let cursor = self.cursors.get(&table).copied().flatten();
            let (batch, next) = t.read_batch(table, cursor, self.batch)?;
            self.cursors.insert(table, next);
            st.read += batch.len();
            // Entries of flows already deleted this round (a batch may hold several of a flow).
            let mut gone: BTreeSet<CtKey> = BTreeSet::new();
            for (k, v) in batch {
                if gone.contains(&k) {
                    continue;
                }
                // Stamped within the shortest timeout its flow can have: the flow stays, whatever
                // its other entries say, so they are not looked up (a system call each, two to
                // eight a flow: on a busy node most of the collector's work). Its forward entry
                // alone is what the observations read.
                if now_ns.saturating_sub(v.last_seen_ns) <= self.timeouts.shortest(table, k.proto) {
                    if k.role(&v) == CtRole::Forward {
                        let found = self.observed.kept(t, table, Some((k, v)), now_ns)?;
                        st.aged += usize::from(found.aged);
                        st.syn_timeouts.extend(found.syn_timeout);
                    }
                    continue;
                }
                let Some(flow) = self.flow_of(t, table, k, v)? else {
                    continue;
                };
                let timeout = self.timeouts.of(table, flow.proto(), flow.closing());
                if now_ns.saturating_sub(flow.last_seen_ns()) > timeout {
                    delete_flow(t, table, &flow, Kept::IfChanged, &mut st)?;
                    gone.extend(flow.entries().map(|(k, _)| *k));
                } else {
                    let found = self.observed.kept(t, table, flow.forward, now_ns)?;
                    st.aged += usize::from(found.aged);
                    st.syn_timeouts.extend(found.syn_timeout);
                }
            }
            if next.is_none() {
                self.observed.end_pass(table);
                st.pass_done = true;
            }
        }
        if st.entries > 0 || st.aged > 0 {
            t.invalidate_flow_cache()?;
        }
        Ok(st)
    }

    /// The flow an entry read in a batch stands for, or None when another entry (its forward
    /// one) stands for it.
    fn flow_of(&self, t: &dyn ConntrackTables, table: Table, k: CtKey, v: CtValue) -> Result<Option<Flow>, MapError> {
        let mut f = Flow::default();
        if k.role(&v) != CtRole::Forward {
            // Follow the entry to its forward one; an entry whose flow has a forward entry is
            // that entry's business.
            if let Some(next) = toward_forward(&k, &v) {
                let fwd_key =
                    if next.dir == CT_DIR_INGRESS { Some(next) } else { t.get(table, &next)?.map(|rv| CtKey::reversed_of(&rv, k.proto, CT_DIR_INGRESS)) };
                if let Some(fk) = fwd_key {
                    if t.get(table, &fk)?.is_some_and(|fv| fv.backend_id == v.backend_id) {
                        return Ok(None);
                    }
                }
            }
            f.put(k, v);
            return Ok(Some(f));
        }
        f.put(k, v);
        let (rev, snat) = keys_of_forward(&k, &v);
        for key in std::iter::once(rev).chain(snat) {
            if let Some(sv) = t.get(table, &key)?.filter(|sv| sv.backend_id == v.backend_id && key.role(sv) != CtRole::Forward) {
                f.put(key, sv);
            }
        }
        if let Some((sk, sv)) = f.snat {
            if let Some(rk) = reverse_snat_key(&sk, &sv) {
                if let Some(rv) = t.get(table, &rk)?.filter(|rv| rv.backend_id == v.backend_id) {
                    f.put(rk, rv);
                }
            }
        }
        Ok(Some(f))
    }

    /// Deletes at once every flow of these (service id, backend id) pairs, idle or not: UDP
    /// backends that left their service, whose clients would otherwise keep sending into them.
    /// A full pass over both tables, batch by batch.
    pub fn purge(&mut self, t: &mut dyn ConntrackTables, pairs: &BTreeSet<(u32, u32)>) -> Result<GcStats, MapError> {
        let mut st = GcStats::default();
        if pairs.is_empty() {
            return Ok(st);
        }
        for table in Table::ALL {
            for f in assemble(&t.entries(table)?) {
                st.read += f.entries().count();
                if pairs.contains(&f.ids()) {
                    delete_flow(t, table, &f, Kept::IfAnotherFlow, &mut st)?;
                }
            }
        }
        if st.entries > 0 {
            t.invalidate_flow_cache()?;
        }
        Ok(st)
    }
}

/// What keeps an entry that changed between the read and the delete.
#[derive(Clone, Copy)]
enum Kept {
    /// Any change: an expiring flow that saw a packet meanwhile lives on.
    IfChanged,
    /// Only another flow in its key: the flow of a removed backend goes however busy it is (a
    /// UDP client sending every few milliseconds stamps its entry between any read and delete).
    IfAnotherFlow,
}

/// Forward entry first (a packet then starts a new flow, and picks ports around the remaining
/// entries), then the others; if the forward entry is kept (`kept`), the flow lives on.
fn delete_flow(t: &mut dyn ConntrackTables, table: Table, f: &Flow, kept: Kept, st: &mut GcStats) -> Result<(), MapError> {
    let mut delete = |k: &CtKey, v: &CtValue| match kept {
        Kept::IfChanged => t.delete_if(table, k, v),
        Kept::IfAnotherFlow => t.delete_if_same_flow(table, k, v),
    };
    if let Some((k, v)) = &f.forward {
        if !delete(k, v)? {
            st.kept += 1;
            return Ok(());
        }
        st.flows += 1;
        st.entries += 1;
    }
    for (k, v) in [&f.reverse_dnat, &f.snat, &f.reverse_snat].into_iter().flatten() {
        if delete(k, v)? {
            st.entries += 1;
        } else {
            st.kept += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::ebpf::maps::FakeTables;
    use proxy_common::{CT_F_MAX_AGE, CT_F_REFUSED, CT_F_SEEN_REPLY};
    use proxy_common::{CT_F_REPLY, CT_F_SNAT, PROTO_UDP};

    fn a(s: &str) -> u32 {
        u32::from_ne_bytes(s.parse::<std::net::Ipv4Addr>().unwrap().octets())
    }
    fn p(n: u16) -> u16 {
        n.to_be()
    }

    /// The entries the data path writes for client C:c -> V:v balanced to B:b via port p, with
    /// masquerade to S:s when given (see proxy_common::CtKey).
    fn flow(proto: u8, c: (&str, u16), v: (&str, u16), b: (&str, u16), port: u16, snat: Option<(&str, u16)>, seen: u64) -> Vec<(CtKey, CtValue)> {
        let (c_a, c_p, v_a, v_p, b_a, b_p) = (a(c.0), p(c.1), a(v.0), p(v.1), a(b.0), p(b.1));
        let port = p(port);
        let masq = if snat.is_some() { CT_F_SNAT } else { 0 };
        let base = CtValue { last_seen_ns: seen, backend_id: 7, service_id: 3, ..CtValue::default() };
        let k = |s, d, sp, dp, dir| CtKey { saddr: s, daddr: d, sport: sp, dport: dp, proto, dir, _pad: 0 };
        let val = |s, d, sp, dp, flags| CtValue { new_saddr: s, new_daddr: d, new_sport: sp, new_dport: dp, flags, ..base };
        let mut out = vec![
            (k(c_a, v_a, c_p, v_p, CT_DIR_INGRESS), val(c_a, b_a, port, b_p, masq)),
            (k(b_a, c_a, b_p, port, CT_DIR_EGRESS), val(v_a, c_a, v_p, c_p, masq | CT_F_REPLY)),
        ];
        if let Some((s, sp)) = snat {
            let (s_a, s_p) = (a(s), p(sp));
            out.push((k(c_a, b_a, port, b_p, CT_DIR_EGRESS), val(s_a, b_a, s_p, b_p, CT_F_SNAT)));
            out.push((k(b_a, s_a, b_p, s_p, CT_DIR_INGRESS), val(b_a, c_a, b_p, port, CT_F_SNAT | CT_F_REPLY)));
        }
        out
    }

    #[test]
    fn assemble_groups_the_four_entries_of_a_masqueraded_flow() {
        let mut e = flow(PROTO_TCP, ("198.18.0.2", 5000), ("198.18.0.1", 30080), ("10.244.1.2", 8080), 5000, Some(("198.18.0.1", 40000)), 1);
        e.extend(flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 1));
        let flows = assemble(&e);
        assert_eq!(flows.len(), 2, "{flows:?}");
        let tcp = flows.iter().find(|f| f.proto() == PROTO_TCP).unwrap();
        assert!(tcp.forward.is_some() && tcp.reverse_dnat.is_some() && tcp.snat.is_some() && tcp.reverse_snat.is_some(), "{tcp:?}");
        let udp = flows.iter().find(|f| f.proto() == PROTO_UDP).unwrap();
        assert!(udp.forward.is_some() && udp.reverse_dnat.is_some() && udp.snat.is_none());
    }

    #[test]
    fn gc_deletes_a_flow_only_when_every_direction_is_idle_and_in_bounded_rounds() {
        let s = 1_000_000_000u64;
        let mut t = FakeTables::default();
        // A UDP flow whose replies are still flowing (reverse DNAT stamped late), an idle one.
        let mut busy = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
        busy[1].1.last_seen_ns = 200 * s;
        let idle = flow(PROTO_UDP, ("10.244.9.2", 6001), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6001, None, 0);
        for (k, v) in busy.iter().chain(&idle) {
            t.assured.insert(*k, *v);
        }
        let mut gc = Gc::new(Timeouts::default(), 2);
        let mut total = GcStats::default();
        for _ in 0..3 {
            let st = gc.round(&mut t, 250 * s).unwrap();
            assert!(st.read <= 2 * 2, "a round reads one batch per table: {st:?}");
            total.flows += st.flows;
            total.entries += st.entries;
        }
        assert_eq!((total.flows, total.entries), (1, 2));
        assert_eq!(t.assured.len(), 2, "the busy flow stays whole");
        assert!(t.assured.contains_key(&busy[0].0));
        assert!(t.flow_cache_generation > 0, "deleting flows invalidates the flow cache");
    }

    #[test]
    fn a_tuple_reused_between_read_and_delete_keeps_its_new_entry() {
        let s = 1_000_000_000u64;
        let mut t = FakeTables::default();
        let old = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
        for (k, v) in &old {
            t.assured.insert(*k, *v);
        }
        // The data path gives the forward tuple a new flow (another backend) after the read.
        let mut new_fwd = old[0].1;
        new_fwd.backend_id = 8;
        new_fwd.last_seen_ns = 300 * s;
        t.reused.insert(old[0].0, new_fwd);
        let st = Gc::new(Timeouts::default(), 16).round(&mut t, 300 * s).unwrap();
        assert_eq!(st.flows, 0);
        assert_eq!(t.assured.get(&old[0].0), Some(&new_fwd), "the new flow's entry was lost");
    }

    #[test]
    fn orphans_and_embryonic_flows_time_out() {
        let s = 1_000_000_000u64;
        let mut t = FakeTables::default();
        let f = flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, None, 0);
        // An embryonic flow past 60 s, and a reverse-DNAT entry whose forward entry is gone.
        for (k, v) in &f {
            t.embryonic.insert(*k, *v);
        }
        let orphan = flow(PROTO_TCP, ("10.244.9.3", 7001), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7001, None, 0);
        t.assured.insert(orphan[1].0, orphan[1].1);
        let st = Gc::new(Timeouts::default(), 16).round(&mut t, 61 * s).unwrap();
        assert_eq!(st.entries, 2, "{st:?}");
        assert!(t.embryonic.is_empty());
        assert_eq!(t.assured.len(), 1, "the orphan is TCP: it waits for the established timeout");
        let st = Gc::new(Timeouts::default(), 16).round(&mut t, 86_401 * s).unwrap();
        assert_eq!(st.entries, 1);
    }

    #[test]
    fn flows_past_their_services_maximum_age_are_marked_once_counted_from_first_sight() {
        let s = 1_000_000_000u64;
        let mut t = FakeTables::default();
        let aged = flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, None, 0);
        let mut other = flow(PROTO_TCP, ("10.244.9.2", 7001), ("10.96.0.11", 80), ("10.244.1.2", 8080), 7001, None, 0);
        for e in other.iter_mut() {
            e.1.service_id = 4;
        }
        for (k, v) in aged.iter().chain(&other) {
            t.assured.insert(*k, *v);
        }
        let mut gc = Gc::new(Timeouts::default(), 16);
        gc.set_max_ages([(3, 10)].into_iter().collect());
        // Busy flows (stamped every round): only the age can end them.
        let at = |t: &mut FakeTables, gc: &mut Gc, secs: u64| {
            for v in t.assured.values_mut() {
                v.last_seen_ns = secs * s;
            }
            gc.round(t, secs * s).unwrap()
        };
        assert_eq!(at(&mut t, &mut gc, 100).aged, 0, "first seen at 100 s");
        assert_eq!(at(&mut t, &mut gc, 105).aged, 0);
        let generation = t.flow_cache_generation;
        let st = at(&mut t, &mut gc, 111);
        assert_eq!((st.aged, st.flows), (1, 0), "marked, not deleted: {st:?}");
        assert!(t.assured[&aged[0].0].flags & CT_F_MAX_AGE != 0, "the forward entry carries the mark");
        assert!(t.assured[&aged[1].0].flags & CT_F_MAX_AGE == 0, "only the forward entry");
        assert!(t.assured[&other[0].0].flags & CT_F_MAX_AGE == 0, "a Service without a maximum age is left alone");
        assert!(t.flow_cache_generation > generation, "no CPU may answer the marked flow from its cache");
        assert_eq!(at(&mut t, &mut gc, 130).aged, 0, "once");
        // The tuple carrying a new flow (another backend) counts from its own first sight.
        t.assured.get_mut(&aged[0].0).unwrap().flags = 0;
        t.assured.get_mut(&aged[0].0).unwrap().backend_id = 8;
        assert_eq!(at(&mut t, &mut gc, 131).aged, 0);
        assert_eq!(at(&mut t, &mut gc, 142).aged, 1);
        // A Service that no longer asks: nothing more is marked.
        t.assured.get_mut(&aged[0].0).unwrap().flags = 0;
        t.assured.get_mut(&aged[0].0).unwrap().backend_id = 9;
        gc.set_max_ages(HashMap::new());
        assert_eq!(at(&mut t, &mut gc, 200).aged, 0);
    }

    #[test]
    fn open_flows_are_counted_per_backend_at_the_end_of_each_pass() {
        let s = 1_000_000_000u64;
        let mut t = FakeTables::default();
        let mut n = 0;
        for (port, backend, closing) in [(7000, 7, false), (7001, 7, false), (7002, 8, false), (7003, 8, true)] {
            for (k, mut v) in flow(PROTO_TCP, ("10.244.9.2", port), ("10.96.0.10", 80), ("10.244.1.2", 8080), port, None, 100 * s) {
                v.backend_id = backend;
                if closing {
                    v.flags |= CT_F_CLOSING;
                }
                t.assured.insert(k, v);
                n += 1;
            }
        }
        assert_eq!(n, 8);
        // Batches of 3: the pass over the 8 entries takes three rounds.
        let mut gc = Gc::new(Timeouts::default(), 3);
        gc.round(&mut t, 101 * s).unwrap();
        gc.round(&mut t, 101 * s).unwrap();
        assert!(gc.active_flows().is_empty(), "nothing before a whole pass over the assured table");
        assert!(gc.round(&mut t, 101 * s).unwrap().pass_done);
        assert_eq!(gc.active_flows(), [(7, 2), (8, 1)].into_iter().collect(), "closing flows are not counted");
    }

    #[test]
    fn busy_flows_are_kept_and_counted_without_a_lookup_of_their_other_entries() {
        let s = 1_000_000_000u64;
        let mut t = FakeTables::default();
        let masqueraded = flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, Some(("10.244.0.1", 7000)), 100 * s);
        let plain = flow(PROTO_UDP, ("10.244.9.2", 7001), ("10.96.0.53", 53), ("10.244.2.2", 5353), 7001, None, 100 * s);
        assert_eq!(masqueraded.len() + plain.len(), 6);
        for (k, v) in masqueraded.iter().chain(&plain) {
            t.assured.insert(*k, *v);
        }
        let mut gc = Gc::new(Timeouts::default(), 16);
        // Stamped 5 s ago: within every timeout (the shortest, a closing TCP flow's, is 10 s).
        let st = gc.round(&mut t, 105 * s).unwrap();
        assert!(st.pass_done && st.read == 6 && st.entries == 0, "{st:?}");
        assert_eq!(t.gets.get(), 0, "no entry was looked up");
        assert_eq!((gc.active_flows(), gc.live_flows()), ([(7, 2)].into_iter().collect(), Some(2)), "each flow counted once");
        // Quiet for 20 s: a closing TCP flow would be idle, so the TCP flow's entries are read
        // whole; the UDP flow (120 s) is still within its shortest timeout.
        let st = gc.round(&mut t, 120 * s).unwrap();
        assert!(t.gets.get() > 0 && st.entries == 0 && t.assured.len() == 6, "{st:?}");
        assert_eq!(gc.live_flows(), Some(2));
    }

    #[test]
    fn unanswered_syns_are_reported_once_after_the_timeout() {
        let s = 1_000_000_000u64;
        let mut t = FakeTables::default();
        for (k, v) in flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, None, 100 * s) {
            t.embryonic.insert(k, v);
        }
        // Answered, or refused (counted by the data path): never reported.
        for (port, flag) in [(7001, CT_F_SEEN_REPLY), (7002, CT_F_REFUSED)] {
            for (k, mut v) in flow(PROTO_TCP, ("10.244.9.2", port), ("10.96.0.10", 80), ("10.244.1.2", 8080), port, None, 100 * s) {
                v.flags |= flag;
                t.embryonic.insert(k, v);
            }
        }
        let mut gc = Gc::new(Timeouts::default(), 16);
        assert!(gc.round(&mut t, 100 * s).unwrap().syn_timeouts.is_empty());
        assert!(gc.round(&mut t, 102 * s).unwrap().syn_timeouts.is_empty());
        assert_eq!(gc.round(&mut t, 103 * s).unwrap().syn_timeouts, vec![7]);
        assert!(gc.round(&mut t, 104 * s).unwrap().syn_timeouts.is_empty(), "once per flow");
    }

    #[test]
    fn purge_deletes_a_busy_flow_that_a_round_keeps() {
        let s = 1_000_000_000u64;
        let old = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
        // A datagram after the read stamps the forward entry: same flow, newer stamp.
        let mut stamped = old[0].1;
        stamped.last_seen_ns = 5 * s;
        let fill = || {
            let mut t = FakeTables::default();
            t.assured.extend(old.iter().copied());
            t.reused.insert(old[0].0, stamped);
            t
        };
        let mut t = fill();
        let st = Gc::new(Timeouts::default(), 16).purge(&mut t, &[(old[0].1.service_id, old[0].1.backend_id)].into_iter().collect()).unwrap();
        assert_eq!((st.flows, st.kept), (1, 0), "the removed backend's flow went, busy or not");
        assert!(t.assured.is_empty(), "{:?}", t.assured);
        // Its own expiry (a round) keeps it: the stamp says it is alive.
        let mut t = fill();
        let st = Gc::new(Timeouts::default(), 16).round(&mut t, 1_000 * s).unwrap();
        assert_eq!((st.flows, st.kept), (0, 1));
        assert_eq!(t.assured.get(&old[0].0), Some(&stamped));
    }

    #[test]
    fn purge_deletes_the_flows_of_removed_backends_at_once() {
        let mut t = FakeTables::default();
        let mut other = flow(PROTO_UDP, ("10.244.9.2", 6001), ("10.96.0.53", 53), ("10.244.3.2", 5353), 6001, None, 5);
        for e in other.iter_mut() {
            e.1.backend_id = 9;
        }
        for (k, v) in flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 5).iter().chain(&other) {
            t.assured.insert(*k, *v);
        }
        let st = Gc::new(Timeouts::default(), 16).purge(&mut t, &[(3, 7)].into_iter().collect()).unwrap();
        assert_eq!((st.flows, st.entries), (1, 2));
        assert_eq!(t.assured.len(), 2);
        assert!(t.assured.values().all(|v| v.backend_id == 9));
    }
}
