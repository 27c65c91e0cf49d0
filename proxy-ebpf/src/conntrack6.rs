//! IPv6 connection tracking for the packet path (see proxy_common::CtKey6): a flow's forward
//! (DNAT) entry at the uplink's ingress and its reply's reverse-DNAT entry at egress. The
//! masquerade between them is netfilter's, so there is no SNAT entry and no port to choose for
//! it.
//!
//! Two tables, as IPv4's (conntrack.rs): a flow lives in CONNTRACK6_NEW until it is assured
//! (the backend's reply was seen and the client sent a packet after it: TCP's handshake, or a
//! UDP flow's datagram after its first reply), then moves to CONNTRACK6, so a flood from
//! outside (SYNs, or UDP) evicts only flows not yet assured. CONNTRACK6_NEW is an array of
//! 4-way buckets as IPv4's (embryonic.rs), and the agent collects its idle flows; the assured
//! table is an LRU.
use proxy_common::{
    counter, Backend, CtBucket6, CtEntry6, CtKey6, CtScratch6, CtValue6, DatapathConfig, CT6_PENDING_SLOTS, CT_DIR_EGRESS, CT_DIR_INGRESS, CT_F_CLOSING, CT_F_REPLY,
    CT_F_SEEN_REPLY, CT_F_SNAT, PROTO_TCP, PROTO_UDP,
};

use crate::{
    conntrack::{self, random_port, Table},
    counters::bump,
    embryonic, hint,
    maps::{BPF_NOEXIST, EEXIST, CONNTRACK6, CT_FORGET_KEYS6, CT_SCRATCH6},
    parse6::Flow6,
};

/// A closing flow (FIN or RST seen) idle this long is over: a new SYN on its tuple before then
/// is still a new flow (the forward entry checks for it), this only bounds what a lost FIN costs.
const CLOSING_TIMEOUT_NS: u64 = 10_000_000_000;

/// An embryonic TCP flow idle this long is over (the collectors' embryonic timeout): a SYN on
/// its tuple then starts a new flow, on a backend chosen anew. Here an embryonic UDP flow ages
/// as an assured one; the agent's collector deletes it sooner (the plain UDP timeout).
const EMBRYONIC_TIMEOUT_NS: u64 = 60_000_000_000;

/// IPv6's side of conntrack::Table (the same two tables, for IPv6 keys).
impl Table {
    #[inline(always)]
    fn get6(self, k: &CtKey6) -> Option<&'static CtValue6> {
        unsafe {
            match self {
                Table::Assured => CONNTRACK6.get(k),
                Table::Embryonic => embryonic::get6(k).map(|v| &*v),
            }
        }
    }
    #[inline(always)]
    fn get_ptr_mut6(self, k: &CtKey6) -> Option<*mut CtValue6> {
        match self {
            Table::Assured => CONNTRACK6.get_ptr_mut(k),
            Table::Embryonic => embryonic::get6(k),
        }
    }
    /// As `insert` (conntrack.rs): a full embryonic bucket evicts its oldest entry first, to
    /// `evicted`, whose flow `forget_pending` forgets once the packet's entries are in.
    #[inline(always)]
    fn insert6(self, k: *const CtKey6, v: *const CtValue6, flags: u64, evicted: *mut CtEntry6) -> Result<(), i32> {
        match self {
            Table::Assured => hint::insert_assured(unsafe { &*k }, unsafe { &*v }, flags),
            Table::Embryonic => embryonic::insert_evicting::<CtBucket6>(k, v, evicted),
        }
    }
    #[inline(always)]
    fn remove6(self, k: &CtKey6) {
        match self {
            Table::Assured => {
                let _ = CONNTRACK6.remove(k);
            }
            Table::Embryonic => {
                embryonic::kpr_ct6_new_remove(k);
            }
        }
    }
}

/// The 4-tuple a packet is rewritten to (network order), with its entry's flags.
#[derive(Clone, Copy, Default)]
pub struct Rewrite6 {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    pub flags: u16,
}

impl Rewrite6 {
    #[inline(always)]
    fn of(v: &CtValue6) -> Self {
        Self { saddr: v.new_saddr, daddr: v.new_daddr, sport: v.new_sport, dport: v.new_dport, flags: v.flags }
    }
    /// The forward packets of a masqueraded flow carry the mark netfilter masquerades by.
    #[inline(always)]
    pub fn masquerade(&self) -> bool {
        self.flags & (CT_F_SNAT | CT_F_REPLY) == CT_F_SNAT
    }
}

#[inline(always)]
pub fn key(f: &Flow6, dir: u8) -> CtKey6 {
    CtKey6 { saddr: f.saddr, daddr: f.daddr, sport: f.sport, dport: f.dport, proto: f.proto, dir, _pad: 0 }
}

#[inline(always)]
fn timeout_ns(cfg: &DatapathConfig, v: &CtValue6, proto: u8, table: Table) -> u64 {
    if table == Table::Embryonic && proto == PROTO_TCP {
        return EMBRYONIC_TIMEOUT_NS;
    }
    if v.flags & CT_F_CLOSING != 0 {
        return CLOSING_TIMEOUT_NS;
    }
    conntrack::timeout_ns(cfg, proto)
}

/// The packet's entry at this hook, its timestamp refreshed. None: no flow (any more). A
/// forward entry ends when idle, when a new SYN finds it closing, and, for UDP, when its backend
/// is gone (kube-proxy deletes a removed endpoint's UDP conntrack entries).
///
/// The assured table first; for UDP, and for a TCP packet that opens or closes a flow (the
/// only ones an embryonic TCP flow sees at its entries, but for the client's last handshake
/// packet, which `embryonic_forward` finds once the frontend lookup said it is a frontend's),
/// the embryonic one. A UDP client's datagram after the first reply makes its flow assured here.
#[inline(always)]
pub fn track(f: &Flow6, key: &CtKey6, cfg: &DatapathConfig, now: u64) -> Option<Rewrite6> {
    // As IPv4's (conntrack::track): only a packet that may open a flow asks the hint first.
    let may_open = f.proto == PROTO_UDP || f.is_tcp_control();
    let found = if may_open { hint::assured(key) } else { CONNTRACK6.get_ptr_mut(key) };
    let (v, table) = match found {
        Some(v) => (v, Table::Assured),
        // A SYN spares a new flow the third lookup, as IPv4's (conntrack::track).
        None if f.is_new_tcp_syn() => (embryonic::get6(key)?, Table::Embryonic),
        None if may_open => after_assured_miss(key)?,
        None => return None,
    };
    let v = unsafe { &mut *v };
    let rw = entry(f, key, v, table, cfg, now)?;
    if table == Table::Embryonic && conntrack::assures(rw.flags, f.is_tcp_control()) {
        promote(key, v);
    }
    Some(rw)
}

/// A TCP packet to a frontend that no assured flow knows: its embryonic flow, if it has one.
/// The first such packet after the backend's reply completes the handshake: the flow moves to
/// the assured table. Inlined into pipeline6's own subprogram for it: one frame fewer in a
/// call chain that counts against 512 bytes.
#[inline(always)]
pub fn embryonic_forward(f: &Flow6, key: &CtKey6, cfg: &DatapathConfig, now: u64) -> Option<Rewrite6> {
    let (v, table) = after_assured_miss(key)?;
    let v = unsafe { &mut *v };
    let rw = entry(f, key, v, table, cfg, now)?;
    if table == Table::Embryonic && conntrack::assures(rw.flags, f.is_tcp_control()) {
        promote(key, v);
    }
    Some(rw)
}

/// `k`'s entry after a miss in the assured table: the embryonic table, then the assured one
/// again, for a key another CPU's promotion moved meanwhile (see IPv4's
/// conntrack::after_assured_miss).
#[inline(always)]
pub(crate) fn after_assured_miss(k: &CtKey6) -> Option<(*mut CtValue6, Table)> {
    match embryonic::get6(k) {
        Some(v) => Some((v, Table::Embryonic)),
        None => hint::assured(k).map(|v| (v, Table::Assured)),
    }
}

/// One entry's packet: freshness, the handshake's reply, the timestamp, a close. None: not (any
/// more) this flow's.
#[inline(always)]
fn entry(f: &Flow6, key: &CtKey6, v: &mut CtValue6, table: Table, cfg: &DatapathConfig, now: u64) -> Option<Rewrite6> {
    // Forward entries live at ingress only (the check is constant where the hook is).
    if key.is_forward(v) {
        // Saturating: another CPU may have stamped the entry with a newer clock reading.
        let idle = now.saturating_sub(v.last_seen_ns) > timeout_ns(cfg, v, f.proto, table);
        let reopened = f.is_new_tcp_syn() && v.flags & CT_F_CLOSING != 0;
        let gone = (f.proto == PROTO_UDP || f.is_new_tcp_syn()) && crate::lb::backend(v.backend_id).is_none();
        if idle || reopened || gone {
            forget(table, key, v);
            return None;
        }
    } else if table == Table::Embryonic && v.flags & CT_F_SEEN_REPLY == 0 && !f.is_tcp_close() {
        // The backend's first reply (a SYN-ACK, or a UDP datagram): the forward entry learns
        // it, once.
        seen_reply(key, v);
    }
    if now > v.last_seen_ns {
        v.last_seen_ns = now;
    }
    if f.is_tcp_close() && v.flags & CT_F_CLOSING == 0 {
        closing(key, v, table);
    }
    let rw = Rewrite6::of(v);
    bump(if rw.flags & CT_F_REPLY != 0 { counter::REVERSE_NAT } else { counter::ESTABLISHED });
    Some(rw)
}

/// The backend answered the handshake (`key`, `v`: the embryonic reply entry): it and its
/// forward entry say so, so the client's next packet completes the flow. A subprogram: rare.
#[inline(never)]
fn seen_reply(key: &CtKey6, v: &mut CtValue6) {
    v.flags |= CT_F_SEEN_REPLY;
    if let Some(fwd) = embryonic::get6(&CtKey6::reversed_of(v, key.proto, CT_DIR_INGRESS)) {
        unsafe { (*fwd).flags |= CT_F_SEEN_REPLY };
    }
}

/// Moves an embryonic flow's entries to the assured table: the reply first, the forward last, so
/// a packet never finds the forward entry assured and its reply's missing; each put into the
/// assured table before it leaves the embryonic one. Counted by the CPU whose delete took the
/// forward entry (two may promote one flow at once, as IPv4's).
#[inline(never)]
fn promote(fwd_key: &CtKey6, v: &CtValue6) {
    move_assured(&CtKey6::reversed_of(v, fwd_key.proto, CT_DIR_EGRESS));
    if move_assured(fwd_key) {
        bump(counter::FLOW_ASSURED);
    }
}

/// Moves one entry; whether this call took it out of the embryonic table. BPF_NOEXIST, as
/// IPv4's (conntrack.rs): another CPU's element stays.
#[inline(always)]
fn move_assured(k: &CtKey6) -> bool {
    if let Some(v) = Table::Embryonic.get6(k) {
        match hint::insert_assured(k, v, BPF_NOEXIST) {
            Err(e) if e != -EEXIST => bump(counter::CT_INSERT_FAILED),
            _ => return embryonic::kpr_ct6_new_remove(k) == 1,
        }
    }
    false
}

/// The first FIN or RST an entry sees: it is closing, and so is its flow's forward entry when
/// the backend's side closed (the forward entry is what ages a flow). Rare: a subprogram.
#[inline(never)]
fn closing(key: &CtKey6, v: &mut CtValue6, table: Table) {
    v.flags |= CT_F_CLOSING;
    if v.flags & CT_F_REPLY != 0 {
        if let Some(fwd) = table.get_ptr_mut6(&CtKey6::reversed_of(v, key.proto, CT_DIR_INGRESS)) {
            unsafe { (*fwd).flags |= CT_F_CLOSING };
        }
    }
}

/// Forgets the flows of the entries evicted while this packet's flow was recorded (the
/// scratch's pending slots), once its own entries are in, and frees the slots. Each flow
/// evicted is counted (ct_embryonic_evicted, with IPv4's), where its forward entry goes. A
/// subprogram, called after new_flow (see pipeline6); its keys live in per-CPU memory.
#[inline(never)]
pub fn forget_pending(s: *mut CtScratch6) {
    let Some(rev) = CT_FORGET_KEYS6.get_ptr_mut(0) else { return };
    for slot in 0..CT6_PENDING_SLOTS {
        let s = unsafe { &mut *s };
        if s.pending[slot].key.is_empty() {
            continue;
        }
        let (key, value) = unsafe { (&mut *(&raw mut s.pending[slot].key), &mut *(&raw mut s.pending[slot].value)) };
        if key.is_forward(value) {
            bump(counter::CT_EMBRYONIC_EVICTED);
            forget_with(Table::Embryonic, key, value, unsafe { &mut *rev });
        } else {
            // The reply's entry names the forward one (worked on in place).
            *key = CtKey6::reversed_of(value, key.proto, CT_DIR_INGRESS);
            if let Some(fwd) = embryonic::get6(key) {
                bump(counter::CT_EMBRYONIC_EVICTED);
                forget_with(Table::Embryonic, key, unsafe { &*fwd }, unsafe { &mut *rev });
            }
        }
        embryonic::clear(&raw mut s.pending[slot].key);
    }
}

/// Deletes a flow's two entries (`v`: the forward one); the reply's only while it is still
/// this flow's (after the assured LRU evicted it, or the collector deleted it, its key may
/// belong to a newer flow). Rare: a subprogram.
#[inline(never)]
fn forget(table: Table, fwd_key: &CtKey6, v: &CtValue6) {
    let mut rev_key = CtKey6::default();
    forget_with(table, fwd_key, v, &mut rev_key);
}

/// `forget`'s work, the reply's key built in `rev_key` (per-CPU map memory where
/// `forget_pending` calls it, which has no stack to spare).
#[inline(always)]
fn forget_with(table: Table, fwd_key: &CtKey6, v: &CtValue6, rev_key: &mut CtKey6) {
    *rev_key = CtKey6::reversed_of(v, fwd_key.proto, CT_DIR_EGRESS);
    if let Some(r) = table.get6(rev_key) {
        let ours = r.new_saddr == fwd_key.daddr && r.new_daddr == fwd_key.saddr && r.new_sport == fwd_key.dport && r.new_dport == fwd_key.sport;
        if ours {
            table.remove6(rev_key);
        }
    }
    table.remove6(fwd_key);
}

/// Records a new flow: the reply's entry first, so a forward entry never exists without it.
/// Its insert with BPF_NOEXIST claims the reply tuple (B:b -> C:p): the client's own port unless
/// the tuple is taken (one client port towards two frontends with a common backend: netfilter
/// would take both for one connection), then a few random ones, as conntrack's NAT moves
/// clashing ports. Keys and values are built in a per-CPU scratch entry, not on the 512-byte
/// stack.
#[inline(always)]
pub fn create(f: &Flow6, backend_id: u32, service_id: u32, be: &Backend, masq: bool, cfg: &DatapathConfig) -> Option<Rewrite6> {
    let snat = if masq { CT_F_SNAT } else { 0 };
    let table = Table::NEW;
    let s = unsafe { &mut *CT_SCRATCH6.get_ptr_mut(0)? };
    // Stamped as IPv4's (conntrack::kpr_new_flow_stamp).
    let blank = CtValue6 { last_seen_ns: conntrack::kpr_new_flow_stamp(), backend_id, service_id, ..CtValue6::default() };
    // Reverse DNAT: (B:b -> C:p) becomes (V:v -> C:c).
    s.keys[0] = CtKey6 { saddr: be.addr, daddr: f.saddr, sport: be.port, dport: f.sport, proto: f.proto, dir: CT_DIR_EGRESS, _pad: 0 };
    s.values[0] = CtValue6 { new_saddr: f.daddr, new_daddr: f.saddr, new_sport: f.dport, new_dport: f.sport, flags: snat | CT_F_REPLY, ..blank };
    let mut tries = 0;
    loop {
        // The reply tuple must be free in the assured table too (as IPv4's claim asks).
        let taken = hint::held_asking_globally(&s.keys[0]);
        match if taken { Err(-EEXIST) } else { table.insert6(&s.keys[0], &s.values[0], BPF_NOEXIST, &raw mut s.pending[0]) } {
            Ok(()) => break,
            Err(e) if e != -EEXIST => {
                bump(counter::CT_INSERT_FAILED);
                return None;
            }
            Err(_) => {}
        }
        bump(counter::SNAT_PORT_COLLISION);
        tries += 1;
        if tries >= 4 {
            bump(counter::SNAT_NO_PORT);
            return None;
        }
        s.keys[0].dport = random_port(cfg);
    }
    let port = s.keys[0].dport;
    // Forward: (C:c -> V:v) becomes (C:p -> B:b). A TCP flow picked up mid-stream (not by a
    // SYN) has no handshake left to wait for: its next packet makes it assured.
    let picked_up = if f.proto == PROTO_TCP && !f.is_new_tcp_syn() { CT_F_SEEN_REPLY } else { 0 };
    s.keys[1] = key(f, CT_DIR_INGRESS);
    s.values[1] = CtValue6 { new_saddr: f.saddr, new_daddr: be.addr, new_sport: port, new_dport: be.port, flags: snat | picked_up, ..blank };
    if table.insert6(&s.keys[1], &s.values[1], 0, &raw mut s.pending[1]).is_err() {
        bump(counter::CT_INSERT_FAILED);
        return None;
    }
    // Read back from the scratch: nothing stays live across the inserts.
    if s.values[1].flags & CT_F_SEEN_REPLY != 0 {
        bump(counter::TCP_MIDSTREAM_PICKUP);
    }
    Some(Rewrite6::of(&s.values[1]))
}
