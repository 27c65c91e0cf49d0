//! IPVS mode's set matching (`kpr_tc_ipset`) through BPF_PROG_TEST_RUN, both families: the
//! real program loaded into the running kernel (IPVS itself is not needed to run it), its set
//! maps written by the agent's own set computation from a dual-stack desired state. The verdicts
//! are read from the return value and the per-CPU counters (mark, firewall drop, VIP filter).
use aya::programs::{TestRun, TestRunOptions};
use kpr_lab::{
    datapath_config,
    packet::{check_icmp6_port_unreachable, frame6},
    PinDir,
};
use proxy_agent::{
    dataplane::{
        ebpf::{kernel::Datapath, kernel_maps::KernelMaps, maps::DatapathMaps},
        ipvs::{
            desired::{bound_addresses, desired_virtual_servers, SyncSettings},
            sets::{self, KernelSetMaps},
        },
    },
    model::{compute, Ipv6Reach, ModelConfig, NodeInfo},
    source::manifests::{load_text, LoadReport},
};
use proxy_common::{counter, prog_names, user::addr_words};
use std::net::IpAddr;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const MANIFESTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: t}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  loadBalancerSourceRanges: [198.51.100.0/24, "2001:db8:c::/48"]
  ports: [{name: http, port: 80, nodePort: 30080}, {name: dns, port: 53, protocol: UDP, nodePort: 30053}]
status: {loadBalancer: {ingress: [{ip: 192.0.2.80}, {ip: "2001:db8::80"}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-4, namespace: t, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.244.1.2], conditions: {ready: true}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-6, namespace: t, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: ["fd00:244:1::2"], conditions: {ready: true}}]
"#;

const NODE_IP: &str = "198.18.0.1";
const NODE_IP6: &str = "fd00:198::1";

struct SetLab {
    _pins: PinDir,
    dp: Datapath,
    maps: KernelMaps,
}

fn load(name: &str) -> SetLab {
    let pins = PinDir::new(name);
    let caps = proxy_agent::settings::Capacities {
        services: 256,
        backends: 256,
        slots: 256,
        conntrack: 256,
        conntrack_new: 256,
        conntrack6: 256,
        conntrack6_new: 256,
        affinity: 256,
    };
    let mut dp = Datapath::load_object(pins.path(), caps).expect("load the object");
    dp.load_ipset().expect("the set program and KUBE-LOOP-BACK match pass the verifier");
    let node_addrs: Vec<IpAddr> = [NODE_IP, NODE_IP6].iter().map(|a| a.parse().unwrap()).collect();
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: node_addrs.clone(), zone: None };
    let mut r = LoadReport::default();
    load_text("dual.yaml", MANIFESTS, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let desired = compute(&r.objects, &node, &ModelConfig { ipv6: Ipv6Reach::All, sctp: true, ..ModelConfig::default() });
    assert!(desired.problems().next().is_none(), "{:?}", desired.problems().collect::<Vec<_>>());
    let settings = SyncSettings { node_addresses: node_addrs.clone(), ..SyncSettings::default() };
    let want = sets::compute(&desired, &node_addrs, &bound_addresses(&desired_virtual_servers(&desired, &settings)));
    let mut set_maps = KernelSetMaps::open(pins.path()).expect("open the set maps");
    sets::sync(&mut set_maps, &want).expect("write the sets");
    let mut maps = KernelMaps::open(pins.path()).expect("open maps");
    // detectLocalMode ClusterCIDR with a cluster CIDR per family.
    let mut cfg = datapath_config(NODE_IP, Some(("10.244.0.0", 16)));
    cfg.cluster_cidr6 = addr_words("fd00:244::".parse().unwrap());
    cfg.cluster_cidr6_len = 32;
    maps.set_config(cfg).expect("config");
    SetLab { _pins: pins, dp, maps }
}

impl SetLab {
    /// The verdict, and which of (masquerade mark, firewall drop, VIP-filter reject) it counted.
    fn run(&mut self, frame: &[u8]) -> (u32, [u64; 3]) {
        let (verdict, counted, _) = self.run_out(frame);
        (verdict, counted)
    }

    /// `run`, with the frame the program left.
    fn run_out(&mut self, frame: &[u8]) -> (u32, [u64; 3], Vec<u8>) {
        let idx = [counter::SET_MASQ_MARK, counter::SET_DROP_FIREWALL, counter::SET_REJECT_FILTER];
        let before = self.maps.counters().unwrap();
        let mut out = vec![0u8; 1600];
        let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
        let r = self.dp.classifier(prog_names::TC_IPSET).unwrap().test_run(opts).expect("BPF_PROG_TEST_RUN");
        let after = self.maps.counters().unwrap();
        out.truncate(r.data_size_out as usize);
        (r.return_value, idx.map(|i| after[i as usize] - before[i as usize]), out)
    }
}

const MARK: [u64; 3] = [1, 0, 0];
const NONE: [u64; 3] = [0, 0, 0];
const FIREWALL: [u64; 3] = [0, 1, 0];
const FILTER: [u64; 3] = [0, 0, 1];

const TCP: u8 = 6;
const UDP: u8 = 17;
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

#[test]
fn ipv6_set_matching_follows_kube_proxys_ipv6_rules() {
    let mut l = load("ipset6");
    let outside = "2001:db8:99::7";
    let pod = "fd00:244:5::9";
    // KUBE-CLUSTER-IP: a client outside the IPv6 cluster CIDR is masqueraded, a pod is not.
    assert_eq!(l.run(&frame6(outside, "fd00:96::10", TCP, 40000, 80, SYN, &[])), (TC_ACT_OK, MARK));
    assert_eq!(l.run(&frame6(pod, "fd00:96::10", TCP, 40000, 80, SYN, &[])), (TC_ACT_OK, NONE));
    assert_eq!(l.run(&frame6(outside, "fd00:96::10", UDP, 40000, 53, 0, &[])), (TC_ACT_OK, MARK));
    // Past extension headers: hop-by-hop, then destination options (two units), then TCP.
    assert_eq!(l.run(&frame6(outside, "fd00:96::10", TCP, 40001, 80, SYN, &[(0, 0), (60, 2)])), (TC_ACT_OK, MARK));
    // A fragment has no reliable ports: passes unmarked, as an IPv4 one does.
    assert_eq!(l.run(&frame6(outside, "fd00:96::10", TCP, 40002, 80, SYN, &[(44, 0)])), (TC_ACT_OK, NONE));
    // KUBE-NODE-PORT on the node's IPv6 address.
    assert_eq!(l.run(&frame6(outside, NODE_IP6, TCP, 40003, 30080, SYN, &[])), (TC_ACT_OK, MARK));
    // KUBE-LOAD-BALANCER-FW: an IPv6 source inside the IPv6 range passes (masqueraded), one
    // outside is dropped; the IPv4 range does not open the IPv6 address.
    assert_eq!(l.run(&frame6("2001:db8:c:1::5", "2001:db8::80", TCP, 40004, 80, SYN, &[])), (TC_ACT_OK, MARK));
    assert_eq!(l.run(&frame6(outside, "2001:db8::80", TCP, 40005, 80, SYN, &[])), (TC_ACT_SHOT, FIREWALL));
    // KUBE-IPVS-FILTER: a new connection to the VIP at a port no service uses is refused with
    // ICMPv6 port unreachable, sent back out of the interface; a packet of an existing one passes.
    let syn = frame6(outside, "fd00:96::10", TCP, 40006, 81, SYN, &[]);
    let (verdict, counted, reply) = l.run_out(&syn);
    assert_eq!((verdict, counted), (TC_ACT_REDIRECT, FILTER));
    check_icmp6_port_unreachable(&reply, &syn);
    assert_eq!(l.run(&frame6(outside, "fd00:96::10", TCP, 40006, 81, ACK, &[])), (TC_ACT_OK, NONE));
    // The IPv4 address of the same bits never matches an IPv6 entry, nor the other way round:
    // traffic to an unknown IPv6 address passes untouched.
    assert_eq!(l.run(&frame6(outside, "fd00:96::11", TCP, 40007, 80, SYN, &[])), (TC_ACT_OK, NONE));
}

/// KUBE-LOOP-BACK, the xt_bpf match of the POSTROUTING rule that masquerades hairpin traffic
/// (an endpoint that reached itself through its service): IPv6 past extension headers too.
#[test]
fn ipv6_loop_back_matches_past_extension_headers() {
    let mut l = load("loopback6");
    let mut matches = |frame: &[u8]| -> bool {
        let mut out = vec![0u8; 1600];
        let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
        l.dp.socket_filter(prog_names::LOOPBACK).unwrap().test_run(opts).expect("BPF_PROG_TEST_RUN").return_value != 0
    };
    // The endpoint fd00:244:1::2 serves 8080/TCP and 5353/UDP.
    let ep = "fd00:244:1::2";
    assert!(matches(&frame6(ep, ep, TCP, 40000, 8080, SYN, &[])));
    assert!(matches(&frame6(ep, ep, UDP, 40001, 5353, 0, &[])));
    assert!(matches(&frame6(ep, ep, TCP, 40002, 8080, SYN, &[(0, 0), (60, 2)])), "hop-by-hop and destination options before TCP");
    assert!(!matches(&frame6(ep, ep, TCP, 40003, 8080, SYN, &[(44, 0)])), "a fragment has no reliable ports");
    assert!(!matches(&frame6(ep, ep, TCP, 40004, 9090, SYN, &[])), "no service's endpoint port");
    assert!(!matches(&frame6("fd00:244:5::9", ep, TCP, 40005, 8080, SYN, &[])), "another client: no hairpin");
    assert!(!matches(&frame6(ep, ep, TCP, 40006, 8080, SYN, &[(0, 0); 7])), "more extension headers than are walked");
}
