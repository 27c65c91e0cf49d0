//! Odd values in Services and EndpointSlices, the kind the API server's validation lets
//! through or an older or newer one may send: each must be reported and programmed around,
//! never crash the agent nor stop another Service. Random documents (a fixed seed per round,
//! so a failure names its input) through the whole pipeline without the kernel: the manifest
//! decoder, the model, the eBPF sync against fake maps, IPVS mode's virtual servers.
use std::net::IpAddr;

use proxy_agent::{
    dataplane::{
        ebpf::{maps::FakeMaps, sync::Syncer},
        ipvs::desired::{desired_virtual_servers, SyncSettings},
    },
    model::{compute, ModelConfig, NodeInfo},
    source::manifests::{load_text, LoadReport},
};
use proxy_common::{DatapathConfig, ServiceKey, PROTO_TCP, SCOPE_INTERNAL};
use serde_json::{json, Value};

/// splitmix64: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick(&mut self, pool: &[Value]) -> Value {
        pool[self.below(pool.len())].clone()
    }
    fn chance(&mut self) -> bool {
        self.next() & 1 == 0
    }
    /// Up to `max` picks.
    fn some(&mut self, pool: &[Value], max: usize) -> Value {
        let n = self.below(max + 1);
        Value::Array((0..n).map(|_| self.pick(pool)).collect())
    }
}

fn odd_service(r: &mut Rng, name: &str, i: usize) -> Value {
    let ips = [
        json!(format!("10.96.1.{i}")),
        json!(format!("fd00::1:{i:x}")),
        json!("None"),
        json!(""),
        json!("garbage"),
        json!("10.96.0.300"),
        json!("::"),
        json!("0.0.0.0"),
        json!("255.255.255.255"),
        json!("fd00::"),
        json!("::ffff:10.96.1.1"),
        Value::Null,
    ];
    let ints = [json!(80), json!(0), json!(-1), json!(65535), json!(65536), json!(2_147_483_647), json!(-2_147_483_648)];
    let node_ports = [Value::Null, json!(0), json!(30080), json!(31000 + i), json!(65536), json!(-1)];
    let names = [json!("http"), json!(""), json!("dns"), json!("x".repeat(70)), Value::Null];
    let protocols = [json!("TCP"), json!("UDP"), json!("SCTP"), json!(""), json!("ICMP"), Value::Null];
    let target_ports = [json!(8080), json!(0), json!("http"), json!(""), json!(-5), json!(70000), json!("dns")];
    let policies = [json!("Cluster"), json!("Local"), json!(""), json!("Weird"), Value::Null];
    let mut ports = Vec::new();
    for _ in 0..r.below(4) {
        ports.push(json!({
            "name": r.pick(&names), "port": r.pick(&ints), "protocol": r.pick(&protocols),
            "targetPort": r.pick(&target_ports), "nodePort": r.pick(&node_ports),
        }));
    }
    let annotations = json!({
        "kpr.io/scheduler": r.pick(&[json!("maglev"), json!("rr"), json!("lc"), json!("p2c"), json!("fastest"), json!("")]),
        "kpr.io/max-connection-age": r.pick(&[json!("10s"), json!("inf"), json!("-1s"), json!("1e20"), json!("9999999999999999999999h"), json!(""), json!("NaN")]),
        "kpr.io/outlier-ejection": r.pick(&[json!("true"), json!("false"), json!("maybe")]),
        "kpr.io/ipvs-forward": r.pick(&[json!("dr"), json!("tun"), json!("nat"), json!("x")]),
        "kpr.io/ipvs-scheduler": r.pick(&[json!("rr"), json!("wlc"), json!("x")]),
        "kpr.io/ipvs-weights": r.pick(&[json!("10.244.1.1=5"), json!("garbage"), json!("=,="), json!("10.244.1.1=-3")]),
    });
    let mut spec = json!({
        "type": r.pick(&[json!("ClusterIP"), json!("NodePort"), json!("LoadBalancer"), json!("ExternalName"), json!(""), json!("Weird")]),
        "clusterIP": r.pick(&ips),
        "ports": ports,
        "externalTrafficPolicy": r.pick(&policies),
        "internalTrafficPolicy": r.pick(&policies),
        "sessionAffinity": r.pick(&[json!("None"), json!("ClientIP"), json!(""), json!("Weird")]),
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": r.pick(&[Value::Null, json!(0), json!(-1), json!(86_400), json!(2_147_483_647)])}},
        "ipFamilies": r.pick(&[json!(["IPv4"]), json!(["IPv6"]), json!(["IPv4", "IPv6"]), json!(["Weird"]), json!([])]),
        "healthCheckNodePort": r.pick(&[Value::Null, json!(0), json!(32000 + i), json!(-1), json!(70000)]),
        "externalIPs": r.some(&[json!(format!("198.51.100.{i}")), json!("garbage"), json!("::1"), json!("0.0.0.0"), json!("")], 3),
        "loadBalancerSourceRanges": r.some(&[json!("10.0.0.0/8"), json!("garbage"), json!("10.0.0.0/33"), json!("::/0"), json!("")], 3),
    });
    if r.chance() {
        spec["clusterIPs"] = r.some(&ips, 3);
    }
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "odd", "annotations": annotations},
        "spec": spec,
        "status": {"loadBalancer": {"ingress": r.some(&[json!({"ip": "203.0.113.1"}), json!({"ip": "garbage"}), json!({"hostname": "x"}), json!({"ip": "fd00::5"})], 2)}},
    })
}

fn odd_slice(r: &mut Rng, service: &str, n: usize) -> Value {
    let addresses = [json!(format!("10.244.1.{n}")), json!("garbage"), json!(format!("fd00:1::{n:x}")), json!(""), json!("10.244.1.300"), json!("0.0.0.0")];
    let bools = [json!(true), json!(false), Value::Null];
    let mut endpoints = Vec::new();
    for _ in 0..r.below(4) {
        endpoints.push(json!({
            "addresses": r.some(&addresses, 2),
            "conditions": {"ready": r.pick(&bools), "serving": r.pick(&bools), "terminating": r.pick(&bools)},
            "nodeName": r.pick(&[json!("node-a"), json!("elsewhere"), json!(""), Value::Null]),
            "hints": {"forZones": r.some(&[json!({"name": "z1"}), json!({"name": ""})], 2)},
        }));
    }
    let mut ports = Vec::new();
    for _ in 0..r.below(3) {
        ports.push(json!({
            "name": r.pick(&[json!("http"), json!(""), json!("dns"), Value::Null]),
            "port": r.pick(&[json!(8080), json!(0), json!(-1), json!(70000), Value::Null]),
            "protocol": r.pick(&[json!("TCP"), json!("UDP"), json!("SCTP"), json!("ICMP"), Value::Null]),
        }));
    }
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-{n}"), "namespace": "odd", "labels": {"kubernetes.io/service-name": service}},
        "addressType": r.pick(&[json!("IPv4"), json!("IPv6"), json!("FQDN"), json!("")]),
        "endpoints": endpoints,
        "ports": ports,
    })
}

/// The one Service every round also holds: it must always be programmed.
const CONTROL: &str = r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ok", "namespace": "odd"},
 "spec": {"clusterIP": "10.96.9.9", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}
---
{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": "ok-1", "namespace": "odd", "labels": {"kubernetes.io/service-name": "ok"}},
 "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}], "endpoints": [{"addresses": ["10.244.9.9"], "conditions": {"ready": true}}]}
"#;

#[test]
fn odd_values_are_programmed_around_and_never_stop_another_service() {
    let node =
        NodeInfo { name: "node-a".into(), nodeport_addresses: vec!["192.0.2.1".parse().unwrap(), "2001:db8::1".parse().unwrap()], zone: Some("z1".into()) };
    let control_key = ServiceKey::new("10.96.9.9".parse::<IpAddr>().unwrap(), 80, PROTO_TCP, SCOPE_INTERNAL);
    let mut reported = 0;
    for round in 0..300u64 {
        let mut r = Rng(round);
        let mut docs = vec![CONTROL.to_string()];
        for i in 0..4 {
            let name = format!("r{i}");
            docs.push(odd_service(&mut r, &name, i).to_string());
            for n in 0..r.below(3) {
                docs.push(odd_slice(&mut r, &name, n).to_string());
            }
        }
        let text = docs.join("\n---\n");
        let run = std::panic::catch_unwind(|| {
            let mut report = LoadReport::default();
            load_text("odd.yaml", &text, &mut report);
            let desired = compute(&report.objects, &node, &ModelConfig::default());
            let mut maps = FakeMaps::default();
            let st = Syncer::new(1024, 1024, 4).sync(&mut maps, &desired, DatapathConfig::default()).expect("the eBPF sync");
            let servers = desired_virtual_servers(&desired, &SyncSettings { node_addresses: node.nodeport_addresses.clone(), ..Default::default() });
            (report.errors.len() + desired.problems().count() + st.errors.len(), desired.dump(), maps.services.contains_key(&control_key), servers.len())
        });
        let (problems, dump, control_in_maps, servers) = run.unwrap_or_else(|_| panic!("round {round} panicked on:\n{text}"));
        assert!(dump.contains("10.96.9.9:80/TCP both clusterip odd/ok:http"), "round {round}: the control Service is missing:\n{dump}\n{text}");
        assert!(control_in_maps, "round {round}: the control Service is not in the maps:\n{text}");
        assert!(servers >= 1, "round {round}: no virtual server for the control Service");
        reported += problems;
    }
    assert!(reported > 300, "odd values are reported: {reported} problems in 300 rounds");
}
