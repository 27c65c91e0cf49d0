//! Connection tracking. A flow has up to four entries, one per hook and direction (see
//! proxy_common::CtKey): DNAT at ingress, reverse DNAT at egress, and for masqueraded flows SNAT
//! at egress and reverse SNAT at ingress. So netfilter, between the two hooks, sees the flow as
//! client <-> backend in both directions, as it does under kube-proxy.
//!
//! Two tables: a flow lives in CONNTRACK_NEW until it is assured (its backend's reply was seen
//! and the client sent a packet after it: TCP's handshake, or a UDP flow's first datagram after a
//! reply), then moves to CONNTRACK. A flood (spoofed SYNs, or UDP from many ports) can only evict
//! flows not yet assured (a full bucket's oldest, see embryonic.rs), never an assured one, as
//! netfilter's early drop takes unassured entries first. A UDP flow that never sees a reply, or
//! whose client never sends after one (a DNS query), stays in CONNTRACK_NEW until it times out.
//!
//! Flows keep their backend whatever happens to the service afterwards.
use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns};
use proxy_common::{
    counter, Backend, CtBucket, CtEntry, CtKey, CtRole, CtScratch, CtValue, DatapathConfig, CT_DIR_EGRESS, CT_PENDING_SLOTS, CT_DIR_INGRESS,
    CT_F_CLOSING, CT_F_MAX_AGE, CT_F_REFUSED, CT_F_REPLY, CT_F_RESET, CT_F_SEEN_REPLY, CT_F_TIME_WAIT, CT_F_SNAT, CT_F_SNAT_PENDING, PROTO_TCP, PROTO_UDP,
    SNAT_PORT_MAX, SNAT_PORT_MIN,
};

use crate::{
    counters::{self, bump},
    flowcache, hint,
    lb,
    embryonic,
    maps::{BPF_NOEXIST, CLOCK, CONNTRACK, CT_FORGET_KEYS, CT_SCRATCH, EEXIST, IFACES},
    parse::{Flow, TCP_RST},
    rewrite::Rewrite,
};

/// CLOCK_MONOTONIC coarse ns, read through the helper once per jiffy and CPU (see ClockCache).
#[inline(always)]
pub fn now_ns(jiffies: u64) -> u64 {
    match CLOCK.get_ptr_mut(0) {
        Some(c) => {
            let c = unsafe { &mut *c };
            if c.jiffies != jiffies {
                c.jiffies = jiffies;
                c.coarse_ns = unsafe { bpf_ktime_get_coarse_ns() };
            }
            c.coarse_ns
        }
        None => unsafe { bpf_ktime_get_coarse_ns() },
    }
}

/// A new flow's stamp (its entries' `last_seen_ns`): the tick's coarse clock (read by
/// `now_ns`, which every packet's path calls before it may create a flow), past this CPU's
/// previous stamp, so that each of the CPU's flows is stamped apart. A full embryonic bucket
/// spares the entries stamped as the inserting flow, its own (embryonic::evict). Without the
/// fine clock's helper call (about 20 ns a new flow on the AMD EPYC VM). A BPF global
/// function, verified once: inlined, its branches multiplied the paths Linux 6.1's verifier
/// walks after IPv6's site (kpr_tc_ingress6: 184,000 instructions against 116,000).
#[no_mangle]
#[inline(never)]
pub extern "C" fn kpr_new_flow_stamp() -> u64 {
    match CLOCK.get_ptr_mut(0) {
        Some(c) if unsafe { (*c).coarse_ns } != 0 => {
            let c = unsafe { &mut *c };
            let stamp = if c.coarse_ns > c.last_stamp_ns { c.coarse_ns } else { c.last_stamp_ns + 1 };
            c.last_stamp_ns = stamp;
            stamp
        }
        _ => unsafe { bpf_ktime_get_ns() },
    }
}

/// Where an entry lives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// CONNTRACK: flows past their handshake (TCP) or their first exchange (UDP).
    Assured,
    /// CONNTRACK_NEW: flows before that.
    Embryonic,
}

impl Table {
    #[inline(always)]
    unsafe fn get(self, k: &CtKey) -> Option<&'static CtValue> {
        match self {
            Table::Assured => CONNTRACK.get(k),
            Table::Embryonic => embryonic::get(k).map(|v| &*v),
        }
    }
    /// `flags` (0 or BPF_NOEXIST) are the assured table's: an embryonic insert always claims its
    /// key (a flow's tuples are never replaced there). An insert into a full embryonic bucket
    /// evicts its oldest entry first, to `evicted` (a pending slot of CT_SCRATCH, one per insert
    /// of a packet); `forget_pending` forgets the rest of that flow once the packet's entries
    /// are all in, one walk for the verifier. A flood evicts the oldest embryonic flows, never
    /// an assured one.
    #[inline(always)]
    fn insert(self, k: *const CtKey, v: *const CtValue, flags: u64, evicted: *mut CtEntry) -> Result<(), i32> {
        let (k, v) = unsafe { (&*k, &*v) };
        match self {
            Table::Assured => hint::insert_assured(k, v, flags),
            Table::Embryonic => embryonic::insert_evicting::<CtBucket>(k, v, evicted),
        }
    }
    #[inline(always)]
    fn remove(self, k: &CtKey) {
        match self {
            Table::Assured => {
                let _ = CONNTRACK.remove(k);
            }
            Table::Embryonic => {
                embryonic::kpr_ct_new_remove(k);
            }
        }
    }
    /// Where a new flow starts, of either protocol (IPv6's too, conntrack6.rs).
    pub(crate) const NEW: Self = Table::Embryonic;
}

#[inline(always)]
pub fn key(f: &Flow, dir: u8) -> CtKey {
    CtKey { saddr: f.saddr, daddr: f.daddr, sport: f.sport, dport: f.dport, proto: f.proto, dir, _pad: 0 }
}

#[inline(always)]
pub fn timeout_ns(cfg: &DatapathConfig, proto: u8) -> u64 {
    let s = if proto == PROTO_TCP { cfg.ct_tcp_timeout_s } else { cfg.ct_udp_timeout_s };
    u64::from(s) * 1_000_000_000
}

/// Whether a table other than `table` (where the caller's insert claims `k`, failing if it is
/// there) holds `k`: a new flow's keys must be free in both.
#[inline(always)]
fn taken_elsewhere(table: Table, k: &CtKey) -> bool {
    match table {
        Table::Embryonic => hint::assured(k).is_some(),
        Table::Assured => embryonic::get(k).is_some(),
    }
}

/// What `track` found, with its inputs and output in one place: a subprogram takes at most
/// five arguments.
pub struct Lookup {
    pub now: u64,
    /// The hook's interface (egress: the one a masqueraded flow leaves by).
    pub ifindex: u32,
    pub rewrite: Rewrite,
}

/// `track`'s answer.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Tracked {
    /// Not tracked: the caller goes on.
    No,
    /// Rewrite the packet as `Lookup::rewrite` says; the entry is assured (cacheable).
    Assured,
    /// Rewrite the packet so; the flow is still embryonic.
    Embryonic,
    /// Tracked, but the packet cannot be translated (no masquerade address or port): drop it.
    Drop,
    /// A TCP flow past its Service's maximum connection age: answer with a reset.
    Reset,
}

/// The packet's entry at this hook, if any: the assured table, then (for UDP, and for TCP
/// packets that open or close a flow, which is when an embryonic TCP flow sees packets) the
/// embryonic one. The handshake's last packet, an ACK, finds its embryonic flow through
/// `embryonic_forward` once the service lookup said it goes to a service; a UDP flow's client
/// datagram after a reply completes it here.
#[inline(always)]
pub fn track(f: &Flow, key: &CtKey, cfg: &DatapathConfig, l: &mut Lookup) -> Tracked {
    // Only a packet that may open a flow asks the hint first: an established TCP packet's key
    // is there (a bit set), and the hint's word would be one more line to read.
    let may_open = f.proto == PROTO_UDP || f.is_tcp_control();
    let found = if may_open { hint::assured(key) } else { CONNTRACK.get_ptr_mut(key) };
    let (v, table) = if let Some(v) = found {
        (v, Table::Assured)
    } else if may_open {
        // A client's SYN races no promotion of its flow (a SYN comes before the handshake
        // that assures it): it spares a new flow the third lookup.
        let found = if f.is_new_tcp_syn() { embryonic::get(key).map(|v| (v, Table::Embryonic)) } else { after_assured_miss(key) };
        match found {
            Some(found) => found,
            None => return Tracked::No,
        }
    } else {
        return Tracked::No;
    };
    if unsafe { (*v).flags } & CT_F_MAX_AGE != 0 {
        return max_age_reached(f.proto == PROTO_TCP, key, unsafe { &mut *v }, table);
    }
    match entry::<true>(f, key, unsafe { &mut *v }, table, cfg, l.now, l.ifindex) {
        None => Tracked::No,
        Some(None) => Tracked::Drop,
        Some(Some(rw)) => {
            l.rewrite = rw;
            if table == Table::Assured {
                Tracked::Assured
            } else if assures(rw.flags, f.is_tcp_control()) {
                promote(key, &rw);
                Tracked::Assured
            } else {
                Tracked::Embryonic
            }
        }
    }
}

/// A flow the agent marked as past its Service's maximum connection age (only forward entries
/// carry the mark): TCP is reset, and closing from now on; UDP starts over, re-balanced. Rare: a
/// subprogram.
#[inline(never)]
fn max_age_reached(tcp: bool, key: &CtKey, v: &mut CtValue, table: Table) -> Tracked {
    if tcp {
        if v.flags & CT_F_CLOSING == 0 {
            v.flags |= CT_F_CLOSING;
            counters::backend_closed(v.backend_id);
        }
        return Tracked::Reset;
    }
    forget(table, key, v);
    flowcache::invalidate();
    Tracked::No
}

/// A TCP packet to a service that no assured flow knows: its embryonic flow, if it has one.
/// The first such packet after the reply was seen completes the handshake: the flow moves to
/// the assured table. A subprogram: off the established path's stack.
#[inline(never)]
pub fn embryonic_forward(f: &Flow, key: &CtKey, cfg: &DatapathConfig, now: u64) -> Option<Rewrite> {
    let (v, table) = after_assured_miss(key)?;
    let rw = entry::<false>(f, key, unsafe { &mut *v }, table, cfg, now, 0)??;
    // Asked of an assured flow too (found on the third lookup): promote then finds nothing
    // to move. The table, kept for the check, would grow this frame past what 6.1 allows.
    if assures(rw.flags, f.is_tcp_control()) {
        promote(key, &rw);
    }
    Some(rw)
}

/// `k`'s entry, asked after a miss in the assured table: the embryonic table, then the assured
/// one again. `promote` puts a key into the assured table before it deletes it from the
/// embryonic one, so a key that another CPU moved between the caller's lookups is there on the
/// third. A client's first data packet races its handshake's last ACK whenever the two leave
/// on different CPUs (the ACK from the CPU that took the SYN-ACK, the data from the
/// application's); without the third lookup, it could meet neither entry and start a new flow,
/// which its backend answered with a reset.
#[inline(always)]
fn after_assured_miss(k: &CtKey) -> Option<(*mut CtValue, Table)> {
    match embryonic::get(k) {
        Some(v) => Some((v, Table::Embryonic)),
        None => hint::assured(k).map(|v| (v, Table::Assured)),
    }
}

/// Whether a packet that met its flow's embryonic entry (its rewrite's `flags`) makes the flow
/// assured: a client's packet (forward, not a SYN, FIN or RST: `tcp_control` false) after the
/// backend's reply was seen. The same rule for TCP (the handshake's last ACK) and UDP (the
/// datagram after the first reply), and for both families (conntrack6.rs), so that a spoofed
/// source, which never sees the reply, never gets a flow assured.
#[inline(always)]
pub(crate) fn assures(flags: u16, tcp_control: bool) -> bool {
    flags & (CT_F_SEEN_REPLY | CT_F_REPLY) == CT_F_SEEN_REPLY && !tcp_control
}

/// One entry's packet: freshness, the handshake, a masquerade to finish, the timestamp. None:
/// not (any more) this flow's; Some(None): drop. `SNAT`: whether the hook may meet an SNAT
/// entry (egress; `track` serves both hooks): embryonic_forward, at ingress only, leaves
/// finish_snat out of its code and its call chain.
#[inline(always)]
fn entry<const SNAT: bool>(f: &Flow, key: &CtKey, v: &mut CtValue, table: Table, cfg: &DatapathConfig, now: u64, ifindex: u32) -> Option<Option<Rewrite>> {
    match key.role(v) {
        CtRole::Forward => {
            // Saturating: another CPU may have stamped the entry with a clock reading newer than
            // ours (the coarse clock moves on one CPU's tick while others still read the old
            // value); a wrapped difference would call a live flow idle and re-balance it.
            let idle = now.saturating_sub(v.last_seen_ns) > timeout_ns(cfg, f.proto);
            // A fresh SYN on a closing tuple, or to a backend that is gone, is a new connection.
            let reopened = f.is_new_tcp_syn()
                && (v.flags & CT_F_CLOSING != 0 || lb::backend(v.backend_id).is_none());
            if idle || reopened {
                forget(table, key, v);
                // The tuple is about to mean another flow: no CPU may answer it from its cache.
                flowcache::invalidate();
                return None;
            }
        }
        CtRole::Snat if v.flags & CT_F_SNAT_PENDING != 0 => {
            if !SNAT || !finish_snat(table, key, v, cfg, ifindex) {
                return Some(None);
            }
        }
        // A TCP handshake's reply, or a UDP flow's first one.
        CtRole::ReverseDnat if v.flags & CT_F_SEEN_REPLY == 0 && (table == Table::Embryonic || key.proto == PROTO_UDP) => {
            seen_reply(f.tcp_flags & TCP_RST != 0, key, v)
        }
        _ => {}
    }
    // The coarse clock ticks every few ms: most packets find the stamp current and leave the
    // shared cache line clean.
    if now > v.last_seen_ns {
        v.last_seen_ns = now;
    }
    if f.is_tcp_close() {
        let seen = if f.tcp_flags & TCP_RST != 0 { CT_F_CLOSING | CT_F_RESET } else { CT_F_CLOSING };
        if v.flags & seen != seen {
            closing(key, v, seen);
        }
    }
    let rw = Rewrite::of(v);
    bump(if rw.reply() { counter::REVERSE_NAT } else { counter::ESTABLISHED });
    Some(Some(rw))
}

/// A FIN or RST the entry had not seen (`seen`: CT_F_CLOSING, with CT_F_RESET for a reset):
/// the first makes it closing, and the client's (on the forward entry) means the flow no
/// longer counts as open on its backend. The backend's reset (on the reverse-DNAT entry) ends
/// the connection for both: the forward entry closes too, so that the client's next SYN on
/// the tuple starts a new flow. The backend's FIN before the client's (on the reverse-SNAT
/// entry, whose SNAT entry is not closing yet) leaves the backend in TIME_WAIT on the SNAT
/// tuple (CT_F_TIME_WAIT). A subprogram: its map key stays off the established path's frame
/// (Linux 6.1 counts every frame of the call chain against 512 bytes).
#[inline(never)]
fn closing(key: &CtKey, v: &mut CtValue, seen: u16) {
    let first = v.flags & CT_F_CLOSING == 0;
    v.flags |= seen;
    match key.role(v) {
        CtRole::Forward if first => counters::backend_closed(v.backend_id),
        CtRole::ReverseSnat if first && seen & CT_F_RESET == 0 => {
            let snat = CtKey::straight_of(v, key.proto, CT_DIR_EGRESS).reversed(CT_DIR_EGRESS);
            if let Some((sv, _)) = lookup_any(&snat) {
                if unsafe { (*sv).flags } & CT_F_CLOSING == 0 {
                    v.flags |= CT_F_TIME_WAIT;
                }
            }
        }
        CtRole::ReverseDnat if seen & CT_F_RESET != 0 => {
            let fwd = CtKey::reversed_of(v, key.proto, CT_DIR_INGRESS);
            if let Some((fv, _)) = after_assured_miss(&fwd) {
                let fv = unsafe { &mut *fv };
                if fv.flags & CT_F_CLOSING == 0 {
                    fv.flags |= CT_F_CLOSING;
                    counters::backend_closed(fv.backend_id);
                }
            }
        }
        _ => {}
    }
}

/// The handshake's reply: the forward entry learns it, so the client's next packet can complete
/// the flow. Once per flow. A reset instead is the backend refusing the connection (outlier
/// detection counts it); a SYN-ACK ends its refusals in a row. A UDP flow's first reply ends
/// them too, and an ICMP error about the flow after it is a late one, not a refusal.
///
/// Takes the flag, not the Flow: a pointer argument would put the Flow on the callers' stack.
/// A subprogram shared by both protocols: a second call site grew TC ingress's frame past what
/// 6.1 allows beside new_flow's.
#[inline(never)]
fn seen_reply(rst: bool, key: &CtKey, v: &mut CtValue) {
    if rst {
        refused(key, v);
        return;
    }
    counters::backend_answered(v.backend_id);
    v.flags |= CT_F_SEEN_REPLY;
    mark_forward(key, v, CT_F_SEEN_REPLY);
}

/// An ICMP refusal (port unreachable: no socket; a REJECT rule) answering a UDP flow its
/// backend never replied to (`key`: its reverse-DNAT entry's): counted once per flow, as a
/// refused TCP handshake is. Such a flow is embryonic (one of an earlier release may be in the
/// assured table). A subprogram with its own lookups: rare, and off the stack of the hook that
/// translates the error.
#[inline(never)]
fn udp_refused(key: &CtKey) {
    if let Some(v) = embryonic::get(key).or_else(|| CONNTRACK.get_ptr_mut(key)) {
        let v = unsafe { &mut *v };
        if key.role(v) == CtRole::ReverseDnat && v.flags & (CT_F_SEEN_REPLY | CT_F_REFUSED) == 0 {
            v.flags |= CT_F_REFUSED;
            counters::backend_refused(v.backend_id);
        }
    }
}

/// An ICMP refusal about an embryonic TCP flow: counted once, at its reverse-DNAT entry (a
/// masqueraded flow's error also meets its reverse-SNAT entry, at another hook), and only before
/// the backend answered. A subprogram: rare, off the hot path's stack.
#[inline(never)]
fn handshake_refused(key: &CtKey, v: &CtValue) {
    if key.role(v) == CtRole::ReverseDnat && v.flags & CT_F_SEEN_REPLY == 0 {
        refused(key, v);
    }
}

/// The backend refused a new flow (`key`, `v`: its reverse-DNAT entry): one refusal in a row,
/// and the forward entry says so, so the collector does not count the SYN as unanswered too.
#[inline(always)]
fn refused(key: &CtKey, v: &CtValue) {
    counters::backend_refused(v.backend_id);
    mark_forward(key, v, CT_F_REFUSED);
}

/// Sets `flag` on the embryonic forward entry of the flow whose reverse-DNAT entry is `key`, `v`.
#[inline(always)]
fn mark_forward(key: &CtKey, v: &CtValue, flag: u16) {
    let fwd = CtKey::reversed_of(v, key.proto, CT_DIR_INGRESS);
    if let Some(fv) = embryonic::get(&fwd) {
        unsafe { (*fv).flags |= flag };
    }
}

/// Deletes a stale flow's entries: the tuple starts a new flow (maybe in the other table), and
/// the old reply tuples must not linger as collisions. Rare: a subprogram, off the hot path's
/// stack.
#[inline(never)]
fn forget(table: Table, fwd_key: &CtKey, v: &CtValue) {
    if let Some(keys) = CT_FORGET_KEYS.get_ptr_mut(0) {
        forget_with(table, fwd_key, v, unsafe { &mut *keys });
    }
}

/// `forget`'s work, its keys built in per-CPU map memory, not on the stack: `forget_pending` runs
/// it in a call chain that Linux 6.1 counts against 512 bytes.
#[inline(always)]
fn forget_with(table: Table, fwd_key: &CtKey, v: &CtValue, keys: &mut [CtKey; 2]) {
    // Both keys from the value first, so that little stays live across the calls.
    let snat = v.flags & CT_F_SNAT != 0;
    keys[0] = CtKey::reversed_of(v, fwd_key.proto, CT_DIR_EGRESS);
    keys[1] = CtKey::straight_of(v, fwd_key.proto, CT_DIR_EGRESS);
    table.remove(&keys[0]);
    if snat {
        if let Some(sv) = unsafe { table.get(&keys[1]) } {
            if sv.flags & CT_F_SNAT_PENDING == 0 {
                keys[0] = CtKey::reversed_of(sv, fwd_key.proto, CT_DIR_INGRESS);
                table.remove(&keys[0]);
            }
        }
        table.remove(&keys[1]);
    }
    table.remove(fwd_key);
}

/// Moves an embryonic flow's entries to the assured table: replies first, forward last, so a
/// packet never finds the forward entry assured and its reply's missing. Each entry is put into
/// the assured table before it leaves the embryonic one (see `after_assured_miss`). Two CPUs
/// may promote one flow at once (its ACK and its data); the flow is counted by the one whose
/// delete took the forward entry.
#[inline(never)]
fn promote(fwd_key: &CtKey, rw: &Rewrite) {
    let proto = fwd_key.proto;
    let v = CtValue { new_saddr: rw.saddr, new_daddr: rw.daddr, new_sport: rw.sport, new_dport: rw.dport, ..CtValue::default() };
    move_assured(&CtKey::reversed_of(&v, proto, CT_DIR_EGRESS));
    if rw.flags & CT_F_SNAT != 0 {
        let snat = CtKey::straight_of(&v, proto, CT_DIR_EGRESS);
        if let Some(sv) = unsafe { Table::Embryonic.get(&snat) } {
            if sv.flags & CT_F_SNAT_PENDING == 0 {
                move_assured(&CtKey::reversed_of(sv, proto, CT_DIR_INGRESS));
            }
        }
        move_assured(&snat);
    }
    if move_assured(fwd_key) {
        bump(counter::FLOW_ASSURED);
    }
}

/// Moves one entry; whether this call took it out of the embryonic table. BPF_NOEXIST: where
/// another CPU's promotion put the key in first, its element stays (a replaced element is
/// freed for reuse while that CPU's packets may still write through their pointer to it).
#[inline(always)]
fn move_assured(k: &CtKey) -> bool {
    if let Some(v) = unsafe { Table::Embryonic.get(k) } {
        match hint::insert_assured(k, v, BPF_NOEXIST) {
            Err(e) if e != -EEXIST => bump(counter::CT_INSERT_FAILED),
            _ => return embryonic::kpr_ct_new_remove(k) == 1,
        }
    }
    false
}

/// A random port of the SNAT range, network order.
#[inline(always)]
pub fn random_port(cfg: &DatapathConfig) -> u16 {
    let (lo, hi) = if cfg.snat_port_min != 0 && cfg.snat_port_max >= cfg.snat_port_min {
        (cfg.snat_port_min, cfg.snat_port_max)
    } else {
        (SNAT_PORT_MIN, SNAT_PORT_MAX)
    };
    let span = u32::from(hi - lo) + 1;
    let p = u32::from(lo) + unsafe { bpf_get_prandom_u32() } % span;
    (p as u16).to_be()
}

/// Forgets the flows of the entries evicted while this packet's flow was recorded (the
/// scratch's pending slots), once its own entries are all in, and frees the slots. Each flow
/// evicted is counted (ct_embryonic_evicted). A subprogram, called after new_flow (see
/// pipeline::forgetting_evicted) and by finish_snat; its keys live in per-CPU memory (see
/// forget_with).
#[inline(never)]
pub fn forget_pending(s: *mut CtScratch) {
    for slot in 0..CT_PENDING_SLOTS {
        let s = unsafe { &mut *s };
        if s.pending[slot].key.is_empty() {
            continue;
        }
        forget_evicted(s, slot);
        embryonic::clear(&raw mut s.pending[slot].key);
    }
}

/// The flow of an entry a full embryonic bucket evicted (pending slot `slot`, worked on in
/// place): its other entries are forgotten too, found through its reverse-DNAT entry, which
/// names the forward one. Counted where the forward entry goes: one packet's inserts may evict
/// two entries of one flow, and the flow counts once.
#[inline(always)]
fn forget_evicted(s: &mut CtScratch, slot: usize) {
    let keys = unsafe { &mut *(&raw mut s.forget_keys) };
    let (key, value) = unsafe { (&mut *(&raw mut s.pending[slot].key), &mut *(&raw mut s.pending[slot].value)) };
    let proto = key.proto;
    // An SNAT entry names the flow's reverse-DNAT entry.
    let via_snat = match key.role(value) {
        CtRole::Forward => {
            bump(counter::CT_EMBRYONIC_EVICTED);
            return forget_with(Table::Embryonic, key, value, keys);
        }
        CtRole::ReverseDnat => false,
        CtRole::Snat => {
            *key = key.reversed(CT_DIR_EGRESS);
            true
        }
        CtRole::ReverseSnat => {
            *key = CtKey::straight_of(value, proto, CT_DIR_EGRESS);
            true
        }
    };
    if via_snat {
        let Some(rev) = embryonic::get(key) else { return };
        embryonic::copy(rev, value);
    }
    *key = CtKey::reversed_of(value, proto, CT_DIR_INGRESS);
    if let Some(fwd) = embryonic::get(key) {
        bump(counter::CT_EMBRYONIC_EVICTED);
        forget_with(Table::Embryonic, key, unsafe { &*fwd }, keys);
    }
}

/// Claims a new flow's reply tuple (B:b -> C:p at egress) by inserting its reverse-DNAT entry
/// (the scratch's second, its value filled in and its key's port left to this) with
/// BPF_NOEXIST, and returns p: the client's own port unless the tuple is taken (one client port
/// towards two VIPs with a common backend, or the backend reached directly too), then a few
/// random tries in the SNAT range, as conntrack's NAT moves clashing ports. The insert is the
/// check in the table the flow starts in (the embryonic one), so two CPUs cannot both claim one
/// tuple; the assured table is probed first. A hairpin flow's port must differ from the
/// backend's, or its SNAT and reverse-DNAT keys meet. Everything is read back from the scratch
/// entry, so little stays live across the calls (new_flow's frame counts against 512 bytes).
/// The embryonic table finds a clash before it evicts: a clash costs no eviction.
#[inline(always)]
fn claim_reply(f: &Flow, be: &Backend, cfg: &DatapathConfig, s: &mut CtScratch) -> Option<u16> {
    s.keys[1] = CtKey { saddr: be.addr[0], daddr: f.saddr, sport: be.port, dport: f.sport, proto: f.proto, dir: CT_DIR_EGRESS, _pad: 0 };
    let mut tries = 0;
    while tries < 4 {
        let k = &s.keys[1];
        let hairpin_clash = k.saddr == k.daddr && k.dport == k.sport;
        if !hairpin_clash && !hint::held_asking_globally(k) {
            match Table::NEW.insert(&raw const s.keys[1], &raw const s.values[1], BPF_NOEXIST, &raw mut s.pending[0]) {
                Ok(()) => return Some(s.keys[1].dport),
                Err(e) if e != -EEXIST => {
                    bump(counter::CT_INSERT_FAILED);
                    return None;
                }
                Err(_) => {}
            }
        }
        bump(counter::SNAT_PORT_COLLISION);
        s.keys[1].dport = random_port(cfg);
        tries += 1;
    }
    bump(counter::SNAT_NO_PORT);
    None
}

/// Random SNAT ports a masqueraded flow tries. Netfilter's NAT tries more (up to 128, then
/// halves), each a hash lookup; here each try is an assured lookup and an embryonic insert, and
/// a closed flow's tuple is taken over (so only open flows fill the range).
const SNAT_TRIES: u32 = 8;
/// The first tries take only a free tuple; the later ones may take a closed flow's
/// (`reclaim_closed`). A free port first, as netfilter's NAT reuses a closed connection's tuple
/// only once its tries meet taken ones: the backend may still hold TIME_WAIT on a closed tuple
/// (it closed first), and a late packet of the old flow could still be on its way.
const SNAT_FREE_TRIES: u32 = 2;

/// The tries after these may also take a closed flow's tuple whose backend holds TIME_WAIT on
/// it (CT_F_TIME_WAIT): the last resort, since the backend may answer the new SYN with an ACK
/// (its timestamp not newer), which makes the client reset and retry after a second.
const SNAT_CLEAN_TRIES: u32 = 6;

/// Whether a masqueraded flow has closed, from the flags of its reverse-SNAT entry (the
/// backend's packets) and its SNAT entry (the client's): a reset either way, or a FIN each way;
/// with `time_wait`, also where the backend closed first and holds TIME_WAIT on the tuple.
#[inline(always)]
fn closed(backend: u16, client: u16, time_wait: bool) -> bool {
    (backend | client) & CT_F_RESET != 0 || (backend & client & CT_F_CLOSING != 0 && (time_wait || backend & CT_F_TIME_WAIT == 0))
}

/// `k`'s entry in either table, the assured one first.
#[inline(always)]
fn lookup_any(k: &CtKey) -> Option<(*mut CtValue, Table)> {
    match hint::assured(k) {
        Some(v) => Some((v, Table::Assured)),
        None => embryonic::get(k).map(|v| (v, Table::Embryonic)),
    }
}

/// Frees the tuple a masqueraded flow tries (`s.keys[0]`, a reverse-SNAT key B:b -> S:s) where
/// a closed flow holds it (see `closed`): its entries are deleted, so the tuple serves a new
/// flow at once rather than after the closing timeout, as netfilter's NAT reuses the tuple of a
/// connection in CLOSE or TIME_WAIT. Short connections would otherwise hold the SNAT range with
/// closed flows. `time_wait`: also a flow whose backend holds TIME_WAIT on the tuple. Whether
/// it freed the tuple. A subprogram; its keys are the scratch entry's (finish_snat's call chain
/// counts against 512 bytes).
#[inline(never)]
fn reclaim_closed(s: &mut CtScratch, time_wait: bool) -> bool {
    let proto = s.keys[0].proto;
    let Some((rv, table)) = lookup_any(&s.keys[0]) else { return false };
    let rv = unsafe { &*rv };
    if s.keys[0].role(rv) != CtRole::ReverseSnat {
        return false;
    }
    let backend = rv.flags;
    // The reverse-SNAT entry names the reverse-DNAT one (B:b -> C:p); the SNAT entry is that
    // tuple the other way, and must translate to this one (S:s).
    s.keys[1] = CtKey::straight_of(rv, proto, CT_DIR_EGRESS);
    s.keys[2] = s.keys[1].reversed(CT_DIR_EGRESS);
    let Some(sv) = (unsafe { table.get(&s.keys[2]) }) else { return false };
    if sv.new_saddr != s.keys[0].daddr || sv.new_sport != s.keys[0].dport || !closed(backend, sv.flags, time_wait) {
        return false;
    }
    table.remove(&s.keys[0]);
    table.remove(&s.keys[2]);
    // The forward entry, named by the reverse-DNAT one, unless its client has already opened a
    // new flow on that tuple (its SNAT key is then another).
    if let Some(rd) = unsafe { table.get(&s.keys[1]) } {
        s.forget_keys[0] = CtKey::reversed_of(rd, proto, CT_DIR_INGRESS);
        if let Some(fv) = unsafe { table.get(&s.forget_keys[0]) } {
            if CtKey::straight_of(fv, proto, CT_DIR_EGRESS) == s.keys[2] {
                table.remove(&s.forget_keys[0]);
            }
        }
    }
    table.remove(&s.keys[1]);
    // No CPU may answer the tuple from its cache for the old flow.
    flowcache::invalidate();
    true
}

/// A masqueraded flow's first packet at egress: the address is the interface's (or the node's),
/// as MASQUERADE picks the outgoing interface's; the port a free one of the SNAT range, which
/// the node's own connections never use (unlike the client's port, which may be one of them).
/// Records the reverse-SNAT entry and completes the SNAT entry. Once per flow.
#[inline(never)]
fn finish_snat(table: Table, key: &CtKey, v: &mut CtValue, cfg: &DatapathConfig, ifindex: u32) -> bool {
    let addr = match unsafe { IFACES.get(&ifindex) } {
        Some(i) if i.snat_addr != 0 => i.snat_addr,
        _ => cfg.snat_addr[0],
    };
    if addr == 0 {
        bump(counter::SNAT_NO_PORT);
        return false;
    }
    // The reverse-SNAT key and value are built in the per-CPU scratch entry (free here: only
    // `create` uses it, for another packet), not on the stack: TC egress's call chain counts
    // against 512 bytes.
    let Some(s) = CT_SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    let s = unsafe { &mut *s };
    // Reverse SNAT: (backend -> S:s) becomes (backend -> client:p), the packet netfilter saw
    // leave.
    s.values[0] = CtValue {
        last_seen_ns: v.last_seen_ns,
        new_saddr: key.daddr,
        new_daddr: key.saddr,
        new_sport: key.dport,
        new_dport: key.sport,
        backend_id: v.backend_id,
        service_id: v.service_id,
        flags: CT_F_SNAT | CT_F_REPLY,
        _pad: 0,
    };
    // The port is drawn first thing in each try: Linux 6.1's verifier rejects a loop that
    // starts again right after a helper call ("back-edge").
    let mut finished = false;
    let mut tries = 0;
    while tries < SNAT_TRIES {
        s.keys[0] = CtKey { saddr: key.daddr, daddr: addr, sport: key.dport, dport: random_port(cfg), proto: key.proto, dir: CT_DIR_INGRESS, _pad: 0 };
        if tries >= SNAT_FREE_TRIES && reclaim_closed(s, tries >= SNAT_CLEAN_TRIES) {
            bump(counter::SNAT_PORT_REUSED);
        }
        if !taken_elsewhere(table, &s.keys[0]) {
            // BPF_NOEXIST: another CPU may have taken the same port since the probe; its
            // entry must not be overwritten (as `claim_reply` claims a new flow's tuple).
            match table.insert(&raw const s.keys[0], &raw const s.values[0], BPF_NOEXIST, &raw mut s.pending[0]) {
                Ok(()) => {
                    v.new_saddr = addr;
                    v.new_sport = s.keys[0].dport;
                    v.flags &= !CT_F_SNAT_PENDING;
                    finished = true;
                    break;
                }
                Err(e) if e != -EEXIST => {
                    bump(counter::CT_INSERT_FAILED);
                    break;
                }
                Err(_) => {}
            }
        }
        bump(counter::SNAT_PORT_COLLISION);
        tries += 1;
    }
    if tries == SNAT_TRIES {
        bump(counter::SNAT_NO_PORT);
    }
    // Whatever came of the tries, the flow of an entry an insert evicted is forgotten now: the
    // pending slots are empty between packets, so no insert clears them first.
    forget_pending(s);
    finished
}

/// Records a new flow: its reverse-DNAT entry (claiming the reply tuple, see `claim_reply`), its
/// SNAT entry (address pending) when masqueraded, then its forward entry, in the table its
/// protocol starts in. Keys and values are built in a per-CPU scratch entry, not on the 512-byte
/// stack.
#[inline(always)]
pub fn create(f: &Flow, backend_id: u32, service_id: u32, be: &Backend, masq: bool, cfg: &DatapathConfig) -> Option<Rewrite> {
    let s = unsafe { &mut *CT_SCRATCH.get_ptr_mut(0)? };
    // Reverse DNAT: (B:b -> C:p) becomes (V:v -> C:c).
    let snat = if masq { CT_F_SNAT } else { 0 };
    s.values[1] = CtValue { last_seen_ns: kpr_new_flow_stamp(), new_saddr: f.daddr, new_daddr: f.saddr, new_sport: f.dport, new_dport: f.sport, backend_id, service_id, flags: snat | CT_F_REPLY, _pad: 0 };
    let port = claim_reply(f, be, cfg, s)?;
    // The other entries read what they share from the reply's: less stays live across the
    // claim's calls.
    let blank = CtValue { last_seen_ns: s.values[1].last_seen_ns, backend_id: s.values[1].backend_id, service_id: s.values[1].service_id, ..CtValue::default() };
    let snat = s.values[1].flags & CT_F_SNAT;
    let table = Table::NEW;
    // Forward: (C:c -> V:v) becomes (C:p -> B:b). A flow picked up mid-stream (not by a SYN)
    // has no handshake left to wait for: its next packet makes it assured.
    let picked_up = if f.proto == PROTO_TCP && !f.is_new_tcp_syn() { CT_F_SEEN_REPLY } else { 0 };
    s.keys[0] = key(f, CT_DIR_INGRESS);
    s.values[0] = CtValue { new_saddr: f.saddr, new_daddr: be.addr[0], new_sport: port, new_dport: be.port, flags: snat | picked_up, ..blank };
    if snat != 0 {
        // SNAT: (C:p -> B:b) becomes (S:s -> B:b) once egress knows S.
        s.keys[2] = CtKey::straight_of(&s.values[0], f.proto, CT_DIR_EGRESS);
        s.values[2] = CtValue { new_saddr: 0, new_daddr: be.addr[0], new_sport: port, new_dport: be.port, flags: CT_F_SNAT | CT_F_SNAT_PENDING, ..blank };
        if table.insert(&raw const s.keys[2], &raw const s.values[2], 0, &raw mut s.pending[1]).is_err() {
            bump(counter::CT_INSERT_FAILED);
            return None;
        }
    }
    if table.insert(&raw const s.keys[0], &raw const s.values[0], 0, &raw mut s.pending[2]).is_err() {
        bump(counter::CT_INSERT_FAILED);
        return None;
    }
    // Read back from the scratch: nothing stays live across the inserts.
    if s.values[0].flags & CT_F_SEEN_REPLY != 0 {
        bump(counter::TCP_MIDSTREAM_PICKUP);
    }
    Some(Rewrite::of(&s.values[0]))
}

/// The entry an ICMP error is translated by: the reply of the packet it quotes, at this hook.
/// A `refusal` (destination unreachable) of a TCP handshake, or of a UDP flow before any reply,
/// counts against the backend as a reset would (outlier detection).
#[inline(always)]
pub fn for_icmp_error(quoted_reverse: &CtKey, refusal: bool) -> Option<Rewrite> {
    // First, with nothing else live across the call: the hook's frame stays as it was (6.1
    // counts it against 512 bytes with new_flow's).
    if refusal && quoted_reverse.proto == PROTO_UDP {
        udp_refused(quoted_reverse);
    }
    let v = match unsafe { CONNTRACK.get(quoted_reverse) } {
        Some(v) => v,
        None => {
            let (v, table) = after_assured_miss(quoted_reverse)?;
            let v = unsafe { &*v };
            if table == Table::Embryonic && refusal && quoted_reverse.proto == PROTO_TCP {
                handshake_refused(quoted_reverse, v);
            }
            v
        }
    };
    if v.flags & CT_F_SNAT_PENDING != 0 {
        return None;
    }
    Some(Rewrite::of(v))
}

/// The direction constants, re-exported for the pipeline.
pub const INGRESS: u8 = CT_DIR_INGRESS;
pub const EGRESS: u8 = CT_DIR_EGRESS;
