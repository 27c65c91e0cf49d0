//! The IPv6 packet path: traffic from outside the node to its IPv6 NodePorts, externalIPs and
//! LB IPs (IPv6 clusterIPs, and every IPv6 Service reached from a socket of the node, are
//! balanced at connect time, sock.rs).
//!
//! - Ingress (TC on the uplinks, `kpr_tc_ingress6`; XDP passes IPv6 on): a tracked packet gets
//!   its DNAT; a packet to a frontend starts a flow (source ranges, backend choice, DNAT) and,
//!   where kube-proxy would masquerade, the 0x4000 mark, which kpr's ip6tables rule masquerades
//!   in POSTROUTING as kube-proxy's does.
//! - Egress (TC egress, every interface of the fast path): the reply, netfilter's masquerade
//!   undone, gets its reverse DNAT.
//!
//! So netfilter sees client <-> backend in both directions, as under kube-proxy. ICMPv6 errors
//! about a flow are translated at both hooks (icmp6.rs).
use aya_ebpf::helpers::bpf_jiffies64;
use aya_ebpf::maps::lpm_trie::Key;
use proxy_common::{
    counter, DatapathConfig, ServiceValue, SourceRangeKey, CFG_F_HANDOVER, CFG_F_NO_NEW_FLOWS,
    MARK_MASQ, PROTO_TCP, PROTO_UDP, SCOPE_EXTERNAL, SVC_F_MASQ, SVC_F_NO_LOCAL_ENDPOINT, SVC_F_PRESERVE_SOURCE,
    SVC_F_SOURCE_RANGES,
};

use crate::{
    conntrack::{self, EGRESS, INGRESS},
    conntrack6::{self, Rewrite6},
    counters::{self, bump},
    csum, icmp6, lb,
    maps::{CONFIG, CT_SCRATCH6, SOURCE_RANGES},
    parse::{Flow, IP_OFF},
    parse6::{self, Flow6, Parsed6},
    pipeline::off_cluster6,
    pkt::{L4Csum, Pkt, Verdict},
    reject,
};

/// The packet's TCP or UDP flow; anything else returns from the hook here: ICMPv6 errors are
/// translated, other packets go on (counted where malformed or a fragment). SCTP goes on: the
/// fast path does not forward it.
///
/// What is not this path's is `Verdict::Next`, never `Pass`: on the uplink's TC ingress the
/// program shares the hook (IPVS mode's set matching during a switch, other tools), and "pass"
/// would end the chain there. With nothing after it, "next" passes the packet.
macro_rules! flow6_or_return {
    ($p:expr, $dir:expr) => {
        match parse6::parse($p) {
            Parsed6::Flow(f) if f.proto == PROTO_TCP || f.proto == PROTO_UDP => f,
            Parsed6::Icmp { off } => return icmp6::translate($p, off, $dir),
            Parsed6::Malformed => {
                bump(counter::MALFORMED);
                return Verdict::Next;
            }
            Parsed6::Fragment => {
                bump(counter::FRAGMENT);
                return Verdict::Next;
            }
            _ => return Verdict::Next,
        }
    };
}

#[inline(always)]
pub fn ingress<P: Pkt>(p: &mut P) -> Verdict {
    let f = flow6_or_return!(p, INGRESS);
    // An IPv6 address whose last 96 bits are zero has an IPv4 frontend's map form: never ours
    // (the agent programs no such IPv6 frontend).
    if f.daddr[1] == 0 && f.daddr[2] == 0 && f.daddr[3] == 0 {
        return Verdict::Next;
    }
    let Some(cfg) = CONFIG.get(0) else {
        return Verdict::Next;
    };
    let now = conntrack::now_ns(unsafe { bpf_jiffies64() });
    if let Some(v) = tracked(p, &f, cfg, now) {
        return v;
    }
    // Draining after a switch to IPVS mode: no new flow; IPVS mode's program after this one
    // serves what no flow of ours knows.
    let draining = cfg.flags & CFG_F_NO_NEW_FLOWS != 0;
    // The handshake's last ACK (or data) of a flow still in the embryonic table, to a frontend
    // (the frontend's value is not held across the call: the frame counts against 512 bytes
    // with new_flow's; a flow picked up mid-stream looks it up twice).
    if f.proto == PROTO_TCP && !f.is_tcp_control() && (draining || lb::lookup(f.daddr, f.dport, f.proto, SCOPE_EXTERNAL).is_some()) {
        if let Some(v) = embryonic(p, &f, cfg, now) {
            return v;
        }
    }
    let Some(svc) = lb::lookup(f.daddr, f.dport, f.proto, SCOPE_EXTERNAL) else {
        return Verdict::Next;
    };
    if draining {
        return Verdict::Next;
    }
    // After a switch from IPVS mode: a connection IPVS still serves (its set matching, after
    // this program, marks it).
    if cfg.flags & CFG_F_HANDOVER != 0 && f.proto == PROTO_TCP && !f.is_new_tcp_syn() {
        bump(counter::HANDOVER_PASS);
        return Verdict::Next;
    }
    match forgetting_evicted(new_flow(p, &f, &svc, cfg, now)) {
        Some(v) => v,
        // Here, not in new_flow: the reject's frame then never adds to new_flow's.
        None => reject::icmp6_port_unreachable(p, f.saddr, f.daddr).unwrap_or_else(|| {
            bump(counter::REJECT_FAILED);
            Verdict::Drop
        }),
    }
}

#[inline(always)]
pub fn egress<P: Pkt>(p: &mut P) -> Verdict {
    let f = flow6_or_return!(p, EGRESS);
    egress_flow(p, &f)
}

/// A subprogram: its frame and the ICMPv6 translation's are siblings (Linux 6.1 counts a call
/// chain's frames against 512 bytes).
#[inline(never)]
fn egress_flow<P: Pkt>(p: &mut P, f: &Flow6) -> Verdict {
    let Some(cfg) = CONFIG.get(0) else {
        return Verdict::Next;
    };
    let now = conntrack::now_ns(unsafe { bpf_jiffies64() });
    // A reply entry, never a forward one: no deletion to call.
    match conntrack6::track(f, &conntrack6::key(f, EGRESS), cfg, now) {
        Some(rw) => rewrite(p, f, &rw),
        None => Verdict::Next,
    }
}

/// An ingress packet's flow: its verdict (rewritten), None for a packet no flow knows. A
/// subprogram: its key and rewrite stay off the frame new_flow's adds to (Linux 6.1 counts a
/// call chain's frames against 512 bytes).
#[inline(never)]
fn tracked<P: Pkt>(p: &mut P, f: &Flow6, cfg: &DatapathConfig, now: u64) -> Option<Verdict> {
    let rw = conntrack6::track(f, &conntrack6::key(f, INGRESS), cfg, now)?;
    Some(rewrite(p, f, &rw))
}

/// `conntrack6::embryonic_forward` and the rewrite, in a frame of their own (as `tracked`).
#[inline(never)]
fn embryonic<P: Pkt>(p: &mut P, f: &Flow6, cfg: &DatapathConfig, now: u64) -> Option<Verdict> {
    let rw = conntrack6::embryonic_forward(f, &conntrack6::key(f, INGRESS), cfg, now)?;
    Some(rewrite(p, f, &rw))
}

/// Forgets the flows that new_flow's inserts evicted (conntrack6::forget_pending), and hands
/// its answer back: as IPv4's (pipeline::forgetting_evicted), that frame never adds to
/// new_flow's.
#[inline(never)]
fn forgetting_evicted(answer: Option<Verdict>) -> Option<Verdict> {
    if let Some(s) = CT_SCRATCH6.get_ptr_mut(0) {
        if unsafe { (*s).any_pending() } {
            conntrack6::forget_pending(s);
        }
    }
    answer
}

/// A packet to a frontend that no flow knows: source ranges, backend choice, conntrack, DNAT.
/// None: no endpoint at all, to be rejected. A subprogram: its frame stays off the established
/// path's.
#[inline(never)]
fn new_flow<P: Pkt>(p: &mut P, f: &Flow6, svc: &ServiceValue, cfg: &DatapathConfig, now: u64) -> Option<Verdict> {
    if svc.flags & SVC_F_SOURCE_RANGES != 0 {
        let key = Key::new(32 + 128, SourceRangeKey { service_id_be: svc.service_id.to_be(), addr: f.saddr });
        if SOURCE_RANGES.get(&key).is_none() {
            bump(counter::DROP_SOURCE_RANGE);
            return Some(Verdict::Drop);
        }
    }
    if svc.backend_count == 0 {
        // kube-proxy's verdicts: traffic policy Local with endpoints elsewhere drops; no
        // endpoint at all rejects (icmp6-port-unreachable).
        if svc.flags & SVC_F_NO_LOCAL_ENDPOINT != 0 {
            bump(counter::DROP_NO_LOCAL_ENDPOINT);
            return Some(Verdict::Drop);
        }
        bump(counter::REJECT_NO_BACKEND);
        return None;
    }
    // The schedulers hash an IPv4-shaped flow: the addresses folded (ClientIP affinity keys on
    // the whole client address).
    let hashed = Flow {
        l4_off: 0,
        ihl_bytes: 0,
        proto: f.proto,
        tcp_flags: f.tcp_flags,
        saddr: lb::fold(&f.saddr),
        daddr: lb::fold(&f.daddr),
        sport: f.sport,
        dport: f.dport,
        csum: L4Csum { off: 0, udp: false },
    };
    let Some((backend_id, be)) = lb::select_backend_for(f.saddr, svc, &hashed, now, lb::Pick::Scheduler) else {
        bump(counter::MISS_BACKEND);
        return Some(Verdict::Drop);
    };
    // Masquerade where kube-proxy would: the frontend's own (external traffic policy Cluster;
    // masqueradeAll on a ClusterIP), clients outside the cluster CIDR (unless the source is
    // preserved), hairpin.
    let masq = be.addr == f.saddr || svc.flags & SVC_F_MASQ != 0 || (svc.flags & SVC_F_PRESERVE_SOURCE == 0 && off_cluster6(&f.saddr, p.ifindex(), cfg));
    let Some(rw) = conntrack6::create(f, backend_id, svc.service_id, &be, masq, cfg) else {
        return Some(Verdict::Drop);
    };
    if masq {
        bump(counter::SNAT);
    }
    bump(counter::NEW_FLOW);
    counters::backend_new(backend_id);
    Some(rewrite(p, f, &rw))
}

/// NAT66: the addresses and ports the entry prescribes, one incremental update of the L4
/// checksum (IPv6 has no header checksum: the pseudo-header's change goes to L4's).
#[inline(always)]
fn rewrite<P: Pkt>(p: &mut P, f: &Flow6, rw: &Rewrite6) -> Verdict {
    match rewrite_inner(p, f, rw) {
        Some(()) => Verdict::Pass,
        None => Verdict::Drop,
    }
}

#[inline(always)]
fn rewrite_inner<P: Pkt>(p: &mut P, f: &Flow6, rw: &Rewrite6) -> Option<()> {
    let mut diff = 0;
    if rw.saddr != f.saddr {
        diff += csum::diff16(&f.saddr, &rw.saddr);
        p.store(IP_OFF + 8, rw.saddr)?;
    }
    if rw.daddr != f.daddr {
        diff += csum::diff16(&f.daddr, &rw.daddr);
        p.store(IP_OFF + 24, rw.daddr)?;
    }
    let mut port_diff = 0;
    if rw.sport != f.sport || rw.dport != f.dport {
        port_diff = csum::diff2(f.sport, rw.sport) + csum::diff2(f.dport, rw.dport);
        p.store(f.l4_off, [rw.sport, rw.dport])?;
    }
    if diff != 0 || port_diff != 0 {
        p.l4_csum_update(f.csum(), diff, port_diff)?;
    }
    if diff != 0 {
        // The helper took the checksum field's change out of a CHECKSUM_COMPLETE sum; the
        // addresses' own change, inside the sum too, puts it back.
        p.complete_csum_add(diff);
    }
    if rw.masquerade() {
        p.or_mark(MARK_MASQ);
    }
    Some(())
}
