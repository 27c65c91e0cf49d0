//! kpr's kernel programs: thin hook wrappers around one pipeline (pipeline.rs).
//! - `kpr_xdp_ingress` on the node's uplinks: north-south traffic (NodePort, ExternalIP, LB IP)
//!   and replies from other nodes;
//! - `kpr_tc_ingress` (clsact ingress) on the node side of pod interfaces and on tunnel devices:
//!   east-west traffic and the replies of local backends;
//! - `kpr_tc_egress` on all of them: masquerade and the replies' reverse DNAT, after netfilter;
//! - connect-time programs for the node's own processes (sock.rs);
//! - IPVS mode's set matching (ipset.rs).
//!
//! `kpr_tc_pass` / `kpr_xdp_pass` only return "pass": the floor the benchmark compares against.
#![no_std]
#![no_main]

mod conntrack;
mod counters;
mod csum;
mod flowcache;
mod icmp;
mod ipset;
mod lb;
mod maps;
mod nat;
mod parse;
mod pipeline;
mod pkt;
mod reject;
mod rewrite;
mod sock;

use aya_ebpf::{
    bindings::{xdp_action, TC_ACT_OK},
    macros::{cgroup_sock_addr, classifier, socket_filter, xdp},
    programs::{SkBuffContext, SockAddrContext, TcContext, XdpContext},
};
use proxy_common::{SCOPE_EXTERNAL, SCOPE_INTERNAL};

use parse::Parsed;
use pkt::{Tc, Xdp};

#[classifier]
pub fn kpr_tc_ingress(mut ctx: TcContext) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    let v = pipeline::ingress(&mut p, SCOPE_INTERNAL);
    p.action(v)
}

#[classifier]
pub fn kpr_tc_egress(mut ctx: TcContext) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    let v = pipeline::egress(&mut p);
    p.action(v)
}

#[xdp]
pub fn kpr_xdp_ingress(ctx: XdpContext) -> u32 {
    let mut p = Xdp(&ctx);
    Xdp::action(pipeline::ingress(&mut p, SCOPE_EXTERNAL))
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
    ipset::tc_verdict(&mut p, &f)
}

/// IPVS mode: KUBE-IPVS-OUT-FILTER for the node's own connections (TCP, connected UDP).
#[cgroup_sock_addr(connect4)]
pub fn kpr_connect4_ipvs(ctx: SockAddrContext) -> i32 {
    sock::ipvs_out_filter(&ctx)
}

/// IPVS mode: the same for unconnected UDP.
#[cgroup_sock_addr(sendmsg4)]
pub fn kpr_sendmsg4_ipvs(ctx: SockAddrContext) -> i32 {
    sock::ipvs_out_filter(&ctx)
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
