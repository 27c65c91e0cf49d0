//! IPVS mode: kube-proxy's iptables + ipset rules as map lookups. IPVS forwards; this program
//! only decides what kube-proxy's KUBE-SERVICES / KUBE-FIREWALL / KUBE-IPVS-FILTER rules would:
//! set the masquerade mark, drop what a source range forbids, drop VIP traffic to unused ports.
//! A constant set of netfilter rules then masquerades marked packets.
use aya_ebpf::{bindings::TC_ACT_OK, bindings::TC_ACT_SHOT, maps::lpm_trie::Key, programs::SkBuffContext};
use proxy_common::{
    counter, sets, SetAddr, SetIpPort, SetIpPortIp, SetIpPortNet, SetPort, CFG_F_MASQUERADE_ALL, FAMILY_V4, FAMILY_V6, MARK_MASQ,
    PROTO_TCP, SET_IPPN_FIXED_BITS,
};

use crate::{
    counters::bump,
    pkt::{Pkt, Tc},
    reject,
    pipeline::{off_cluster, off_cluster6},
    maps::{CONFIG, SET_IP_PORT_IP, SET_IP_PORT_NET, SET_IP_PORT, SET_IP, SET_PORT},
    parse::{Flow, TCP_ACK, TCP_SYN},
    parse6::{walk_ext_headers, Flow6, L4At, IPV6_HDR_LEN},
};

pub enum SetVerdict {
    Pass,
    Mark,
    /// KUBE-FIREWALL: a source outside loadBalancerSourceRanges (kube-proxy drops).
    Drop,
    /// KUBE-IPVS-FILTER: a new connection to a VIP at a port no service uses (kube-proxy
    /// rejects, and only new ones: `-m conntrack --ctstate NEW`).
    Reject,
}

/// What set matching reads of a packet, either family (an IPv4 address in word 0, the rest
/// zero, as the set keys hold it). Network order.
#[derive(Clone, Copy)]
pub struct SetFlow {
    pub family: u8,
    pub proto: u8,
    pub tcp_flags: u8,
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub dport: u16,
}

impl SetFlow {
    #[inline(always)]
    pub fn v4(f: &Flow) -> Self {
        SetFlow { family: FAMILY_V4, proto: f.proto, tcp_flags: f.tcp_flags, saddr: [f.saddr, 0, 0, 0], daddr: [f.daddr, 0, 0, 0], dport: f.dport }
    }
    #[inline(always)]
    pub fn v6(f: &Flow6) -> Self {
        SetFlow { family: FAMILY_V6, proto: f.proto, tcp_flags: f.tcp_flags, saddr: f.saddr, daddr: f.daddr, dport: f.dport }
    }
    #[inline(always)]
    fn is_new_tcp_syn(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }
}

#[inline(always)]
fn bits_ip_port(k: &SetIpPort) -> u32 {
    unsafe { SET_IP_PORT.get(k) }.copied().unwrap_or(0)
}

#[inline(always)]
fn source_allowed(ipp: SetIpPort, saddr: [u32; 4]) -> bool {
    let ip = unsafe { SET_IP_PORT_IP.get(&SetIpPortIp { ip_port: ipp, addr2: saddr }) }.copied().unwrap_or(0);
    if ip & sets::LOAD_BALANCER_SOURCE_IP != 0 {
        return true;
    }
    SET_IP_PORT_NET.get(&Key::new(SET_IPPN_FIXED_BITS + 128, SetIpPortNet { ip_port: ipp, net: saddr })).is_some()
}

/// What kube-proxy's IPVS-mode rules do with this packet (at PREROUTING), arrived on `ifindex`.
#[inline(always)]
pub fn classify(f: &SetFlow, ifindex: u32) -> SetVerdict {
    let ipp = SetIpPort { addr: f.daddr, port: f.dport, proto: f.proto, family: f.family };
    let bits = bits_ip_port(&ipp);
    if bits != 0 {
        if bits & sets::CLUSTER_IP != 0 {
            let Some(cfg) = CONFIG.get(0) else { return SetVerdict::Pass };
            // KUBE-SERVICES: masqueradeAll, or a client that is not local (detectLocalMode).
            let off = if f.family == FAMILY_V6 { off_cluster6(&f.saddr, ifindex, cfg) } else { off_cluster(f.saddr[0], ifindex, cfg) };
            if cfg.flags & CFG_F_MASQUERADE_ALL != 0 || off {
                return SetVerdict::Mark;
            }
            return SetVerdict::Pass;
        }
        if bits & sets::LOAD_BALANCER != 0 {
            // KUBE-LOAD-BALANCER -> KUBE-FIREWALL for services with source ranges.
            if bits & sets::LOAD_BALANCER_FW != 0 && !source_allowed(ipp, f.saddr) {
                return SetVerdict::Drop;
            }
            return if bits & sets::LOAD_BALANCER_LOCAL != 0 { SetVerdict::Pass } else { SetVerdict::Mark };
        }
        if bits & sets::EXTERNAL_IP != 0 {
            return SetVerdict::Mark;
        }
        return SetVerdict::Pass; // EXTERNAL-IP-LOCAL: source kept
    }
    let ip_bits = unsafe { SET_IP.get(&SetAddr { addr: f.daddr, family: f.family, _pad: [0; 3] }) }.copied().unwrap_or(0);
    if ip_bits == 0 {
        return SetVerdict::Pass;
    }
    let port_bits = unsafe { SET_PORT.get(&SetPort { port: f.dport, proto: f.proto, family: f.family }) }.copied().unwrap_or(0);
    if ip_bits & sets::NODE_IPS != 0 && port_bits & sets::NODE_PORT != 0 {
        // KUBE-NODE-PORT (addrtype LOCAL): Local policy keeps the source.
        return if port_bits & sets::NODE_PORT_LOCAL != 0 { SetVerdict::Pass } else { SetVerdict::Mark };
    }
    if ip_bits & sets::IPVS_IPS != 0 && port_bits & sets::HEALTH_CHECK_NODE_PORT == 0 {
        // KUBE-IPVS-FILTER: a VIP at a port no service uses. New connections only: a TCP
        // packet without SYN belongs to one that was there before (UDP has no such state).
        if f.proto == PROTO_TCP && !f.is_new_tcp_syn() {
            return SetVerdict::Pass;
        }
        return SetVerdict::Reject;
    }
    SetVerdict::Pass
}

/// kube-proxy's IPVS-mode PREROUTING decisions for one packet at TC ingress. `v4` is the IPv4
/// packet's parse (for the ICMP reject); None for IPv6 (an ICMPv6 reject).
#[inline(always)]
pub fn tc_verdict(p: &mut Tc, f: &SetFlow, v4: Option<&Flow>) -> i32 {
    match classify(f, p.ifindex()) {
        SetVerdict::Pass => TC_ACT_OK,
        SetVerdict::Mark => {
            p.or_mark(MARK_MASQ);
            bump(counter::SET_MASQ_MARK);
            TC_ACT_OK
        }
        SetVerdict::Drop => {
            bump(counter::SET_DROP_FIREWALL);
            TC_ACT_SHOT
        }
        SetVerdict::Reject => {
            bump(counter::SET_REJECT_FILTER);
            let reply = match v4 {
                Some(f4) => reject::icmp_port_unreachable(p, f4),
                None => reject::icmp6_port_unreachable(p, f.saddr, f.daddr),
            };
            match reply {
                Some(v) => p.action(v),
                None => TC_ACT_SHOT,
            }
        }
    }
}

/// KUBE-LOOP-BACK (dst,dst,src) on a packet as POSTROUTING sees it (after IPVS's DNAT):
/// an endpoint that reached itself through its service. `ctx` starts at the IP header (IPv4, or
/// IPv6 with the L4 header past up to six extension headers, as the set matching walks them).
#[inline(always)]
pub fn loopback_match(ctx: &SkBuffContext) -> bool {
    let Ok(vihl) = ctx.load::<u8>(0) else { return false };
    let key = match vihl >> 4 {
        4 => {
            let (Ok(proto), Ok(saddr), Ok(daddr)) = (ctx.load::<u8>(9), ctx.load::<u32>(12), ctx.load::<u32>(16)) else { return false };
            if saddr != daddr {
                return false;
            }
            let l4 = ((vihl & 0x0f) as usize) * 4;
            let Ok(dport) = ctx.load::<u16>(l4 + 2) else { return false };
            SetIpPortIp { ip_port: SetIpPort { addr: [daddr, 0, 0, 0], port: dport, proto, family: FAMILY_V4 }, addr2: [saddr, 0, 0, 0] }
        }
        6 => {
            let (Ok(first), Ok(saddr), Ok(daddr)) = (ctx.load::<u8>(6), ctx.load::<[u32; 4]>(8), ctx.load::<[u32; 4]>(24)) else {
                return false;
            };
            if saddr != daddr {
                return false;
            }
            let L4At::Header { next: proto, off } = walk_ext_headers(first, IPV6_HDR_LEN, |off| ctx.load::<[u8; 2]>(off).ok()) else {
                return false;
            };
            let Ok(dport) = ctx.load::<u16>(off + 2) else { return false };
            SetIpPortIp { ip_port: SetIpPort { addr: daddr, port: dport, proto, family: FAMILY_V6 }, addr2: saddr }
        }
        _ => return false,
    };
    unsafe { SET_IP_PORT_IP.get(&key) }.is_some_and(|b| b & sets::LOOP_BACK != 0)
}

/// KUBE-IPVS-OUT-FILTER at connect time: may the node reach this LoadBalancer IP and port?
#[inline(always)]
pub fn node_may_connect(daddr: u32, dport: u16, proto: u8) -> bool {
    bits_ip_port(&SetIpPort { addr: [daddr, 0, 0, 0], port: dport, proto, family: FAMILY_V4 }) & sets::LOAD_BALANCER_NODE_DENY == 0
}

/// The same for an IPv6 address (network order).
#[inline(always)]
pub fn node_may_connect6(daddr: [u32; 4], dport: u16, proto: u8) -> bool {
    bits_ip_port(&SetIpPort { addr: daddr, port: dport, proto, family: FAMILY_V6 }) & sets::LOAD_BALANCER_NODE_DENY == 0
}
