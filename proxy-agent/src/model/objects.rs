//! The model's input: the Services and EndpointSlices a source delivers, and what is wrong
//! with one of them.
//!
//! A source keeps every object for the agent's lifetime, so it keeps only what the model reads
//! (`ServiceObject`, `SliceObject`), not the k8s-openapi types: an endpoint of those is about
//! 340 bytes before its strings, and at 10,000 Services the cached types were most of the
//! agent's memory. Values stay as the API wrote them where the model reports them (a bad
//! address is kept as text, so its error names it).
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use k8s_openapi::api::{
    core::v1::{LoadBalancerIngress, Service, ServicePort as ApiServicePort, ServiceSpec as ApiServiceSpec},
    discovery::v1::{EndpointPort as ApiEndpointPort, EndpointSlice},
};
use smallvec::SmallVec;

use crate::model::{
    intern::{intern, intern_in, Interner},
    slice_wire::SliceWire,
    SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL,
};

/// (namespace, name).
pub type ObjectName = (String, String);

#[derive(Debug, Default, Clone)]
pub struct Objects {
    pub services: BTreeMap<ObjectName, ServiceObject>,
    pub slices: Slices,
}

/// The EndpointSlices, by name and by owning Service: an incremental sync reads the slices of
/// the changed Services only, not every slice of the cluster.
#[derive(Debug, Default, Clone)]
pub struct Slices {
    by_name: BTreeMap<ObjectName, SliceObject>,
    /// (namespace, Service) -> its slices' names, sorted. Inline: most Services have one slice
    /// per family, and a B-tree set's first node costs 280 bytes.
    by_service: BTreeMap<ObjectName, SmallVec<[String; 1]>>,
    /// Slices without the kubernetes.io/service-name label (reported at every sync).
    unowned: BTreeSet<ObjectName>,
}

/// The same map in full nodes. A B-tree filled in key order (a list) leaves each node half
/// empty, one filled at random two thirds full; rebuilt from its sorted entries, it fills them
/// (100,000 slices: about 20 MB less).
pub fn packed<K: Ord, V>(map: BTreeMap<K, V>) -> BTreeMap<K, V> {
    map.into_iter().collect()
}

impl Slices {
    /// The same slices in full map nodes (`packed`).
    pub fn packed(self) -> Self {
        Slices { by_name: packed(self.by_name), by_service: packed(self.by_service), unowned: self.unowned }
    }

    pub fn get(&self, name: &ObjectName) -> Option<&SliceObject> {
        self.by_name.get(name)
    }
    pub fn len(&self) -> usize {
        self.by_name.len()
    }
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
    pub fn iter(&self) -> impl Iterator<Item = (&ObjectName, &SliceObject)> {
        self.by_name.iter()
    }

    fn index(&mut self, name: &ObjectName, slice: &SliceObject) {
        match &slice.service {
            Some(svc) => {
                let names = self.by_service.entry((name.0.clone(), svc.clone())).or_default();
                if let Err(at) = names.binary_search(&name.1) {
                    names.insert(at, name.1.clone());
                }
            }
            None => {
                self.unowned.insert(name.clone());
            }
        }
    }
    fn unindex(&mut self, name: &ObjectName, slice: &SliceObject) {
        match &slice.service {
            Some(svc) => {
                let owner = (name.0.clone(), svc.clone());
                if let Some(names) = self.by_service.get_mut(&owner) {
                    names.retain(|n| *n != name.1);
                    if names.is_empty() {
                        self.by_service.remove(&owner);
                    }
                }
            }
            None => {
                self.unowned.remove(name);
            }
        }
    }

    pub fn insert(&mut self, name: ObjectName, slice: SliceObject) -> Option<SliceObject> {
        let previous = self.remove(&name);
        self.index(&name, &slice);
        self.by_name.insert(name, slice);
        previous
    }

    pub fn remove(&mut self, name: &ObjectName) -> Option<SliceObject> {
        let previous = self.by_name.remove(name)?;
        self.unindex(name, &previous);
        Some(previous)
    }

    /// The slices of Service `ns`/`service`, by name.
    pub fn of_service<'a>(&'a self, ns: &str, service: &str) -> impl Iterator<Item = (&'a String, &'a SliceObject)> + 'a {
        let names = self.by_service.get(&(ns.to_string(), service.to_string()));
        let ns = ns.to_string();
        names.into_iter().flatten().filter_map(move |n| self.by_name.get_key_value(&(ns.clone(), n.clone())).map(|((_, n), s)| (n, s)))
    }

    /// The slices that name no Service.
    pub fn unowned(&self) -> impl Iterator<Item = &ObjectName> {
        self.unowned.iter()
    }
}

/// The annotations the model reads: kpr's own.
const KPR_ANNOTATION_PREFIX: &str = "kpr.io/";
/// Written by the endpoint controllers (network programming latency).
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// What the model reads of a Service.
#[derive(Debug, Default, Clone)]
pub struct ServiceObject {
    /// Renewed by every change (the change trackers compare it).
    pub resource_version: Option<Box<str>>,
    /// Labelled service.kubernetes.io/service-proxy-name: another proxy's Service.
    pub other_proxy: bool,
    /// Its kpr.io/ annotations (boxed: most Services have none, and the cache's map nodes hold
    /// this struct inline).
    pub annotations: Option<Box<BTreeMap<String, String>>>,
    /// What the model reads of the spec (not the selector, the families, the target ports:
    /// the endpoint controllers' concern). Boxed: a map node holds eleven entries inline and
    /// is often half full.
    pub spec: Option<Box<ServiceSpec>>,
    /// status.loadBalancer.ingress.
    pub ingress: Box<[LoadBalancerIngress]>,
}

impl From<Service> for ServiceObject {
    fn from(svc: Service) -> Self {
        let meta = svc.metadata;
        let annotations = meta.annotations.map(|a| a.into_iter().filter(|(k, _)| k.starts_with(KPR_ANNOTATION_PREFIX)).collect::<BTreeMap<_, _>>());
        let ingress = svc.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default();
        ServiceObject {
            resource_version: meta.resource_version.map(String::into_boxed_str),
            other_proxy: meta.labels.as_ref().is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL)),
            annotations: annotations.filter(|a| !a.is_empty()).map(Box::new),
            spec: svc.spec.map(|spec| Box::new(spec.into())),
            ingress: ingress.into_iter().map(|i| LoadBalancerIngress { hostname: None, ports: None, ..i }).collect(),
        }
    }
}

/// What the model reads of a Service's spec: 120 bytes and an allocation or three, against
/// about 870 for the API type with its strings (at 100,000 Services the largest part of the
/// Service cache). The values the API writes from a small set (type, policies, protocols,
/// port names) are interned: one copy each for the whole cluster. Addresses stay text, as
/// written, so an error names them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    /// type, the traffic policies and sessionAffinity: the Services of a cluster share a few
    /// combinations, interned.
    kinds: Option<Arc<SpecKinds>>,
    pub cluster_ip: Option<Box<str>>,
    pub cluster_ips: Box<[Box<str>]>,
    pub external_ips: Box<[Box<str>]>,
    pub load_balancer_source_ranges: Box<[Box<str>]>,
    pub ports: Box<[ServicePort]>,
    /// sessionAffinityConfig.clientIP.timeoutSeconds.
    pub affinity_timeout_seconds: Option<i32>,
    pub health_check_node_port: Option<i32>,
    pub publish_not_ready_addresses: Option<bool>,
}

#[derive(Debug, Default, PartialEq, Eq, Hash)]
struct SpecKinds {
    type_: Option<Box<str>>,
    external_traffic_policy: Option<Box<str>>,
    internal_traffic_policy: Option<Box<str>>,
    session_affinity: Option<Box<str>>,
}

impl ServiceSpec {
    fn kinds(&self) -> &SpecKinds {
        static NONE: SpecKinds = SpecKinds { type_: None, external_traffic_policy: None, internal_traffic_policy: None, session_affinity: None };
        self.kinds.as_deref().unwrap_or(&NONE)
    }
    pub fn type_(&self) -> Option<&str> {
        self.kinds().type_.as_deref()
    }
    pub fn external_traffic_policy(&self) -> Option<&str> {
        self.kinds().external_traffic_policy.as_deref()
    }
    pub fn internal_traffic_policy(&self) -> Option<&str> {
        self.kinds().internal_traffic_policy.as_deref()
    }
    pub fn session_affinity(&self) -> Option<&str> {
        self.kinds().session_affinity.as_deref()
    }
}

/// One of spec.ports, as the model reads it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub name: Option<Arc<str>>,
    pub protocol: Option<Arc<str>>,
    pub port: i32,
    pub node_port: Option<i32>,
}

fn texts(v: Option<Vec<String>>) -> Box<[Box<str>]> {
    v.unwrap_or_default().into_iter().map(String::into_boxed_str).collect()
}

impl From<ApiServiceSpec> for ServiceSpec {
    fn from(spec: ApiServiceSpec) -> Self {
        let port = |p: ApiServicePort| ServicePort { name: p.name.map(intern), protocol: p.protocol.map(intern), port: p.port, node_port: p.node_port };
        let kinds = SpecKinds {
            type_: spec.type_.map(String::into_boxed_str),
            external_traffic_policy: spec.external_traffic_policy.map(String::into_boxed_str),
            internal_traffic_policy: spec.internal_traffic_policy.map(String::into_boxed_str),
            session_affinity: spec.session_affinity.map(String::into_boxed_str),
        };
        ServiceSpec {
            kinds: (kinds != SpecKinds::default()).then(|| intern_kinds(kinds)),
            cluster_ip: spec.cluster_ip.map(String::into_boxed_str),
            cluster_ips: texts(spec.cluster_ips),
            external_ips: texts(spec.external_ips),
            load_balancer_source_ranges: texts(spec.load_balancer_source_ranges),
            ports: spec.ports.unwrap_or_default().into_iter().map(port).collect(),
            affinity_timeout_seconds: spec.session_affinity_config.and_then(|c| c.client_ip).and_then(|c| c.timeout_seconds),
            health_check_node_port: spec.health_check_node_port,
            publish_not_ready_addresses: spec.publish_not_ready_addresses,
        }
    }
}

/// One of an EndpointSlice's ports, as the model reads it (name and protocol interned).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EndpointPort {
    pub name: Option<Arc<str>>,
    pub protocol: Option<Arc<str>>,
    pub port: Option<i32>,
}

/// What the model reads of an EndpointSlice.
#[derive(Debug, Default, Clone)]
pub struct SliceObject {
    pub resource_version: Option<Box<str>>,
    /// The owning Service (the kubernetes.io/service-name label).
    pub service: Option<String>,
    /// Interned: "IPv4", "IPv6" or "FQDN" in every slice.
    pub address_type: Arc<str>,
    pub ports: Box<[EndpointPort]>,
    pub endpoints: Box<[Endpoint]>,
    /// endpoints.kubernetes.io/last-change-trigger-time, when it parses.
    pub trigger_time: Option<SystemTime>,
}

/// One endpoint of a slice: 32 bytes with its address, against 340 and several allocations for
/// the API type. A million of them are a 100,000-Service cluster's largest cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The first address, when it is an IP (the usual endpoint: one address), by `FIRST_V4`
    /// or `FIRST_V6`; the others are in `place`.
    first: [u8; 16],
    first_family: u8,
    /// conditions.ready, .serving, .terminating as written, two bits each (`condition`).
    conditions: u8,
    /// Interned: the endpoints on a node with the same hints (and no other address) share one.
    place: Option<Arc<Place>>,
}

const FIRST_NONE: u8 = 0;
const FIRST_V4: u8 = 4;
const FIRST_V6: u8 = 6;

/// Where an endpoint is (its node and hints.forZones), and the addresses it has past an IP
/// first one (all of them when the first is not an IP).
#[derive(Debug, PartialEq, Eq, Hash)]
struct Place {
    node: Option<Arc<str>>,
    zones: Box<[Arc<str>]>,
    addresses: Box<[Address]>,
}

/// An optional condition in two bits: 0 unset, 1 false, 2 true.
fn condition(bits: u8, at: u8) -> Option<bool> {
    match (bits >> at) & 3 {
        0 => None,
        v => Some(v == 2),
    }
}

impl Endpoint {
    pub fn new(addresses: Vec<Address>, node_name: Option<String>, zones: Vec<String>, conditions: [Option<bool>; 3]) -> Self {
        let mut rest = addresses.into_iter();
        let (mut first, mut first_family) = ([0u8; 16], FIRST_NONE);
        let mut others: Vec<Address> = Vec::new();
        match rest.next() {
            Some(Address::Ip(IpAddr::V4(ip))) => {
                first[..4].copy_from_slice(&ip.octets());
                first_family = FIRST_V4;
            }
            Some(Address::Ip(IpAddr::V6(ip))) => {
                first = ip.octets();
                first_family = FIRST_V6;
            }
            Some(other) => others.push(other),
            None => {}
        }
        others.extend(rest);
        let place = Place { node: node_name.map(intern), zones: zones.into_iter().map(intern).collect(), addresses: others.into() };
        let place = (place.node.is_some() || !place.zones.is_empty() || !place.addresses.is_empty()).then(|| intern_place(place));
        let conditions = conditions.iter().enumerate().fold(0u8, |bits, (i, c)| bits | (c.map_or(0, |v| 1 + u8::from(v)) << (2 * i)));
        Endpoint { first, first_family, conditions, place }
    }

    /// Its addresses, in the slice's order.
    pub fn addresses(&self) -> impl Iterator<Item = std::borrow::Cow<'_, Address>> + '_ {
        let first = match self.first_family {
            FIRST_V4 => Some(IpAddr::from([self.first[0], self.first[1], self.first[2], self.first[3]])),
            FIRST_V6 => Some(IpAddr::from(self.first)),
            _ => None,
        };
        let rest = self.place.as_ref().map_or(&[][..], |p| &p.addresses);
        first.map(|ip| std::borrow::Cow::Owned(Address::Ip(ip))).into_iter().chain(rest.iter().map(std::borrow::Cow::Borrowed))
    }

    pub fn ready(&self) -> Option<bool> {
        condition(self.conditions, 0)
    }
    pub fn serving(&self) -> Option<bool> {
        condition(self.conditions, 2)
    }
    pub fn terminating(&self) -> Option<bool> {
        condition(self.conditions, 4)
    }

    pub fn node_name(&self) -> Option<&str> {
        self.place.as_ref().and_then(|p| p.node.as_deref())
    }

    /// hints.forZones; empty when the controller set none.
    pub fn zones(&self) -> &[Arc<str>] {
        self.place.as_ref().map_or(&[], |p| &p.zones)
    }
}

fn intern_place(place: Place) -> Arc<Place> {
    static PLACES: Mutex<Option<Interner<Place>>> = Mutex::new(None);
    intern_in(&PLACES, place)
}

fn intern_kinds(kinds: SpecKinds) -> Arc<SpecKinds> {
    static KINDS: Mutex<Option<Interner<SpecKinds>>> = Mutex::new(None);
    intern_in(&KINDS, kinds)
}

/// An endpoint's address: parsed when it is one, else the text, for the error that names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Address {
    Ip(IpAddr),
    Invalid(Box<str>),
}

impl Address {
    /// The address, when the text was one.
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            Address::Ip(ip) => Some(*ip),
            Address::Invalid(_) => None,
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Ip(ip) => ip.fmt(f),
            Address::Invalid(text) => f.write_str(text),
        }
    }
}

impl From<SliceWire> for SliceObject {
    fn from(slice: SliceWire) -> Self {
        let meta = slice.metadata;
        let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k)).cloned();
        let trigger_time = meta.annotations.as_ref().and_then(|a| a.get(TRIGGER_TIME_ANNOTATION)).and_then(|t| humantime::parse_rfc3339_weak(t.trim()).ok());
        let endpoints = slice
            .endpoints
            .into_iter()
            .map(|e| {
                let conditions = e.conditions.unwrap_or_default();
                let addresses = e.addresses.into_iter().map(|a| a.parse().map(Address::Ip).unwrap_or_else(|_| Address::Invalid(a.into()))).collect();
                Endpoint::new(addresses, e.node_name, e.zone_hints, [conditions.ready, conditions.serving, conditions.terminating])
            })
            .collect();
        SliceObject {
            resource_version: meta.resource_version.clone().map(String::into_boxed_str),
            service: label(SERVICE_NAME_LABEL),
            address_type: intern(slice.address_type),
            ports: slice
                .ports
                .unwrap_or_default()
                .into_iter()
                .map(|p: ApiEndpointPort| EndpointPort { name: p.name.map(intern), protocol: p.protocol.map(intern), port: p.port })
                .collect(),
            endpoints,
            trigger_time,
        }
    }
}

/// Manifests and tests hold k8s-openapi's type; the model reads the watch's.
impl From<EndpointSlice> for SliceObject {
    fn from(slice: EndpointSlice) -> Self {
        SliceWire::from(slice).into()
    }
}

/// A problem with one object: where it came from, which object, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectError {
    pub source: String,
    pub object: String,
    pub field: String,
    pub message: String,
    /// The Event's reason.
    pub reason: &'static str,
}

/// A field kpr cannot program (the object is wrong, or kpr does not support it).
pub const FIELD_NOT_PROGRAMMED: &str = "FieldNotProgrammed";
/// A map had no room for the object's frontends or endpoints.
pub const MAP_FULL: &str = "MapFull";
/// A valid part kpr does not program yet (IPv6, SCTP).
pub const NOT_SUPPORTED: &str = "NotSupported";
/// A backend left out of a Service for now: it refused or let time out new connections.
pub const OUTLIER_EJECTED: &str = "OutlierEjected";
/// Every reason kpr gives an Event.
pub const REASONS: [&str; 4] = [FIELD_NOT_PROGRAMMED, NOT_SUPPORTED, MAP_FULL, OUTLIER_EJECTED];

impl fmt::Display for ObjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: field {}: {}", self.source, self.object, self.field, self.message)
    }
}

/// A valid part of an object that kpr does not program yet (reported, never skipped in silence).
pub(crate) fn unsupported(errors: &mut Vec<ObjectError>, object: &str, field: impl Into<String>, message: impl Into<String>) {
    errors.push(ObjectError { source: "model".into(), object: object.into(), field: field.into(), message: message.into(), reason: NOT_SUPPORTED });
}

pub(crate) fn err(errors: &mut Vec<ObjectError>, object: &str, field: impl Into<String>, message: impl Into<String>) {
    errors.push(ObjectError { source: "model".into(), object: object.into(), field: field.into(), message: message.into(), reason: FIELD_NOT_PROGRAMMED });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(owner: Option<&str>) -> SliceObject {
        SliceObject { service: owner.map(str::to_string), address_type: "IPv4".into(), ..Default::default() }
    }
    fn names<'a>(s: &'a Slices, svc: &str) -> Vec<&'a str> {
        s.of_service("ns", svc).map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn an_endpoint_is_32_bytes_and_shares_its_place() {
        assert_eq!(std::mem::size_of::<Endpoint>(), 32);
        let ip = |s: &str| Address::Ip(s.parse().unwrap());
        let addrs = |e: &Endpoint| e.addresses().map(|a| a.to_string()).collect::<Vec<_>>();
        let a = Endpoint::new(vec![ip("10.0.0.1")], Some("node-a".into()), vec!["z1".into()], [Some(true), None, Some(false)]);
        let b = Endpoint::new(vec![ip("fd00::2")], Some("node-a".into()), vec!["z1".into()], [None; 3]);
        assert!(Arc::ptr_eq(a.place.as_ref().unwrap(), b.place.as_ref().unwrap()), "one address each: the place is shared");
        assert_eq!((a.node_name(), &*a.zones()[0], addrs(&a), addrs(&b)), (Some("node-a"), "z1", vec!["10.0.0.1".to_string()], vec!["fd00::2".to_string()]));
        assert_eq!((a.ready(), a.serving(), a.terminating(), b.ready()), (Some(true), None, Some(false), None));
        // More addresses, or a first that is not one, live in the place, in order.
        let c = Endpoint::new(vec![ip("10.0.0.3"), Address::Invalid("x".into()), ip("fd00::3")], None, vec![], [None; 3]);
        let d = Endpoint::new(vec![Address::Invalid("y".into()), ip("10.0.0.4")], None, vec![], [None; 3]);
        assert_eq!((addrs(&c), addrs(&d)), (["10.0.0.3", "x", "fd00::3"].map(String::from).to_vec(), ["y", "10.0.0.4"].map(String::from).to_vec()));
        assert!(d.addresses().next().unwrap().ip().is_none());
        let bare = Endpoint::new(vec![], None, vec![], [None; 3]);
        assert!(bare.place.is_none() && bare.addresses().next().is_none() && bare.zones().is_empty());
    }

    #[test]
    fn slices_stay_indexed_by_owner_through_relabels_and_removals() {
        let n = |s: &str| ("ns".to_string(), s.to_string());
        let mut s = Slices::default();
        s.insert(n("a-1"), slice(Some("a")));
        s.insert(n("a-2"), slice(Some("a")));
        s.insert(n("x"), slice(None));
        assert_eq!((names(&s, "a"), s.unowned().count()), (vec!["a-1", "a-2"], 1));
        // a-2 is relabelled to b, x gets a label, a-1 loses its own.
        s.insert(n("a-2"), slice(Some("b")));
        s.insert(n("x"), slice(Some("b")));
        s.insert(n("a-1"), slice(None));
        assert_eq!((names(&s, "a"), names(&s, "b")), (vec![], vec!["a-2", "x"]));
        assert_eq!(s.unowned().collect::<Vec<_>>(), vec![&n("a-1")]);
        assert!(s.remove(&n("x")).is_some() && s.remove(&n("x")).is_none());
        assert_eq!((names(&s, "b"), s.len()), (vec!["a-2"], 2));
        assert!(names(&s, "a").is_empty() && s.by_service.len() == 1, "no empty index entries left");
    }
}
