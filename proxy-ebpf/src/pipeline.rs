//! The load balancer's packet pipeline, written once for every hook (see pkt::Pkt).
//!
//! - Ingress (XDP on uplinks, TC ingress on pod and tunnel interfaces), before netfilter: a
//!   tracked packet gets its forward (DNAT) or reverse-SNAT rewrite; a packet to a service
//!   starts a flow (policy, backend choice, DNAT); the rest passes untouched.
//! - Egress (TC egress on the same interfaces), after netfilter: a tracked packet gets its SNAT
//!   or reverse-DNAT rewrite; nothing else is looked up.
//!
//! So between the two, netfilter sees client <-> backend in both directions, as under
//! kube-proxy, and conntrack state rules (ctstate INVALID drops, CNI policy chains) hold.
use aya_ebpf::helpers::bpf_jiffies64;
use proxy_common::{
    counter, DatapathConfig, ServiceValue, SourceRangeKey, CFG_F_LOCAL_BY_IFACE, CFG_F_NO_LOCAL_DETECTOR,
    CFG_F_HANDOVER, CFG_F_NO_FLOW_CACHE, CFG_F_NO_NEW_FLOWS, CtKey, IFACE_F_LOCAL,
    PROTO_TCP, SCOPE_EXTERNAL, SVC_F_MASQ, SVC_F_NO_LOCAL_ENDPOINT, SVC_F_PRESERVE_SOURCE,
    SVC_F_SOURCE_RANGES,
};
use aya_ebpf::maps::lpm_trie::Key;

use crate::{
    conntrack::{self, Lookup, Tracked},
    counters::{self, bump},
    flowcache, icmp, lb,
    maps::{CONFIG, CT_SCRATCH, IFACES, SOURCE_RANGES},
    nat,
    parse::{self, Flow, Parsed},
    pkt::{Pkt, Verdict},
    reject,
    rewrite::Rewrite,
};

/// kube-proxy's detectLocalMode: is this packet's client outside the cluster (masqueraded
/// when it reaches a ClusterIP)? By address (ClusterCIDR, NodeCIDR; no CIDR: nobody is), or by
/// the interface it arrived on (BridgeInterface, InterfaceNamePrefix).
#[inline(always)]
pub(crate) fn off_cluster(saddr: u32, ifindex: u32, cfg: &DatapathConfig) -> bool {
    if cfg.flags & CFG_F_LOCAL_BY_IFACE != 0 {
        return unsafe { IFACES.get(&ifindex) }.is_none_or(|i| i.flags & IFACE_F_LOCAL == 0);
    }
    let len = cfg.cluster_cidr_len;
    if len == 0 || len > 32 {
        return false;
    }
    let mask = (u32::MAX << (32 - len)).to_be();
    saddr & mask != cfg.cluster_cidr[0] & mask
}

/// `off_cluster` for an IPv6 client (IPVS mode's set matching).
#[inline(always)]
pub(crate) fn off_cluster6(saddr: &[u32; 4], ifindex: u32, cfg: &DatapathConfig) -> bool {
    if cfg.flags & CFG_F_LOCAL_BY_IFACE != 0 {
        return unsafe { IFACES.get(&ifindex) }.is_none_or(|i| i.flags & IFACE_F_LOCAL == 0);
    }
    let len = cfg.cluster_cidr6_len;
    if len == 0 || len > 128 {
        return false;
    }
    for i in 0..4u32 {
        let bits = len.saturating_sub(32 * i).min(32);
        if bits == 0 {
            break;
        }
        let mask = (u32::MAX << (32 - bits)).to_be();
        if saddr[i as usize] & mask != cfg.cluster_cidr6[i as usize] & mask {
            return true;
        }
    }
    false
}

#[inline(always)]
fn source_allowed(f: &Flow, service_id: u32) -> bool {
    let key = Key::new(64, SourceRangeKey { service_id_be: service_id.to_be(), addr: [f.saddr, 0, 0, 0] });
    SOURCE_RANGES.get(&key).is_some()
}

/// The packet's TCP/UDP flow; anything else returns from the hook here: ICMP errors are
/// translated, other packets pass (counted where malformed or a fragment). A macro, not a
/// function returning the Flow: through a returned enum the verifier loses the offsets' bounds.
macro_rules! flow_or_return {
    ($p:expr, $dir:expr) => {
        match parse::parse($p) {
            Parsed::Flow(f) => f,
            Parsed::IcmpError(e) => return icmp::translate($p, &e, $dir),
            Parsed::Other => return Verdict::Pass,
            Parsed::Malformed => {
                bump(counter::MALFORMED);
                return Verdict::Pass;
            }
            Parsed::Fragment => {
                bump(counter::FRAGMENT);
                return Verdict::Pass;
            }
        }
    };
}

#[inline(always)]
pub fn ingress<P: Pkt>(p: &mut P, scope: u8) -> Verdict {
    let f = flow_or_return!(p, conntrack::INGRESS);
    let Some(cfg) = CONFIG.get(0) else {
        return Verdict::Pass;
    };
    let key = conntrack::key(&f, conntrack::INGRESS);
    let now = match tracked(p, &f, &key, cfg) {
        Ok(v) => return v,
        Err(now) => now,
    };
    // Draining after a switch to IPVS mode: no new flow; IPVS mode's program after this one
    // serves what no flow of ours knows.
    let draining = cfg.flags & CFG_F_NO_NEW_FLOWS != 0;
    let scope = if cfg.flags & CFG_F_NO_LOCAL_DETECTOR != 0 { SCOPE_EXTERNAL } else { scope };
    let svc = lb::lookup_service(&f, scope);
    if svc.is_none() && !draining {
        return Verdict::Pass;
    }
    // The handshake's last ACK (or data) of a flow still in the embryonic table.
    if f.proto == PROTO_TCP && !f.is_tcp_control() {
        if let Some(rw) = conntrack::embryonic_forward(&f, &key, cfg, now) {
            return rewrite(p, &f, &rw);
        }
    }
    let Some(svc) = svc.filter(|_| !draining) else {
        return Verdict::Next;
    };
    // After a switch from IPVS mode: a connection IPVS still serves (its FIN and RST too).
    if cfg.flags & CFG_F_HANDOVER != 0 && f.proto == PROTO_TCP && !f.is_new_tcp_syn() {
        bump(counter::HANDOVER_PASS);
        return Verdict::Pass;
    }
    match forgetting_evicted(new_flow(p, &f, &svc, cfg, now)) {
        NewFlow::Done(v) => v,
        // Here, not in new_flow: the reject's frame then never adds to new_flow's.
        NewFlow::Reject => reject::icmp_port_unreachable(p, &f).unwrap_or_else(|| {
            bump(counter::REJECT_FAILED);
            Verdict::Drop
        }),
    }
}

/// Forgets the flows that new_flow's inserts evicted (conntrack::forget_pending), and hands
/// its answer back. Here, not in new_flow: that frame never adds to new_flow's in the call
/// chain, and the hook's keeps nothing across the call. Most new flows evict nothing, and
/// skip the call.
#[inline(never)]
fn forgetting_evicted(answer: NewFlow) -> NewFlow {
    if let Some(s) = CT_SCRATCH.get_ptr_mut(0) {
        if unsafe { (*s).any_pending() } {
            conntrack::forget_pending(s);
        }
    }
    answer
}

/// What new_flow decided.
enum NewFlow {
    Done(Verdict),
    /// No endpoints at all: answer with ICMP port unreachable.
    Reject,
}

#[inline(always)]
pub fn egress<P: Pkt>(p: &mut P) -> Verdict {
    let f = flow_or_return!(p, conntrack::EGRESS);
    let Some(cfg) = CONFIG.get(0) else {
        return Verdict::Pass;
    };
    let key = conntrack::key(&f, conntrack::EGRESS);
    tracked(p, &f, &key, cfg).unwrap_or(Verdict::Pass)
}

/// A tracked packet's verdict (rewritten), or Err(now) for a packet no flow knows.
#[inline(always)]
fn tracked<P: Pkt>(p: &mut P, f: &Flow, key: &CtKey, cfg: &DatapathConfig) -> Result<Verdict, u64> {
    let jiffies = unsafe { bpf_jiffies64() };
    let cached = cfg.flags & CFG_F_NO_FLOW_CACHE == 0;
    let generation = flowcache::generation();
    if cached && !f.is_tcp_control() {
        if let Some(rw) = flowcache::lookup(key, generation, jiffies) {
            bump(if rw.reply() { counter::REVERSE_NAT } else { counter::ESTABLISHED });
            return Ok(rewrite(p, f, &rw));
        }
    }
    let mut l = Lookup { now: conntrack::now_ns(jiffies), ifindex: p.ifindex(), rewrite: Rewrite::default() };
    match conntrack::track(f, key, cfg, &mut l) {
        Tracked::No => Err(l.now),
        Tracked::Drop => {
            bump(counter::FLOW_CACHE_MISS);
            Ok(Verdict::Drop)
        }
        Tracked::Reset => {
            bump(counter::MAX_AGE_RESET);
            let ports = u32::from(f.sport) | (u32::from(f.dport) << 16);
            Ok(reject::tcp_reset(p, f.saddr, f.daddr, ports, f.l4_off).unwrap_or(Verdict::Drop))
        }
        t => {
            bump(counter::FLOW_CACHE_MISS);
            // Embryonic flows are never cached: the handshake's last packet must reach them.
            if cached && t == Tracked::Assured {
                flowcache::fill(key, &l.rewrite, generation, jiffies);
            }
            Ok(rewrite(p, f, &l.rewrite))
        }
    }
}

#[inline(always)]
fn rewrite<P: Pkt>(p: &mut P, f: &Flow, rw: &Rewrite) -> Verdict {
    match nat::rewrite(p, f, rw) {
        Some(()) => Verdict::Pass,
        None => Verdict::Drop,
    }
}

/// A packet to a service that no flow knows: policy, backend choice, conntrack, DNAT.
/// A BPF subprogram of its own, so its stack does not add to the established-flow path's.
#[inline(never)]
fn new_flow<P: Pkt>(p: &mut P, f: &Flow, svc: &ServiceValue, cfg: &DatapathConfig, now: u64) -> NewFlow {
    if svc.flags & SVC_F_SOURCE_RANGES != 0 && !source_allowed(f, svc.service_id) {
        bump(counter::DROP_SOURCE_RANGE);
        return NewFlow::Done(Verdict::Drop);
    }
    if svc.backend_count == 0 {
        // kube-proxy's verdicts: a traffic policy Local frontend with endpoints elsewhere only
        // drops; a service with no endpoint at all rejects.
        if svc.flags & SVC_F_NO_LOCAL_ENDPOINT != 0 {
            bump(counter::DROP_NO_LOCAL_ENDPOINT);
            return NewFlow::Done(Verdict::Drop);
        }
        bump(counter::REJECT_NO_BACKEND);
        return NewFlow::Reject;
    }
    let Some((backend_id, be)) = lb::select_backend(svc, f, now, lb::Pick::Scheduler) else {
        bump(counter::MISS_BACKEND);
        return NewFlow::Done(Verdict::Drop);
    };

    // Masquerade exactly where kube-proxy would: hairpin, the frontend's own (external traffic
    // policy Cluster; masqueradeAll on a ClusterIP), and clients outside the cluster CIDR
    // (unless the source is preserved).
    let hairpin = be.addr[0] == f.saddr;
    let off_cluster = svc.flags & SVC_F_PRESERVE_SOURCE == 0 && off_cluster(f.saddr, p.ifindex(), cfg);
    let masq = hairpin || svc.flags & SVC_F_MASQ != 0 || off_cluster;
    let Some(rw) = conntrack::create(f, backend_id, svc.service_id, &be, masq, cfg) else {
        return NewFlow::Done(Verdict::Drop);
    };
    if masq {
        bump(counter::SNAT);
    }
    bump(counter::NEW_FLOW);
    counters::backend_new(backend_id);
    counters::backend_active(backend_id);
    // Not cached: a flow is cached once assured (a UDP flow too: its eviction from the
    // embryonic table by a flood must not leave a copy behind).
    NewFlow::Done(rewrite(p, f, &rw))
}
