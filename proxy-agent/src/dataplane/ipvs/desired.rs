//! IPVS mode's projection of the model: the virtual servers and destinations the desired state
//! asks for, and which addresses go on kube-ipvs0.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    ops::RangeInclusive,
};

use ipnet::IpNet;

use crate::{
    dataplane::ipvs::client::{flags, DestConfig, FwdMethod, ServiceConfig, ServiceId},
    model::{DesiredState, Frontend, FrontendKey, FrontendKind, IpvsForward, Scope},
    settings::VipBinding,
};

pub const DEFAULT_NODE_PORT_RANGE: RangeInclusive<u16> = proxy_common::NODE_PORT_MIN..=proxy_common::NODE_PORT_MAX;

#[derive(Clone, Debug)]
/// What the projection and the ownership rule need: the default scheduler, the ranges to leave
/// alone, the node's addresses and NodePort range.
pub struct SyncSettings {
    pub scheduler: String,
    /// Virtual servers in these ranges are never deleted (kube-proxy's ipvs.excludeCIDRs).
    pub exclude_cidrs: Vec<IpNet>,
    /// Node addresses NodePorts listen on; a virtual server on one of them within
    /// `node_port_range` is ours.
    pub node_addresses: Vec<IpAddr>,
    pub node_port_range: RangeInclusive<u16>,
    /// IPv4 virtual IPs as kube-ipvs0's addresses or as local routes.
    pub vip_binding: VipBinding,
    /// A sync with at least this many VIPs to bind binds them on a thread of its own beside
    /// the IPVS writes; fewer are bound first, on the sync's thread.
    pub concurrent_binds: usize,
}

impl Default for SyncSettings {
    fn default() -> Self {
        SyncSettings {
            scheduler: proxy_common::IPVS_DEFAULT_SCHEDULER.into(),
            exclude_cidrs: vec![],
            node_addresses: vec![],
            node_port_range: DEFAULT_NODE_PORT_RANGE,
            vip_binding: VipBinding::Address,
            // A node's first sync binds one per Service; a change, a handful.
            concurrent_binds: 64,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualServer {
    pub config: ServiceConfig,
    pub dests: BTreeMap<(IpAddr, u16), DestConfig>,
    /// Bound on kube-ipvs0 (ClusterIP, externalIP, LoadBalancer); NodePorts use node addresses.
    pub bind: bool,
    /// "namespace/name:port", for logs.
    pub service: String,
}

/// The addresses the virtual servers want bound on kube-ipvs0.
pub fn bound_addresses(vs: &BTreeMap<ServiceId, VirtualServer>) -> BTreeSet<IpAddr> {
    vs.values()
        .filter(|v| v.bind)
        .filter_map(|v| match v.config.id {
            ServiceId::Addr { addr, .. } => Some(addr),
            ServiceId::Fwmark { .. } => None,
        })
        .collect()
}

/// The frontends IPVS mode programs, one an address and port: ClusterIPs take the internal
/// view of a frontend (internalTrafficPolicy), node ports, external and load-balancer IPs the
/// external one (externalTrafficPolicy Local: node-local endpoints only, as kube-proxy's IPVS
/// mode).
pub fn ipvs_frontends(desired: &DesiredState) -> impl Iterator<Item = (&FrontendKey, &Frontend)> {
    desired.frontends.iter().filter(|(key, fe)| key.scope.answers(if fe.kind == FrontendKind::ClusterIp { Scope::Internal } else { Scope::External }))
}

/// The virtual servers `desired` asks for (`ipvs_frontends`).
pub fn desired_virtual_servers(desired: &DesiredState, settings: &SyncSettings) -> BTreeMap<ServiceId, VirtualServer> {
    let mut out = BTreeMap::new();
    for (key, fe) in ipvs_frontends(desired) {
        let id = ServiceId::Addr { proto: key.proto.number(), addr: key.ip, port: key.port };
        let (svc_flags, timeout_s, netmask) = if fe.affinity_timeout_s > 0 {
            (flags::PERSISTENT, fe.affinity_timeout_s, if key.ip.is_ipv4() { u32::MAX } else { 128 })
        } else {
            (0, 0, if key.ip.is_ipv4() { u32::MAX } else { 128 })
        };
        let fwd = match fe.ipvs.forward {
            IpvsForward::Nat => FwdMethod::Masq,
            IpvsForward::DirectRouting => FwdMethod::Route,
            IpvsForward::Tunnel => FwdMethod::Tunnel,
        };
        let dests = fe
            .backends
            .iter()
            .map(|b| {
                let weight = fe.ipvs.weights.get(&b.ip).copied().unwrap_or(1);
                ((b.ip, b.port), DestConfig::new(b.ip, b.port, fwd, weight))
            })
            .collect();
        out.insert(
            id,
            VirtualServer {
                config: ServiceConfig {
                    id,
                    scheduler: fe.ipvs.scheduler.clone().unwrap_or_else(|| settings.scheduler.clone()),
                    flags: svc_flags,
                    timeout_s,
                    netmask,
                    pe_name: None,
                },
                dests,
                // kube-proxy's shouldBind: an ExternalIP or LB IP that is a node address is the
                // node's already; binding it on kube-ipvs0 too would take it over.
                bind: match fe.kind {
                    FrontendKind::NodePort => false,
                    FrontendKind::ExternalIp | FrontendKind::LoadBalancer => !settings.node_addresses.contains(&key.ip),
                    FrontendKind::ClusterIp => true,
                },
                service: fe.service.to_string(),
            },
        );
    }
    out
}
