//! The model's input: the Services and EndpointSlices a source delivers, and what is wrong
//! with one of them.
//!
//! A source keeps every object for the agent's lifetime, so it keeps only what the model reads
//! (`ServiceObject`, `SliceObject`), not the k8s-openapi types: an endpoint of those is about
//! 340 bytes before its strings, and at 10,000 Services the cached types were most of the
//! agent's memory. Values stay as the API wrote them where the model reports them (a bad
//! address is kept as text, so its error names it).
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use k8s_openapi::api::{
    core::v1::{LoadBalancerIngress, Service, ServicePort, ServiceSpec},
    discovery::v1::{EndpointPort, EndpointSlice},
};
use smallvec::SmallVec;

use crate::model::{SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL};

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

impl Slices {
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
    pub resource_version: Option<String>,
    /// Labelled service.kubernetes.io/service-proxy-name: another proxy's Service.
    pub other_proxy: bool,
    /// Its kpr.io/ annotations.
    pub annotations: Option<BTreeMap<String, String>>,
    /// The spec without what the model never reads (the selector, the families, the target
    /// ports: the endpoint controllers' concern). Boxed: a map node holds eleven entries inline
    /// and is often half full, so a 700-byte spec inline would cost twice its size.
    pub spec: Option<Box<ServiceSpec>>,
    /// status.loadBalancer.ingress.
    pub ingress: Vec<LoadBalancerIngress>,
}

impl From<Service> for ServiceObject {
    fn from(svc: Service) -> Self {
        let meta = svc.metadata;
        let annotations = meta.annotations.map(|a| a.into_iter().filter(|(k, _)| k.starts_with(KPR_ANNOTATION_PREFIX)).collect::<BTreeMap<_, _>>());
        let ingress = svc.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default();
        ServiceObject {
            resource_version: meta.resource_version,
            other_proxy: meta.labels.as_ref().is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL)),
            annotations: annotations.filter(|a| !a.is_empty()),
            spec: svc.spec.map(|spec| {
                Box::new(ServiceSpec {
                    selector: None,
                    ip_families: None,
                    ip_family_policy: None,
                    allocate_load_balancer_node_ports: None,
                    load_balancer_class: None,
                    external_name: None,
                    traffic_distribution: None,
                    ports: spec.ports.map(|ports| ports.into_iter().map(|p| ServicePort { target_port: None, app_protocol: None, ..p }).collect()),
                    ..spec
                })
            }),
            ingress: ingress.into_iter().map(|i| LoadBalancerIngress { hostname: None, ports: None, ..i }).collect(),
        }
    }
}

/// What the model reads of an EndpointSlice.
#[derive(Debug, Default, Clone)]
pub struct SliceObject {
    pub resource_version: Option<String>,
    /// The owning Service (the kubernetes.io/service-name label).
    pub service: Option<String>,
    pub address_type: String,
    pub ports: Vec<EndpointPort>,
    pub endpoints: Box<[Endpoint]>,
    /// endpoints.kubernetes.io/last-change-trigger-time, when it parses.
    pub trigger_time: Option<SystemTime>,
}

/// One endpoint of a slice: 72 bytes with its address, against 340 and several allocations for
/// the API type. A million of them are a 100,000-Service cluster's largest cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Inline: the API allows up to 100, but the controllers write one.
    pub addresses: SmallVec<[Address; 1]>,
    /// conditions.ready, .serving, .terminating as written (None: not set).
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    /// Interned: a node's name is shared by every endpoint on it.
    pub node_name: Option<Arc<str>>,
    /// hints.forZones (interned); empty when the controller set none.
    pub zones: Box<[Arc<str>]>,
}

/// Node and zone names, one copy each. Names no endpoint holds any more are dropped when the
/// table has doubled since it was last pruned, so node churn does not grow it for ever.
#[derive(Default)]
struct Interner {
    names: HashSet<Arc<str>>,
    pruned_at: usize,
}

impl Interner {
    fn intern(&mut self, name: String) -> Arc<str> {
        if let Some(known) = self.names.get(name.as_str()) {
            return known.clone();
        }
        if self.names.len() >= (self.pruned_at * 2).max(1024) {
            self.names.retain(|n| Arc::strong_count(n) > 1);
            self.pruned_at = self.names.len();
        }
        let new: Arc<str> = name.into();
        self.names.insert(new.clone());
        new
    }
}

fn intern(name: String) -> Arc<str> {
    static NAMES: Mutex<Option<Interner>> = Mutex::new(None);
    NAMES.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get_or_insert_with(Interner::default).intern(name)
}

/// An endpoint's address: parsed when it is one, else the text, for the error that names it.
#[derive(Debug, Clone, PartialEq, Eq)]
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

impl From<EndpointSlice> for SliceObject {
    fn from(slice: EndpointSlice) -> Self {
        let meta = slice.metadata;
        let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k)).cloned();
        let trigger_time = meta.annotations.as_ref().and_then(|a| a.get(TRIGGER_TIME_ANNOTATION)).and_then(|t| humantime::parse_rfc3339_weak(t.trim()).ok());
        let endpoints = slice
            .endpoints
            .into_iter()
            .map(|e| {
                let conditions = e.conditions.unwrap_or_default();
                Endpoint {
                    addresses: e.addresses.into_iter().map(|a| a.parse().map(Address::Ip).unwrap_or_else(|_| Address::Invalid(a.into()))).collect(),
                    ready: conditions.ready,
                    serving: conditions.serving,
                    terminating: conditions.terminating,
                    node_name: e.node_name.map(intern),
                    zones: e.hints.and_then(|h| h.for_zones).unwrap_or_default().into_iter().map(|z| intern(z.name)).collect(),
                }
            })
            .collect();
        SliceObject {
            resource_version: meta.resource_version.clone(),
            service: label(SERVICE_NAME_LABEL),
            address_type: slice.address_type,
            ports: slice.ports.unwrap_or_default().into_iter().map(|p| EndpointPort { app_protocol: None, ..p }).collect(),
            endpoints,
            trigger_time,
        }
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
    fn a_name_is_stored_once_and_dropped_once_unused() {
        let mut table = Interner::default();
        let first = table.intern("node-a".to_string());
        assert!(Arc::ptr_eq(&first, &table.intern("node-a".to_string())), "the second endpoint on a node shares its name");
        drop(first);
        let held: Vec<Arc<str>> = (0..1023).map(|i| table.intern(format!("node-{i}"))).collect();
        assert_eq!(table.names.len(), 1024, "no prune below 1,024 names");
        // The 1,025th name prunes: node-a, which nothing holds, goes; the names in use stay.
        let _next = table.intern("node-b".to_string());
        assert_eq!((table.names.len(), table.pruned_at), (1024, 1023));
        assert!(!table.names.contains("node-a") && held.iter().all(|n| table.names.contains(n)));
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
