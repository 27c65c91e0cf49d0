//! Each watched object decoded on its own. kube-rs decodes a list page or a watch event as one
//! value: one Service or EndpointSlice whose JSON does not fit its type (a field of the wrong
//! type) failed the whole page, the watch retried it for ever, and every other object's
//! changes stopped. `Decoded<K>` turns such an object into `Undecodable` (its name, the field's
//! path, serde's message) and lets the rest of the page through.
use std::{borrow::Cow, fmt, marker::PhantomData};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{
    de::{self, DeserializeOwned, MapAccess, Visitor},
    Deserialize, Deserializer,
};
use serde_json::Value;

/// One object of a list or a watch event.
// The object is the common case: boxing it would cost an allocation per object of a list.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Decoded<K> {
    Object(K),
    Undecodable(Undecodable),
}

/// An object that does not fit its type: what could still be read of it, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Undecodable {
    /// Its name, namespace, resourceVersion and labels, where they are strings.
    pub metadata: ObjectMeta,
    /// The path of the field that does not fit, as `spec.ports[0].port`.
    pub field: String,
    pub message: String,
}

/// serde_json's name for its raw value. Asked for it, serde_json hands over the object's JSON
/// text as it is (a map of one entry, whose value is the text): the object then decodes from
/// text at full speed, and is read a second time only when it does not fit. Other
/// deserializers see a plain newtype struct, and the object goes through serde_json::Value:
/// serde's buffer does so when a watch event's "object" comes before its "type", and so would
/// serde_json, should the name ever change. (A deserializer that ignored the newtype and
/// handed over the object's fields as a map would be refused: kube-rs decodes with
/// serde_json only.)
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

impl<'de, K: DeserializeOwned> Deserialize<'de> for Decoded<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_newtype_struct(RAW_VALUE_TOKEN, ObjectVisitor(PhantomData))
    }
}

struct ObjectVisitor<K>(PhantomData<K>);

impl<'de, K: DeserializeOwned> Visitor<'de> for ObjectVisitor<K> {
    type Value = Decoded<K>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    /// serde_json's raw text.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        match map.next_key::<Cow<'de, str>>()? {
            Some(key) if key == RAW_VALUE_TOKEN => Ok(from_text(&map.next_value::<Text<'de>>()?.0)),
            _ => Err(de::Error::custom("expected serde_json's raw value")),
        }
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        Ok(from_value(Value::deserialize(d)?))
    }
}

/// A string, borrowed from the input where the input allows it.
struct Text<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("JSON text")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s)))
            }
        }
        d.deserialize_str(TextVisitor)
    }
}

fn from_text<K: DeserializeOwned>(text: &str) -> Decoded<K> {
    match serde_json::from_str(text) {
        Ok(o) => Decoded::Object(o),
        // Read again as a value, for the field's path and what can be read of the metadata.
        Err(e) => match serde_json::from_str(text) {
            Ok(v) => from_value(v),
            Err(_) => Decoded::Undecodable(Undecodable { metadata: ObjectMeta::default(), field: "-".into(), message: e.to_string() }),
        },
    }
}

fn from_value<K: DeserializeOwned>(v: Value) -> Decoded<K> {
    match serde_path_to_error::deserialize(&v) {
        Ok(o) => Decoded::Object(o),
        Err(e) => {
            let path = e.path().to_string();
            let field = if path == "." { "-".to_string() } else { path };
            Decoded::Undecodable(Undecodable { metadata: salvage(&v["metadata"]), field, message: e.into_inner().to_string() })
        }
    }
}

/// The metadata's fields the source names and tracks an object by, each where it is a string.
fn salvage(m: &Value) -> ObjectMeta {
    let text = |field: &str| m[field].as_str().map(str::to_string);
    let strings = |field: &str| m[field].as_object().map(|o| o.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect());
    ObjectMeta { name: text("name"), namespace: text("namespace"), resource_version: text("resourceVersion"), labels: strings("labels"), ..Default::default() }
}

/// The API's names are the decoded type's.
impl<K: kube::Resource<DynamicType = ()>> kube::Resource for Decoded<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(_: &()) -> Cow<'_, str> {
        K::kind(&())
    }
    fn group(_: &()) -> Cow<'_, str> {
        K::group(&())
    }
    fn version(_: &()) -> Cow<'_, str> {
        K::version(&())
    }
    fn api_version(_: &()) -> Cow<'_, str> {
        K::api_version(&())
    }
    fn plural(_: &()) -> Cow<'_, str> {
        K::plural(&())
    }
    fn meta(&self) -> &ObjectMeta {
        match self {
            Decoded::Object(o) => o.meta(),
            Decoded::Undecodable(u) => &u.metadata,
        }
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Decoded::Object(o) => o.meta_mut(),
            Decoded::Undecodable(u) => &mut u.metadata,
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use kube::core::{ObjectList, WatchEvent};

    use super::*;
    use crate::model::slice_wire::SliceWire;

    const GOOD: &str = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","namespace":"demo","resourceVersion":"7"},
        "spec":{"clusterIP":"10.96.0.10","ports":[{"name":"http","port":80,"targetPort":8080}]}}"#;
    const BAD: &str = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"odd","namespace":"demo","resourceVersion":"8","labels":{"app":"odd"}},
        "spec":{"clusterIP":"10.96.0.11","ports":[{"name":"http","port":80},{"name":"dns","port":"fifty-three"}]}}"#;

    fn undecodable<K: fmt::Debug>(d: &Decoded<K>) -> &Undecodable {
        match d {
            Decoded::Undecodable(u) => u,
            Decoded::Object(o) => panic!("decoded: {o:?}"),
        }
    }

    #[test]
    fn one_object_that_does_not_fit_leaves_the_rest_of_its_list_decoded() {
        let list = format!(r#"{{"apiVersion":"v1","kind":"ServiceList","metadata":{{"resourceVersion":"9"}},"items":[{GOOD},{BAD},{GOOD}]}}"#);
        // As kube-rs reads a list page: from text.
        let page: ObjectList<Decoded<Service>> = serde_json::from_str(&list).unwrap();
        assert_eq!(page.items.len(), 3);
        let expected: Service = serde_json::from_str(GOOD).unwrap();
        for i in [0, 2] {
            assert_eq!(page.items[i], Decoded::Object(expected.clone()));
        }
        let u = undecodable(&page.items[1]);
        assert_eq!((u.field.as_str(), u.metadata.name.as_deref(), u.metadata.namespace.as_deref()), ("spec.ports[1].port", Some("odd"), Some("demo")));
        assert_eq!(u.metadata.resource_version.as_deref(), Some("8"), "the watch resumes from it");
        assert_eq!(u.metadata.labels, Some([("app".to_string(), "odd".to_string())].into()));
        assert!(u.message.contains("fifty-three"), "{}", u.message);
        // The same page through a reader (serde_json then hands over the text owned).
        let from_reader: ObjectList<Decoded<Service>> = serde_json::from_reader(list.as_bytes()).unwrap();
        assert_eq!(from_reader.items, page.items);
    }

    #[test]
    fn a_watch_event_decodes_whichever_of_its_fields_comes_first() {
        // The API server writes "type" first (serde_json's raw text); with "object" first,
        // serde buffers the object (serde_json::Value): both read the same.
        for (object, expect_odd) in [(GOOD, false), (BAD, true)] {
            let type_first: WatchEvent<Decoded<Service>> = serde_json::from_str(&format!(r#"{{"type":"MODIFIED","object":{object}}}"#)).unwrap();
            let object_first: WatchEvent<Decoded<Service>> = serde_json::from_str(&format!(r#"{{"object":{object},"type":"MODIFIED"}}"#)).unwrap();
            let (WatchEvent::Modified(a), WatchEvent::Modified(b)) = (type_first, object_first) else { panic!("not MODIFIED") };
            assert_eq!(a, b);
            assert_eq!(matches!(a, Decoded::Undecodable(_)), expect_odd, "{a:?}");
        }
    }

    #[test]
    fn a_slice_names_its_field_too() {
        let slice = r#"{"metadata":{"name":"web-1","namespace":"demo","labels":{"kubernetes.io/service-name":"web"}},"addressType":"IPv4",
            "endpoints":[{"addresses":["10.244.1.2"],"conditions":{"ready":"yes"}}]}"#;
        let d: Decoded<SliceWire> = serde_json::from_str(slice).unwrap();
        let u = undecodable(&d);
        assert_eq!(u.field, "endpoints[0].conditions.ready");
        assert_eq!(u.metadata.labels.as_ref().and_then(|l| l.get("kubernetes.io/service-name")).map(String::as_str), Some("web"));
        // Metadata that does not fit either: what is a string is kept.
        let odd_meta = r#"{"metadata":{"name":"web-2","namespace":7,"labels":{"kubernetes.io/service-name":"web","n":1}}}"#;
        let u = undecodable(&serde_json::from_str::<Decoded<SliceWire>>(odd_meta).unwrap()).clone();
        assert_eq!((u.metadata.name.as_deref(), u.metadata.namespace, u.metadata.labels.map(|l| l.len())), (Some("web-2"), None, Some(1)));
        let not_an_object: Decoded<SliceWire> = serde_json::from_str("[1]").unwrap();
        assert_eq!(undecodable(&not_an_object).metadata, ObjectMeta::default());
    }
}
