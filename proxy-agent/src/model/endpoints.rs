//! Which endpoints of a Service port a frontend uses: readiness (KEP-1669) and topology hints.
use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use crate::model::{
    errors::{err, unsupported, ObjectError},
    slice_object::SliceObject,
    BackendKey, Ipv6Reach, NodeInfo, Protocol, NO_WIRE_FORM,
};

#[derive(Clone, Debug)]
pub(crate) struct Ep {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub local: bool,
    /// EndpointSlice hints.forZones (empty: none set).
    pub zones: Box<[Arc<str>]>,
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
    let applies =
        node.zone.as_ref().filter(|_| !ready.is_empty() && ready.iter().all(|e| !e.zones.is_empty())).filter(|zone| ready.iter().any(|e| hinted_for(e, zone)));
    match applies {
        Some(zone) => {
            let ours: Vec<&Ep> = ready.iter().map(|e| **e).filter(|e| hinted_for(e, zone)).collect();
            usable(&ours, publish_not_ready)
        }
        None => usable(eps, publish_not_ready),
    }
}

fn hinted_for(e: &Ep, zone: &str) -> bool {
    e.zones.iter().any(|z| &**z == zone)
}

/// The endpoints of one Service port (by name and protocol) across the Service's slices; what
/// cannot be read is reported on its slice.
pub(crate) fn port_endpoints(
    slices: &[(&String, &SliceObject)],
    ns: &str,
    port_name: &str,
    proto: Protocol,
    node: &NodeInfo,
    ipv6: Ipv6Reach,
    errors: &mut Vec<ObjectError>,
) -> Vec<Ep> {
    let mut eps: Vec<Ep> = Vec::new();
    for (slice_name, slice) in slices {
        let sobj = format!("EndpointSlice {ns}/{slice_name}");
        let v4 = match &*slice.address_type {
            "IPv4" => true,
            "IPv6" if ipv6 != Ipv6Reach::None => false,
            "IPv6" => {
                unsupported(errors, &sobj, "addressType", format!("IPv6 endpoints are not served by this data plane; port {port_name:?}"));
                continue;
            }
            other => {
                unsupported(errors, &sobj, "addressType", format!("{other:?} endpoints are not programmed (IPv4 and IPv6 only)"));
                continue;
            }
        };
        let target = slice.ports.iter().find(|p| p.name.as_deref().unwrap_or_default() == port_name && p.protocol.as_deref().unwrap_or("TCP") == proto.name());
        let Some(target) = target else { continue };
        let Some(tport) = target.port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0) else {
            err(errors, &sobj, "ports[].port", format!("port {port_name:?} has no valid port number"));
            continue;
        };
        for (ei, ep) in slice.endpoints.iter().enumerate() {
            let ready = ep.ready().unwrap_or(true);
            let serving = ep.serving().unwrap_or(ready);
            let terminating = ep.terminating().unwrap_or(false);
            let local = ep.node_name() == Some(node.name.as_str());
            for (ai, a) in ep.addresses().enumerate() {
                match a.ip() {
                    Some(ip) if ipv6.ebpf() && !proxy_common::user::has_wire_form(ip) => {
                        unsupported(errors, &sobj, format!("endpoints[{ei}].addresses[{ai}]"), format!("{ip}: {NO_WIRE_FORM}"))
                    }
                    Some(ip) if ip.is_ipv4() == v4 => eps.push(Ep { ip, port: tport, ready, serving, terminating, local, zones: ep.zones().into() }),
                    _ => {
                        err(errors, &sobj, format!("endpoints[{ei}].addresses[{ai}]"), format!("{:?} is not an {} address", a.to_string(), slice.address_type))
                    }
                }
            }
        }
    }
    eps
}
