//! IPVS mode's replacement for kube-proxy's ipsets: the same set semantics, held in BPF maps
//! (one bit per set in each map's value) and matched by `kpr_tc_ipset`. Computed from the
//! desired state, synced by difference, and listed back in `ipset list` style by `kpr ipset`.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::Path,
};

use aya::maps::{lpm_trie::Key, HashMap, LpmTrie, MapData};
use proxy_common::{map_names, sets, SetAddr, SetIpPort, SetIpPortIp, SetIpPortNet, SetPort, FAMILY_V4, SET_IPPN_FIXED_BITS};
use serde::Serialize;

use crate::{
    dataplane::ebpf::kernel_maps::{collect, del, op, open_typed},
    dataplane::ebpf::maps::MapError,
    dataplane::ipvs::desired::ipvs_frontends,
    model::{DesiredState, FrontendKind},
};

/// One member of one of the maps (the map is implied by the variant).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Entry {
    IpPort(SetIpPort),
    IpPortIp(SetIpPortIp),
    /// The source CIDR's prefix length beside the key.
    IpPortNet(SetIpPortNet, u8),
    Port(SetPort),
    Ip(SetAddr),
}

impl Entry {
    /// Whether it belongs to the IPv4 sets (kube-proxy's KUBE-*) or the IPv6 ones (KUBE-6-*).
    fn is_v4(&self) -> bool {
        let family = match self {
            Entry::IpPort(k) => k.family,
            Entry::IpPortIp(k) => k.ip_port.family,
            Entry::IpPortNet(k, _) => k.ip_port.family,
            Entry::Port(k) => k.family,
            Entry::Ip(k) => k.family,
        };
        family == FAMILY_V4
    }
}

/// Entry -> set bits.
pub type Sets = BTreeMap<Entry, u32>;

fn proto_name(p: u8) -> &'static str {
    proxy_common::Protocol::from_number(p).map_or("?", |p| p.lower())
}

/// The sets for `desired`, both families: `node_addrs` are this node's addresses, `bound` the
/// VIPs on kube-ipvs0.
pub fn compute(desired: &DesiredState, node_addrs: &[IpAddr], bound: &BTreeSet<IpAddr>) -> Sets {
    let mut s = Sets::new();
    let mut add = |e: Entry, bit: u32| *s.entry(e).or_insert(0) |= bit;
    for (k, fe) in ipvs_frontends(desired) {
        let v4 = k.ip.is_ipv4();
        let proto = k.proto.number();
        let ipp = Entry::IpPort(SetIpPort::new(k.ip, k.port, proto));
        let local = fe.preserve_source;
        match fe.kind {
            FrontendKind::ClusterIp => add(ipp, sets::CLUSTER_IP),
            FrontendKind::ExternalIp => add(ipp, if local { sets::EXTERNAL_IP_LOCAL } else { sets::EXTERNAL_IP }),
            FrontendKind::LoadBalancer => {
                add(ipp, sets::LOAD_BALANCER | if local { sets::LOAD_BALANCER_LOCAL } else { 0 });
                if !fe.source_ranges.is_empty() {
                    add(ipp, sets::LOAD_BALANCER_FW);
                    // KUBE-IPVS-OUT-FILTER: the node itself may not reach it, unless a range
                    // holds one of its addresses.
                    if !node_addrs.iter().any(|a| fe.source_ranges.iter().any(|n| n.contains(a))) {
                        add(ipp, sets::LOAD_BALANCER_NODE_DENY);
                    }
                    for net in fe.source_ranges.iter().filter(|n| n.addr().is_ipv4() == v4) {
                        add(Entry::IpPortNet(SetIpPortNet::new(k.ip, k.port, proto, net.network()), net.prefix_len()), sets::LOAD_BALANCER_SOURCE_CIDR);
                    }
                    // The service's own endpoints may reach it through the LB (hairpin).
                    for b in fe.backends.iter() {
                        add(Entry::IpPortIp(SetIpPortIp::new(k.ip, k.port, proto, b.ip)), sets::LOAD_BALANCER_SOURCE_IP);
                    }
                }
            }
            FrontendKind::NodePort => add(Entry::Port(SetPort::new(k.port, proto, v4)), sets::NODE_PORT | if local { sets::NODE_PORT_LOCAL } else { 0 }),
        }
        for b in fe.backends.iter().filter(|b| b.ip.is_ipv4() == v4) {
            add(Entry::IpPortIp(SetIpPortIp::new(b.ip, b.port, proto, b.ip)), sets::LOOP_BACK);
        }
    }
    // The health check server answers on every address, of either family.
    let families = if node_addrs.iter().chain(bound).any(IpAddr::is_ipv6) { &[true, false][..] } else { &[true][..] };
    for port in desired.health_checks.keys() {
        for v4 in families {
            add(Entry::Port(SetPort::new(*port, proxy_common::PROTO_TCP, *v4)), sets::HEALTH_CHECK_NODE_PORT);
        }
    }
    for a in bound {
        add(Entry::Ip(SetAddr::new(*a)), sets::IPVS_IPS);
    }
    for a in node_addrs {
        add(Entry::Ip(SetAddr::new(*a)), sets::NODE_IPS);
    }
    s
}

pub trait SetMaps {
    fn read(&self) -> Result<Sets, MapError>;
    fn put(&mut self, e: &Entry, bits: u32) -> Result<(), MapError>;
    fn del(&mut self, e: &Entry) -> Result<(), MapError>;
}

#[derive(Default, Debug)]
pub struct FakeSetMaps(pub Sets);

impl SetMaps for FakeSetMaps {
    fn read(&self) -> Result<Sets, MapError> {
        Ok(self.0.clone())
    }
    fn put(&mut self, e: &Entry, bits: u32) -> Result<(), MapError> {
        self.0.insert(*e, bits);
        Ok(())
    }
    fn del(&mut self, e: &Entry) -> Result<(), MapError> {
        self.0.remove(e);
        Ok(())
    }
}

/// Writes the difference from what the maps hold; returns (writes, deletes).
pub fn sync(maps: &mut dyn SetMaps, want: &Sets) -> Result<(usize, usize), MapError> {
    let have = maps.read()?;
    sync_from(maps, &have, want)
}

/// Writes the difference from `have`, what the maps are known to hold (the last sync's
/// result: an incremental sync does not re-read every map).
pub fn sync_from(maps: &mut dyn SetMaps, have: &Sets, want: &Sets) -> Result<(usize, usize), MapError> {
    let (mut w, mut d) = (0, 0);
    for (e, bits) in want {
        if have.get(e) != Some(bits) {
            maps.put(e, *bits)?;
            w += 1;
        }
    }
    for e in have.keys().filter(|e| !want.contains_key(e)) {
        maps.del(e)?;
        d += 1;
    }
    Ok((w, d))
}

pub struct KernelSetMaps {
    ip_port: HashMap<MapData, SetIpPort, u32>,
    ip_port_ip: HashMap<MapData, SetIpPortIp, u32>,
    ip_port_net: LpmTrie<MapData, SetIpPortNet, u32>,
    port: HashMap<MapData, SetPort, u32>,
    ip: HashMap<MapData, SetAddr, u32>,
}

impl KernelSetMaps {
    pub fn open(pin_dir: &Path) -> Result<Self, MapError> {
        Ok(Self {
            ip_port: open_typed(pin_dir, map_names::SET_IP_PORT)?,
            ip_port_ip: open_typed(pin_dir, map_names::SET_IP_PORT_IP)?,
            ip_port_net: open_typed(pin_dir, map_names::SET_IP_PORT_NET)?,
            port: open_typed(pin_dir, map_names::SET_PORT)?,
            ip: open_typed(pin_dir, map_names::SET_IP)?,
        })
    }
}

impl SetMaps for KernelSetMaps {
    fn read(&self) -> Result<Sets, MapError> {
        let mut s = Sets::new();
        s.extend(collect(map_names::SET_IP_PORT, self.ip_port.iter())?.into_iter().map(|(k, v)| (Entry::IpPort(k), v)));
        s.extend(collect(map_names::SET_IP_PORT_IP, self.ip_port_ip.iter())?.into_iter().map(|(k, v)| (Entry::IpPortIp(k), v)));
        s.extend(
            collect(map_names::SET_IP_PORT_NET, self.ip_port_net.iter())?
                .into_iter()
                .map(|(k, v)| (Entry::IpPortNet(k.data(), k.prefix_len().saturating_sub(SET_IPPN_FIXED_BITS) as u8), v)),
        );
        s.extend(collect(map_names::SET_PORT, self.port.iter())?.into_iter().map(|(k, v)| (Entry::Port(k), v)));
        s.extend(collect(map_names::SET_IP, self.ip.iter())?.into_iter().map(|(k, v)| (Entry::Ip(k), v)));
        Ok(s)
    }
    fn put(&mut self, e: &Entry, bits: u32) -> Result<(), MapError> {
        match e {
            Entry::IpPort(k) => self.ip_port.insert(k, bits, 0).map_err(|e| op(map_names::SET_IP_PORT, "update", e)),
            Entry::IpPortIp(k) => self.ip_port_ip.insert(k, bits, 0).map_err(|e| op(map_names::SET_IP_PORT_IP, "update", e)),
            Entry::IpPortNet(k, len) => {
                self.ip_port_net.insert(&Key::new(SET_IPPN_FIXED_BITS + u32::from(*len), *k), bits, 0).map_err(|e| op(map_names::SET_IP_PORT_NET, "update", e))
            }
            Entry::Port(k) => self.port.insert(k, bits, 0).map_err(|e| op(map_names::SET_PORT, "update", e)),
            Entry::Ip(k) => self.ip.insert(k, bits, 0).map_err(|e| op(map_names::SET_IP, "update", e)),
        }
    }
    fn del(&mut self, e: &Entry) -> Result<(), MapError> {
        match e {
            Entry::IpPort(k) => del(map_names::SET_IP_PORT, self.ip_port.remove(k)),
            Entry::IpPortIp(k) => del(map_names::SET_IP_PORT_IP, self.ip_port_ip.remove(k)),
            Entry::IpPortNet(k, len) => del(map_names::SET_IP_PORT_NET, self.ip_port_net.remove(&Key::new(SET_IPPN_FIXED_BITS + u32::from(*len), *k))),
            Entry::Port(k) => del(map_names::SET_PORT, self.port.remove(k)),
            Entry::Ip(k) => del(map_names::SET_IP, self.ip.remove(k)),
        }
    }
}

/// One set as `ipset list` shows it.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct SetListing {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub members: Vec<String>,
}

/// kube-proxy's set names and types, with the members the maps hold, in kube-proxy's order:
/// the IPv4 sets, then (where the node has IPv6 members) the IPv6 ones, named KUBE-6-* as
/// kube-proxy's IPv6 proxier names them.
pub fn listing(s: &Sets) -> Vec<SetListing> {
    let mut out = listing_of(s, true);
    if s.keys().any(|e| !e.is_v4()) {
        out.extend(listing_of(s, false));
    }
    out
}

fn listing_of(s: &Sets, v4: bool) -> Vec<SetListing> {
    let mut out: Vec<SetListing> = Vec::new();
    let mut push = |name: &str, kind: &'static str, members: Vec<String>| {
        let name = if v4 { name.to_string() } else { name.replacen("KUBE-", "KUBE-6-", 1).replacen("KPR-", "KPR-6-", 1) };
        out.push(SetListing { name, kind, members })
    };
    let ours = || s.iter().filter(move |(e, _)| e.is_v4() == v4);
    let ip_port = |bit: u32| -> Vec<String> {
        ours()
            .filter_map(|(e, b)| match e {
                Entry::IpPort(k) if b & bit != 0 => Some(format!("{},{}:{}", k.addr(), proto_name(k.proto), k.port())),
                _ => None,
            })
            .collect()
    };
    let ip_port_ip = |bit: u32| -> Vec<String> {
        ours()
            .filter_map(|(e, b)| match e {
                Entry::IpPortIp(k) if b & bit != 0 => Some(format!("{},{}:{},{}", k.ip_port.addr(), proto_name(k.ip_port.proto), k.ip_port.port(), k.addr2())),
                _ => None,
            })
            .collect()
    };
    let ports = |bit: u32, proto: u8| -> Vec<String> {
        ours()
            .filter_map(|(e, b)| match e {
                Entry::Port(k) if b & bit != 0 && k.proto == proto => Some(k.port().to_string()),
                _ => None,
            })
            .collect()
    };
    let ips = |bit: u32| -> Vec<String> {
        ours()
            .filter_map(|(e, b)| match e {
                Entry::Ip(k) if b & bit != 0 => Some(k.ip().to_string()),
                _ => None,
            })
            .collect()
    };
    push("KUBE-CLUSTER-IP", "hash:ip,port", ip_port(sets::CLUSTER_IP));
    push("KUBE-LOOP-BACK", "hash:ip,port,ip", ip_port_ip(sets::LOOP_BACK));
    push("KUBE-EXTERNAL-IP", "hash:ip,port", ip_port(sets::EXTERNAL_IP));
    push("KUBE-EXTERNAL-IP-LOCAL", "hash:ip,port", ip_port(sets::EXTERNAL_IP_LOCAL));
    push("KUBE-LOAD-BALANCER", "hash:ip,port", ip_port(sets::LOAD_BALANCER));
    push("KUBE-LOAD-BALANCER-LOCAL", "hash:ip,port", ip_port(sets::LOAD_BALANCER_LOCAL));
    push("KUBE-LOAD-BALANCER-FW", "hash:ip,port", ip_port(sets::LOAD_BALANCER_FW));
    push("KUBE-LOAD-BALANCER-SOURCE-IP", "hash:ip,port,ip", ip_port_ip(sets::LOAD_BALANCER_SOURCE_IP));
    let cidrs = ours()
        .filter_map(|(e, b)| match e {
            Entry::IpPortNet(k, len) if b & sets::LOAD_BALANCER_SOURCE_CIDR != 0 => {
                Some(format!("{},{}:{},{}/{len}", k.ip_port.addr(), proto_name(k.ip_port.proto), k.ip_port.port(), k.net()))
            }
            _ => None,
        })
        .collect();
    push("KUBE-LOAD-BALANCER-SOURCE-CIDR", "hash:ip,port,net", cidrs);
    for proto in proxy_common::Protocol::ALL {
        if proto == proxy_common::Protocol::Sctp {
            // kube-proxy keeps SCTP NodePorts per node address (hash:ip,port): the same
            // entries, crossed with KPR-NODE-IPS.
            let per_ip = |bit: u32| -> Vec<String> {
                let node_ips = ips(sets::NODE_IPS);
                ports(bit, proto.number()).iter().flat_map(|p| node_ips.iter().map(move |ip| format!("{ip},sctp:{p}"))).collect()
            };
            push("KUBE-NODE-PORT-SCTP-HASH", "hash:ip,port", per_ip(sets::NODE_PORT));
            push("KUBE-NODE-PORT-LOCAL-SCTP-HASH", "hash:ip,port", per_ip(sets::NODE_PORT_LOCAL));
            continue;
        }
        push(&format!("KUBE-NODE-PORT-{}", proto.name()), "bitmap:port", ports(sets::NODE_PORT, proto.number()));
        push(&format!("KUBE-NODE-PORT-LOCAL-{}", proto.name()), "bitmap:port", ports(sets::NODE_PORT_LOCAL, proto.number()));
    }
    push("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port", ports(sets::HEALTH_CHECK_NODE_PORT, proxy_common::PROTO_TCP));
    push("KUBE-IPVS-IPS", "hash:ip", ips(sets::IPVS_IPS));
    push("KPR-NODE-IPS", "hash:ip", ips(sets::NODE_IPS));
    // What kube-proxy writes as KUBE-IPVS-OUT-FILTER rules, as a set.
    push("KPR-LOAD-BALANCER-NODE-DENY", "hash:ip,port", ip_port(sets::LOAD_BALANCER_NODE_DENY));
    out
}

/// `ipset list`'s layout.
pub fn render(sets: &[SetListing]) -> String {
    let mut o = String::new();
    for s in sets {
        o += &format!("Name: {}\nType: {}\nNumber of entries: {}\nMembers:\n", s.name, s.kind, s.members.len());
        for m in &s.members {
            o += m;
            o.push('\n');
        }
        o.push('\n');
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frontend, FrontendKey, Protocol, Scope};

    /// `local`: externalTrafficPolicy Local (the client address kept); else masqueraded.
    fn fe(kind: FrontendKind, local: bool, ranges: &[&str]) -> Frontend {
        Frontend {
            service: "ns/s:p".into(),
            masquerade: !local && kind != FrontendKind::ClusterIp,
            preserve_source: local,
            source_ranges: ranges.iter().map(|r| r.parse().unwrap()).collect(),
            ..Frontend::for_test(kind, &[("10.244.1.2", 8080)], Protocol::Tcp)
        }
    }

    #[test]
    fn sets_follow_kube_proxy_and_sync_by_difference() {
        let mut d = DesiredState::default();
        let k = |ip: &str, port, scope| FrontendKey { ip: ip.parse().unwrap(), port, proto: Protocol::Tcp, scope };
        d.frontends.insert(k("10.96.0.1", 80, Scope::Internal), fe(FrontendKind::ClusterIp, false, &[]));
        d.frontends.insert(k("10.96.0.1", 80, Scope::External), fe(FrontendKind::ClusterIp, false, &[]));
        d.frontends.insert(k("198.18.0.1", 30080, Scope::External), fe(FrontendKind::NodePort, true, &[]));
        d.frontends.insert(k("192.0.2.10", 80, Scope::External), fe(FrontendKind::LoadBalancer, false, &["203.0.113.0/24"]));
        d.frontends.insert(k("192.0.2.20", 80, Scope::External), fe(FrontendKind::ExternalIp, false, &[]));
        // A range holding the node's address: the node may reach it.
        d.frontends.insert(k("192.0.2.11", 80, Scope::External), fe(FrontendKind::LoadBalancer, false, &["198.18.0.0/24"]));
        d.health_checks.insert(32000, ("ns".into(), "s".into(), 1));
        let bound: BTreeSet<IpAddr> = ["10.96.0.1", "192.0.2.10", "192.0.2.20"].iter().map(|a| a.parse().unwrap()).collect();
        let want = compute(&d, &["198.18.0.1".parse().unwrap()], &bound);
        let list = listing(&want);
        let members = |name: &str| list.iter().find(|s| s.name == name).unwrap().members.clone();
        assert_eq!(members("KUBE-CLUSTER-IP"), vec!["10.96.0.1,tcp:80"]);
        assert_eq!(members("KUBE-LOOP-BACK"), vec!["10.244.1.2,tcp:8080,10.244.1.2"]);
        assert_eq!(members("KUBE-EXTERNAL-IP"), vec!["192.0.2.20,tcp:80"]);
        assert_eq!(members("KUBE-LOAD-BALANCER-FW"), vec!["192.0.2.10,tcp:80", "192.0.2.11,tcp:80"]);
        assert_eq!(members("KPR-LOAD-BALANCER-NODE-DENY"), vec!["192.0.2.10,tcp:80"], "no range holds the node's 198.18.0.1");
        assert_eq!(members("KUBE-LOAD-BALANCER-SOURCE-CIDR"), vec!["192.0.2.10,tcp:80,203.0.113.0/24", "192.0.2.11,tcp:80,198.18.0.0/24"]);
        assert_eq!(members("KUBE-LOAD-BALANCER-SOURCE-IP"), vec!["192.0.2.10,tcp:80,10.244.1.2", "192.0.2.11,tcp:80,10.244.1.2"]);
        assert!(members("KUBE-LOAD-BALANCER-LOCAL").is_empty());
        assert_eq!(members("KUBE-NODE-PORT-TCP"), vec!["30080"]);
        assert_eq!(members("KUBE-NODE-PORT-LOCAL-TCP"), vec!["30080"]);
        assert_eq!(members("KUBE-HEALTH-CHECK-NODE-PORT"), vec!["32000"]);
        assert_eq!(members("KUBE-IPVS-IPS").len(), 3);
        let mut maps = FakeSetMaps::default();
        let (w, _) = sync(&mut maps, &want).unwrap();
        assert_eq!(w, want.len());
        assert_eq!(sync(&mut maps, &want).unwrap(), (0, 0));
        d.frontends.retain(|_, f| f.kind != FrontendKind::ExternalIp);
        let fewer = compute(&d, &["198.18.0.1".parse().unwrap()], &bound);
        assert_eq!(sync(&mut maps, &fewer).unwrap(), (0, 1));
        assert!(render(&listing(&maps.0)).contains("Name: KUBE-EXTERNAL-IP\nType: hash:ip,port\nNumber of entries: 0\n"));
    }

    #[test]
    fn sctp_node_ports_are_listed_per_node_address_as_kube_proxy_keeps_them() {
        let mut d = DesiredState::default();
        let mut np = fe(FrontendKind::NodePort, false, &[]);
        np.backends = np.backends.iter().map(|b| crate::model::BackendKey { proto: Protocol::Sctp, ..b }).collect();
        d.frontends.insert(FrontendKey { ip: "198.18.0.1".parse().unwrap(), port: 30090, proto: Protocol::Sctp, scope: Scope::External }, np);
        let nodes: Vec<IpAddr> = ["198.18.0.1", "198.18.0.2"].iter().map(|a| a.parse().unwrap()).collect();
        let list = listing(&compute(&d, &nodes, &BTreeSet::new()));
        let members = |name: &str| list.iter().find(|s| s.name == name).map(|s| (s.kind, s.members.clone()));
        assert_eq!(members("KUBE-NODE-PORT-SCTP-HASH"), Some(("hash:ip,port", vec!["198.18.0.1,sctp:30090".to_string(), "198.18.0.2,sctp:30090".to_string()])));
        assert_eq!(members("KUBE-NODE-PORT-LOCAL-SCTP-HASH").map(|m| m.1.len()), Some(0));
        assert_eq!(members("KUBE-LOOP-BACK").map(|m| m.1), Some(vec!["10.244.1.2,sctp:8080,10.244.1.2".to_string()]));
        assert!(members("KUBE-NODE-PORT-SCTP").is_none());
    }
}
