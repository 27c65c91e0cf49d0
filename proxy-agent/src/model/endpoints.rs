//! Which endpoints of a Service port a frontend uses: readiness (KEP-1669) and topology hints.
use std::{collections::BTreeSet, net::IpAddr};

use crate::model::{BackendKey, NodeInfo, Protocol};

#[derive(Clone, Debug)]
pub(crate) struct Ep {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub local: bool,
    /// EndpointSlice hints.forZones, when the controller set them.
    pub zones: Option<Vec<String>>,
}

/// KEP-1669: ready endpoints; when none, the serving-and-terminating ones.
pub(crate) fn usable(eps: &[&Ep], publish_not_ready: bool) -> Vec<BackendKeyNoProto> {
    let ready: Vec<_> = eps.iter().filter(|e| publish_not_ready || e.ready).collect();
    let chosen: Vec<_> = if ready.is_empty() { eps.iter().filter(|e| e.serving && e.terminating).collect() } else { ready };
    let set: BTreeSet<(IpAddr, u16)> = chosen.iter().map(|e| (e.ip, e.port)).collect();
    set.into_iter().collect()
}

pub(crate) type BackendKeyNoProto = (IpAddr, u16);

pub(crate) fn to_keys_of(proto: Protocol, v: Vec<BackendKeyNoProto>) -> Vec<BackendKey> {
    v.into_iter().map(|(ip, port)| BackendKey { ip, port, proto }).collect()
}

/// Topology hints, as kube-proxy applies them (pkg/proxy/topology.go): the EndpointSlice
/// controller writes zone hints only for Services that ask (trafficDistribution PreferClose,
/// topology-mode Auto), and they decide alone. They are used when every ready endpoint has some
/// and at least one names this node's zone: then the ready endpoints hinted for it (or, when
/// none is ready there, the serving-terminating ones from anywhere). Otherwise every endpoint.
pub(crate) fn topology_filtered(eps: &[&Ep], node: &NodeInfo, publish_not_ready: bool) -> Vec<BackendKeyNoProto> {
    let ready: Vec<&&Ep> = eps.iter().filter(|e| e.ready).collect();
    let applies = node
        .zone
        .as_ref()
        .filter(|_| !ready.is_empty() && ready.iter().all(|e| e.zones.as_ref().is_some_and(|z| !z.is_empty())))
        .filter(|zone| ready.iter().any(|e| e.zones.as_ref().is_some_and(|z| z.contains(zone))));
    match applies {
        Some(zone) => {
            let ours: Vec<&Ep> = ready.iter().map(|e| **e).filter(|e| e.zones.as_ref().is_some_and(|z| z.contains(zone))).collect();
            usable(&ours, publish_not_ready)
        }
        None => usable(eps, publish_not_ready),
    }
}
