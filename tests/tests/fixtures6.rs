//! IPv6 packet fixtures through BPF_PROG_TEST_RUN: the uplinks' `kpr_tc_ingress6` (DNAT of
//! traffic from outside to IPv6 NodePorts, externalIPs and LB IPs) and `kpr_tc_egress` (the
//! reply's reverse DNAT), loaded into the running kernel, with maps programmed by the real agent
//! pipeline (manifests -> model -> sync).
use aya::programs::{TestRun, TestRunOptions};
use kpr_lab::{
    datapath_config, ip,
    packet::{check_icmp6_port_unreachable, frame6, icmp6_error, parse6, parse_icmp6_error, Frame, ACK, FIN, RST, SYN, TCP, UDP},
    Loaded,
};
use proxy_agent::{
    dataplane::ebpf::kernel::Datapath,
    dataplane::ebpf::kernel_maps::Hint,
    dataplane::ebpf::maps::{DatapathMaps, Table},
    model::NodeInfo,
};
use proxy_common::{counter, prog_names, CtKey6};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
/// TC_ACT_UNSPEC: not this program's, the next one on the hook (or the stack) decides.
const TC_ACT_NEXT: u32 = u32::MAX;

const NODE_IP: &str = "198.18.0.1";
const NODE_IP6: &str = "fd00:198::1";
const OUTSIDE: &str = "2001:db8:c:1::5";
const BACKEND: &str = "fd00:244:1::2";
const LOCAL_BACKEND: &str = "fd00:244:1::3";

const MANIFESTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: t}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  externalIPs: ["2001:db8:e::10"]
  loadBalancerSourceRanges: [198.51.100.0/24, "2001:db8:c::/48"]
  ports: [{name: http, port: 80, nodePort: 30080}, {name: dns, port: 53, protocol: UDP, nodePort: 30053}]
status: {loadBalancer: {ingress: [{ip: 192.0.2.80}, {ip: "2001:db8::80"}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-6, namespace: t, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: ["fd00:244:1::2"], conditions: {ready: true}, nodeName: node-b}]
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: t}
spec:
  type: NodePort
  clusterIP: "fd00:96::11"
  clusterIPs: ["fd00:96::11"]
  ipFamilies: [IPv6]
  externalTrafficPolicy: Local
  ports: [{name: http, port: 80, nodePort: 30081}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-6, namespace: t, labels: {kubernetes.io/service-name: local}}
addressType: IPv6
ports: [{name: http, port: 8080}]
endpoints: [{addresses: ["fd00:244:1::3"], conditions: {ready: true}, nodeName: node-a}]
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: t}
spec:
  type: NodePort
  clusterIP: "fd00:96::12"
  clusterIPs: ["fd00:96::12"]
  ipFamilies: [IPv6]
  ports: [{name: http, port: 80, nodePort: 30082}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: empty-6, namespace: t, labels: {kubernetes.io/service-name: empty}}
addressType: IPv6
ports: [{name: http, port: 8080}]
endpoints: []
"#;

fn load(name: &str) -> Loaded {
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP), ip(NODE_IP6)], zone: None };
    Loaded::new(name, MANIFESTS, &node, datapath_config(NODE_IP, Some(("10.244.0.0", 16))))
}

fn run(dp: &mut Datapath, program: &'static str, frame: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; 1600];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
    let r = dp.classifier(program).unwrap().test_run(opts).expect("BPF_PROG_TEST_RUN");
    out.truncate(r.data_size_out as usize);
    (r.return_value, out)
}

/// The uplink's IPv6 ingress.
fn ingress(l: &mut Loaded, frame: &[u8]) -> (u32, Vec<u8>) {
    run(&mut l.dp, prog_names::TC_INGRESS6, frame)
}

/// TC egress (the interface the reply leaves by).
fn egress(l: &mut Loaded, frame: &[u8]) -> (u32, Vec<u8>) {
    run(&mut l.dp, prog_names::TC_EGRESS, frame)
}

fn counter_of(l: &Loaded, idx: u32) -> u64 {
    l.maps.counters().unwrap()[idx as usize]
}

/// A handshake from outside to `vip`:`vport`: the SYN's DNAT (to `backend`:8080), the SYN-ACK's
/// reverse DNAT at egress, the ACK to the same backend. Checksums stay valid throughout.
fn handshake(l: &mut Loaded, sport: u16, vip: &str, vport: u16, backend: &str, ext: &[(u8, u8)]) {
    let (v, o) = ingress(l, &frame6(OUTSIDE, vip, TCP, sport, vport, SYN, ext));
    assert_eq!(v, TC_ACT_OK);
    let fwd = if ext.is_empty() { parse6(&o) } else { parse6_past_ext(&o, ext) };
    assert_eq!((fwd.src, fwd.sport, fwd.dst, fwd.dport), (OUTSIDE.parse().unwrap(), sport, backend.parse().unwrap(), 8080), "DNAT to {vip}");
    assert!(fwd.l4_csum_ok, "the DNAT keeps the TCP checksum valid");
    let (v, back) = egress(l, &frame6(backend, OUTSIDE, TCP, 8080, sport, SYN | ACK, &[]));
    assert_eq!(v, TC_ACT_OK);
    let back = parse6(&back);
    assert_eq!((back.src, back.sport, back.dst, back.dport), (vip.parse().unwrap(), vport, OUTSIDE.parse().unwrap(), sport), "reverse DNAT");
    assert!(back.l4_csum_ok, "the reverse DNAT keeps the TCP checksum valid");
    let (_, o) = ingress(l, &frame6(OUTSIDE, vip, TCP, sport, vport, ACK, &[]));
    let ack = parse6(&o);
    assert_eq!((ack.dst, ack.dport), (backend.parse().unwrap(), 8080), "the flow keeps its backend");
    assert!(ack.l4_csum_ok);
}

/// `parse6` of a frame whose extension headers (`ext`) sit between IPv6 and L4: the same frame
/// without them (their bytes are not in the L4 checksum).
fn parse6_past_ext(f: &[u8], ext: &[(u8, u8)]) -> kpr_lab::packet::Parsed6 {
    let ext_len: usize = ext.iter().map(|e| (usize::from(e.1) + 1) * 8).sum();
    let mut g = f[..54].to_vec();
    g[20] = TCP;
    let len = u16::from_be_bytes([f[18], f[19]]) as usize - ext_len;
    g[18..20].copy_from_slice(&(len as u16).to_be_bytes());
    g.extend_from_slice(&f[54 + ext_len..]);
    parse6(&g)
}

#[test]
fn ipv6_nodeport_lb_ip_and_external_ip_from_outside_dnat_and_reverse_dnat() {
    let mut l = load("fx6-dnat");
    let snat = counter_of(&l, counter::SNAT);
    handshake(&mut l, 40000, NODE_IP6, 30080, BACKEND, &[]);
    handshake(&mut l, 40001, "2001:db8::80", 80, BACKEND, &[]);
    handshake(&mut l, 40002, "2001:db8:e::10", 80, BACKEND, &[]);
    // externalTrafficPolicy Cluster: each new flow is marked for netfilter's masquerade.
    assert_eq!(counter_of(&l, counter::SNAT) - snat, 3);
    // Past hop-by-hop and destination options headers.
    handshake(&mut l, 40003, NODE_IP6, 30080, BACKEND, &[(0, 0), (60, 2)]);
}

#[test]
fn ipv6_one_client_port_to_two_frontends_with_one_backend_gets_two_reply_tuples() {
    let mut l = load("fx6-clash");
    let collisions = counter_of(&l, counter::SNAT_PORT_COLLISION);
    let (_, a) = ingress(&mut l, &frame6(OUTSIDE, "2001:db8::80", TCP, 40100, 80, SYN, &[]));
    let (_, b) = ingress(&mut l, &frame6(OUTSIDE, "2001:db8:e::10", TCP, 40100, 80, SYN, &[]));
    let (a, b) = (parse6(&a), parse6(&b));
    let backend: std::net::Ipv6Addr = BACKEND.parse().unwrap();
    assert_eq!((a.dst, a.sport), (backend, 40100), "the first flow keeps its port");
    assert_eq!(b.dst, backend);
    assert_ne!(b.sport, 40100, "the second flow's port moves");
    assert!(b.l4_csum_ok);
    assert_eq!(counter_of(&l, counter::SNAT_PORT_COLLISION), collisions + 1);
    // Each SYN-ACK goes back through its own frontend.
    for (sport, frontend) in [(b.sport, "2001:db8:e::10"), (40100, "2001:db8::80")] {
        let (_, r) = egress(&mut l, &frame6(BACKEND, OUTSIDE, TCP, 8080, sport, SYN | ACK, &[]));
        let r = parse6(&r);
        assert_eq!((r.src, r.sport, r.dport), (frontend.parse().unwrap(), 80, 40100));
        assert!(r.l4_csum_ok);
    }
}

#[test]
fn ipv6_a_reply_tuple_held_by_an_assured_flow_moves_the_new_flows_port_through_a_rebuilt_hint() {
    let mut l = load("fx6-clash-assured");
    // The assured table's hint as the collector keeps it, rebuilt from the (empty) table: the
    // handshake's promotion sets the flow's bits (fixtures.rs checks a rebuild that reads them).
    proxy_agent::dataplane::ebpf::kernel_maps::rebuild_hints_now(l.pins.path()).unwrap();
    handshake(&mut l, 40200, "2001:db8::80", 80, BACKEND, &[]);
    let hint = Hint::<proxy_common::CtBucket6>::open(l.pins.path()).unwrap();
    let held = l.maps.ipv6_flows(Table::Assured).unwrap();
    assert!(held.len() == 2 && held.iter().all(|(k, _)| hint.may_hold(k)), "the flow's two entries are assured and hinted");
    let others = (1..=1000u16).map(|i| CtKey6 { sport: (20000 + i).to_be(), ..held[0].0 }).filter(|k| hint.may_hold(k)).count();
    assert!(others < 10, "{others} of 1,000 keys never seen are hinted");
    // The same client port to another frontend with the same backend: the assured flow holds
    // the reply tuple, so the port moves.
    let collisions = counter_of(&l, counter::SNAT_PORT_COLLISION);
    let (_, b) = ingress(&mut l, &frame6(OUTSIDE, "2001:db8:e::10", TCP, 40200, 80, SYN, &[]));
    let b = parse6(&b);
    assert_eq!(b.dst, BACKEND.parse::<std::net::Ipv6Addr>().unwrap());
    assert_ne!(b.sport, 40200, "the assured flow holds the reply tuple");
    assert!(b.l4_csum_ok);
    assert_eq!(counter_of(&l, counter::SNAT_PORT_COLLISION), collisions + 1);
    let (_, r) = egress(&mut l, &frame6(BACKEND, OUTSIDE, TCP, 8080, b.sport, SYN | ACK, &[]));
    let r = parse6(&r);
    assert_eq!((r.src, r.sport, r.dport), ("2001:db8:e::10".parse().unwrap(), 80, 40200));
}

#[test]
fn ipv6_traffic_policy_local_keeps_the_client_address() {
    let mut l = load("fx6-local");
    let snat = counter_of(&l, counter::SNAT);
    handshake(&mut l, 40010, NODE_IP6, 30081, LOCAL_BACKEND, &[]);
    assert_eq!(counter_of(&l, counter::SNAT), snat, "not marked for masquerade");
}

#[test]
fn ipv6_udp_dnat_keeps_a_valid_checksum_and_the_flow_is_assured_by_the_clients_next_datagram() {
    let mut l = load("fx6-udp");
    let (v, o) = ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, UDP, 40020, 30053, 0, &[]));
    assert_eq!(v, TC_ACT_OK);
    let f = parse6(&o);
    assert_eq!((f.dst, f.dport, f.proto), (BACKEND.parse().unwrap(), 5353, UDP));
    assert!(f.l4_csum_ok, "NAT66 updates the UDP checksum (mandatory in IPv6)");
    let count = |l: &Loaded, t: Table| l.maps.ipv6_flows(t).unwrap().iter().filter(|(k, _)| k.proto == UDP).count();
    assert_eq!((count(&l, Table::Embryonic), count(&l, Table::Assured)), (2, 0), "a new UDP flow starts embryonic");
    let (_, back) = egress(&mut l, &frame6(BACKEND, OUTSIDE, UDP, 5353, 40020, 0, &[]));
    let back = parse6(&back);
    assert_eq!((back.src, back.sport), (NODE_IP6.parse().unwrap(), 30053));
    assert!(back.l4_csum_ok);
    assert_eq!((count(&l, Table::Embryonic), count(&l, Table::Assured)), (2, 0), "an answer alone assures nothing");
    // The client's datagram after the answer makes the flow assured (a flood from spoofed
    // sources never does, so it evicts only flows not assured).
    let assured = counter_of(&l, counter::FLOW_ASSURED);
    let (_, o) = ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, UDP, 40020, 30053, 0, &[]));
    assert_eq!(parse6(&o).dst, f.dst);
    assert_eq!((count(&l, Table::Embryonic), count(&l, Table::Assured)), (0, 2));
    assert_eq!(counter_of(&l, counter::FLOW_ASSURED), assured + 1);
    let (_, back) = egress(&mut l, &frame6(BACKEND, OUTSIDE, UDP, 5353, 40020, 0, &[]));
    assert_eq!(parse6(&back).sport, 30053);
}

#[test]
fn ipv6_source_ranges_no_endpoints_and_unknown_traffic() {
    let mut l = load("fx6-policy");
    // loadBalancerSourceRanges: the IPv6 range admits its clients, not others.
    let (v, _) = ingress(&mut l, &frame6("2001:db8:d::5", "2001:db8::80", TCP, 40030, 80, SYN, &[]));
    assert_eq!(v, TC_ACT_SHOT, "outside 2001:db8:c::/48");
    // No endpoints: ICMPv6 port unreachable, back out of the uplink.
    let syn = frame6(OUTSIDE, NODE_IP6, TCP, 40031, 30082, SYN, &[]);
    let (v, reply) = ingress(&mut l, &syn);
    assert_eq!(v, TC_ACT_REDIRECT);
    check_icmp6_port_unreachable(&reply, &syn);
    // What is no frontend, a fragment, IPv4, and an IPv6 address with an IPv4 frontend's map
    // form (10.96.0.10's words) go on untouched, to whatever runs next on the hook.
    for f in [
        frame6(OUTSIDE, NODE_IP6, TCP, 40032, 22, SYN, &[]),
        frame6(OUTSIDE, NODE_IP6, TCP, 40033, 30080, SYN, &[(44, 0)]),
        Frame::tcp("203.0.113.5", 40034, NODE_IP, 30080, SYN).bytes(),
        frame6(OUTSIDE, "a60:a::", TCP, 40035, 80, SYN, &[]),
    ] {
        assert_eq!(ingress(&mut l, &f), (TC_ACT_NEXT, f.clone()));
    }
}

#[test]
fn ipv6_fin_closes_and_a_new_syn_starts_a_new_flow() {
    let mut l = load("fx6-fin");
    handshake(&mut l, 40040, NODE_IP6, 30080, BACKEND, &[]);
    let new_flows = counter_of(&l, counter::NEW_FLOW);
    let (_, o) = ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, TCP, 40040, 30080, FIN | ACK, &[]));
    assert_eq!(parse6(&o).dst, BACKEND.parse::<std::net::Ipv6Addr>().unwrap());
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new_flows);
    handshake(&mut l, 40040, NODE_IP6, 30080, BACKEND, &[]);
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new_flows + 1, "the SYN on a closing tuple is a new flow");
    // The backend's reset (at egress, on the reply entry) closes the flow too.
    let (_, o) = egress(&mut l, &frame6(BACKEND, OUTSIDE, TCP, 8080, 40040, RST | ACK, &[]));
    assert_eq!(parse6(&o).src, NODE_IP6.parse::<std::net::Ipv6Addr>().unwrap());
    handshake(&mut l, 40040, NODE_IP6, 30080, BACKEND, &[]);
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new_flows + 2, "a SYN after the backend's reset is a new flow");
}

#[test]
fn ipv6_icmp_errors_about_a_flow_are_translated_at_both_hooks() {
    let mut l = load("fx6-icmp");
    handshake(&mut l, 40050, NODE_IP6, 30080, BACKEND, &[]);
    let translated = counter_of(&l, counter::ICMP_ERROR_NAT);
    // A router on the client's side: packet too big about a reply the node sent (frontend ->
    // client). It goes to the backend, quoting backend -> client.
    let reply = frame6(NODE_IP6, OUTSIDE, TCP, 30080, 40050, ACK, &[]);
    let router = "2001:db8:ffff::1";
    let ptb = icmp6_error(router, NODE_IP6, 2, 0, 1280, &reply, reply.len() - 14);
    let (v, o) = ingress(&mut l, &ptb);
    assert_eq!(v, TC_ACT_OK);
    let e = parse_icmp6_error(&o);
    assert_eq!((e.src, e.dst, e.icmp_type), (router.parse().unwrap(), BACKEND.parse().unwrap(), 2));
    assert_eq!(e.quoted, (BACKEND.parse().unwrap(), 8080, OUTSIDE.parse().unwrap(), 40050));
    assert!(e.csum_ok, "the ICMPv6 checksum covers the new outer addresses and the new quote");
    assert_eq!(e.quoted_l4_csum_ok, Some(true), "the quoted TCP checksum follows its addresses and ports");

    // The backend's answer to a UDP datagram (port unreachable), on its way to the client:
    // from the frontend, quoting client -> frontend.
    let (_, fwd) = ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, UDP, 40051, 30053, 0, &[]));
    let fwd = parse6(&fwd);
    let sent = frame6(OUTSIDE, BACKEND, UDP, fwd.sport, 5353, 0, &[]);
    let unreach = icmp6_error(BACKEND, OUTSIDE, 1, 4, 0, &sent, 48);
    let (v, o) = egress(&mut l, &unreach);
    assert_eq!(v, TC_ACT_OK);
    let e = parse_icmp6_error(&o);
    assert_eq!((e.src, e.dst, e.icmp_type), (NODE_IP6.parse().unwrap(), OUTSIDE.parse().unwrap(), 1));
    assert_eq!(e.quoted, (OUTSIDE.parse().unwrap(), 40051, NODE_IP6.parse().unwrap(), 30053));
    assert!(e.csum_ok);
    assert_eq!(counter_of(&l, counter::ICMP_ERROR_NAT) - translated, 2);

    // An error about no flow of ours, and an echo request, pass untouched.
    let stranger = frame6(NODE_IP6, "2001:db8:c:9::9", TCP, 22, 50000, ACK, &[]);
    let other = icmp6_error(router, NODE_IP6, 2, 0, 1280, &stranger, stranger.len() - 14);
    let echo = icmp6_error(OUTSIDE, NODE_IP6, 128, 0, 1, &stranger, 48);
    for f in [other, echo] {
        assert_eq!(ingress(&mut l, &f), (TC_ACT_NEXT, f.clone()));
    }
    assert_eq!(counter_of(&l, counter::ICMP_ERROR_NAT) - translated, 2);
}

#[test]
fn an_ipv6_syn_flood_evicts_only_embryonic_flows() {
    let mut l = load("fx6-flood");
    handshake(&mut l, 40060, NODE_IP6, 30080, BACKEND, &[]);
    let assured = |l: &Loaded| {
        let mut flows = l.maps.ipv6_flows(Table::Assured).unwrap();
        flows.sort_by_key(|(k, _)| *k);
        flows
    };
    let before = assured(&l);
    assert_eq!(before.len(), 2, "the handshake's two entries are assured");
    // Spoofed SYNs from outside, each from another source, none completing: more flows than
    // the assured table holds (65,536 entries, two a flow) and than the embryonic one (32,768).
    let new_flows = counter_of(&l, counter::NEW_FLOW);
    for i in 0..40_000u32 {
        let src = format!("2001:db8:f::{:x}:{:x}", i >> 16, i & 0xffff);
        ingress(&mut l, &frame6(&src, NODE_IP6, TCP, 10_000 + (i % 50_000) as u16, 30080, SYN, &[]));
    }
    assert_eq!(counter_of(&l, counter::NEW_FLOW) - new_flows, 40_000);
    let embryonic = l.maps.ipv6_flows(Table::Embryonic).unwrap().len();
    // Its 4-way buckets keep about 80% of the entries under a flood, never under three quarters
    // (fixtures.rs's flood_fills).
    let capacity = proxy_common::limits::MAX_CONNTRACK6_NEW as usize;
    assert!(embryonic * 4 >= capacity * 3 && embryonic <= capacity, "the flood fills the embryonic table: {embryonic}");
    // A full bucket makes room (its oldest flow), and each eviction is counted: every flood
    // flow the table no longer holds (two entries a flow) was evicted once.
    assert_eq!(counter_of(&l, counter::CT_INSERT_FAILED), 0);
    assert_eq!(counter_of(&l, counter::CT_EMBRYONIC_EVICTED), 40_000 - embryonic as u64 / 2, "evictions counted");
    let after = assured(&l);
    assert!(
        after == before,
        "the flood touched the assured table: {} entries, the held flow's {}",
        after.len(),
        if before.iter().all(|e| after.contains(e)) { "kept" } else { "evicted" }
    );
    // The held flow still answers both ways.
    let (_, o) = ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, TCP, 40060, 30080, ACK, &[]));
    assert_eq!(parse6(&o).dst, BACKEND.parse::<std::net::Ipv6Addr>().unwrap());
    let (_, o) = egress(&mut l, &frame6(BACKEND, OUTSIDE, TCP, 8080, 40060, ACK, &[]));
    assert_eq!(parse6(&o).src, NODE_IP6.parse::<std::net::Ipv6Addr>().unwrap());
    // A handshake during the flood completes, and only then is assured.
    let (_, o) = ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, TCP, 40061, 30080, SYN, &[]));
    assert_eq!(parse6(&o).dst, BACKEND.parse::<std::net::Ipv6Addr>().unwrap());
    assert_eq!(assured(&l).len(), 2, "embryonic: not in the assured table yet");
    let assured_flows = counter_of(&l, counter::FLOW_ASSURED);
    handshake(&mut l, 40061, NODE_IP6, 30080, BACKEND, &[]);
    assert_eq!(assured(&l).len(), 4);
    assert_eq!(counter_of(&l, counter::FLOW_ASSURED) - assured_flows, 1);
}

/// The collector of the IPv6 embryonic table (a preallocated hash: nothing leaves it by itself)
/// deletes, in the kernel's map, the flows idle past their timeouts: a UDP flow never assured at
/// 30 s, a TCP handshake never completed at 60 s; an assured flow is not its business.
#[test]
fn the_collector_deletes_idle_ipv6_embryonic_flows_from_the_kernel_map() {
    use proxy_agent::dataplane::ebpf::{conntrack::Timeouts, conntrack6::Gc6, kernel::monotonic_ns, kernel_maps::KernelEmbryonic6};
    let mut l = load("fx6-gc");
    handshake(&mut l, 40070, NODE_IP6, 30080, BACKEND, &[]);
    ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, UDP, 40071, 30053, 0, &[]));
    ingress(&mut l, &frame6(OUTSIDE, NODE_IP6, TCP, 40072, 30080, SYN, &[]));
    let flows = |l: &Loaded, t: Table| {
        let mut ports: Vec<u16> =
            l.maps.ipv6_flows(t).unwrap().iter().filter(|(k, _)| k.dir == proxy_common::CT_DIR_INGRESS).map(|(k, _)| u16::from_be(k.sport)).collect();
        ports.sort();
        ports
    };
    assert_eq!(flows(&l, Table::Embryonic), [40071, 40072]);
    let mut table = KernelEmbryonic6::open(l.pins.path()).unwrap();
    // A batch of 2^20 entries reads 2^18 buckets: one round covers the whole table.
    let (mut gc, timeouts, now) = (Gc6::new(1 << 20), Timeouts::default(), monotonic_ns());
    let s = 1_000_000_000;
    assert_eq!(gc.round(&mut table, &timeouts, now + 20 * s).unwrap(), 0);
    assert_eq!(gc.round(&mut table, &timeouts, now + 31 * s).unwrap(), 1);
    assert_eq!(flows(&l, Table::Embryonic), [40072]);
    assert_eq!(l.maps.ipv6_flows(Table::Embryonic).unwrap().len(), 2, "the UDP flow's two entries are gone");
    assert_eq!(gc.round(&mut table, &timeouts, now + 61 * s).unwrap(), 1);
    assert!(l.maps.ipv6_flows(Table::Embryonic).unwrap().is_empty());
    assert_eq!(flows(&l, Table::Assured), [40070], "the assured flow stays");
}
