//! What the model reads of an EndpointSlice (`SliceObject`), kept for the agent's lifetime: an
//! endpoint packed into 32 bytes, its node, zones and further addresses interned (`Place`).
use std::{
    fmt,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use k8s_openapi::api::discovery::v1::{EndpointPort as ApiEndpointPort, EndpointSlice};

use crate::model::{
    intern::{intern, intern_in, Interner},
    slice_wire::SliceWire,
    SERVICE_NAME_LABEL,
};

/// Written by the endpoint controllers (network programming latency).
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
