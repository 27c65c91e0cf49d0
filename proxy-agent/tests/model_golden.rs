//! Desired-state golden dumps: one line per frontend and per backend.
use proxy_agent::{
    model::{compute, Ipv6Reach, ModelConfig, NodeInfo},
    source::manifests::{load_text, LoadReport},
};

const MANIFESTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: local, namespace: g}
spec:
  type: NodePort
  clusterIP: 10.96.1.1
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  externalIPs: [192.0.2.50]
  ports: [{name: http, port: 80, nodePort: 30001}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-1, namespace: g, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.244.1.10], conditions: {ready: true}, nodeName: me}
- {addresses: [10.244.2.10], conditions: {ready: true}, nodeName: other}
---
apiVersion: v1
kind: Service
metadata: {name: draining, namespace: g}
spec: {clusterIP: 10.96.1.2, ports: [{name: "", port: 53, protocol: UDP}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: draining-1, namespace: g, labels: {kubernetes.io/service-name: draining}}
addressType: IPv4
ports: [{port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.1.20], conditions: {ready: false, serving: true, terminating: true}, nodeName: me}
- {addresses: [10.244.1.21], conditions: {ready: false, serving: false, terminating: true}, nodeName: me}
---
apiVersion: v1
kind: Service
metadata: {name: headless, namespace: g}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: other-proxy, namespace: g, labels: {service.kubernetes.io/service-proxy-name: foo}}
spec: {clusterIP: 10.96.1.3, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: broken, namespace: g}
spec: {clusterIP: 10.96.1.300, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: mixed, namespace: g, annotations: {kpr.io/scheduler: fastest}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.1.4
  sessionAffinity: ClientIP
  loadBalancerSourceRanges: [203.0.113.0/24, not-a-cidr]
  ports:
  - {name: a, port: 443, nodePort: 30443}
  - {name: b, port: 443}
  - {name: c, port: 9, protocol: SCTP}
status: {loadBalancer: {ingress: [{ip: 198.51.100.7}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: mixed-1, namespace: g, labels: {kubernetes.io/service-name: mixed}}
addressType: IPv4
ports: [{name: a, port: 8443}]
endpoints:
- {addresses: [10.244.3.1, "10.244.3.x"], nodeName: other}
"#;

const GOLDEN: &str = "\
frontend 10.96.1.1:80/TCP both clusterip g/local:http sched=random affinity=0 flags=- ranges=
  backend 10.244.1.10:8080
frontend 10.96.1.2:53/UDP both clusterip g/draining: sched=random affinity=0 flags=- ranges=
  backend 10.244.1.20:5353
frontend 10.96.1.4:443/TCP both clusterip g/mixed:a sched=random affinity=10800 flags=- ranges=
  backend 10.244.3.1:8443
frontend 192.0.2.1:30001/TCP internal nodeport g/local:http sched=random affinity=0 flags=- ranges=
  backend 10.244.1.10:8080
  backend 10.244.2.10:8080
frontend 192.0.2.1:30001/TCP external nodeport g/local:http sched=random affinity=0 flags=preserve-source ranges=
  backend 10.244.1.10:8080
frontend 192.0.2.1:30443/TCP both nodeport g/mixed:a sched=random affinity=10800 flags=masq ranges=
  backend 10.244.3.1:8443
frontend 192.0.2.50:80/TCP internal externalip g/local:http sched=random affinity=0 flags=- ranges=
  backend 10.244.1.10:8080
  backend 10.244.2.10:8080
frontend 192.0.2.50:80/TCP external externalip g/local:http sched=random affinity=0 flags=preserve-source ranges=
  backend 10.244.1.10:8080
frontend 198.51.100.7:443/TCP both loadbalancer g/mixed:a sched=random affinity=10800 flags=masq,source-ranges ranges=203.0.113.0/24
  backend 10.244.3.1:8443
";

#[test]
fn traffic_policies_terminating_fallback_and_bad_input() {
    let mut r = LoadReport::default();
    load_text("golden.yaml", MANIFESTS, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["192.0.2.1".parse().unwrap()], ..Default::default() };
    let d = compute(&r.objects, &node, &ModelConfig::default());
    assert_eq!(d.dump(), GOLDEN, "\n--- got ---\n{}", d.dump());
    // Each problem once; their order is not a contract.
    let mut errors: Vec<String> = d.problems().map(|e| format!("{}: {}", e.object, e.field)).collect();
    errors.sort();
    assert_eq!(
        errors,
        vec![
            "EndpointSlice g/mixed-1: endpoints[0].addresses[1]",
            "Service g/broken: spec.clusterIP",
            "Service g/mixed: metadata.annotations[kpr.io/scheduler]",
            "Service g/mixed: spec.loadBalancerSourceRanges[1]",
            "Service g/mixed: spec.ports[1].port",
            "Service g/mixed: spec.ports[2].protocol",
        ]
    );
}

#[test]
fn topology_hints_prefer_the_nodes_zone_only_when_complete() {
    let svc = |name: &str, ip: &str, extra: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: t}}\nspec: {{clusterIP: {ip}, {extra} ports: [{{port: 80}}]}}\n---\n")
    };
    let slice = |name: &str, eps: &str| {
        format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: t, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: {eps}\n---\n")
    };
    let hinted = "[{addresses: [10.0.0.1], hints: {forZones: [{name: z1}]}}, {addresses: [10.0.0.2], hints: {forZones: [{name: z2}]}}]";
    let partial = "[{addresses: [10.0.0.1], hints: {forZones: [{name: z1}]}}, {addresses: [10.0.0.2]}]";
    let mut y = String::new();
    y += &svc("close", "10.96.2.1", "trafficDistribution: PreferClose,");
    y += &slice("close", hinted);
    y += &svc("auto", "10.96.2.2", "");
    y = y.replace("name: auto, namespace: t}", "name: auto, namespace: t, annotations: {service.kubernetes.io/topology-mode: Auto}}");
    y += &slice("auto", hinted);
    y += &svc("partial", "10.96.2.3", "trafficDistribution: PreferClose,");
    y += &slice("partial", partial);
    y += &svc("plain", "10.96.2.4", "");
    y += &slice("plain", hinted);
    // A not-ready endpoint without hints does not turn topology off: only ready ones count.
    y += &svc("notready", "10.96.2.5", "trafficDistribution: PreferClose,");
    y += &slice("notready", "[{addresses: [10.0.0.1], hints: {forZones: [{name: z1}]}}, {addresses: [10.0.0.2], hints: {forZones: [{name: z2}]}}, {addresses: [10.0.0.3], conditions: {ready: false}}]");
    // Hints, but none for this node's zone: all.
    y += &svc("elsewhere", "10.96.2.6", "trafficDistribution: PreferClose,");
    y += &slice("elsewhere", "[{addresses: [10.0.0.2], hints: {forZones: [{name: z2}]}}, {addresses: [10.0.0.3], hints: {forZones: [{name: z3}]}}]");
    let mut r = LoadReport::default();
    load_text("topology.yaml", &y, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let node = NodeInfo { name: "me".into(), zone: Some("z1".into()), ..Default::default() };
    let d = compute(&r.objects, &node, &ModelConfig::default());
    let backends = |ip: &str| -> Vec<String> {
        let k = d.frontends.keys().find(|k| k.ip.to_string() == ip && k.scope.answers(proxy_agent::model::Scope::Internal)).unwrap();
        d.frontends[k].backends.iter().map(|b| b.ip.to_string()).collect()
    };
    assert_eq!(backends("10.96.2.1"), ["10.0.0.1"], "PreferClose: own zone");
    assert_eq!(backends("10.96.2.2"), ["10.0.0.1"], "topology-mode Auto: own zone");
    assert_eq!(backends("10.96.2.3"), ["10.0.0.1", "10.0.0.2"], "hints missing on some ready endpoint: all");
    // As kube-proxy: the hints decide (the EndpointSlice controller writes them only where
    // the Service asks).
    assert_eq!(backends("10.96.2.4"), ["10.0.0.1"], "hints without the Service field: own zone");
    assert_eq!(backends("10.96.2.5"), ["10.0.0.1"], "a not-ready endpoint without hints is ignored");
    assert_eq!(backends("10.96.2.6"), ["10.0.0.2", "10.0.0.3"], "no hint for this zone: all");
}

#[test]
fn publish_not_ready_and_absurd_sizes() {
    let mut y = String::from("apiVersion: v1\nkind: Service\nmetadata: {name: pnr, namespace: s}\nspec: {clusterIP: 10.96.3.1, publishNotReadyAddresses: true, ports: [{port: 80}]}\n---\n");
    y += "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: pnr-1, namespace: s, labels: {kubernetes.io/service-name: pnr}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.0.0.1], conditions: {ready: false}}]\n---\n";
    y += "apiVersion: v1\nkind: Service\nmetadata: {name: huge, namespace: s}\nspec: {clusterIP: 10.96.3.2, ports: [{port: 80}]}\n---\n";
    let eps: Vec<String> = (0..70_000u32).map(|i| format!("{{addresses: [10.{}.{}.{}]}}", 100 + i / 65536, (i / 256) % 256, i % 256)).collect();
    y += &format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: huge-1, namespace: s, labels: {{kubernetes.io/service-name: huge}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{}]\n", eps.join(","));
    let mut r = LoadReport::default();
    load_text("sizes.yaml", &y, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let d = compute(&r.objects, &NodeInfo::default(), &ModelConfig::default());
    assert_eq!(d.dump(), "frontend 10.96.3.1:80/TCP both clusterip s/pnr: sched=random affinity=0 flags=- ranges=\n  backend 10.0.0.1:8080\n");
    let problems: Vec<_> = d.problems().collect();
    assert_eq!(problems.len(), 1);
    assert_eq!((problems[0].object.as_str(), problems[0].field.as_str()), ("Service s/huge", "spec.ports[0]"));
}

#[test]
fn load_balancer_ip_mode_proxy_and_traffic_policy_local_verdicts() {
    let y = r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: m}
spec: {type: LoadBalancer, clusterIP: 10.96.4.1, externalTrafficPolicy: Local, ports: [{name: p, port: 80, nodePort: 30100}]}
status: {loadBalancer: {ingress: [{ip: 198.51.100.1}, {ip: 198.51.100.2, ipMode: Proxy}, {ip: 198.51.100.3, ipMode: VIP}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: m, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: p, port: 8080}]
endpoints: [{addresses: [10.244.5.1], nodeName: elsewhere}]
"#;
    let mut r = LoadReport::default();
    load_text("lb.yaml", y, &mut r);
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["192.0.2.1".parse().unwrap()], ..Default::default() };
    let d = compute(&r.objects, &node, &ModelConfig::default());
    let ips: std::collections::BTreeSet<String> = d.frontends.keys().map(|k| k.ip.to_string()).collect();
    assert!(ips.contains("198.51.100.1") && ips.contains("198.51.100.3"), "{ips:?}");
    assert!(!ips.contains("198.51.100.2"), "ipMode Proxy: the load balancer proxies it, nothing is programmed: {ips:?}");
    // externalTrafficPolicy Local with the only endpoint elsewhere: the external frontends have
    // no backend and drop (no-local-endpoint), the internal ones reach it.
    let dump = d.dump();
    assert!(
        dump.contains("frontend 192.0.2.1:30100/TCP external nodeport m/lb:p sched=random affinity=0 flags=preserve-source,no-local-endpoint ranges="),
        "{dump}"
    );
    assert!(
        dump.contains("frontend 192.0.2.1:30100/TCP internal nodeport m/lb:p sched=random affinity=0 flags=- ranges=\n  backend 10.244.5.1:8080"),
        "{dump}"
    );
}

#[test]
fn ipvs_annotations_are_validated_per_service() {
    let y = r#"
apiVersion: v1
kind: Service
metadata:
  name: good
  namespace: a
  annotations: {kpr.io/ipvs-scheduler: wlc, kpr.io/ipvs-forward: dr, kpr.io/ipvs-weights: "10.244.1.2=5, nonsense, 10.244.1.3=2"}
spec: {clusterIP: 10.96.2.1, ports: [{name: p, port: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: good-1, namespace: a, labels: {kubernetes.io/service-name: good}}
addressType: IPv4
ports: [{name: p, port: 8080}]
endpoints: [{addresses: [10.244.1.2]}, {addresses: [10.244.1.3]}]
---
apiVersion: v1
kind: Service
metadata:
  name: bad
  namespace: a
  annotations: {kpr.io/ipvs-scheduler: fastest, kpr.io/ipvs-forward: tun}
spec: {clusterIP: 10.96.2.2, ports: [{name: p, port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: bad-1, namespace: a, labels: {kubernetes.io/service-name: bad}}
addressType: IPv4
ports: [{name: p, port: 8080}]
endpoints: [{addresses: [10.244.1.2]}]
"#;
    let mut r = LoadReport::default();
    load_text("ipvs.yaml", y, &mut r);
    let d = compute(&r.objects, &NodeInfo { name: "me".into(), ..Default::default() }, &ModelConfig::default());
    let good = d.frontends.values().find(|f| &*f.service == "a/good:p").expect("good programmed");
    assert_eq!(good.ipvs.scheduler.as_deref(), Some("wlc"));
    assert_eq!(good.ipvs.forward, proxy_agent::model::IpvsForward::DirectRouting);
    assert_eq!(good.ipvs.weights.len(), 2);
    let bad = d.frontends.values().find(|f| &*f.service == "a/bad:p").expect("bad still programmed");
    // Unknown scheduler: the configured one; tun with port != targetPort: NAT.
    assert_eq!((bad.ipvs.scheduler.as_deref(), bad.ipvs.forward), (None, proxy_agent::model::IpvsForward::Nat));
    let errs: Vec<String> = d.problems().map(|e| e.to_string()).collect();
    let has = |object: &str, field: &str| errs.iter().any(|e| e.contains(object) && e.contains(field));
    assert!(has("Service a/good", "metadata.annotations[kpr.io/ipvs-weights][1]"), "{errs:#?}");
    assert!(has("Service a/bad", "metadata.annotations[kpr.io/ipvs-scheduler]"), "{errs:#?}");
    assert!(has("Service a/bad", "metadata.annotations[kpr.io/ipvs-forward]"), "{errs:#?}");
    assert_eq!(errs.len(), 3, "{errs:#?}");
}

/// A dual-stack Service: its IPv4 half is programmed, and every IPv6 part (addresses, the IPv6
/// EndpointSlice) and an SCTP port are reported with the NotSupported reason, not skipped in
/// silence.
#[test]
fn ipv6_and_sctp_parts_are_reported_not_skipped() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: dual, namespace: g}
spec:
  type: LoadBalancer
  clusterIP: 10.96.3.1
  clusterIPs: [10.96.3.1, "fd00::3:1"]
  ipFamilies: [IPv4, IPv6]
  externalIPs: ["2001:db8::1"]
  ports: [{name: http, port: 80, nodePort: 30080}, {name: sig, port: 9, protocol: SCTP}]
status: {loadBalancer: {ingress: [{ip: 192.0.2.30}, {ip: "2001:db8::30"}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dual-4, namespace: g, labels: {kubernetes.io/service-name: dual}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.30], conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dual-6, namespace: g, labels: {kubernetes.io/service-name: dual}}
addressType: IPv6
ports: [{name: http, port: 8080}]
endpoints: [{addresses: ["fd00:10:244::30"], conditions: {ready: true}}]
"#;
    let mut r = LoadReport::default();
    load_text("dual.yaml", text, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["198.18.0.1".parse().unwrap()], zone: None };
    let d = compute(&r.objects, &node, &ModelConfig::default());
    assert!(d.frontends.keys().all(|k| k.ip.is_ipv4()));
    assert!(
        d.frontends.keys().any(|k| k.ip.to_string() == "10.96.3.1") && d.frontends.keys().any(|k| k.ip.to_string() == "192.0.2.30"),
        "the IPv4 half is programmed"
    );
    let reported: Vec<(String, String, &str)> = d.problems().map(|e| (e.object.clone(), e.field.clone(), e.reason)).collect();
    for (object, field) in [
        ("Service g/dual", "spec.clusterIPs"),
        ("Service g/dual", "spec.externalIPs[0]"),
        ("Service g/dual", "status.loadBalancer.ingress[1].ip"),
        ("Service g/dual", "spec.ports[1].protocol"),
        ("EndpointSlice g/dual-6", "addressType"),
    ] {
        assert!(
            reported.iter().any(|(o, f, reason)| o == object && f == field && *reason == proxy_agent::model::errors::NOT_SUPPORTED),
            "{object} {field} not reported: {reported:?}"
        );
    }
}

/// SCTP ports where the data plane forwards SCTP (IPVS mode): frontends like TCP's, with the
/// EndpointSlice's SCTP ports as backends; nothing reported.
#[test]
fn sctp_ports_are_programmed_where_the_plane_forwards_sctp() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: sig, namespace: g}
spec:
  type: NodePort
  clusterIP: 10.96.3.2
  ports: [{name: s, port: 9000, targetPort: 8080, protocol: SCTP, nodePort: 30090}, {name: t, port: 9000, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sig-1, namespace: g, labels: {kubernetes.io/service-name: sig}}
addressType: IPv4
ports: [{name: s, port: 8080, protocol: SCTP}, {name: t, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.31], conditions: {ready: true}}]
"#;
    let mut r = LoadReport::default();
    load_text("sctp.yaml", text, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["198.18.0.1".parse().unwrap()], zone: None };
    let d = compute(&r.objects, &node, &ModelConfig { sctp: true, ..Default::default() });
    assert_eq!(d.problems().count(), 0, "{:?}", d.problems().collect::<Vec<_>>());
    let dump = d.dump();
    for line in [
        "frontend 10.96.3.2:9000/SCTP both clusterip g/sig:s",
        "frontend 198.18.0.1:30090/SCTP both nodeport g/sig:s",
        "frontend 10.96.3.2:9000/TCP both clusterip g/sig:t",
    ] {
        assert!(dump.lines().any(|l| l.starts_with(line)), "{line} missing:\n{dump}");
    }
    assert!(dump.contains("  backend 10.244.1.31:8080"), "{dump}");
    // The same objects where the plane does not forward SCTP: the port is reported, TCP kept.
    let d = compute(&r.objects, &node, &ModelConfig::default());
    assert!(d.frontends.keys().all(|k| k.proto == proxy_agent::model::Protocol::Tcp));
    assert_eq!(d.problems().map(|e| e.field.as_str()).collect::<Vec<_>>(), ["spec.ports[0].protocol"]);
}

/// kube-proxy's masqueradeAll masquerades traffic to a ClusterIP, and only that: a NodePort's
/// traffic keeps its externalTrafficPolicy's (Local: the client's address, from outside and
/// from pods alike; Cluster: masqueraded anyway).
#[test]
fn masquerade_all_masquerades_cluster_ips_only() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: local, namespace: g}
spec: {type: NodePort, clusterIP: 10.96.4.1, externalTrafficPolicy: Local, ports: [{name: p, port: 80, targetPort: 8080, nodePort: 30091}]}
---
apiVersion: v1
kind: Service
metadata: {name: cluster, namespace: g}
spec: {type: NodePort, clusterIP: 10.96.4.2, ports: [{name: p, port: 80, targetPort: 8080, nodePort: 30092}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-1, namespace: g, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports: [{name: p, port: 8080}]
endpoints: [{addresses: [10.244.1.41], conditions: {ready: true}, nodeName: me}, {addresses: [10.244.2.41], conditions: {ready: true}, nodeName: other}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: cluster-1, namespace: g, labels: {kubernetes.io/service-name: cluster}}
addressType: IPv4
ports: [{name: p, port: 8080}]
endpoints: [{addresses: [10.244.1.42], conditions: {ready: true}, nodeName: me}]
"#;
    let mut r = LoadReport::default();
    load_text("masq-all.yaml", text, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["198.18.0.1".parse().unwrap()], zone: None };
    // "scope flags" of each of a frontend's entries, sorted.
    let flags = |d: &proxy_agent::model::DesiredState, frontend: &str| -> Vec<String> {
        let mut v: Vec<String> = d
            .dump()
            .lines()
            .filter(|l| l.starts_with(&format!("frontend {frontend} ")))
            .map(|l| format!("{} {}", l.split_whitespace().nth(2).unwrap(), l.split("flags=").nth(1).unwrap().split(' ').next().unwrap()))
            .collect();
        v.sort();
        v
    };
    for masquerade_all in [false, true] {
        let d = compute(&r.objects, &node, &ModelConfig { masquerade_all, ..ModelConfig::default() });
        let cluster_ip = if masquerade_all { "both masq" } else { "both -" };
        assert_eq!(flags(&d, "10.96.4.1:80/TCP"), [cluster_ip], "masqueradeAll {masquerade_all}");
        assert_eq!(flags(&d, "10.96.4.2:80/TCP"), [cluster_ip], "masqueradeAll {masquerade_all}");
        // externalTrafficPolicy Local: the external entry keeps the client, the internal one
        // (pods) is not masqueraded either.
        assert_eq!(flags(&d, "198.18.0.1:30091/TCP"), ["external preserve-source", "internal -"], "masqueradeAll {masquerade_all}");
        assert_eq!(flags(&d, "198.18.0.1:30092/TCP"), ["both masq"], "masqueradeAll {masquerade_all}");
    }
}

/// Where the data plane serves IPv6 (IPVS mode): a dual-stack Service gets frontends of both
/// families, each with its own family's endpoints, NodePorts on the node's addresses of each
/// family, and each LoadBalancer IP its own family's source ranges. An IPv6 address of a Service
/// with no IPv6 clusterIP is reported, as kube-proxy serves none of it.
#[test]
fn dual_stack_services_get_frontends_per_family_where_the_plane_serves_ipv6() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: dual, namespace: g}
spec:
  type: LoadBalancer
  clusterIP: 10.96.3.1
  clusterIPs: [10.96.3.1, "fd00::3:1"]
  ipFamilies: [IPv4, IPv6]
  externalTrafficPolicy: Local
  loadBalancerSourceRanges: [203.0.113.0/24, "2001:db8:1::/48"]
  ports: [{name: http, port: 80, nodePort: 30080}]
status: {loadBalancer: {ingress: [{ip: 192.0.2.30}, {ip: "2001:db8::30"}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dual-4, namespace: g, labels: {kubernetes.io/service-name: dual}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.244.1.30], conditions: {ready: true}, nodeName: me}
- {addresses: [10.244.2.30], conditions: {ready: true}, nodeName: other}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dual-6, namespace: g, labels: {kubernetes.io/service-name: dual}}
addressType: IPv6
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: ["fd00:10:244::30"], conditions: {ready: true}, nodeName: other}
- {addresses: ["10.244.9.9"], conditions: {ready: true}, nodeName: other}
---
apiVersion: v1
kind: Service
metadata: {name: v4only, namespace: g}
spec:
  clusterIP: 10.96.3.2
  externalIPs: ["2001:db8::2", 192.0.2.2]
  ports: [{name: http, port: 80}]
"#;
    let mut r = LoadReport::default();
    load_text("dual.yaml", text, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["198.18.0.1".parse().unwrap(), "fd00:198::1".parse().unwrap()], zone: None };
    let d = compute(&r.objects, &node, &ModelConfig { ipv6: Ipv6Reach::All, ..ModelConfig::default() });
    let want = "\
frontend 10.96.3.1:80/TCP both clusterip g/dual:http sched=random affinity=0 flags=- ranges=
  backend 10.244.1.30:8080
  backend 10.244.2.30:8080
frontend 10.96.3.2:80/TCP both clusterip g/v4only:http sched=random affinity=0 flags=- ranges=
frontend 192.0.2.2:80/TCP both externalip g/v4only:http sched=random affinity=0 flags=masq ranges=
frontend 192.0.2.30:80/TCP internal loadbalancer g/dual:http sched=random affinity=0 flags=source-ranges ranges=203.0.113.0/24
  backend 10.244.1.30:8080
  backend 10.244.2.30:8080
frontend 192.0.2.30:80/TCP external loadbalancer g/dual:http sched=random affinity=0 flags=preserve-source,source-ranges ranges=203.0.113.0/24
  backend 10.244.1.30:8080
frontend 198.18.0.1:30080/TCP internal nodeport g/dual:http sched=random affinity=0 flags=- ranges=
  backend 10.244.1.30:8080
  backend 10.244.2.30:8080
frontend 198.18.0.1:30080/TCP external nodeport g/dual:http sched=random affinity=0 flags=preserve-source ranges=
  backend 10.244.1.30:8080
frontend [2001:db8::30]:80/TCP internal loadbalancer g/dual:http sched=random affinity=0 flags=source-ranges ranges=2001:db8:1::/48
  backend [fd00:10:244::30]:8080
frontend [2001:db8::30]:80/TCP external loadbalancer g/dual:http sched=random affinity=0 flags=preserve-source,source-ranges,no-local-endpoint ranges=2001:db8:1::/48
frontend [fd00::3:1]:80/TCP both clusterip g/dual:http sched=random affinity=0 flags=- ranges=
  backend [fd00:10:244::30]:8080
frontend [fd00:198::1]:30080/TCP internal nodeport g/dual:http sched=random affinity=0 flags=- ranges=
  backend [fd00:10:244::30]:8080
frontend [fd00:198::1]:30080/TCP external nodeport g/dual:http sched=random affinity=0 flags=preserve-source,no-local-endpoint ranges=
";
    assert_eq!(d.dump(), want, "got:\n{}", d.dump());
    let reported: Vec<(String, String, &str)> = d.problems().map(|e| (e.object.clone(), e.field.clone(), e.reason)).collect();
    assert_eq!(reported.len(), 2, "{reported:?}");
    assert!(reported.iter().any(|(o, f, _)| o == "Service g/v4only" && f == "spec.externalIPs[0]"), "{reported:?}");
    assert!(reported.iter().any(|(o, f, _)| o == "EndpointSlice g/dual-6" && f == "endpoints[1].addresses[0]"), "{reported:?}");
    // Where the plane does not serve IPv6, the same objects give IPv4 frontends only.
    let d4 = compute(&r.objects, &node, &ModelConfig::default());
    assert!(d4.frontends.keys().all(|k| k.ip.is_ipv4()), "{}", d4.dump());
    // eBPF mode: every IPv6 address too (clusterIPs at connect time, the rest per packet from
    // outside the node), the same frontends and reports as IPVS mode's.
    let dc = compute(&r.objects, &node, &ModelConfig { ipv6: Ipv6Reach::AllWithoutFlowFeatures, ..ModelConfig::default() });
    assert_eq!(dc.dump(), want, "got:\n{}", dc.dump());
    let mut reported: Vec<(String, String, &str)> = dc.problems().map(|e| (e.object.clone(), e.field.clone(), e.reason)).collect();
    reported.sort();
    let want: Vec<(String, String, &str)> = [
        ("EndpointSlice g/dual-6", "endpoints[1].addresses[0]", "FieldNotProgrammed"),
        // A Service without an IPv6 clusterIP: the same reason in every mode.
        ("Service g/v4only", "spec.externalIPs[0]", "FieldNotProgrammed"),
    ]
    .into_iter()
    .map(|(o, f, r)| (o.to_string(), f.to_string(), r))
    .collect();
    assert_eq!(reported, want);
    // eBPF mode without its IPv6 masquerade rule: the IPv6 clusterIP and its endpoints; each
    // other IPv6 address is reported.
    let dc = compute(&r.objects, &node, &ModelConfig { ipv6: Ipv6Reach::ClusterIps, ..ModelConfig::default() });
    let v6: Vec<String> = dc.frontends.keys().filter(|k| k.ip.is_ipv6()).map(|k| format!("{}:{} {:?}", k.ip, k.port, k.scope)).collect();
    assert_eq!(v6, ["fd00::3:1:80 Both"], "{}", dc.dump());
    let mut reported: Vec<(String, String, &str)> = dc.problems().map(|e| (e.object.clone(), e.field.clone(), e.reason)).collect();
    reported.sort();
    let want: Vec<(String, String, &str)> = [
        ("EndpointSlice g/dual-6", "endpoints[1].addresses[0]", "FieldNotProgrammed"),
        ("Service g/dual", "spec.ports[0].nodePort", "NotSupported"),
        ("Service g/dual", "status.loadBalancer.ingress[1].ip", "NotSupported"),
        ("Service g/v4only", "spec.externalIPs[0]", "FieldNotProgrammed"),
    ]
    .into_iter()
    .map(|(o, f, r)| (o.to_string(), f.to_string(), r))
    .collect();
    assert_eq!(reported, want);
}

/// eBPF mode keeps every address in its maps' form: an IPv6 clusterIP whose last 96 bits are
/// zero would read as an IPv4 one there, so it is reported, and the IPv4 half is served.
#[test]
fn an_ipv6_cluster_ip_with_an_ipv4_wire_form_is_reported() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: anycast, namespace: g}
spec:
  clusterIP: 10.96.3.3
  clusterIPs: [10.96.3.3, "2001:db8::"]
  ports: [{name: http, port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: six, namespace: g}
spec:
  clusterIP: "fd00::3:4"
  clusterIPs: ["fd00::3:4"]
  ports: [{name: http, port: 80}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: six-1, namespace: g, labels: {kubernetes.io/service-name: six}}
addressType: IPv6
ports: [{name: http, port: 80}]
endpoints:
- {addresses: ["fd00:10:244::4"]}
- {addresses: ["fd00:10::"]}
"#;
    let mut r = LoadReport::default();
    load_text("anycast.yaml", text, &mut r);
    let d = compute(&r.objects, &NodeInfo::default(), &ModelConfig { ipv6: Ipv6Reach::AllWithoutFlowFeatures, ..ModelConfig::default() });
    let want = "\
frontend 10.96.3.3:80/TCP both clusterip g/anycast:http sched=random affinity=0 flags=- ranges=
frontend [fd00::3:4]:80/TCP both clusterip g/six:http sched=random affinity=0 flags=- ranges=
  backend [fd00:10:244::4]:80
";
    assert_eq!(d.dump(), want, "got:\n{}", d.dump());
    let reported: Vec<(String, String, &str)> = d.problems().map(|e| (e.object.clone(), e.field.clone(), e.reason)).collect();
    let want = [("Service g/anycast", "spec.clusterIPs"), ("EndpointSlice g/six-1", "endpoints[1].addresses[0]")]
        .map(|(o, f)| (o.to_string(), f.to_string(), "NotSupported"));
    assert_eq!(reported, want);
    // IPVS mode has no such form: it serves both.
    let d = compute(&r.objects, &NodeInfo::default(), &ModelConfig { ipv6: Ipv6Reach::All, ..ModelConfig::default() });
    assert_eq!(d.frontends.len(), 3, "{}", d.dump());
    assert!(d.problems().next().is_none());
}

/// What eBPF mode does with its IPv4 flow table (maximum age, outlier ejection,
/// least-connection) does not reach IPv6 frontends (clusterIPs balanced at connect time, the rest
/// by a flow table without these features): each such annotation of a Service with one is
/// reported; the IPv4 frontends keep it.
#[test]
fn flow_table_annotations_of_a_service_with_an_ipv6_cluster_ip_are_reported() {
    let text = r#"
apiVersion: v1
kind: Service
metadata:
  name: dual
  namespace: g
  annotations: {kpr.io/max-connection-age: "600", kpr.io/outlier-ejection: "true", kpr.io/scheduler: least-connection}
spec:
  clusterIP: 10.96.3.5
  clusterIPs: [10.96.3.5, "fd00::3:5"]
  ports: [{name: http, port: 80}]
"#;
    let mut r = LoadReport::default();
    load_text("dual.yaml", text, &mut r);
    let cfg = ModelConfig { ipv6: Ipv6Reach::AllWithoutFlowFeatures, max_connection_age: true, outlier_ejection: true, ..ModelConfig::default() };
    let d = compute(&r.objects, &NodeInfo::default(), &cfg);
    let mut reported: Vec<String> = d.problems().map(|e| format!("{} {}", e.field, e.reason)).collect();
    reported.sort();
    assert_eq!(
        reported,
        [
            "metadata.annotations[kpr.io/max-connection-age] NotSupported",
            "metadata.annotations[kpr.io/outlier-ejection] NotSupported",
            "metadata.annotations[kpr.io/scheduler] NotSupported"
        ]
    );
    assert_eq!(d.frontends.len(), 2, "both clusterIPs are programmed: {}", d.dump());
    // IPv4 only: nothing to report.
    let d = compute(&r.objects, &NodeInfo::default(), &ModelConfig { ipv6: Ipv6Reach::None, ..cfg });
    assert_eq!(d.problems().filter(|e| e.field.starts_with("metadata")).count(), 0);
}

/// An incremental sync (the changed Services computed alone, then put in place) gives what a
/// full compute gives, also when a slice moves to another Service, one loses its label, and two
/// Services claim the same address and port.
#[test]
fn incremental_compute_equals_full_compute() {
    let svc = |name: &str, ip: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: i}}\nspec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}]}}\n---\n")
    };
    let slice = |name: &str, owner: Option<&str>, ep: &str| {
        let labels = owner.map(|o| format!(", labels: {{kubernetes.io/service-name: {o}}}")).unwrap_or_default();
        format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: i{labels}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{{addresses: [{ep}]}}]\n---\n")
    };
    let load = |y: String| {
        let mut r = LoadReport::default();
        load_text("i.yaml", &y, &mut r);
        r.objects
    };
    let node = NodeInfo::default();
    let cfg = ModelConfig::default();
    let before = load(
        [
            svc("a", "10.96.2.1"),
            svc("b", "10.96.2.2"),
            svc("c", "10.96.2.3"),
            slice("a-1", Some("a"), "10.244.0.1"),
            slice("b-1", Some("b"), "10.244.0.2"),
            slice("c-1", Some("c"), "10.244.0.3"),
        ]
        .concat(),
    );
    // a-1 moves to b; c-1 loses its label; c claims b's address (c, computed later, holds it).
    let after = load(
        [
            svc("a", "10.96.2.1"),
            svc("b", "10.96.2.2"),
            svc("c", "10.96.2.2"),
            slice("a-1", Some("b"), "10.244.0.1"),
            slice("b-1", Some("b"), "10.244.0.2"),
            slice("c-1", None, "10.244.0.3"),
        ]
        .concat(),
    );
    // The agent recomputes the changed Services and the owners of changed slices, before and after.
    let changed: std::collections::BTreeSet<(String, String)> = ["a", "b", "c"].iter().map(|n| ("i".to_string(), n.to_string())).collect();
    let mut d = compute(&before, &node, &cfg);
    let touched = d.recompute_services(&after, &node, &cfg, &changed);
    let full = compute(&after, &node, &cfg);
    assert_eq!(d.dump(), full.dump());
    assert_eq!(d.by_service, full.by_service);
    assert_eq!(d.problems().map(|e| e.to_string()).collect::<Vec<_>>(), full.problems().map(|e| e.to_string()).collect::<Vec<_>>());
    assert_eq!(touched.len(), 3, "three addresses, each one frontend for both scopes: {touched:?}");
    assert!(full.dump().contains("10.96.2.2:80/TCP both clusterip i/c:http"), "{}", full.dump());
    assert!(full.problems().any(|e| e.object == "EndpointSlice i/c-1" && e.field.contains("kubernetes.io/service-name")));
    // Only b changes back: b's recompute takes its address again; c's index entry is stale and
    // must not remove b's frontends on c's next change.
    let mut d = full.clone();
    let b_only: std::collections::BTreeSet<(String, String)> = [("i".to_string(), "b".to_string())].into();
    d.recompute_services(&after, &node, &cfg, &b_only);
    assert!(d.dump().contains("10.96.2.2:80/TCP both clusterip i/b:http"), "{}", d.dump());
    let c_only: std::collections::BTreeSet<(String, String)> = [("i".to_string(), "c".to_string())].into();
    let mut c_removed = after.clone();
    c_removed.services.remove(&("i".to_string(), "c".to_string()));
    d.recompute_services(&c_removed, &node, &cfg, &c_only);
    assert!(d.dump().contains("10.96.2.2:80/TCP both clusterip i/b:http"), "c's removal keeps b's frontends:\n{}", d.dump());
}

/// A load balancer that puts its IP on the node loops the node's own requests back with that IP
/// as the source: where a loadBalancerSourceRanges entry admits the node, kube-proxy admits the
/// LB IP itself too ("same node to LB, SNATted to LB" in its tests); otherwise it does not.
#[test]
fn source_ranges_admit_the_lb_ip_itself_where_they_admit_the_node() {
    let text = |ranges: &str| {
        format!(
            r#"
apiVersion: v1
kind: Service
metadata: {{name: lb, namespace: g}}
spec: {{type: LoadBalancer, clusterIP: 10.96.5.1, loadBalancerSourceRanges: [{ranges}], ports: [{{name: p, port: 80, nodePort: 30093}}]}}
status: {{loadBalancer: {{ingress: [{{ip: 1.2.3.4}}]}}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: lb-1, namespace: g, labels: {{kubernetes.io/service-name: lb}}}}
addressType: IPv4
ports: [{{name: p, port: 80}}]
endpoints: [{{addresses: [10.244.1.51], conditions: {{ready: true}}, nodeName: me}}]
"#
        )
    };
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["192.168.0.2".parse().unwrap()], zone: None };
    let ranges_of = |yaml: &str| -> Vec<String> {
        let mut r = LoadReport::default();
        load_text("lb.yaml", yaml, &mut r);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        let d = compute(&r.objects, &node, &ModelConfig::default());
        let fe = d.frontends.iter().find(|(k, _)| k.ip.to_string() == "1.2.3.4").expect("the LB frontend").1;
        fe.source_ranges.iter().map(|n| n.to_string()).collect()
    };
    assert_eq!(ranges_of(&text("192.168.0.0/24, ' 203.0.113.0/25'")), ["192.168.0.0/24", "203.0.113.0/25", "1.2.3.4/32"]);
    assert_eq!(ranges_of(&text("203.0.113.0/25")), ["203.0.113.0/25"]);
}

/// `ipMode: Proxy` (KEP-1860): the load balancer proxies that address itself, so kube-proxy
/// programs nothing for it; a `VIP` address beside it is served as before.
#[test]
fn an_ip_mode_proxy_address_is_left_to_the_load_balancer() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: g}
spec: {type: LoadBalancer, clusterIP: 10.96.6.1, ports: [{name: p, port: 80, nodePort: 30094}]}
status: {loadBalancer: {ingress: [{ip: 1.2.3.4, ipMode: Proxy}, {ip: 5.6.7.8, ipMode: VIP}, {ip: 9.10.11.12}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: g, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: p, port: 80}]
endpoints: [{addresses: [10.244.1.61], conditions: {ready: true}, nodeName: me}]
"#;
    let mut r = LoadReport::default();
    load_text("ip-mode.yaml", text, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let node = NodeInfo { name: "me".into(), nodeport_addresses: vec!["192.168.0.2".parse().unwrap()], zone: None };
    let d = compute(&r.objects, &node, &ModelConfig::default());
    let addrs: std::collections::BTreeSet<String> = d.frontends.keys().map(|k| k.ip.to_string()).collect();
    assert!(!addrs.contains("1.2.3.4"), "{addrs:?}");
    assert!(addrs.contains("5.6.7.8") && addrs.contains("9.10.11.12") && addrs.contains("10.96.6.1"), "{addrs:?}");
    assert!(d.problems().next().is_none());
}
