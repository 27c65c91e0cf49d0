//! Connection tracking: a forward entry per flow and a reply entry for its reverse NAT, in one
//! LRU map and one key space, so every packet of a flow costs one probe of a 16-byte key.
//! Flows keep their backend whatever happens to the service afterwards.
use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns};
use proxy_common::{
    counter, Backend, CtKey, CtValue, DatapathConfig, CT_F_CLOSING, CT_F_REPLY, CT_F_SNAT,
    PROTO_TCP, SNAT_PORT_MAX, SNAT_PORT_MIN,
};

use crate::{
    counters::bump,
    flowcache,
    maps::{KPR_BE_V2, KPR_CLOCK, KPR_CT_SCRATCH, KPR_CT_V2},
    parse::Flow,
};

/// CLOCK_MONOTONIC coarse ns, read through the helper once per jiffy and CPU (see ClockCache).
#[inline(always)]
pub fn now_ns(jiffies: u64) -> u64 {
    match KPR_CLOCK.get_ptr_mut(0) {
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

/// The 4-tuple a packet is rewritten to (network order), with its entry's CtValue flags.
#[derive(Clone, Copy)]
pub struct Rewrite {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub flags: u16,
}

impl Rewrite {
    #[inline(always)]
    fn of(v: &CtValue) -> Self {
        Self { saddr: v.new_saddr, daddr: v.new_daddr, sport: v.new_sport, dport: v.new_dport, flags: v.flags }
    }
    /// Masqueraded.
    #[inline(always)]
    pub fn snat(&self) -> bool {
        self.flags & CT_F_SNAT != 0
    }
    /// A reply entry's rewrite (reverse NAT).
    #[inline(always)]
    pub fn reply(&self) -> bool {
        self.flags & CT_F_REPLY != 0
    }
}

#[inline(always)]
pub fn key(f: &Flow) -> CtKey {
    CtKey { saddr: f.saddr, daddr: f.daddr, sport: f.sport, dport: f.dport, proto: f.proto, _pad: 0, _pad2: 0 }
}

/// The key replies of a flow to `be` arrive with: from the backend to (client or SNAT) address.
#[inline(always)]
fn reply_key(be: &Backend, to_addr: u32, to_port: u16, proto: u8) -> CtKey {
    CtKey { saddr: be.addr[0], daddr: to_addr, sport: be.port, dport: to_port, proto, _pad: 0, _pad2: 0 }
}

#[inline(always)]
fn timeout_ns(cfg: &DatapathConfig, proto: u8) -> u64 {
    let s = if proto == PROTO_TCP { cfg.ct_tcp_timeout_s } else { cfg.ct_udp_timeout_s };
    u64::from(s) * 1_000_000_000
}

/// The rewrite of an existing flow, forward or reply, refreshed for this packet.
#[inline(always)]
pub fn established(f: &Flow, key: &CtKey, cfg: &DatapathConfig, now: u64) -> Option<Rewrite> {
    let v = unsafe { &mut *KPR_CT_V2.get_ptr_mut(key)? };
    if v.flags & CT_F_REPLY != 0 {
        touch(v, f, now);
        bump(counter::REVERSE_NAT);
        return Some(Rewrite::of(v));
    }
    // Saturating: another CPU may have stamped the entry with a clock reading newer than ours
    // (the coarse clock moves on one CPU's tick while others still read the old value); a
    // wrapped difference would call a live flow idle and re-balance it mid-connection.
    let idle = now.saturating_sub(v.last_seen_ns) > timeout_ns(cfg, f.proto);
    // A fresh SYN on a closing tuple, or to a backend that is gone, is a new connection.
    let reopened = f.is_new_tcp_syn()
        && (v.flags & CT_F_CLOSING != 0 || unsafe { KPR_BE_V2.get(&v.backend_id) }.is_none());
    if idle || reopened {
        // The tuple is about to mean another flow: no CPU may answer it from its cache.
        flowcache::invalidate();
        return None;
    }
    touch(v, f, now);
    bump(counter::ESTABLISHED);
    Some(Rewrite::of(v))
}

#[inline(always)]
fn touch(v: &mut CtValue, f: &Flow, now: u64) {
    // The coarse clock ticks every few ms: most packets find the stamp current and leave the
    // shared cache line clean.
    if now > v.last_seen_ns {
        v.last_seen_ns = now;
    }
    if f.is_tcp_close() {
        v.flags |= CT_F_CLOSING;
    }
}

/// Source port for the flow's packets towards the backend, seen from `snat_addr`: the client's
/// own unless another flow already owns that reply tuple, then a few random tries in the SNAT
/// range. Without masquerade too: two clients' flows (or one client's flows to two VIPs) that
/// meet on one backend with the same address and port would share a reply tuple, as conntrack's
/// NAT knows; the port is moved so each reply finds its own flow.
#[inline(always)]
pub fn snat_port(f: &Flow, be: &Backend, snat_addr: u32) -> Option<u16> {
    let mut port = f.sport;
    let mut tries = 0;
    while tries < 4 {
        match unsafe { KPR_CT_V2.get(&reply_key(be, snat_addr, port, f.proto)) } {
            None => return Some(port),
            // Our own flow (a retransmitted first packet): same client and same service address.
            Some(v)
                if v.flags & CT_F_REPLY != 0
                    && v.new_daddr == f.saddr
                    && v.new_dport == f.sport
                    && v.new_saddr == f.daddr
                    && v.new_sport == f.dport =>
            {
                return Some(port)
            }
            Some(_) => {
                bump(counter::SNAT_PORT_COLLISION);
                let span = u32::from(SNAT_PORT_MAX - SNAT_PORT_MIN) + 1;
                let p = SNAT_PORT_MIN as u32 + unsafe { bpf_get_prandom_u32() } % span;
                port = (p as u16).to_be();
            }
        }
        tries += 1;
    }
    None
}

/// Records a new flow: forward (client -> VIP becomes new tuple) and reply (its inverse).
/// Keys and values are built in a per-CPU scratch entry, not on the 512-byte stack.
#[inline(always)]
pub fn create(
    f: &Flow,
    now: u64,
    backend_id: u32,
    service_id: u32,
    be: &Backend,
    src: (u32, u16),
    masq: bool,
) -> Option<Rewrite> {
    let (saddr, sport) = src;
    let flags = if masq { CT_F_SNAT } else { 0 };
    let s = unsafe { &mut *KPR_CT_SCRATCH.get_ptr_mut(0)? };
    s.fwd_key = key(f);
    s.fwd = CtValue {
        last_seen_ns: now,
        new_saddr: saddr,
        new_daddr: be.addr[0],
        new_sport: sport,
        new_dport: be.port,
        backend_id,
        service_id,
        flags,
        _pad: 0,
    };
    s.rev_key = reply_key(be, saddr, sport, f.proto);
    s.rev = CtValue {
        last_seen_ns: now,
        new_saddr: f.daddr,
        new_daddr: f.saddr,
        new_sport: f.dport,
        new_dport: f.sport,
        backend_id,
        service_id,
        flags: flags | CT_F_REPLY,
        _pad: 0,
    };
    if KPR_CT_V2.insert(&s.rev_key, &s.rev, 0).is_err() || KPR_CT_V2.insert(&s.fwd_key, &s.fwd, 0).is_err() {
        bump(counter::CT_INSERT_FAILED);
        return None;
    }
    Some(Rewrite::of(&s.fwd))
}
