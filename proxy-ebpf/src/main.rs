//! kpr's kernel programs. One load balancer (`process`) serves two hooks:
//! - `kpr_tc_ingress` (clsact ingress) on the node side of pod interfaces: east-west traffic and
//!   the replies of every backend;
//! - `kpr_xdp_ingress` on the node's uplink: north-south traffic (NodePort, ExternalIP, LB IP).
//!
//! `kpr_tc_pass` / `kpr_xdp_pass` only return "pass": the floor the benchmark compares against.
#![no_std]
#![no_main]

mod conntrack;
mod counters;
mod csum;
mod flowcache;
mod ipset;
mod lb;
mod maps;
mod nat;
mod parse;
mod pkt;
mod reject;
mod sock;

use aya_ebpf::{
    bindings::{xdp_action, TC_ACT_OK},
    helpers::bpf_jiffies64,
    macros::{cgroup_sock_addr, classifier, socket_filter, xdp},
    maps::lpm_trie::Key,
    programs::{SkBuffContext, SockAddrContext, TcContext, XdpContext},
};
use proxy_common::{
    counter, DatapathConfig, SourceRangeKey, CFG_F_MASQUERADE_ALL, CFG_F_NO_FLOW_CACHE, MARK_MASQ,
    SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_F_MASQ, SVC_F_PRESERVE_SOURCE, SVC_F_SOURCE_RANGES,
};

use counters::bump;
use maps::{KPR_CFG_V1, KPR_SRCRNG_V1};
use conntrack::Rewrite;
use parse::{Flow, Parsed};
use pkt::{Pkt, Tc, Verdict, Xdp};

#[inline(always)]
pub(crate) fn in_cluster_cidr(addr: u32, cfg: &DatapathConfig) -> bool {
    let len = cfg.cluster_cidr_len;
    if len == 0 || len > 32 {
        return false;
    }
    let mask = (u32::MAX << (32 - len)).to_be();
    addr & mask == cfg.cluster_cidr[0] & mask
}

#[inline(always)]
fn source_allowed(f: &Flow, service_id: u32) -> bool {
    let key = Key::new(64, SourceRangeKey { service_id_be: service_id.to_be(), addr: [f.saddr, 0, 0, 0] });
    KPR_SRCRNG_V1.get(&key).is_some()
}

#[inline(always)]
fn process<P: Pkt>(p: &mut P, scope: u8) -> Verdict {
    let f = match parse::parse(p) {
        Parsed::Flow(f) => f,
        Parsed::Other => return Verdict::Pass,
        Parsed::Malformed => {
            bump(counter::MALFORMED);
            return Verdict::Pass;
        }
        Parsed::Fragment => {
            bump(counter::FRAGMENT);
            return Verdict::Pass;
        }
    };
    let Some(cfg) = KPR_CFG_V1.get(0) else {
        return Verdict::Pass;
    };
    let jiffies = unsafe { bpf_jiffies64() };
    let key = conntrack::key(&f);
    let cached = cfg.flags & CFG_F_NO_FLOW_CACHE == 0;
    let generation = flowcache::generation();

    if cached && !f.is_tcp_control() {
        if let Some(rw) = flowcache::lookup(&key, generation, jiffies) {
            bump(if rw.reply() { counter::REVERSE_NAT } else { counter::ESTABLISHED });
            return forward(p, &f, &rw);
        }
    }
    let now = conntrack::now_ns(jiffies);
    if let Some(rw) = conntrack::established(&f, &key, cfg, now) {
        bump(counter::FLOW_CACHE_MISS);
        if cached {
            flowcache::fill(&key, &rw, generation, jiffies);
        }
        return forward(p, &f, &rw);
    }

    new_flow(p, &f, scope, cfg, now)
}

/// An established flow's packet: the masquerade mark and the rewrite.
#[inline(always)]
fn forward<P: Pkt>(p: &mut P, f: &Flow, rw: &Rewrite) -> Verdict {
    if rw.snat() {
        p.or_mark(MARK_MASQ);
    }
    match nat::rewrite(p, f, rw) {
        Some(()) => Verdict::Pass,
        None => Verdict::Drop,
    }
}

/// A packet of no known flow: service lookup, policy, backend choice, conntrack, NAT.
/// A BPF subprogram of its own, so its stack does not add to the established-flow path's.
#[inline(never)]
fn new_flow<P: Pkt>(p: &mut P, f: &Flow, scope: u8, cfg: &DatapathConfig, now: u64) -> Verdict {
    let f = *f;
    let Some(svc) = lb::lookup_service(&f, scope) else {
        return Verdict::Pass;
    };
    if svc.flags & SVC_F_SOURCE_RANGES != 0 && !source_allowed(&f, svc.service_id) {
        bump(counter::DROP_SOURCE_RANGE);
        return Verdict::Drop;
    }
    if svc.backend_count == 0 {
        bump(counter::REJECT_NO_BACKEND);
        return reject::icmp_port_unreachable(p, &f).unwrap_or_else(|| {
            bump(counter::REJECT_FAILED);
            Verdict::Drop
        });
    }
    let Some((backend_id, be)) = lb::select_backend(&svc, &f, now) else {
        bump(counter::MISS_BACKEND);
        return Verdict::Drop;
    };

    // Masquerade exactly where kube-proxy would: hairpin, external traffic policy Cluster,
    // masqueradeAll, and clients outside the cluster CIDR (unless the source is preserved).
    let hairpin = be.addr[0] == f.saddr;
    let off_cluster = cfg.cluster_cidr_len != 0
        && !in_cluster_cidr(f.saddr, cfg)
        && svc.flags & SVC_F_PRESERVE_SOURCE == 0;
    let masq = hairpin
        || svc.flags & SVC_F_MASQ != 0
        || cfg.flags & CFG_F_MASQUERADE_ALL != 0
        || off_cluster;
    let src_addr = if masq { cfg.snat_addr[0] } else { f.saddr };
    let Some(src_port) = conntrack::snat_port(&f, &be, src_addr) else {
        return Verdict::Drop;
    };
    let Some(rw) = conntrack::create(&f, now, backend_id, svc.service_id, &be, (src_addr, src_port), masq) else {
        return Verdict::Drop;
    };
    if masq {
        p.or_mark(MARK_MASQ);
        bump(counter::SNAT);
    }
    bump(counter::NEW_FLOW);
    counters::backend_new(backend_id);
    if cfg.flags & CFG_F_NO_FLOW_CACHE == 0 {
        flowcache::fill(&conntrack::key(&f), &rw, flowcache::generation(), unsafe { bpf_jiffies64() });
    }
    match nat::rewrite(p, &f, &rw) {
        Some(()) => Verdict::Pass,
        None => Verdict::Drop,
    }
}

#[classifier]
pub fn kpr_tc_ingress(mut ctx: TcContext) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    let v = process(&mut p, SCOPE_INTERNAL);
    p.action(v)
}

#[xdp]
pub fn kpr_xdp_ingress(ctx: XdpContext) -> u32 {
    let mut p = Xdp(&ctx);
    Xdp::action(process(&mut p, SCOPE_EXTERNAL))
}

#[cgroup_sock_addr(connect4)]
pub fn kpr_connect4(ctx: SockAddrContext) -> i32 {
    sock::balance(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn kpr_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::balance(&ctx)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn kpr_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn kpr_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// IPVS mode: kube-proxy's set matching (masquerade mark, source-range firewall, VIP filter).
#[classifier]
pub fn kpr_tc_ipset(mut ctx: TcContext) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    let f = match parse::parse(&mut p) {
        Parsed::Flow(f) => f,
        _ => return TC_ACT_OK as i32,
    };
    let mut mark = 0;
    let v = ipset::tc_verdict(&f, &mut mark);
    if mark != 0 {
        p.or_mark(mark);
    }
    v
}

/// IPVS mode: KUBE-LOOP-BACK as an xt_bpf match (non-zero: the packet is in the set).
#[socket_filter]
pub fn kpr_loopback(ctx: SkBuffContext) -> i64 {
    ipset::loopback_match(&ctx) as i64
}

#[classifier]
pub fn kpr_tc_pass(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}

#[xdp]
pub fn kpr_xdp_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 4] = *b"GPL\0";
