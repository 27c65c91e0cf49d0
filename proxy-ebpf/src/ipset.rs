//! IPVS mode: kube-proxy's iptables + ipset rules as map lookups. IPVS forwards; this program
//! only decides what kube-proxy's KUBE-SERVICES / KUBE-FIREWALL / KUBE-IPVS-FILTER rules would:
//! set the masquerade mark, drop what a source range forbids, drop VIP traffic to unused ports.
//! A constant set of netfilter rules then masquerades marked packets.
use aya_ebpf::{bindings::TC_ACT_OK, bindings::TC_ACT_SHOT, maps::lpm_trie::Key, programs::SkBuffContext};
use proxy_common::{
    counter, sets, SetIpPort, SetIpPortIp, SetIpPortNet, SetPort, CFG_F_MASQUERADE_ALL, MARK_MASQ,
};

use crate::{
    counters::bump,
    pipeline::in_cluster_cidr,
    maps::{KPR_CFG_V2, KPR_SET_IPPI_V1, KPR_SET_IPPN_V1, KPR_SET_IPP_V1, KPR_SET_IP_V1, KPR_SET_PORT_V1},
    parse::Flow,
};

pub enum SetVerdict {
    Pass,
    Mark,
    Drop,
}

#[inline(always)]
fn bits_ip_port(k: &SetIpPort) -> u32 {
    unsafe { KPR_SET_IPP_V1.get(k) }.copied().unwrap_or(0)
}

#[inline(always)]
fn source_allowed(ipp: SetIpPort, saddr: u32) -> bool {
    let ip = unsafe { KPR_SET_IPPI_V1.get(&SetIpPortIp { ip_port: ipp, addr2: saddr }) }.copied().unwrap_or(0);
    if ip & sets::LOAD_BALANCER_SOURCE_IP != 0 {
        return true;
    }
    KPR_SET_IPPN_V1.get(&Key::new(96, SetIpPortNet { ip_port: ipp, net: saddr })).is_some()
}

/// What kube-proxy's IPVS-mode rules do with this packet (at PREROUTING).
#[inline(always)]
pub fn classify(f: &Flow) -> SetVerdict {
    let ipp = SetIpPort { addr: f.daddr, port: f.dport, proto: f.proto, _pad: 0 };
    let bits = bits_ip_port(&ipp);
    if bits != 0 {
        if bits & sets::CLUSTER_IP != 0 {
            let Some(cfg) = KPR_CFG_V2.get(0) else { return SetVerdict::Pass };
            // KUBE-SERVICES: masqueradeAll, or `! -s clusterCIDR`.
            let off_cluster = cfg.cluster_cidr_len != 0 && !in_cluster_cidr(f.saddr, cfg);
            if cfg.flags & CFG_F_MASQUERADE_ALL != 0 || off_cluster {
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
    let ip_bits = unsafe { KPR_SET_IP_V1.get(&f.daddr) }.copied().unwrap_or(0);
    if ip_bits == 0 {
        return SetVerdict::Pass;
    }
    let port_bits = unsafe { KPR_SET_PORT_V1.get(&SetPort { port: f.dport, proto: f.proto, _pad: 0 }) }.copied().unwrap_or(0);
    if ip_bits & sets::NODE_IPS != 0 && port_bits & sets::NODE_PORT != 0 {
        // KUBE-NODE-PORT (addrtype LOCAL): Local policy keeps the source.
        return if port_bits & sets::NODE_PORT_LOCAL != 0 { SetVerdict::Pass } else { SetVerdict::Mark };
    }
    if ip_bits & sets::IPVS_IPS != 0 && port_bits & sets::HEALTH_CHECK_NODE_PORT == 0 {
        // KUBE-IPVS-FILTER: a VIP at a port no service uses.
        return SetVerdict::Drop;
    }
    SetVerdict::Pass
}

#[inline(always)]
pub fn tc_verdict(f: &Flow, mark: &mut u32) -> i32 {
    match classify(f) {
        SetVerdict::Pass => TC_ACT_OK,
        SetVerdict::Mark => {
            *mark |= MARK_MASQ;
            bump(counter::SET_MASQ_MARK);
            TC_ACT_OK
        }
        SetVerdict::Drop => {
            let fw = bits_ip_port(&SetIpPort { addr: f.daddr, port: f.dport, proto: f.proto, _pad: 0 }) != 0;
            bump(if fw { counter::SET_DROP_FIREWALL } else { counter::SET_DROP_FILTER });
            TC_ACT_SHOT
        }
    }
}

/// KUBE-LOOP-BACK (dst,dst,src) on a packet as POSTROUTING sees it (after IPVS's DNAT):
/// an endpoint that reached itself through its service. `ctx` starts at the IPv4 header.
#[inline(always)]
pub fn loopback_match(ctx: &SkBuffContext) -> bool {
    let Ok(vihl) = ctx.load::<u8>(0) else { return false };
    if vihl >> 4 != 4 {
        return false;
    }
    let (Ok(proto), Ok(saddr), Ok(daddr)) = (ctx.load::<u8>(9), ctx.load::<u32>(12), ctx.load::<u32>(16)) else { return false };
    if saddr != daddr {
        return false;
    }
    let l4 = ((vihl & 0x0f) as usize) * 4;
    let Ok(dport) = ctx.load::<u16>(l4 + 2) else { return false };
    let key = SetIpPortIp { ip_port: SetIpPort { addr: daddr, port: dport, proto, _pad: 0 }, addr2: saddr };
    unsafe { KPR_SET_IPPI_V1.get(&key) }.is_some_and(|b| b & sets::LOOP_BACK != 0)
}
