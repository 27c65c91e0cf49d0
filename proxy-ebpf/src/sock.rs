//! Connect-time balancing for the node's own processes (cgroup sock_addr hooks, as Cilium's
//! socket LB in its host-namespace-only mode): their packets never cross a TC ingress hook, so
//! the socket is pointed at the backend instead. connect4 covers TCP and connected UDP,
//! sendmsg4 unconnected UDP; recvmsg4 and getpeername4 show the service address back to the
//! application.
//!
//! Only sockets of the host's network namespace: the DaemonSet attaches to the cgroup root, so
//! pods' processes run these hooks too, but a pod's packets cross its interface's TC hook,
//! where the Service's semantics hold per pod (ClientIP affinity keyed by the pod's address,
//! loadBalancerSourceRanges, traffic policies). Here, the node is the client.
use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    maps::lpm_trie::Key,
    programs::SockAddrContext,
};
use proxy_common::{
    counter, DatapathConfig, SockRevKey, SockRevValue, SourceRangeKey, PROTO_TCP, PROTO_UDP,
    SCOPE_INTERNAL, SVC_F_NO_LOCAL_ENDPOINT, SVC_F_SOURCE_RANGES,
};

use crate::{
    counters::bump,
    lb,
    maps::{CONFIG, SOCK_REV, SOURCE_RANGES},
    parse::Flow,
    pkt::L4Csum,
};

const ALLOW: i32 = 1;
/// The connect() fails with EPERM: the socket-level form of kube-proxy's REJECT.
const DENY: i32 = 0;

#[inline(always)]
fn flow_of(ctx: &SockAddrContext, cookie: u64, cfg: &DatapathConfig) -> Option<Flow> {
    let sa = unsafe { &*ctx.sock_addr };
    let proto = sa.protocol as u8;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    Some(Flow {
        l4_off: 0,
        ihl_bytes: 0,
        proto,
        tcp_flags: 0,
        // The node is the client (its address keys ClientIP affinity).
        saddr: cfg.snat_addr[0],
        daddr: sa.user_ip4,
        // No source port exists yet: the socket cookie spreads flows for the hash schedulers.
        sport: cookie as u16,
        dport: sa.user_port as u16,
        csum: L4Csum { off: 0, udp: false },
    })
}

/// A socket of the host's network namespace (all of them where the agent set no cookie).
#[inline(always)]
fn host_socket(ctx: &SockAddrContext, cfg: &DatapathConfig) -> bool {
    cfg.host_netns_cookie == 0 || unsafe { bpf_get_netns_cookie(ctx.sock_addr as *mut _) } == cfg.host_netns_cookie
}

/// IPVS mode: refuses the node's connections to a LoadBalancer IP its source ranges exclude
/// it from (kube-proxy's KUBE-IPVS-OUT-FILTER drops them in OUTPUT).
#[inline(always)]
pub fn ipvs_out_filter(ctx: &SockAddrContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    let sa = unsafe { &*ctx.sock_addr };
    let proto = sa.protocol as u8;
    if !host_socket(ctx, cfg) || (proto != PROTO_TCP && proto != PROTO_UDP) {
        return ALLOW;
    }
    if crate::ipset::node_may_connect(sa.user_ip4, sa.user_port as u16, proto) {
        ALLOW
    } else {
        bump(counter::SET_DROP_FIREWALL);
        DENY
    }
}

/// `ipvs_out_filter` for the node's IPv6 sockets.
#[inline(always)]
pub fn ipvs_out_filter6(ctx: &SockAddrContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    let sa = unsafe { &*ctx.sock_addr };
    let proto = sa.protocol as u8;
    if !host_socket(ctx, cfg) || (proto != PROTO_TCP && proto != PROTO_UDP) {
        return ALLOW;
    }
    // Word by word: the verifier allows ctx loads at constant offsets only, not through a
    // pointer into the context.
    let ip6 = unsafe { [0usize, 1, 2, 3].map(|i| core::ptr::read_volatile(&sa.user_ip6[i])) };
    if crate::ipset::node_may_connect6(ip6, sa.user_port as u16, proto) {
        ALLOW
    } else {
        bump(counter::SET_DROP_FIREWALL);
        DENY
    }
}

/// Points the socket at a backend. Returns DENY when the service has no endpoints.
#[inline(always)]
pub fn balance(ctx: &SockAddrContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    // A pod's socket: its packets are balanced at its interface.
    if !host_socket(ctx, cfg) {
        return ALLOW;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let Some(f) = flow_of(ctx, cookie, cfg) else { return ALLOW };
    let Some(svc) = lb::lookup_service(&f, SCOPE_INTERNAL) else { return ALLOW };
    if svc.flags & SVC_F_SOURCE_RANGES != 0 {
        let key = Key::new(64, SourceRangeKey { service_id_be: svc.service_id.to_be(), addr: [f.saddr, 0, 0, 0] });
        if SOURCE_RANGES.get(&key).is_none() {
            bump(counter::DROP_SOURCE_RANGE);
            return DENY;
        }
    }
    if svc.backend_count == 0 {
        bump(if svc.flags & SVC_F_NO_LOCAL_ENDPOINT != 0 { counter::DROP_NO_LOCAL_ENDPOINT } else { counter::REJECT_NO_BACKEND });
        return DENY;
    }
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_coarse_ns() };
    let Some((backend_id, be)) = lb::select_backend(&svc, &f, now) else {
        bump(counter::MISS_BACKEND);
        return DENY;
    };
    let key = SockRevKey { cookie, addr: be.addr, port: be.port, _pad: [0; 6] };
    let rev = SockRevValue { addr: [f.daddr, 0, 0, 0], port: f.dport, _pad: [0; 6] };
    let _ = SOCK_REV.insert(&key, &rev, 0);
    unsafe {
        (*ctx.sock_addr).user_ip4 = be.addr[0];
        (*ctx.sock_addr).user_port = u32::from(be.port);
    }
    bump(counter::NEW_FLOW);
    crate::counters::backend_new(backend_id);
    ALLOW
}

/// Shows the service address instead of the backend's (recvmsg, getpeername).
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let sa = unsafe { &*ctx.sock_addr };
    let key = SockRevKey { cookie, addr: [sa.user_ip4, 0, 0, 0], port: sa.user_port as u16, _pad: [0; 6] };
    if let Some(v) = unsafe { SOCK_REV.get(&key) } {
        unsafe {
            (*ctx.sock_addr).user_ip4 = v.addr[0];
            (*ctx.sock_addr).user_port = u32::from(v.port);
        }
        bump(counter::REVERSE_NAT);
    }
    ALLOW
}
