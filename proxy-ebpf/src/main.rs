//! kpr's kernel programs: thin hook wrappers around one pipeline (pipeline.rs), each exported
//! under its name in proxy-common's list (`program!`).
//! - `kpr_xdp_ingress` on the node's uplinks: north-south traffic (NodePort, ExternalIP, LB IP)
//!   and replies from other nodes;
//! - `kpr_tc_ingress` (clsact ingress) on the node side of pod interfaces and on tunnel devices:
//!   east-west traffic and the replies of local backends;
//! - `kpr_tc_egress` on all of them: masquerade and the replies' reverse DNAT, after netfilter;
//! - `kpr_tc_ingress6` on the uplinks: IPv6 traffic from outside to the node's IPv6 NodePorts,
//!   externalIPs and LB IPs (pipeline6.rs; its replies take `kpr_tc_egress`);
//! - connect-time programs: the node's own processes, and IPv6 Services for every socket (sock.rs);
//! - IPVS mode's set matching (ipset.rs).
//!
//! `kpr_tc_pass` / `kpr_xdp_pass` only return "pass": the floor the benchmark compares against.
#![no_std]
#![feature(core_intrinsics)]
#![allow(internal_features)]
#![no_main]

mod conntrack;
mod conntrack6;
mod counters;
mod csum;
mod embryonic;
mod flowcache;
mod hint;
mod icmp;
mod icmp6;
mod ipset;
mod lb;
mod maps;
mod nat;
mod parse;
mod parse6;
mod pipeline;
mod pipeline6;
mod pkt;
mod reject;
mod rewrite;
mod sock;

use aya_ebpf::{
    bindings::{__sk_buff, bpf_sock_addr, xdp_action, xdp_md, TC_ACT_OK},
    programs::{SkBuffContext, SockAddrContext, TcContext, XdpContext},
};
use proxy_common::{SCOPE_EXTERNAL, SCOPE_INTERNAL};

use lb::Pick;
use parse::Parsed;
use pkt::{Pkt, Tc, Xdp};

/// What aya's program attributes do, with the symbol from proxy-common's list
/// (`prog_name!(ROLE)`), the name the agent loads the program by.
macro_rules! program {
    ($section:literal $role:ident: fn $name:ident($ctx:ident: $ty:ident, $raw:ty) -> $ret:ty $body:block) => {
        #[unsafe(export_name = proxy_common::prog_name!($role))]
        #[unsafe(link_section = $section)]
        pub fn $name(raw: *mut $raw) -> $ret {
            return run($ty::new(raw));

            #[allow(unused_mut)]
            fn run(mut $ctx: $ty) -> $ret $body
        }
    };
}

program!("classifier" TC_INGRESS: fn tc_ingress(ctx: TcContext, __sk_buff) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    let v = pipeline::ingress(&mut p, SCOPE_INTERNAL);
    p.action(v)
});

program!("classifier" TC_EGRESS: fn tc_egress(ctx: TcContext, __sk_buff) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    let v = if p.load::<u16>(12) == Some(parse6::ETH_P_IPV6_BE) { egress6(&mut p) } else { egress4(&mut p) };
    p.action(v)
});

/// Each family's egress is a subprogram: the two frames are siblings, never added up (Linux
/// 6.1 counts a call chain's frames against 512 bytes).
#[inline(never)]
fn egress4(p: &mut Tc) -> pkt::Verdict {
    pipeline::egress(p)
}

#[inline(never)]
fn egress6(p: &mut Tc) -> pkt::Verdict {
    p.pull_headers_to(pkt::HEADERS6_MAX);
    // TC egress is the fast path's alone: what is not its own passes, as for IPv4.
    match pipeline6::egress(p) {
        pkt::Verdict::Next => pkt::Verdict::Pass,
        v => v,
    }
}

program!("classifier" TC_INGRESS6: fn tc_ingress6(ctx: TcContext, __sk_buff) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers_to(pkt::HEADERS6_MAX);
    let v = pipeline6::ingress(&mut p);
    p.action(v)
});

program!("xdp" XDP_INGRESS: fn xdp_ingress(ctx: XdpContext, xdp_md) -> u32 {
    let mut p = Xdp(&ctx);
    Xdp::action(pipeline::ingress(&mut p, SCOPE_EXTERNAL))
});

// The same at TC ingress (an uplink without native XDP). XDP_PASS lets the hook's TC programs
// run; so does this: what it passes goes on to the next one (IPv6's, IPVS mode's during a
// switch), not straight to the stack.
program!("classifier" TC_UPLINK: fn tc_uplink(ctx: TcContext, __sk_buff) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    let v = match pipeline::ingress(&mut p, SCOPE_EXTERNAL) {
        pkt::Verdict::Pass => pkt::Verdict::Next,
        v => v,
    };
    p.action(v)
});

program!("cgroup/connect4" CONNECT4: fn connect4(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::balance(&ctx, Pick::Scheduler)
});

program!("cgroup/sendmsg4" SENDMSG4: fn sendmsg4(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::balance(&ctx, Pick::Hash)
});

program!("cgroup/recvmsg4" RECVMSG4: fn recvmsg4(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::reverse(&ctx)
});

program!("cgroup/getpeername4" GETPEERNAME4: fn getpeername4(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::reverse(&ctx)
});

program!("cgroup/connect6" CONNECT6: fn connect6(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::balance6(&ctx, Pick::Scheduler)
});

program!("cgroup/sendmsg6" SENDMSG6: fn sendmsg6(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::balance6(&ctx, Pick::Hash)
});

program!("cgroup/recvmsg6" RECVMSG6: fn recvmsg6(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::reverse6(&ctx)
});

program!("cgroup/getpeername6" GETPEERNAME6: fn getpeername6(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::reverse6(&ctx)
});

// IPVS mode: kube-proxy's set matching (masquerade mark, source-range firewall, VIP filter).
program!("classifier" TC_IPSET: fn tc_ipset(ctx: TcContext, __sk_buff) -> i32 {
    let mut p = Tc(&mut ctx);
    p.pull_headers();
    match parse::parse_with_sctp(&mut p) {
        Parsed::Flow(f) => ipset::tc_verdict(&mut p, &ipset::SetFlow::v4(&f), Some(&f)),
        Parsed::Other => match parse6::parse(&p) {
            parse6::Parsed6::Flow(f) => ipset::tc_verdict(&mut p, &ipset::SetFlow::v6(&f), None),
            _ => TC_ACT_OK as i32,
        },
        _ => TC_ACT_OK as i32,
    }
});

// IPVS mode: KUBE-IPVS-OUT-FILTER for the node's own connections (TCP, connected UDP).
program!("cgroup/connect4" CONNECT4_IPVS: fn connect4_ipvs(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::ipvs_out_filter(&ctx)
});

// IPVS mode: the same for unconnected UDP.
program!("cgroup/sendmsg4" SENDMSG4_IPVS: fn sendmsg4_ipvs(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::ipvs_out_filter(&ctx)
});

// IPVS mode: KUBE-IPVS-OUT-FILTER for the node's IPv6 sockets.
program!("cgroup/connect6" CONNECT6_IPVS: fn connect6_ipvs(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::ipvs_out_filter6(&ctx)
});

program!("cgroup/sendmsg6" SENDMSG6_IPVS: fn sendmsg6_ipvs(ctx: SockAddrContext, bpf_sock_addr) -> i32 {
    sock::ipvs_out_filter6(&ctx)
});

// IPVS mode: KUBE-LOOP-BACK as an xt_bpf match (non-zero: the packet is in the set).
program!("socket" LOOPBACK: fn loopback(ctx: SkBuffContext, __sk_buff) -> i64 {
    ipset::loopback_match(&ctx) as i64
});

program!("classifier" TC_PASS: fn tc_pass(_ctx: TcContext, __sk_buff) -> i32 {
    TC_ACT_OK as i32
});

program!("xdp" XDP_PASS: fn xdp_pass(_ctx: XdpContext, xdp_md) -> u32 {
    xdp_action::XDP_PASS
});

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// The kernel's view of the programs' license: the GPL-2.0 side of their dual license
/// (Apache-2.0 OR GPL-2.0-only; LICENSE-GPL-2.0 here, LICENSE at the root), which the
/// GPL-only helpers require.
#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 4] = *b"GPL\0";
