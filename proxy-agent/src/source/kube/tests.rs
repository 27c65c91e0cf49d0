use super::*;

#[test]
fn a_node_being_deleted_or_marked_by_the_autoscaler_is_not_eligible() {
    use k8s_openapi::api::core::v1::{NodeSpec, Taint};
    assert!(node_eligible(None), "no Node yet: eligible, as kube-proxy");
    let mut node = Node::default();
    assert!(node_eligible(Some(&node)));
    let taint = |key: &str| Taint { key: key.into(), effect: "NoSchedule".into(), ..Default::default() };
    node.spec = Some(NodeSpec { taints: Some(vec![taint("node.kubernetes.io/unschedulable")]), ..Default::default() });
    assert!(node_eligible(Some(&node)), "cordoned only: still eligible");
    node.spec = Some(NodeSpec { taints: Some(vec![taint("node.kubernetes.io/unschedulable"), taint(TO_BE_DELETED_TAINT)]), ..Default::default() });
    assert!(!node_eligible(Some(&node)));
    node.spec = None;
    node.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()));
    assert!(!node_eligible(Some(&node)));
}

#[test]
fn an_object_that_does_not_decode_is_reported_and_keeps_its_last_decoded_version() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let shared = Arc::new(Shared::default());
    let mut relist = Relist::default();
    let meta =
        |name: &str, rv: &str| ObjectMeta { name: Some(name.into()), namespace: Some("demo".into()), resource_version: Some(rv.into()), ..Default::default() };
    let good = |name: &str, rv: &str| Decoded::Object(Service { metadata: meta(name, rv), ..Default::default() });
    let bad = |name: &str, rv: &str| {
        Decoded::Undecodable(Undecodable { metadata: meta(name, rv), field: "spec.ports[0].port".into(), message: "invalid type".into() })
    };
    let list = |relist: &mut Relist, items: Vec<Decoded<Service>>| {
        apply(&shared, relist, Kind::Service(watcher::Event::Init));
        for o in items {
            apply(&shared, relist, Kind::Service(watcher::Event::InitApply(o)));
        }
        apply(&shared, relist, Kind::Service(watcher::Event::InitDone));
    };
    let state = |shared: &Shared| {
        let st = shared.state.lock().unwrap();
        let services: Vec<(String, String)> =
            st.objects.services.iter().map(|((_, n), o)| (n.clone(), o.resource_version.as_deref().unwrap_or_default().to_string())).collect();
        let errors: Vec<String> = st.undecodable.values().map(|e| e.to_string()).collect();
        (services, errors)
    };
    let pair = |n: &str, rv: &str| (n.to_string(), rv.to_string());

    list(&mut relist, vec![good("a", "1"), bad("b", "2")]);
    let (services, errors) = state(&shared);
    assert_eq!(services, vec![pair("a", "1")], "the rest of the list is programmed");
    assert_eq!(errors, vec!["kubernetes: Service demo/b: field spec.ports[0].port: cannot decode: invalid type; kpr ignores it until it decodes"]);

    // A bad update keeps the version programmed.
    apply(&shared, &mut relist, Kind::Service(watcher::Event::Apply(bad("a", "3"))));
    let (services, errors) = state(&shared);
    assert_eq!(services, vec![pair("a", "1")]);
    assert!(errors[0].starts_with("kubernetes: Service demo/a: ") && errors[0].ends_with("kpr uses its last version that decoded"), "{errors:?}");
    // What the sync reads: the errors with the objects.
    use crate::source::Source;
    let mut source = crate::source::KubeSource::new(shared.clone());
    assert_eq!(source.with_input(|i| i.errors.len()), 2);

    // A re-list: a still bad (kept), b fixed (its error gone).
    list(&mut relist, vec![bad("a", "3"), good("b", "4")]);
    let (services, errors) = state(&shared);
    assert_eq!(services, vec![pair("a", "1"), pair("b", "4")]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("Service demo/a"), "{errors:?}");

    // Fixed by an update; an undecodable object deleted.
    apply(&shared, &mut relist, Kind::Service(watcher::Event::Apply(good("a", "5"))));
    apply(&shared, &mut relist, Kind::Service(watcher::Event::Apply(bad("b", "6"))));
    apply(&shared, &mut relist, Kind::Service(watcher::Event::Delete(bad("b", "7"))));
    assert_eq!(state(&shared), (vec![pair("a", "5")], vec![]));
}

#[test]
fn a_node_that_does_not_decode_keeps_its_last_decoded_version_and_counts_as_listed() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let shared = Shared::default();
    let mut relist = Relist::default();
    let meta = |rv: &str| ObjectMeta { name: Some("n1".into()), resource_version: Some(rv.into()), ..Default::default() };
    let bad = |rv: &str| Decoded::Undecodable(Undecodable { metadata: meta(rv), field: "spec.podCIDRs".into(), message: "invalid type".into() });
    let list = |relist: &mut Relist, o: Decoded<Node>| {
        for ev in [watcher::Event::Init, watcher::Event::InitApply(o), watcher::Event::InitDone] {
            apply(&shared, relist, Kind::Node(ev));
        }
    };
    let node_rv = |shared: &Shared| shared.state.lock().unwrap().node.as_ref().and_then(|n| n.metadata.resource_version.clone());
    list(&mut relist, bad("1"));
    {
        let st = shared.state.lock().unwrap();
        assert!(st.node_synced && st.node.is_none(), "listed: the sync is not held back");
        assert_eq!(
            st.undecodable.values().map(|e| e.to_string()).collect::<Vec<_>>(),
            vec!["kubernetes: Node /n1: field spec.podCIDRs: cannot decode: invalid type; kpr ignores it until it decodes"]
        );
    }
    apply(&shared, &mut relist, Kind::Node(watcher::Event::Apply(Decoded::Object(Node { metadata: meta("2"), ..Default::default() }))));
    assert_eq!((node_rv(&shared).as_deref(), shared.state.lock().unwrap().undecodable.len()), (Some("2"), 0));
    apply(&shared, &mut relist, Kind::Node(watcher::Event::Apply(bad("3"))));
    list(&mut relist, bad("3"));
    assert_eq!(node_rv(&shared).as_deref(), Some("2"), "the last version that decoded");
    assert_eq!(shared.state.lock().unwrap().undecodable.len(), 1);
}

#[test]
fn trigger_time_is_read_from_the_annotation() {
    let at = |t: &str| {
        let mut slice = k8s_openapi::api::discovery::v1::EndpointSlice::default();
        slice.metadata.annotations = Some([(crate::model::slice_object::TRIGGER_TIME_ANNOTATION.to_string(), t.to_string())].into());
        SliceObject::from(slice).trigger_time.map(|t| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis())
    };
    assert_eq!(at("2024-02-29T12:34:56Z"), Some(1_709_210_096_000));
    assert_eq!(at("1970-01-01T00:00:01.5Z"), Some(1500));
    assert_eq!(at("yesterday"), None);
}
