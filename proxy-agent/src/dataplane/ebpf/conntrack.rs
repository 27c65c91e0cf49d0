//! The data path's conntrack from user space: flows assembled from their entries (see
//! proxy_common::CtKey), the garbage collector, and deletes of the flows of removed backends.
//!
//! The collector does bounded work per round (one batch of each table, read with
//! BPF_MAP_LOOKUP_BATCH), on its own thread, and deletes only what it read: an entry that changed
//! between the read and the delete (traffic came, or the tuple now carries a new flow) is kept.
use std::collections::{BTreeSet, HashMap};

use proxy_common::{CtKey, CtRole, CtValue, CT_DIR_EGRESS, CT_DIR_INGRESS, CT_F_CLOSING, CT_F_RESET, CT_F_SNAT_PENDING, CT_F_TIME_WAIT, PROTO_TCP};

use crate::dataplane::ebpf::{
    hint::PassBatch,
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
    /// A masqueraded flow whose backend closed first and holds TIME_WAIT on its SNAT tuple (no
    /// reset since): kept for that long, so that no free-looking tuple meets it.
    pub fn backend_time_wait(&self) -> bool {
        self.reverse_snat.is_some_and(|(_, v)| v.flags & CT_F_TIME_WAIT != 0) && !self.entries().any(|(_, v)| v.flags & CT_F_RESET != 0)
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
    /// Assured UDP flows.
    pub udp: u32,
    /// UDP flows in the embryonic table (not assured).
    pub udp_unassured: u32,
    /// TCP after FIN or RST.
    pub closing: u32,
    /// TCP before its handshake completed.
    pub embryonic: u32,
    /// A masqueraded flow whose backend closed first (Flow::backend_time_wait).
    pub time_wait: u32,
}

impl Default for Timeouts {
    fn default() -> Self {
        // kube-proxy's conntrack defaults (tcpEstablishedTimeout 24h, tcpCloseWaitTimeout 1h is
        // the kernel's; a closed flow here only waits for its last packets), the kernel's
        // SYN_RECV timeout for embryonic flows; the kernel's UDP timeouts, stream and not.
        Self { tcp: 86_400, udp: 120, udp_unassured: 30, closing: 10, embryonic: 60, time_wait: proxy_common::BACKEND_TIME_WAIT_S }
    }
}

impl Timeouts {
    /// The fast path's, from the agent's conntrack settings (both modes write them to
    /// KPR_CFG: IPVS mode for a draining fast path).
    pub fn from_settings(c: &crate::settings::ConntrackSettings) -> Self {
        let secs = |d: std::time::Duration| d.as_secs().clamp(1, u64::from(u32::MAX)) as u32;
        Self {
            tcp: secs(c.tcp_established),
            udp: secs(c.fast_path_udp()),
            udp_unassured: secs(c.fast_path_udp_unassured()),
            closing: secs(c.tcp_closing),
            ..Default::default()
        }
    }

    /// The shortest timeout a flow of `proto` in `table` can have, closing or not.
    fn shortest(&self, table: Table, proto: u8) -> u64 {
        self.of(table, proto, false).min(self.of(table, proto, true))
    }

    /// A flow's timeout: its table's, protocol's and state's, and for a masqueraded flow whose
    /// backend closed first at least the backend's TIME_WAIT.
    fn of_flow(&self, table: Table, flow: &Flow) -> u64 {
        let timeout = self.of(table, flow.proto(), flow.closing());
        if flow.backend_time_wait() {
            timeout.max(u64::from(self.time_wait) * 1_000_000_000)
        } else {
            timeout
        }
    }

    pub(crate) fn of(&self, table: Table, proto: u8, closing: bool) -> u64 {
        let s = match (table, proto == PROTO_TCP, closing) {
            (Table::Embryonic, true, _) => self.embryonic,
            (Table::Embryonic, false, _) => self.udp_unassured,
            (Table::Assured, true, true) => self.closing,
            (Table::Assured, true, false) => self.tcp,
            (Table::Assured, false, _) => self.udp,
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
    /// The assured table's batch this round, as read (with `Gc::hand_over_assured_keys`): the
    /// hint's rebuild follows this pass (dataplane/ebpf/hint.rs) instead of reading the table
    /// a second time.
    pub assured: PassBatch<CtKey>,
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
    /// When each table's last pass started (the round's clock).
    pass_started: HashMap<Table, u64>,
    /// A pass over a table starts at most this often (0: every round). Where the assured
    /// table is sparse, its pass is one batch, and that one system call walks every bucket of
    /// the kernel's hash (524,288 by default) without a break for other work on its CPU.
    pub pass_every_ns: u64,
    /// What the passes learn of the flows they keep.
    observed: Observations,
    /// Hand each assured batch's keys over (`GcStats::assured`): set once the hint's rebuild
    /// follows these passes; until then the copy would go unread.
    pub hand_over_assured_keys: bool,
}

impl Gc {
    pub fn new(timeouts: Timeouts, batch: usize) -> Self {
        Self {
            timeouts,
            batch,
            cursors: HashMap::new(),
            pass_started: HashMap::new(),
            pass_every_ns: 0,
            observed: Observations::default(),
            hand_over_assured_keys: false,
        }
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
            if cursor.is_none() {
                if self.pass_started.get(&table).is_some_and(|&at| now_ns.saturating_sub(at) < self.pass_every_ns) {
                    continue;
                }
                self.pass_started.insert(table, now_ns);
            }
            let (batch, next) = t.read_batch(table, cursor, self.batch)?;
            self.cursors.insert(table, next);
            st.read += batch.len();
            if table == Table::Assured && self.hand_over_assured_keys {
                st.assured = PassBatch { keys: batch.iter().map(|(k, _)| *k).collect(), first: cursor.is_none(), last: next.is_none() };
            }
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
                let timeout = self.timeouts.of_flow(table, &flow);
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
mod tests;
