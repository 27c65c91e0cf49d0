//! An EndpointSlice as kpr decodes it from the API server: the fields the model reads, no more.
//! k8s-openapi's type decodes every field (an object's managedFields, each endpoint's
//! targetRef, hostname, deprecated topology) into structs of a few hundred bytes, moved several
//! times on the way; at 100,000 slices that decode was the longest step of the agent's start.
//! The watch decodes this type; manifests and tests convert k8s-openapi's into it, so the
//! model reads one shape.
use std::{borrow::Cow, collections::BTreeMap};

use k8s_openapi::{
    api::discovery::v1::{EndpointPort, EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{Deserialize, Deserializer};

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceWire {
    #[serde(default, deserialize_with = "lean_meta")]
    pub metadata: ObjectMeta,
    #[serde(default, deserialize_with = "null_as_default")]
    pub address_type: String,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub endpoints: Vec<EndpointWire>,
    #[serde(default)]
    pub ports: Option<Vec<EndpointPort>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointWire {
    #[serde(default, deserialize_with = "null_as_empty")]
    pub addresses: Vec<String>,
    #[serde(default)]
    pub conditions: Option<ConditionsWire>,
    #[serde(default)]
    pub node_name: Option<String>,
    /// `hints.forZones[].name`.
    #[serde(default, rename = "hints", deserialize_with = "zone_hints")]
    pub zone_hints: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ConditionsWire {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

/// An absent list and `null` (Go's nil slice) both read as empty.
fn null_as_empty<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    null_as_default(d)
}

/// `null` reads as the default, as k8s-openapi reads it: one odd field never fails a page of
/// the list (the watch would retry it for ever).
fn null_as_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn zone_hints<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    struct Zone {
        #[serde(default, deserialize_with = "null_as_default")]
        name: String,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Hints {
        #[serde(default, deserialize_with = "null_as_empty")]
        for_zones: Vec<Zone>,
    }
    Ok(Option::<Hints>::deserialize(d)?.map(|h| h.for_zones.into_iter().map(|z| z.name).collect()).unwrap_or_default())
}

/// The metadata the watch and the model read: names, resourceVersion, labels, annotations.
fn lean_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Meta {
        name: Option<String>,
        namespace: Option<String>,
        resource_version: Option<String>,
        labels: Option<BTreeMap<String, String>>,
        annotations: Option<BTreeMap<String, String>>,
    }
    let m = Option::<Meta>::deserialize(d)?;
    Ok(m.map(|m| ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        resource_version: m.resource_version,
        labels: m.labels,
        annotations: m.annotations,
        ..Default::default()
    })
    .unwrap_or_default())
}

/// Through its JSON, so the fields kept and how they read are this file's decoder alone (a
/// manifest's slice is small; the watch decodes the API's JSON directly).
impl From<EndpointSlice> for SliceWire {
    fn from(s: EndpointSlice) -> Self {
        serde_json::to_value(s).and_then(serde_json::from_value).expect("every field this type reads is optional and typed as in k8s-openapi's")
    }
}

/// The API's names for the type are k8s-openapi's.
impl kube::Resource for SliceWire {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        <EndpointSlice as k8s_openapi::Resource>::KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        <EndpointSlice as k8s_openapi::Resource>::GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        <EndpointSlice as k8s_openapi::Resource>::VERSION.into()
    }
    fn api_version(_: &()) -> Cow<'_, str> {
        <EndpointSlice as k8s_openapi::Resource>::API_VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        <EndpointSlice as k8s_openapi::Resource>::URL_PATH_SEGMENT.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slice as the API server writes it, with the fields kpr does not read.
    const SLICE: &str = r#"{
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-abc", "namespace": "shop", "resourceVersion": "42", "uid": "u-1",
            "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2024-02-29T12:34:56Z"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web", "uid": "s-1", "controller": true}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "discovery.k8s.io/v1",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:endpoints": {}}}]},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.1.0.5"], "conditions": {"ready": true, "serving": true, "terminating": false},
             "nodeName": "n1", "zone": "a", "hostname": "web-0", "hints": {"forZones": [{"name": "a"}, {"name": "b"}]},
             "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-0", "uid": "p-1"}},
            {"addresses": ["10.1.0.6", "10.1.0.7"], "conditions": {"ready": false, "terminating": true}, "deprecatedTopology": {"x": "y"}},
            {"addresses": ["10.1.0.8"], "hints": {"forNodes": [{"name": "n2"}]}}
        ],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}, {"port": 53, "protocol": "UDP"}]
    }"#;

    #[test]
    fn decodes_the_fields_the_model_reads_and_skips_the_rest() {
        let wire: SliceWire = serde_json::from_str(SLICE).unwrap();
        let reference: EndpointSlice = serde_json::from_str(SLICE).unwrap();
        assert_eq!(wire, SliceWire::from(reference));
        assert_eq!((wire.metadata.name.as_deref(), wire.metadata.namespace.as_deref(), wire.address_type.as_str()), (Some("web-abc"), Some("shop"), "IPv4"));
        assert_eq!(wire.metadata.labels.as_ref().unwrap()["kubernetes.io/service-name"], "web");
        assert!(wire.metadata.annotations.as_ref().unwrap().contains_key("endpoints.kubernetes.io/last-change-trigger-time"));
        assert_eq!(wire.endpoints.iter().map(|e| e.addresses.len()).collect::<Vec<_>>(), [1, 2, 1]);
        assert_eq!(wire.endpoints[0].node_name.as_deref(), Some("n1"));
        let ports = wire.ports.as_ref().unwrap();
        assert_eq!((ports[0].name.as_deref(), ports[0].port, ports[1].protocol.as_deref()), (Some("http"), Some(8080), Some("UDP")));
        assert_eq!(wire.endpoints[0].zone_hints, ["a", "b"]);
        assert_eq!(wire.endpoints[1].conditions, Some(ConditionsWire { ready: Some(false), serving: None, terminating: Some(true) }));
        assert!(wire.endpoints[2].zone_hints.is_empty(), "node hints are not zone hints");
        assert_eq!(wire.metadata.resource_version.as_deref(), Some("42"));
        assert!(wire.metadata.managed_fields.is_none(), "managedFields are skipped, not decoded");
    }

    #[test]
    fn null_lists_read_as_empty() {
        let wire: SliceWire =
            serde_json::from_str(r#"{"metadata": {"name": "s", "namespace": "n"}, "addressType": "IPv4", "endpoints": null, "ports": null}"#).unwrap();
        assert!(wire.endpoints.is_empty());
        assert_eq!(wire.ports, None);
        let wire: SliceWire =
            serde_json::from_str(r#"{"metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": [{"addresses": null, "hints": null}]}"#).unwrap();
        assert_eq!(wire.endpoints, [EndpointWire::default()]);
        // As k8s-openapi reads them: a null address type, a zone hint without a name.
        let odd =
            r#"{"metadata": {"name": "s"}, "addressType": null, "endpoints": [{"addresses": ["10.0.0.1"], "hints": {"forZones": [{"name": null}, {}]}}]}"#;
        let wire: SliceWire = serde_json::from_str(odd).unwrap();
        assert_eq!((wire.address_type.as_str(), &wire.endpoints[0].zone_hints[..]), ("", &[String::new(), String::new()][..]));
        assert_eq!(wire, SliceWire::from(serde_json::from_str::<EndpointSlice>(odd).unwrap()));
    }

    #[test]
    fn the_api_path_is_endpoint_slices() {
        use kube::Resource;
        assert_eq!(SliceWire::url_path(&(), Some("shop")), "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices");
        assert_eq!(SliceWire::api_version(&()), "discovery.k8s.io/v1");
    }
}
