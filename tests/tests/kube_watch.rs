//! The real kube-rs client against an in-process API server (support/fake_api.rs): list and
//! watch, resourceVersions, bookmarks, 410 Gone and re-list, dropped watches, slow answers, an
//! outage. After each scenario the desired state is compared with a golden text dump, and the
//! maps (the fake map writer) must hold exactly that state.
use std::{sync::Arc, time::Duration};

use kpr_lab::fake_api::{FakeApi, Kind};
use proxy_agent::{
    dataplane::ebpf::maps::FakeMaps,
    dataplane::ebpf::sync::Syncer,
    model::{compute, ModelConfig, NodeInfo},
    source::kube::{self as kube_source, Shared},
};
use proxy_common::DatapathConfig;
use serde_json::{json, Value};

fn service(name: &str, ip: &str, port: u16, extra_labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "w", "labels": extra_labels},
        "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}})
}

fn slice(svc: &str, ips: &[&str]) -> Value {
    let eps: Vec<Value> = ips.iter().map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": "node-a"})).collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{svc}-1"), "namespace": "w", "labels": {"kubernetes.io/service-name": svc},
                     "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": eps})
}

fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "z1"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}})
}

struct Harness {
    shared: Arc<Shared>,
    maps: FakeMaps,
    syncer: Syncer,
}

impl Harness {
    async fn start(api: FakeApi) -> Self {
        let config = kube::Config::new(api.url().parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let shared = Arc::new(Shared::default());
        tokio::spawn(kube_source::run(client, "node-a".into(), shared.clone()));
        Harness { shared, maps: FakeMaps::default(), syncer: Syncer::default() }
    }

    fn dump(&self) -> String {
        let st = self.shared.state.lock().unwrap();
        let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec!["192.0.2.1".parse().unwrap()], ..Default::default() };
        compute(&st.objects, &node, &ModelConfig::default()).dump()
    }

    /// Waits until the caches are synced and the desired state dumps as `golden`, then syncs
    /// the (fake) maps and checks they hold it.
    async fn converge(&mut self, golden: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let synced = self.shared.state.lock().unwrap().synced();
            if synced && self.dump() == golden {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "did not converge; want:\n{golden}\ngot (synced={synced}):\n{}", self.dump());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let st = self.shared.state.lock().unwrap();
        let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec!["192.0.2.1".parse().unwrap()], ..Default::default() };
        let d = compute(&st.objects, &node, &ModelConfig::default());
        self.syncer.sync(&mut self.maps, &d, DatapathConfig::default()).unwrap();
        let frontends: usize = d.frontends.len();
        assert_eq!(self.maps.services.len(), frontends);
        let slots: usize = d.frontends.values().map(|f| f.backends.len()).sum();
        assert_eq!(self.maps.slots.len(), slots);
    }
}

fn golden(lines: &[(&str, &[&str])]) -> String {
    let mut s = String::new();
    for (ip, backends) in lines {
        let name = match *ip {
            "10.96.0.1" => "w/a:http",
            "10.96.0.2" => "w/b:http",
            _ => "w/c:http",
        };
        s += &format!("frontend {ip}:80/TCP both clusterip {name} sched=random affinity=0 flags=- ranges=\n");
        for b in *backends {
            s += &format!("  backend {b}:8080\n");
        }
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_watch_bookmarks_gone_drops_slowness_and_outage() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node());
    api.apply(Kind::Service, service("a", "10.96.0.1", 80, json!({})));
    api.apply(Kind::Slice, slice("a", &["10.244.1.1", "10.244.1.2"]));
    // Another proxy's service and a headless slice are filtered by kube-proxy's selectors.
    api.apply(Kind::Service, service("other", "10.96.0.9", 80, json!({"service.kubernetes.io/service-proxy-name": "x"})));
    let mut h = Harness::start(api.clone()).await;

    // 1. Initial list.
    h.converge(&golden(&[("10.96.0.1", &["10.244.1.1", "10.244.1.2"])])).await;
    assert!(h.shared.state.lock().unwrap().node.is_some(), "own node watched");

    // 2. Watch: add, modify, delete (with bookmarks flowing every 300 ms).
    api.apply(Kind::Service, service("b", "10.96.0.2", 80, json!({})));
    api.apply(Kind::Slice, slice("b", &["10.244.2.1"]));
    api.apply(Kind::Slice, slice("a", &["10.244.1.2", "10.244.1.3"]));
    h.converge(&golden(&[("10.96.0.1", &["10.244.1.2", "10.244.1.3"]), ("10.96.0.2", &["10.244.2.1"])])).await;
    tokio::time::sleep(Duration::from_millis(700)).await; // bookmarks arrive; nothing changes
    api.delete(Kind::Service, "w", "b");
    h.converge(&golden(&[("10.96.0.1", &["10.244.1.2", "10.244.1.3"])])).await;

    // 3. Dropped watches: the client resumes from its resourceVersion and sees what it missed.
    api.drop_watches();
    api.apply(Kind::Slice, slice("a", &["10.244.1.4"]));
    h.converge(&golden(&[("10.96.0.1", &["10.244.1.4"])])).await;

    // 4. 410 Gone: history compacted while watches are down; a change in the gap must still
    //    arrive, through a re-list.
    let lists_before = api.lists();
    api.compact();
    api.drop_watches();
    api.apply(Kind::Service, service("c", "10.96.0.3", 80, json!({})));
    api.apply(Kind::Slice, slice("c", &["10.244.3.1"]));
    api.compact();
    api.drop_watches();
    h.converge(&golden(&[("10.96.0.1", &["10.244.1.4"]), ("10.96.0.3", &["10.244.3.1"])])).await;
    assert!(api.lists() > lists_before, "410 Gone must lead to a re-list");

    // 5. Slow answers.
    api.set_delay(Duration::from_millis(400));
    api.drop_watches();
    api.delete(Kind::Slice, "w", "c-1");
    h.converge(&golden(&[("10.96.0.1", &["10.244.1.4"]), ("10.96.0.3", &[])])).await;
    api.set_delay(Duration::ZERO);

    // 6. Outage: the API is down while the world changes; the last programmed state stays (the
    //    caches keep their objects) and converges once it is back.
    api.set_down(true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(h.dump().contains("10.96.0.3"), "an outage must not flush the cache");
    {
        // Changes made "while down" (written to the store, not streamed to anyone).
        api.apply(Kind::Slice, slice("c", &["10.244.3.2"]));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(h.dump().contains("10.244.1.4"), "forwarding state kept during the outage");
    api.set_down(false);
    h.converge(&golden(&[("10.96.0.1", &["10.244.1.4"]), ("10.96.0.3", &["10.244.3.2"])])).await;

    // Change tracking counted what happened.
    let st = h.shared.state.lock().unwrap();
    assert!(st.service_changes.total >= 3 && st.slice_changes.total >= 5, "{} {}", st.service_changes.total, st.slice_changes.total);
    assert!(!st.trigger_times.is_empty(), "EndpointSlice trigger times are collected for the programming-latency metric");
}

/// kube-rs lists 500 objects a page, as the API server serves them from etcd: 1,234 Services
/// and slices arrive over three pages each, and the agent sees every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_longer_than_a_page_arrives_whole() {
    let api = FakeApi::start().await;
    api.apply(Kind::Node, node());
    let n = 1234;
    for i in 0..n {
        let name = format!("p{i}");
        api.apply(Kind::Service, service(&name, &format!("10.97.{}.{}", i / 256, i % 256), 80, json!({})));
        api.apply(Kind::Slice, slice(&name, &[&format!("10.245.{}.{}", i / 256, i % 256)]));
    }
    let h = Harness::start(api.clone()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !h.shared.state.lock().unwrap().synced() {
        assert!(tokio::time::Instant::now() < deadline, "did not sync");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let st = h.shared.state.lock().unwrap();
    assert_eq!((st.objects.services.len(), st.objects.slices.len()), (n, n));
    assert_eq!(st.objects.slices.of_service("w", "p1233").count(), 1);
    // Three pages of Services, three of slices, one list of the Node.
    assert!(api.lists() >= 7, "{} list requests: the list was not paged", api.lists());
    let node = NodeInfo { name: "node-a".into(), ..Default::default() };
    assert_eq!(compute(&st.objects, &node, &ModelConfig::default()).frontends.len(), n, "one frontend a ClusterIP port");
}
