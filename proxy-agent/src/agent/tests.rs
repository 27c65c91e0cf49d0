//! The loop with a fake source and a fake data plane, on a clock the test moves.
use std::sync::{Arc, Mutex};

use super::*;
use crate::{
    dataplane::FakeDataplane,
    source::{manifests, FakeSource},
    stats::Stats,
};

fn service(name: &str, vip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec: {{clusterIP: {vip}, ports: [{{name: http, port: 80, targetPort: 8080}}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}\n\
         addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{{addresses: [10.244.1.2], conditions: {{ready: true}}}}]\n---\n"
    )
}

fn agent(services: usize) -> Agent<FakeSource, FakeDataplane> {
    let mut report = manifests::LoadReport::default();
    let text: String = (0..services).map(|i| service(&format!("s{i}"), &format!("10.96.0.{}", i + 1))).collect();
    manifests::load_text("t.yaml", &text, &mut report);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let source = FakeSource { objects: report.objects, ready: true, ..Default::default() };
    let mut cfg = LoopSettings::new(&Settings::default(), "node-a".into());
    cfg.sync_period = Duration::from_secs(30);
    cfg.min_sync_period = Duration::from_secs(1);
    cfg.burst_syncs = 2;
    Agent::new(cfg, source, FakeDataplane::default(), Arc::new(Mutex::new(Stats::new(Duration::from_secs(60)))))
}

fn changed(names: &[&str]) -> Option<BTreeSet<(String, String)>> {
    Some(names.iter().map(|n| ("demo".to_string(), n.to_string())).collect())
}

const W: Duration = Duration::ZERO;

#[test]
fn nothing_is_programmed_before_the_source_has_listed() {
    let mut a = agent(2);
    a.source.ready = false;
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Waiting);
    assert_eq!(a.step(t0 + Duration::from_secs(60), W), Step::Waiting);
    assert!(a.dataplane.syncs.is_empty());
    assert!(a.stats.lock().unwrap().pending_since.is_some(), "health sees the wait");
    a.source.ready = true;
    assert_eq!(a.step(t0 + Duration::from_secs(61), W), Step::Synced { full: true });
}

#[test]
fn changes_sync_incrementally_between_full_syncs() {
    let mut a = agent(3);
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Synced { full: true });
    // A ClusterIP is one frontend (the same for traffic from pods and from outside the node).
    assert_eq!(a.dataplane.syncs[0], (true, 0, 3));
    assert_eq!(a.step(t0 + Duration::from_millis(100), W), Step::Idle, "no change, no sync");
    a.source.pending = changed(&["s1"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Synced { full: false });
    // One service changed: its frontends touched; the desired state still holds all three.
    assert_eq!(a.dataplane.syncs[1], (false, 1, 3));
    // syncPeriod later: a full sync repairs drift, changes or not.
    assert_eq!(a.step(t0 + Duration::from_secs(31), W), Step::Synced { full: true });
    assert_eq!(a.dataplane.syncs.len(), 3);
}

#[test]
fn a_failed_sync_is_retried_with_a_backoff_and_the_retry_is_full() {
    let mut a = agent(2);
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Synced { full: true });
    a.dataplane.fail = 2;
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Failed);
    assert!(a.stats.lock().unwrap().failing_since.is_some());
    // Not before the back-off (1 s), even with more changes.
    a.source.pending = changed(&["s1"]);
    assert_eq!(a.step(t0 + Duration::from_millis(2500), W), Step::Idle);
    assert_eq!(a.step(t0 + Duration::from_millis(3100), W), Step::Failed);
    // The back-off doubled: 2 s now.
    assert_eq!(a.step(t0 + Duration::from_millis(4500), W), Step::Idle);
    // The changes were consumed by the failed attempts: only a full sync knows what to write.
    assert_eq!(a.step(t0 + Duration::from_millis(5200), W), Step::Synced { full: true });
    assert_eq!(a.stats.lock().unwrap().m.sync_failures_total.get(), 2);
    assert!(a.stats.lock().unwrap().failing_since.is_none());
    assert!(a.stats.lock().unwrap().pending_since.is_none());
}

#[test]
fn an_unreadable_source_fails_the_sync_without_touching_the_data_plane() {
    let mut a = agent(1);
    let t0 = Instant::now();
    a.step(t0, W);
    a.source.unavailable = Some("gone".into());
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Failed);
    assert_eq!(a.dataplane.syncs.len(), 1, "the kernel keeps what it has");
    a.source.unavailable = None;
    assert_eq!(a.step(t0 + Duration::from_secs(4), W), Step::Synced { full: true });
}

#[test]
fn a_change_of_the_node_makes_the_sync_full() {
    let mut a = agent(1);
    let t0 = Instant::now();
    a.step(t0, W);
    let mut node = Node::default();
    node.metadata.resource_version = Some("7".into());
    a.source.node = Some(node);
    a.source.pending = changed(&[]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Synced { full: true });
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(4), W), Step::Synced { full: false });
}

#[test]
fn event_driven_syncs_are_bounded_by_min_sync_period() {
    let mut a = agent(1);
    let t0 = Instant::now();
    a.step(t0, W);
    // The first sync took one token of the burst of two; one more at once, then one a second.
    let mut synced = 0;
    for i in 1..=10 {
        a.source.pending = changed(&["s0"]);
        if matches!(a.step(t0 + Duration::from_millis(i * 10), W), Step::Synced { .. }) {
            synced += 1;
        }
    }
    assert_eq!(synced, 1, "a burst, then minSyncPeriod");
    assert!(matches!(a.step(t0 + Duration::from_millis(1200), W), Step::Synced { .. }));
}

#[test]
fn a_data_plane_can_ask_for_full_syncs_sooner() {
    let mut a = agent(1);
    let t0 = Instant::now();
    a.step(t0, W);
    assert_eq!(a.step(t0 + Duration::from_secs(3), W), Step::Idle);
    a.dataplane.full_within = Some(Duration::from_secs(2));
    assert_eq!(a.step(t0 + Duration::from_secs(3), W), Step::Synced { full: true });
}

#[test]
fn interfaces_are_reconciled_every_second() {
    let mut a = agent(1);
    a.source.ready = false;
    let t0 = Instant::now();
    for ms in [0, 300, 600, 900, 1000, 1500, 2100] {
        a.step(t0 + Duration::from_millis(ms), W);
    }
    assert_eq!(a.dataplane.reconciled, 3);
}

#[test]
fn failed_writes_are_counted_and_the_sync_goes_on() {
    let mut a = agent(1);
    a.dataplane.errors = vec!["10.96.0.1:80/6: add destination 10.244.1.5:8080: EINVAL".into(), "bind 10.96.0.1 (address): EBUSY".into()];
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Synced { full: true });
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Synced { full: false });
    let m = &a.stats.lock().unwrap().m;
    assert_eq!((m.write_errors_total.get(), m.sync_failures_total.get(), m.syncs_total.get()), (4, 0, 2));
}

#[test]
fn a_services_failed_write_is_an_event_once_and_a_metric() {
    let mut a = agent(1);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    a.events = Some(tx);
    let failed = |message: &str| crate::model::errors::service_port_error("demo/s0:http", message, crate::model::errors::WRITE_FAILED);
    a.dataplane.errors = vec!["add service TCP 10.96.0.1:80: EINVAL".into(), "add destination TCP 10.96.0.1:80 -> 10.244.1.5:8080: ESRCH".into()];
    // The virtual server and its destination: one Event for the port.
    a.dataplane.failed = vec![failed("IPVS: add service: EINVAL"), failed("IPVS: add destination: ESRCH")];
    let failure = failed("IPVS: add service: EINVAL (and 1 more failures of this field)");
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Synced { full: true });
    assert_eq!(rx.try_recv().expect("an Event"), failure);
    assert!(rx.try_recv().is_err(), "one Event for the port");
    assert_eq!((failure.object.as_str(), failure.field.as_str()), ("Service demo/s0", "spec.ports[http]"));
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Synced { full: false });
    assert!(rx.try_recv().is_err(), "once while it lasts");
    {
        let stats = a.stats.lock().unwrap();
        assert_eq!(stats.m.not_programmed.with_label_values(&[crate::model::errors::WRITE_FAILED]).get(), 1);
        assert_eq!(stats.m.write_errors_total.get(), 4, "each write counted at each sync");
        assert!(stats.not_programmed.contains(&failure), "listed at /notProgrammed");
    }
    // An incremental sync that does not touch the port does not try it again: still listed.
    (a.dataplane.errors, a.dataplane.failed) = (Vec::new(), Vec::new());
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(4), W), Step::Synced { full: false });
    assert!(a.stats.lock().unwrap().not_programmed.contains(&failure), "until the next full sync");
    // The next full sync tries everything: gone.
    a.dataplane.full_within = Some(Duration::ZERO);
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(6), W), Step::Synced { full: true });
    let stats = a.stats.lock().unwrap();
    assert!(!stats.not_programmed.contains(&failure));
    assert_eq!(stats.m.not_programmed.with_label_values(&[crate::model::errors::WRITE_FAILED]).get(), 0);
}

#[test]
fn a_full_map_is_an_event_once_and_a_metric_each_time() {
    let mut a = agent(1);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    a.events = Some(tx);
    a.dataplane.full = vec![(proxy_common::map_names::BACKENDS, "demo/s0:http".into())];
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Synced { full: true });
    let e = rx.try_recv().expect("an Event");
    assert_eq!((e.reason, e.object.as_str(), e.field.as_str()), (crate::model::errors::MAP_FULL, "Service demo/s0", "spec.ports[http]"));
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Synced { full: false });
    assert!(rx.try_recv().is_err(), "once while it lasts");
    assert_eq!(a.stats.lock().unwrap().m.map_full_total.with_label_values(&[proxy_common::map_names::BACKENDS]).get(), 2);
}

#[test]
fn a_maglev_fallback_counts_as_its_full_map() {
    let mut a = agent(1);
    a.dataplane.fallback = vec![(proxy_common::map_names::MAGLEV, "demo/s0:http".into())];
    a.dataplane.failed =
        vec![crate::model::errors::service_port_error("demo/s0:http", "all 2 Maglev rows in use: balanced at random instead", crate::model::errors::MAP_FULL)];
    assert_eq!(a.step(Instant::now(), W), Step::Synced { full: true });
    let stats = a.stats.lock().unwrap();
    assert_eq!(stats.m.map_full_total.with_label_values(&[proxy_common::map_names::MAGLEV]).get(), 1);
    assert_eq!(stats.m.not_programmed.with_label_values(&[crate::model::errors::MAP_FULL]).get(), 1, "one entry, not two");
}

#[test]
fn what_is_not_programmed_stays_known_across_incremental_syncs() {
    let mut a = agent(2);
    // s0 asks for a scheduler kpr does not have: programmed with the default, and reported.
    let svc = a.source.objects.services.get_mut(&("demo".to_string(), "s0".to_string())).unwrap();
    svc.annotations = Some(Box::new([(crate::model::SCHEDULER_ANNOTATION.to_string(), "fastest".to_string())].into()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    a.events = Some(tx);
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Synced { full: true });
    let e = rx.try_recv().expect("an Event");
    assert_eq!((e.object.as_str(), e.field.as_str()), ("Service demo/s0", "metadata.annotations[kpr.io/scheduler]"));
    let listed = |a: &Agent<FakeSource, FakeDataplane>| a.stats.lock().unwrap().not_programmed.iter().map(|e| e.object.clone()).collect::<Vec<_>>();
    let gauge =
        |a: &Agent<FakeSource, FakeDataplane>| a.stats.lock().unwrap().m.not_programmed.with_label_values(&[crate::model::errors::FIELD_NOT_PROGRAMMED]).get();
    assert_eq!((listed(&a), gauge(&a)), (vec!["Service demo/s0".to_string()], 1));
    // Another Service changes: s0's problem is still listed and counted, and not sent again.
    a.source.pending = changed(&["s1"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Synced { full: false });
    assert_eq!((listed(&a), gauge(&a)), (vec!["Service demo/s0".to_string()], 1));
    assert!(rx.try_recv().is_err(), "once while it lasts");
    // s0 is fixed: gone from the list and the gauge.
    let svc = a.source.objects.services.get_mut(&("demo".to_string(), "s0".to_string())).unwrap();
    svc.annotations = None;
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(4), W), Step::Synced { full: false });
    assert_eq!((listed(&a), gauge(&a)), (Vec::<String>::new(), 0));
}

#[test]
fn snat_drops_since_the_last_sync_are_an_event_on_the_node() {
    let mut a = agent(1);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    a.events = Some(tx);
    // Drops before this agent started (the count is pinned): read, not reported.
    a.dataplane.snat_no_port = 7;
    let t0 = Instant::now();
    assert_eq!(a.step(t0, W), Step::Synced { full: true });
    assert!(rx.try_recv().is_err(), "the first sync only reads the count");
    a.dataplane.snat_no_port = 12;
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(2), W), Step::Synced { full: false });
    let e = rx.try_recv().expect("an Event");
    assert_eq!((e.reason, e.object.as_str(), e.field.as_str()), (crate::model::errors::SNAT_PORTS_EXHAUSTED, "Node /node-a", "status.addresses"));
    assert!(e.message.starts_with("5 new masqueraded connections dropped"), "{e}");
    // No more drops: no more Events.
    a.source.pending = changed(&["s0"]);
    assert_eq!(a.step(t0 + Duration::from_secs(4), W), Step::Synced { full: false });
    assert!(rx.try_recv().is_err());
}
