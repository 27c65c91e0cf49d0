//! Packet fixtures through BPF_PROG_TEST_RUN (as Katran and Cilium test their data paths):
//! each case is an input frame, the expected verdict and the expected output frame, run through
//! the real programs, loaded into the running kernel, with maps programmed by the real agent
//! pipeline (manifests -> model -> sync).
use aya::programs::{TestRun, TestRunOptions};
use kpr_tests::{
    datapath_config, ip,
    packet::{parse, Frame, ACK, FIN, ICMP, SYN, TCP, UDP},
    Loaded,
};
use proxy_agent::{kernel::Datapath, maps::DatapathMaps, model::NodeInfo};
use proxy_common::{counter, prog_names};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;

const NODE_IP: &str = "192.0.2.1";

fn svc(name: &str, cluster_ip: &str, port: u16, proto: &str, extra_spec: &str, extra_meta: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: fx\n{extra_meta}spec:\n  clusterIP: {cluster_ip}\n  ports:\n  - name: p\n    port: {port}\n    protocol: {proto}\n{extra_spec}---\n"
    )
}

fn slice(name: &str, port: u16, proto: &str, addrs: &[&str]) -> String {
    let eps: String = addrs.iter().map(|a| format!("- addresses: [\"{a}\"]\n  conditions: {{ready: true}}\n  nodeName: node-a\n")).collect();
    let eps = if eps.is_empty() { "[]\n".to_string() } else { format!("\n{eps}") };
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-x\n  namespace: fx\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n- name: p\n  port: {port}\n  protocol: {proto}\nendpoints: {eps}---\n"
    )
}

const BACKENDS: [&str; 3] = ["10.244.1.1", "10.244.1.2", "10.244.1.3"];
/// Used by no other service, so removing one removes the backend itself.
const WEB: [&str; 3] = ["10.244.2.1", "10.244.2.2", "10.244.2.3"];

fn manifests() -> String {
    let mut y = String::new();
    y += &svc("web", "10.96.0.10", 80, "TCP", "", "");
    y += &slice("web", 8080, "TCP", &WEB);
    y += &svc("sticky", "10.96.0.11", 80, "TCP", "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n", "");
    y += &slice("sticky", 8080, "TCP", &BACKENDS);
    y += &svc("empty", "10.96.0.12", 80, "TCP", "", "");
    y += &slice("empty", 8080, "TCP", &[]);
    y += &svc("empty-udp", "10.96.0.18", 53, "UDP", "", "");
    y += &slice("empty-udp", 53, "UDP", &[]);
    y += &svc("np", "10.96.0.13", 80, "TCP", "  type: NodePort\n", "");
    y = y.replace("    protocol: TCP\n  type: NodePort\n", "    protocol: TCP\n    nodePort: 30080\n  type: NodePort\n");
    y += &slice("np", 8080, "TCP", &["10.244.1.1"]);
    y += "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: fx}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.14\n  loadBalancerSourceRanges: [198.51.100.0/24]\n  ports: [{name: p, port: 443, protocol: TCP, nodePort: 30443}]\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.10}]}}\n---\n";
    y += &slice("lb", 8443, "TCP", &["10.244.1.2"]);
    y += &svc("dns", "10.96.0.15", 53, "UDP", "", "");
    y += &slice("dns", 5353, "UDP", &["10.244.1.3"]);
    y += &svc("hairpin", "10.96.0.16", 80, "TCP", "", "");
    y += &slice("hairpin", 8080, "TCP", &["10.244.1.1"]);
    y += &svc("maglev", "10.96.0.17", 80, "TCP", "", "  annotations: {kpr.io/scheduler: maglev}\n");
    y += &slice("maglev", 8080, "TCP", &BACKENDS);
    y
}

fn load(name: &str) -> Loaded {
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    Loaded::new(name, &manifests(), &node, datapath_config(NODE_IP, Some(("10.244.0.0", 16))))
}

fn run(dp: &mut Datapath, xdp: bool, frame: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; 512];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
    let r = if xdp {
        dp.xdp(prog_names::XDP_INGRESS).unwrap().test_run(opts)
    } else {
        dp.classifier(prog_names::TC_INGRESS).unwrap().test_run(opts)
    }
    .expect("BPF_PROG_TEST_RUN");
    let n = r.data_size_out as usize;
    out.truncate(n);
    (r.return_value, out)
}

fn tc(dp: &mut Datapath, f: &Frame) -> (u32, Vec<u8>) {
    run(dp, false, &f.bytes())
}

fn counter_of(l: &Loaded, idx: u32) -> u64 {
    l.maps.counters().unwrap()[idx as usize]
}

#[test]
fn dnat_established_and_reverse_nat_keep_checksums_valid() {
    let mut l = load("dnat");
    let syn = Frame::tcp("10.244.0.5", 40000, "10.96.0.10", 80, SYN);
    let (v, out) = tc(&mut l.dp, &syn);
    assert_eq!(v, TC_ACT_OK);
    let p = parse(&out);
    assert!(WEB.contains(&p.dst.to_string().as_str()), "dst {}", p.dst);
    assert_eq!((p.src.to_string().as_str(), p.sport, p.dport), ("10.244.0.5", 40000, 8080));
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
    assert_eq!(out.len(), syn.bytes().len());

    // Every later packet of the flow goes to the same backend.
    for _ in 0..5 {
        let (v, out2) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40000, "10.96.0.10", 80, ACK));
        assert_eq!(v, TC_ACT_OK);
        assert_eq!(parse(&out2).dst, p.dst);
    }
    assert!(counter_of(&l, counter::ESTABLISHED) >= 5);

    // The reply from that backend is rewritten back to the VIP.
    let reply = Frame::tcp(&p.dst.to_string(), 8080, "10.244.0.5", 40000, SYN | ACK);
    let (v, out3) = tc(&mut l.dp, &reply);
    assert_eq!(v, TC_ACT_OK);
    let r = parse(&out3);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dst.to_string().as_str(), r.dport), ("10.96.0.10", 80, "10.244.0.5", 40000));
    assert!(r.ip_csum_ok && r.l4_csum_ok, "{r:?}");
    assert!(counter_of(&l, counter::REVERSE_NAT) >= 1);
}

#[test]
fn flow_keeps_its_backend_after_the_backend_set_changes() {
    let mut l = load("ctkeep");
    let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.6", 41000, "10.96.0.10", 80, SYN));
    let chosen = parse(&out).dst;
    // Remove every backend but one that is not the chosen one.
    let other = WEB.iter().find(|b| **b != chosen.to_string()).unwrap();
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    let full = slice("web", 8080, "TCP", &WEB);
    let y = manifests().replace(&full, &slice("web", 8080, "TCP", &[other]));
    assert_ne!(y, manifests());
    let d = kpr_tests::desired(&y, &node);
    l.syncer.sync(&mut l.maps, &d, datapath_config(NODE_IP, Some(("10.244.0.0", 16)))).unwrap();
    let (v, out2) = tc(&mut l.dp, &Frame::tcp("10.244.0.6", 41000, "10.96.0.10", 80, ACK));
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(parse(&out2).dst, chosen, "established flow moved");
    // A new connection only reaches the remaining backend.
    for port in 41001..41011 {
        let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.6", port, "10.96.0.10", 80, SYN));
        assert_eq!(parse(&o).dst.to_string(), *other);
    }
    // A fresh SYN reusing the old tuple after the backend is gone is a new connection.
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.6", 41000, "10.96.0.10", 80, SYN));
    assert_eq!(parse(&o).dst.to_string(), *other);
}

#[test]
fn nodeport_from_outside_is_masqueraded_and_reversed_by_xdp_then_tc() {
    let mut l = load("snat");
    let syn = Frame::tcp("198.18.0.1", 50000, NODE_IP, 30080, SYN);
    let (v, out) = run(&mut l.dp, true, &syn.bytes());
    assert_eq!(v, XDP_PASS);
    let p = parse(&out);
    assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str(), p.dport), (NODE_IP, "10.244.1.1", 8080));
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
    assert!(counter_of(&l, counter::SNAT) >= 1);
    // Reply from the backend to the node's address, seen by TC on the pod interface.
    let reply = Frame::tcp("10.244.1.1", 8080, NODE_IP, p.sport, SYN | ACK);
    let (v, out) = tc(&mut l.dp, &reply);
    assert_eq!(v, TC_ACT_OK);
    let r = parse(&out);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dst.to_string().as_str(), r.dport), (NODE_IP, 30080, "198.18.0.1", 50000));
    assert!(r.ip_csum_ok && r.l4_csum_ok);
}

#[test]
fn clusterip_from_a_pod_is_not_masqueraded_but_hairpin_is() {
    let mut l = load("hairpin");
    let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.7", 42000, "10.96.0.13", 80, SYN));
    assert_eq!(parse(&out).src.to_string(), "10.244.0.7");
    // The only backend of 10.96.0.16 is the client itself: masquerade to the node.
    let (v, out) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 42001, "10.96.0.16", 80, SYN));
    assert_eq!(v, TC_ACT_OK);
    let p = parse(&out);
    assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), (NODE_IP, "10.244.1.1"));
    assert!(p.ip_csum_ok && p.l4_csum_ok);
    let (_, back) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, NODE_IP, p.sport, SYN | ACK));
    let r = parse(&back);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dst.to_string().as_str(), r.dport), ("10.96.0.16", 80, "10.244.1.1", 42001));
}

#[test]
fn client_ip_affinity_pins_then_expires_and_follows_backend_removal() {
    let mut l = load("affinity");
    let mut first = None;
    for port in 43000..43030 {
        let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.8", port, "10.96.0.11", 80, SYN));
        let d = parse(&out).dst;
        assert_eq!(*first.get_or_insert(d), d, "affinity broken at port {port}");
    }
    assert!(counter_of(&l, counter::AFFINITY_HIT) >= 29);
    let pinned = first.unwrap();
    // Age the entry past its timeout: the next flow is scheduled afresh and remembered again.
    let aff = l.maps.affinity().unwrap();
    assert_eq!(aff.len(), 1);
    let (k, mut v) = aff[0];
    v.last_used_ns -= 61_000_000_000;
    let mut m: aya::maps::HashMap<_, proxy_common::AffinityKey, proxy_common::AffinityValue> =
        aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(l.pins.path().join(proxy_common::map_names::AFFINITY)).unwrap()).unwrap().try_into().unwrap();
    m.insert(k, v, 0).unwrap();
    let hits = counter_of(&l, counter::AFFINITY_HIT);
    let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.8", 43100, "10.96.0.11", 80, SYN));
    assert_eq!(counter_of(&l, counter::AFFINITY_HIT), hits, "an expired entry must not count as a hit");
    let fresh = l.maps.affinity().unwrap()[0].1;
    assert!(fresh.last_used_ns > v.last_used_ns + 60_000_000_000);
    assert_eq!(proxy_common::user::words_addr(l.maps.backends().unwrap().into_iter().find(|(id, _)| *id == fresh.backend_id).unwrap().1.addr), parse(&out).dst);
    let _ = pinned;
}

#[test]
fn no_endpoints_rejects_with_icmp_port_unreachable() {
    let mut l = load("reject");
    let syn = Frame::tcp("10.244.0.9", 44000, "10.96.0.12", 80, SYN);
    for xdp in [false, true] {
        let (v, out) = run(&mut l.dp, xdp, &syn.bytes());
        // TC sends it straight back; XDP hands it to the stack, which routes it back.
        assert_eq!(v, if xdp { XDP_PASS } else { TC_ACT_REDIRECT });
        let p = parse(&out);
        assert_eq!(p.proto, ICMP);
        assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), ("10.96.0.12", "10.244.0.9"));
        let (ty, code, qs, qd, qsp, qdp) = p.icmp.unwrap();
        assert_eq!((ty, code), (3, 3));
        assert_eq!((qs.to_string().as_str(), qd.to_string().as_str(), qsp, qdp), ("10.244.0.9", "10.96.0.12", 44000, 80));
        assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
        assert_eq!(out.len(), 70);
        if xdp {
            assert_eq!(p.dst_mac, [2, 0, 0, 0, 0, 0xaa], "to the stack: MACs kept");
        } else {
            assert_eq!(p.dst_mac, [2, 0, 0, 0, 0, 0xbb], "out of the same interface: MACs swapped");
        }
    }
    // UDP too, from a short datagram (the frame grows).
    let (v, out) = tc(&mut l.dp, &Frame::udp("10.244.0.9", 44001, "10.96.0.18", 53, b"x"));
    assert_eq!(v, TC_ACT_REDIRECT);
    let p = parse(&out);
    assert_eq!(p.icmp.map(|i| (i.0, i.1, i.4, i.5)), Some((3, 3, 44001, 53)));
    assert!(p.ip_csum_ok && p.l4_csum_ok && out.len() == 70, "{p:?}");
    assert_eq!(counter_of(&l, counter::REJECT_NO_BACKEND), 3);
}

#[test]
fn load_balancer_source_ranges_are_enforced() {
    let mut l = load("srcrange");
    for xdp in [true, false] {
        let (v, out) = run(&mut l.dp, xdp, &Frame::tcp("198.18.0.2", 45000 + xdp as u16, "203.0.113.10", 443, SYN).bytes());
        assert_eq!(v, if xdp { XDP_DROP } else { TC_ACT_SHOT }, "outside the ranges must drop");
        let _ = out;
        let (v, out) = run(&mut l.dp, xdp, &Frame::tcp("198.51.100.7", 45100 + xdp as u16, "203.0.113.10", 443, SYN).bytes());
        assert_eq!(v, if xdp { XDP_PASS } else { TC_ACT_OK });
        let p = parse(&out);
        assert_eq!((p.dst.to_string().as_str(), p.dport), ("10.244.1.2", 8443));
    }
    assert_eq!(counter_of(&l, counter::DROP_SOURCE_RANGE), 2);
}

#[test]
fn udp_dnat_valid_checksum_and_zero_checksum_stays_zero() {
    let mut l = load("udp");
    let (v, out) = tc(&mut l.dp, &Frame::udp("10.244.0.10", 46000, "10.96.0.15", 53, b"query"));
    assert_eq!(v, TC_ACT_OK);
    let p = parse(&out);
    assert_eq!((p.dst.to_string().as_str(), p.dport, p.proto), ("10.244.1.3", 5353, UDP));
    assert!(p.ip_csum_ok && p.l4_csum_ok && !p.l4_csum_zero);
    let mut f = Frame::udp("10.244.0.10", 46001, "10.96.0.15", 53, b"query");
    f.udp_no_checksum = true;
    for xdp in [false, true] {
        f.sport += 1;
        let (_, out) = run(&mut l.dp, xdp, &f.bytes());
        let p = parse(&out);
        assert_eq!(p.dst.to_string(), "10.244.1.3");
        assert!(p.l4_csum_zero && p.ip_csum_ok, "{p:?}");
    }
}

#[test]
fn maglev_is_consistent_per_flow() {
    let mut l = load("maglev");
    let mut seen = std::collections::BTreeSet::new();
    for port in 47000..47060 {
        let f = Frame::tcp("10.244.0.11", port, "10.96.0.17", 80, SYN);
        let (_, a) = tc(&mut l.dp, &f);
        seen.insert(parse(&a).dst);
        // The same tuple after its conntrack entry is gone hashes to the same backend.
        for (k, _) in l.maps.conntrack().unwrap() {
            let _ = proxy_agent::maps::DatapathMaps::del_conntrack(&mut l.maps, k);
        }
        let (_, b) = tc(&mut l.dp, &f);
        assert_eq!(parse(&a).dst, parse(&b).dst);
    }
    assert_eq!(seen.len(), 3, "maglev should spread 60 flows over all 3 backends");
}

#[test]
fn non_service_and_malformed_traffic_passes_untouched() {
    let mut l = load("untouched");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not a VIP", Frame::tcp("10.244.0.12", 48000, "10.244.1.1", 8080, SYN).bytes()),
        ("VIP, other port", Frame::tcp("10.244.0.12", 48001, "10.96.0.10", 81, SYN).bytes()),
        ("VIP, other protocol", Frame::udp("10.244.0.12", 48002, "10.96.0.10", 80, b"x").bytes()),
        ("ARP", {
            let mut f = vec![0xff; 6];
            f.extend_from_slice(&[2, 0, 0, 0, 0, 1, 0x08, 0x06]);
            f.extend_from_slice(&[0u8; 28]);
            f
        }),
        ("IPv6", {
            let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb, 0x86, 0xdd, 0x60];
            f.extend_from_slice(&[0u8; 53]);
            f
        }),
    ];
    for xdp in [false, true] {
        for (name, input) in &cases {
            let (v, out) = run(&mut l.dp, xdp, input);
            assert_eq!(v, if xdp { XDP_PASS } else { TC_ACT_OK }, "{name}");
            assert_eq!(&out, input, "{name} was modified");
        }
    }
    // Malformed: IP total length beyond the frame, TCP header cut short, a fragment, a bad IHL.
    let good = Frame::tcp("10.244.0.12", 48003, "10.96.0.10", 80, SYN).bytes();
    let mut too_long = good.clone();
    too_long[16..18].copy_from_slice(&200u16.to_be_bytes());
    let cut = good[..14 + 20 + 10].to_vec();
    let mut cut_len = cut.clone();
    cut_len[16..18].copy_from_slice(&30u16.to_be_bytes());
    let mut frag = good.clone();
    frag[20] = 0x20; // more fragments
    let mut bad_ihl = good.clone();
    bad_ihl[14] = 0x43;
    let before = counter_of(&l, counter::MALFORMED);
    for xdp in [false, true] {
        for (name, input) in [("too long", &too_long), ("cut", &cut), ("cut, consistent length", &cut_len), ("fragment", &frag), ("ihl 3", &bad_ihl)] {
            let (v, out) = run(&mut l.dp, xdp, input);
            assert_eq!(v, if xdp { XDP_PASS } else { TC_ACT_OK }, "{name}");
            assert_eq!(&out, input, "{name} was rewritten");
        }
    }
    assert_eq!(counter_of(&l, counter::MALFORMED) - before, 8);
    assert_eq!(counter_of(&l, counter::FRAGMENT), 2);
    assert!(l.maps.conntrack().unwrap().is_empty(), "malformed packets must create no flow");
}

#[test]
fn fin_marks_the_flow_closing_and_a_new_syn_reschedules() {
    let mut l = load("closing");
    let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.13", 49000, "10.96.0.10", 80, SYN));
    let _first = parse(&out).dst;
    let (_, _) = tc(&mut l.dp, &Frame::tcp("10.244.0.13", 49000, "10.96.0.10", 80, FIN | ACK));
    let ct = l.maps.conntrack().unwrap();
    assert!(ct.iter().any(|(_, v)| !v.is_reply() && v.flags & proxy_common::CT_F_CLOSING != 0));
    let new_before = counter_of(&l, counter::NEW_FLOW);
    let (_, _) = tc(&mut l.dp, &Frame::tcp("10.244.0.13", 49000, "10.96.0.10", 80, SYN));
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new_before + 1);
    assert_eq!(parse(&out).proto, TCP);
}

#[test]
fn two_flows_meeting_on_one_backend_with_one_reply_tuple_get_distinct_ports() {
    // One client, one source port, two VIPs whose only backend is the same: without a port
    // move both flows would expect replies from 10.244.1.1:8080 to 10.244.0.20:51000.
    let mut l = load("clash");
    let (_, a) = tc(&mut l.dp, &Frame::tcp("10.244.0.20", 51000, "10.96.0.13", 80, SYN));
    let (_, b) = tc(&mut l.dp, &Frame::tcp("10.244.0.20", 51000, "10.96.0.16", 80, SYN));
    let (a, b) = (parse(&a), parse(&b));
    assert_eq!((a.dst, b.dst), (ip("10.244.1.1").to_string().parse().unwrap(), ip("10.244.1.1").to_string().parse().unwrap()));
    assert_eq!(a.sport, 51000, "the first flow keeps its port");
    assert_ne!(b.sport, 51000, "the second flow's port moves");
    assert_eq!(b.src.to_string(), "10.244.0.20", "no masquerade: the client address stays");
    assert!(b.ip_csum_ok && b.l4_csum_ok);
    // Each reply goes back to its own flow.
    let (_, ra) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, "10.244.0.20", 51000, SYN | ACK));
    let (_, rb) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, "10.244.0.20", b.sport, SYN | ACK));
    let (ra, rb) = (parse(&ra), parse(&rb));
    assert_eq!((ra.src.to_string().as_str(), ra.dport), ("10.96.0.13", 51000));
    assert_eq!((rb.src.to_string().as_str(), rb.sport, rb.dport), ("10.96.0.16", 80, 51000));
    assert!(rb.ip_csum_ok && rb.l4_csum_ok);
    // The second flow's later packets keep the moved port.
    let (_, b2) = tc(&mut l.dp, &Frame::tcp("10.244.0.20", 51000, "10.96.0.16", 80, ACK));
    assert_eq!(parse(&b2).sport, b.sport);
    assert_eq!(counter_of(&l, counter::SNAT), 0, "a port move is not a masquerade");
}

/// Runs the rest of this thread on one CPU: the flow cache is per CPU.
fn on_cpu(cpu: usize) {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0, "pin to CPU {cpu}");
    }
}

#[test]
fn flow_cache_answers_established_packets_and_never_outlives_a_tuple_reuse() {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let other_cpu = if cpus > 1 { 1 } else { 0 };
    let mut l = load("flowcache");
    let cfg = datapath_config(NODE_IP, Some(("10.244.0.0", 16)));
    let ack = Frame::tcp("10.244.0.30", 52000, "10.96.0.10", 80, ACK);
    on_cpu(0);
    let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.30", 52000, "10.96.0.10", 80, SYN));
    let first = parse(&out).dst;

    // Established packets come from the cache: conntrack is not probed.
    let misses = counter_of(&l, counter::FLOW_CACHE_MISS);
    for _ in 0..3 {
        let (v, o) = tc(&mut l.dp, &ack);
        assert_eq!(v, TC_ACT_OK);
        let p = parse(&o);
        assert_eq!(p.dst, first);
        assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
    }
    assert_eq!(counter_of(&l, counter::FLOW_CACHE_MISS), misses, "the cache answered");
    // With the cache off, every packet probes conntrack, with the same result.
    l.maps.set_config(proxy_common::DatapathConfig { flags: cfg.flags | proxy_common::CFG_F_NO_FLOW_CACHE, ..cfg }).unwrap();
    let (_, o) = tc(&mut l.dp, &ack);
    assert_eq!(parse(&o).dst, first);
    assert_eq!(counter_of(&l, counter::FLOW_CACHE_MISS), misses + 1);
    l.maps.set_config(cfg).unwrap();

    // Another CPU caches the flow too. Then its backend goes, and a new SYN on the same tuple
    // (on CPU 0) is a new flow to another backend: the other CPU's copy must not answer.
    on_cpu(other_cpu);
    assert_eq!(parse(&tc(&mut l.dp, &ack).1).dst, first);
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    let rest: Vec<&str> = WEB.iter().copied().filter(|b| *b != first.to_string()).collect();
    let y = manifests().replace(&slice("web", 8080, "TCP", &WEB), &slice("web", 8080, "TCP", &rest));
    l.syncer.sync(&mut l.maps, &kpr_tests::desired(&y, &node), cfg).unwrap();
    on_cpu(0);
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.30", 52000, "10.96.0.10", 80, SYN));
    let second = parse(&o).dst;
    assert_ne!(second, first);
    on_cpu(other_cpu);
    assert_eq!(parse(&tc(&mut l.dp, &ack).1).dst, second, "a stale flow cache entry answered on CPU {other_cpu}");

    // Flows deleted from user space: after the invalidation nothing answers for them.
    for (k, _) in l.maps.conntrack().unwrap() {
        l.maps.del_conntrack(k).unwrap();
    }
    l.maps.invalidate_flow_cache().unwrap();
    let new_before = counter_of(&l, counter::NEW_FLOW);
    tc(&mut l.dp, &ack);
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new_before + 1, "the cache answered for a deleted flow");
}

#[test]
fn a_flow_stamped_by_a_cpu_whose_clock_is_ahead_stays_established() {
    // The coarse clock moves on one CPU's tick while another still reads the old value, so an
    // entry's stamp can be a little ahead of the clock a packet reads. That must not make the
    // flow look idle (a wrapped age), or it is re-balanced mid-connection.
    use aya::maps::{HashMap, MapData};
    use proxy_common::{map_names, CtKey, CtValue, CFG_F_NO_FLOW_CACHE};
    let mut l = load("clockskew");
    let cfg = datapath_config(NODE_IP, Some(("10.244.0.0", 16)));
    l.maps.set_config(proxy_common::DatapathConfig { flags: cfg.flags | CFG_F_NO_FLOW_CACHE, ..cfg }).unwrap();
    let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.31", 53000, "10.96.0.10", 80, SYN));
    let first = parse(&out).dst;
    let mut ct: HashMap<MapData, CtKey, CtValue> = proxy_agent::kernel::open_typed(l.pins.path(), map_names::CONNTRACK).unwrap();
    let entries: Vec<(CtKey, CtValue)> = ct.iter().map(|e| e.unwrap()).collect();
    for (k, mut v) in entries {
        v.last_seen_ns += 50_000_000;
        ct.insert(k, v, 0).unwrap();
    }
    let (est, new) = (counter_of(&l, counter::ESTABLISHED), counter_of(&l, counter::NEW_FLOW));
    for _ in 0..5 {
        let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.31", 53000, "10.96.0.10", 80, ACK));
        assert_eq!(parse(&o).dst, first);
    }
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new, "a live flow was taken for idle and scheduled again");
    assert_eq!(counter_of(&l, counter::ESTABLISHED), est + 5);
}
