//! Connect-time balancing (cgroup sock_addr hooks, as Cilium's socket LB): the socket is
//! pointed at the backend instead of its packets being rewritten. connect4/6 cover TCP and
//! connected UDP, sendmsg4/6 unconnected UDP; recvmsg4/6 and getpeername4/6 show the service
//! address back to the application.
//!
//! - IPv4 Services: only the host network namespace's sockets. The DaemonSet attaches to the
//!   cgroup root, so pods' processes run these hooks too, but a pod's IPv4 packets cross its
//!   interface's TC hook, where the Service's semantics hold per pod (ClientIP affinity keyed by
//!   the pod's address, loadBalancerSourceRanges, traffic policies). Here, the node is the
//!   client. An IPv6 socket reaching an IPv4 Service through an IPv4-mapped address
//!   (::ffff:a.b.c.d, Java's default) is served the same way.
//! - IPv6 Services (ClusterIPs: the only IPv6 frontends eBPF mode programs): every socket, pods'
//!   too, because the TC and XDP fast path does not parse IPv6 yet. A pod is then the client
//!   by its network namespace (its cookie keys ClientIP affinity).
use aya_ebpf::{
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    maps::lpm_trie::Key,
    programs::SockAddrContext,
};
use proxy_common::{
    counter, Backend, DatapathConfig, ServiceKey, SockRevKey, SockRevValue, SourceRangeKey, PROTO_TCP,
    PROTO_UDP, SCOPE_INTERNAL, SVC_F_NO_LOCAL_ENDPOINT, SVC_F_SOURCE_RANGES,
};

use crate::{
    counters::bump,
    lb::{self, Pick},
    maps::{CONFIG, SERVICES, SOCK_REV, SOURCE_RANGES},
    parse::Flow,
    pkt::L4Csum,
};

const ALLOW: i32 = 1;
/// The connect() fails with EPERM: the socket-level form of kube-proxy's REJECT.
const DENY: i32 = 0;

/// The flow a connect-time choice is made for. No source port exists yet: the socket cookie
/// spreads flows for the hash schedulers. `client` keys ClientIP affinity.
#[inline(always)]
fn flow_of(sa: &bpf_sock_addr, client: u32, daddr: u32, cookie: u64) -> Option<Flow> {
    let proto = sa.protocol as u8;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    Some(Flow {
        l4_off: 0,
        ihl_bytes: 0,
        proto,
        tcp_flags: 0,
        saddr: client,
        daddr,
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

enum Choice {
    /// Not a service: the socket goes where it asked.
    Pass,
    /// The connect() (or sendmsg()) fails with EPERM.
    Deny,
    To(Backend),
}

/// The backend for a socket asking for `vip` (the flow's port and protocol), remembered in
/// KPR_SOCK_REV_V1 for the reverse hooks.
#[inline(always)]
fn choose(f: &Flow, vip: [u32; 4], cookie: u64, pick: Pick) -> Choice {
    let key = ServiceKey { addr: vip, port: f.dport, proto: f.proto, scope: SCOPE_INTERNAL };
    let Some(svc) = (unsafe { SERVICES.get(&key) }).copied() else { return Choice::Pass };
    if svc.flags & SVC_F_SOURCE_RANGES != 0 {
        // (IPv4 only: eBPF mode programs no IPv6 LoadBalancer IP.)
        let key = Key::new(64, SourceRangeKey { service_id_be: svc.service_id.to_be(), addr: [f.saddr, 0, 0, 0] });
        if SOURCE_RANGES.get(&key).is_none() {
            bump(counter::DROP_SOURCE_RANGE);
            return Choice::Deny;
        }
    }
    if svc.backend_count == 0 {
        bump(if svc.flags & SVC_F_NO_LOCAL_ENDPOINT != 0 { counter::DROP_NO_LOCAL_ENDPOINT } else { counter::REJECT_NO_BACKEND });
        return Choice::Deny;
    }
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_coarse_ns() };
    let Some((backend_id, be)) = lb::select_backend(&svc, f, now, pick) else {
        bump(counter::MISS_BACKEND);
        return Choice::Deny;
    };
    let key = SockRevKey { cookie, addr: be.addr, port: be.port, _pad: [0; 6] };
    let rev = SockRevValue { addr: vip, port: f.dport, _pad: [0; 6] };
    let _ = SOCK_REV.insert(&key, &rev, 0);
    bump(counter::NEW_FLOW);
    crate::counters::backend_new(backend_id);
    Choice::To(be)
}

/// IPv4 sockets: points the socket at a backend. Denies when the service has no endpoints.
/// `pick`: Pick::Hash at sendmsg (every datagram of an unconnected socket comes here).
#[inline(always)]
pub fn balance(ctx: &SockAddrContext, pick: Pick) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    // A pod's socket: its packets are balanced at its interface.
    if !host_socket(ctx, cfg) {
        return ALLOW;
    }
    let sa = unsafe { &*ctx.sock_addr };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    // The node is the client (its address keys ClientIP affinity).
    let Some(f) = flow_of(sa, cfg.snat_addr[0], sa.user_ip4, cookie) else { return ALLOW };
    match choose(&f, [f.daddr, 0, 0, 0], cookie, pick) {
        Choice::Pass => ALLOW,
        Choice::Deny => DENY,
        Choice::To(be) => {
            unsafe {
                (*ctx.sock_addr).user_ip4 = be.addr[0];
                (*ctx.sock_addr).user_port = u32::from(be.port);
            }
            ALLOW
        }
    }
}

/// Word 2 of an IPv4-mapped IPv6 address (::ffff:a.b.c.d) as it lies in memory.
const V4_MAPPED_WORD2: u32 = u32::from_be(0x0000_ffff);

/// The socket address's IPv6 words. One by one: the verifier allows context loads at
/// constant offsets only, not through a pointer into the context.
#[inline(always)]
fn user_ip6(sa: &bpf_sock_addr) -> [u32; 4] {
    unsafe { [0usize, 1, 2, 3].map(|i| core::ptr::read_volatile(&sa.user_ip6[i])) }
}

/// Points an IPv6 socket address at `addr` (an IPv4 one, word 0, in its IPv4-mapped form).
/// Word by word, at constant offsets, as the verifier wants context stores.
#[inline(always)]
fn set_user_ip6(ctx: &SockAddrContext, mapped: bool, addr: &[u32; 4], port: u16) {
    unsafe {
        if mapped {
            (*ctx.sock_addr).user_ip6[3] = addr[0];
        } else {
            (*ctx.sock_addr).user_ip6[0] = addr[0];
            (*ctx.sock_addr).user_ip6[1] = addr[1];
            (*ctx.sock_addr).user_ip6[2] = addr[2];
            (*ctx.sock_addr).user_ip6[3] = addr[3];
        }
        (*ctx.sock_addr).user_port = u32::from(port);
    }
}

#[inline(always)]
fn is_v4_mapped(ip6: &[u32; 4]) -> bool {
    ip6[0] == 0 && ip6[1] == 0 && ip6[2] == V4_MAPPED_WORD2
}

/// IPv6 sockets: an IPv6 Service (every socket), or an IPv4 Service through an IPv4-mapped
/// address (the node's sockets, as `balance`; connect6 only: the kernel hands an unconnected
/// datagram to a mapped address to sendmsg4).
#[inline(always)]
pub fn balance6(ctx: &SockAddrContext, pick: Pick) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    let sa = unsafe { &*ctx.sock_addr };
    let ip6 = user_ip6(sa);
    let mapped = is_v4_mapped(&ip6);
    // An IPv6 address whose last 96 bits are zero has the wire form of an IPv4 one: the agent
    // programs no such frontend (proxy_common::wire::has_wire_form).
    let v4_form = ip6[1] == 0 && ip6[2] == 0 && ip6[3] == 0;
    if (mapped && !host_socket(ctx, cfg)) || v4_form {
        return ALLOW;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let (client, vip) = if mapped {
        (cfg.snat_addr[0], [ip6[3], 0, 0, 0])
    } else {
        // The socket's network namespace is the client: one pod, or the node.
        let netns = unsafe { bpf_get_netns_cookie(ctx.sock_addr as *mut _) };
        (netns as u32 ^ (netns >> 32) as u32, ip6)
    };
    // (daddr feeds only the flow hash here.)
    let Some(f) = flow_of(sa, client, lb::fold(&vip), cookie) else { return ALLOW };
    match choose(&f, vip, cookie, pick) {
        Choice::Pass => ALLOW,
        Choice::Deny => DENY,
        Choice::To(be) => {
            set_user_ip6(ctx, mapped, &be.addr, be.port);
            ALLOW
        }
    }
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

/// `reverse` for IPv6 sockets (an IPv4-mapped backend is looked up as the IPv4 one it is).
#[inline(always)]
pub fn reverse6(ctx: &SockAddrContext) -> i32 {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let sa = unsafe { &*ctx.sock_addr };
    let ip6 = user_ip6(sa);
    let mapped = is_v4_mapped(&ip6);
    let addr = if mapped { [ip6[3], 0, 0, 0] } else { ip6 };
    let key = SockRevKey { cookie, addr, port: sa.user_port as u16, _pad: [0; 6] };
    if let Some(v) = unsafe { SOCK_REV.get(&key) } {
        set_user_ip6(ctx, mapped, &v.addr, v.port);
        bump(counter::REVERSE_NAT);
    }
    ALLOW
}
