//! IPv6 connection tracking for the packet path (see proxy_common::CtKey6): a flow's forward
//! (DNAT) entry at the uplink's ingress and its reply's reverse-DNAT entry at egress. The
//! masquerade between them is netfilter's, so there is no SNAT entry and no port to choose for
//! it.
//!
//! One LRU table for every state (IPv4 keeps embryonic TCP flows apart, see conntrack.rs).
use proxy_common::{
    counter, Backend, CtKey6, CtValue6, DatapathConfig, CT_DIR_EGRESS, CT_DIR_INGRESS, CT_F_CLOSING, CT_F_REPLY,
    CT_F_SNAT, PROTO_UDP,
};

use crate::{
    conntrack::{self, random_port},
    counters::bump,
    maps::{BPF_NOEXIST, EEXIST, CONNTRACK6, CT_SCRATCH6},
    parse6::Flow6,
};

/// A closing flow (FIN or RST seen) idle this long is over: a new SYN on its tuple before then
/// is still a new flow (the forward entry checks for it), this only bounds what a lost FIN costs.
const CLOSING_TIMEOUT_NS: u64 = 10_000_000_000;

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
fn timeout_ns(cfg: &DatapathConfig, v: &CtValue6, proto: u8) -> u64 {
    if v.flags & CT_F_CLOSING != 0 {
        return CLOSING_TIMEOUT_NS;
    }
    conntrack::timeout_ns(cfg, proto)
}

/// The packet's entry at this hook, its timestamp refreshed. None: no flow (any more). A
/// forward entry ends when idle, when a new SYN finds it closing, and, for UDP, when its backend
/// is gone (kube-proxy deletes a removed endpoint's UDP conntrack entries).
#[inline(always)]
pub fn track(f: &Flow6, key: &CtKey6, cfg: &DatapathConfig, now: u64) -> Option<Rewrite6> {
    let v = unsafe { &mut *CONNTRACK6.get_ptr_mut(key)? };
    // Forward entries live at ingress only (the check is constant where the hook is).
    if key.dir == CT_DIR_INGRESS && v.flags & CT_F_REPLY == 0 {
        // Saturating: another CPU may have stamped the entry with a newer clock reading.
        let idle = now.saturating_sub(v.last_seen_ns) > timeout_ns(cfg, v, f.proto);
        let reopened = f.is_new_tcp_syn() && v.flags & CT_F_CLOSING != 0;
        let gone = (f.proto == PROTO_UDP || f.is_new_tcp_syn()) && crate::lb::backend(v.backend_id).is_none();
        if idle || reopened || gone {
            forget(key, v);
            return None;
        }
    }
    if now > v.last_seen_ns {
        v.last_seen_ns = now;
    }
    if f.is_tcp_close() && v.flags & CT_F_CLOSING == 0 {
        closing(key, v);
    }
    let rw = Rewrite6::of(v);
    bump(if rw.flags & CT_F_REPLY != 0 { counter::REVERSE_NAT } else { counter::ESTABLISHED });
    Some(rw)
}

/// The first FIN or RST an entry sees: it is closing, and so is its flow's forward entry when
/// the backend's side closed (the forward entry is what ages a flow). Rare: a subprogram.
#[inline(never)]
fn closing(key: &CtKey6, v: &mut CtValue6) {
    v.flags |= CT_F_CLOSING;
    if v.flags & CT_F_REPLY != 0 {
        if let Some(fwd) = CONNTRACK6.get_ptr_mut(&CtKey6::reversed_of(v, key.proto, CT_DIR_INGRESS)) {
            unsafe { (*fwd).flags |= CT_F_CLOSING };
        }
    }
}

/// Deletes a flow's two entries (`v`: the forward one); the reply's only while it is still
/// this flow's (after an LRU eviction its key may belong to a newer flow). Rare: a subprogram.
#[inline(never)]
fn forget(fwd_key: &CtKey6, v: &CtValue6) {
    let rev_key = CtKey6::reversed_of(v, fwd_key.proto, CT_DIR_EGRESS);
    if let Some(r) = unsafe { CONNTRACK6.get(&rev_key) } {
        let ours = r.new_saddr == fwd_key.daddr && r.new_daddr == fwd_key.saddr && r.new_sport == fwd_key.dport && r.new_dport == fwd_key.sport;
        if ours {
            let _ = CONNTRACK6.remove(&rev_key);
        }
    }
    let _ = CONNTRACK6.remove(fwd_key);
}

/// Records a new flow: the reply's entry first, so a forward entry never exists without it.
/// Its insert with BPF_NOEXIST claims the reply tuple (B:b -> C:p): the client's own port unless
/// the tuple is taken (one client port towards two frontends with a common backend: netfilter
/// would take both for one connection), then a few random ones, as conntrack's NAT moves
/// clashing ports. Keys and values are built in a per-CPU scratch entry, not on the 512-byte
/// stack.
#[inline(always)]
pub fn create(f: &Flow6, now: u64, backend_id: u32, service_id: u32, be: &Backend, masq: bool, cfg: &DatapathConfig) -> Option<Rewrite6> {
    let snat = if masq { CT_F_SNAT } else { 0 };
    let s = unsafe { &mut *CT_SCRATCH6.get_ptr_mut(0)? };
    let blank = CtValue6 { last_seen_ns: now, backend_id, service_id, ..CtValue6::default() };
    // Reverse DNAT: (B:b -> C:p) becomes (V:v -> C:c).
    s.keys[0] = CtKey6 { saddr: be.addr, daddr: f.saddr, sport: be.port, dport: f.sport, proto: f.proto, dir: CT_DIR_EGRESS, _pad: 0 };
    s.values[0] = CtValue6 { new_saddr: f.daddr, new_daddr: f.saddr, new_sport: f.dport, new_dport: f.sport, flags: snat | CT_F_REPLY, ..blank };
    let mut tries = 0;
    loop {
        match CONNTRACK6.insert(&s.keys[0], &s.values[0], BPF_NOEXIST) {
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
    // Forward: (C:c -> V:v) becomes (C:p -> B:b).
    s.keys[1] = key(f, CT_DIR_INGRESS);
    s.values[1] = CtValue6 { new_saddr: f.saddr, new_daddr: be.addr, new_sport: port, new_dport: be.port, flags: snat, ..blank };
    if CONNTRACK6.insert(&s.keys[1], &s.values[1], 0).is_err() {
        bump(counter::CT_INSERT_FAILED);
        return None;
    }
    Some(Rewrite6::of(&s.values[1]))
}
