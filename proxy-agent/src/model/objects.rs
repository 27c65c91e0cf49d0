//! The model's input: the Services and EndpointSlices a source delivers, indexed (the slices by
//! their Service), and what the model reads of a Service. What it reads of a slice is
//! slice_object.rs; what is wrong with an object, errors.rs.
//!
//! A source keeps every object for the agent's lifetime, so it keeps only what the model reads
//! (`ServiceObject`, `SliceObject`), not the k8s-openapi types: an endpoint of those is about
//! 340 bytes before its strings, and at 10,000 Services the cached types were most of the
//! agent's memory. Values stay as the API wrote them where the model reports them (a bad
//! address is kept as text, so its error names it).
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
};

use k8s_openapi::api::core::v1::{LoadBalancerIngress, Service, ServicePort as ApiServicePort, ServiceSpec as ApiServiceSpec};
use smallvec::SmallVec;

use crate::model::{
    intern::{intern, intern_in, Interner},
    slice_object::SliceObject,
    SERVICE_PROXY_NAME_LABEL,
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
    /// The slices of a list, in full map nodes (`packed`): each map built in one pass from
    /// sorted entries, where inserting 100,000 slices one by one walked down both maps three
    /// times a slice, comparing names. A name listed twice keeps its last slice.
    pub fn from_list(list: Vec<(ObjectName, SliceObject)>) -> Self {
        let by_name: BTreeMap<ObjectName, SliceObject> = list.into_iter().collect();
        let mut owned: Vec<(ObjectName, String)> = Vec::with_capacity(by_name.len());
        let mut unowned = Vec::new();
        for (name, slice) in &by_name {
            match &slice.service {
                Some(svc) => owned.push(((name.0.clone(), svc.clone()), name.1.clone())),
                None => unowned.push(name.clone()),
            }
        }
        // Stable: each Service's slice names stay in name order, as `index` keeps them.
        owned.sort_by(|a, b| a.0.cmp(&b.0));
        let mut by_service: Vec<(ObjectName, SmallVec<[String; 1]>)> = Vec::new();
        for (owner, name) in owned {
            match by_service.last_mut() {
                Some((o, names)) if *o == owner => names.push(name),
                _ => by_service.push((owner, SmallVec::from_elem(name, 1))),
            }
        }
        Slices { by_name, by_service: by_service.into_iter().collect(), unowned: unowned.into_iter().collect() }
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

fn intern_kinds(kinds: SpecKinds) -> Arc<SpecKinds> {
    static KINDS: Mutex<Option<Interner<SpecKinds>>> = Mutex::new(None);
    intern_in(&KINDS, kinds)
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

    #[test]
    fn a_list_builds_the_slices_that_inserting_them_one_by_one_builds() {
        let n = |s: &str| ("ns".to_string(), s.to_string());
        let v = |owner: Option<&str>, rv: &str| SliceObject { resource_version: Some(rv.into()), ..slice(owner) };
        // Out of order, one unowned, one name twice (the last counts).
        let list = vec![
            (n("b-2"), v(Some("b"), "1")),
            (n("a-1"), v(Some("a"), "2")),
            (n("x"), v(None, "3")),
            (n("b-1"), v(Some("b"), "4")),
            (n("a-1"), v(Some("b"), "5")),
        ];
        let mut one_by_one = Slices::default();
        for (name, slice) in list.clone() {
            one_by_one.insert(name, slice);
        }
        let built = Slices::from_list(list);
        let view = |s: &Slices| {
            let slices: Vec<_> = s.iter().map(|(n, o)| (n.clone(), o.resource_version.clone(), o.service.clone())).collect();
            (slices, s.by_service.clone(), s.unowned.clone())
        };
        assert_eq!(view(&built), view(&one_by_one));
        assert_eq!((names(&built, "a"), names(&built, "b")), (vec![], vec!["a-1", "b-1", "b-2"]));
    }
}
