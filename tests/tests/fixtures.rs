//! Packet fixtures through BPF_PROG_TEST_RUN (as Katran and Cilium test their data paths):
//! each case is an input frame, the expected verdict and the expected output frame, run through
//! the real programs, loaded into the running kernel, with maps programmed by the real agent
//! pipeline (manifests -> model -> sync). A packet crossing the node meets the ingress program
//! of the interface it arrives on (`tc`/`xdp` here) and the egress program of the one it leaves
//! by (`out`); netfilter sees it in between.
use aya::programs::{TestRun, TestRunOptions};
use kpr_lab::{
    datapath_config, ip,
    packet::{icmp_error, parse, Frame, ACK, FIN, ICMP, RST, SYN, TCP, UDP},
    Loaded,
};
use proxy_agent::{
    dataplane::ebpf::kernel::Datapath, dataplane::ebpf::kernel_maps::Buckets, dataplane::ebpf::kernel_maps::Hint, dataplane::ebpf::maps::DatapathMaps,
    dataplane::ebpf::maps::Table, model::NodeInfo,
};
use proxy_common::{counter, map_names, prog_names, user::addr_words, ClockCache, CtBucket, CtKey, CtValue, CT_DIR_EGRESS, CT_DIR_INGRESS, PROTO_TCP};

const TC_ACT_OK: u32 = 0;
const TC_ACT_UNSPEC: u32 = u32::MAX;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

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
/// The least-connection and P2C services' backends.
const LOADED: [&str; 3] = ["10.244.3.1", "10.244.3.2", "10.244.3.3"];

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
    y += &svc("lc", "10.96.0.21", 80, "TCP", "", "  annotations: {kpr.io/scheduler: least-connection}\n");
    y += &slice("lc", 8080, "TCP", &LOADED);
    y += &svc("p2c", "10.96.0.22", 80, "TCP", "", "  annotations: {kpr.io/scheduler: p2c}\n");
    y += &slice("p2c", 8080, "TCP", &LOADED);
    y += &svc("hairpin", "10.96.0.16", 80, "TCP", "", "");
    y += &slice("hairpin", 8080, "TCP", &["10.244.1.1"]);
    y += &svc("maglev", "10.96.0.17", 80, "TCP", "", "  annotations: {kpr.io/scheduler: maglev}\n");
    y += &slice("maglev", 8080, "TCP", &BACKENDS);
    y
}

fn load(name: &str) -> Loaded {
    load_with(name, "")
}

/// `load` with more manifests.
fn load_with(name: &str, extra: &str) -> Loaded {
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    Loaded::new(name, &(manifests() + extra), &node, datapath_config(NODE_IP, Some(("10.244.0.0", 16))))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    TcIngress,
    TcEgress,
    Xdp,
    /// The uplinks' IPv4 ingress at TC (`--xdp-mode off`, veths).
    TcUplink,
}

/// What the uplinks' IPv4 ingress answers for a packet it passes: XDP_PASS, or at TC "the
/// next program" (TC_ACT_UNSPEC), as XDP_PASS lets the hook's TC programs run.
fn passed(hook: Hook) -> u32 {
    if hook == Hook::Xdp {
        XDP_PASS
    } else {
        TC_ACT_UNSPEC
    }
}

fn run_at(dp: &mut Datapath, hook: Hook, frame: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; 1600];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
    let r = match hook {
        Hook::Xdp => dp.xdp(prog_names::XDP_INGRESS).unwrap().test_run(opts),
        Hook::TcIngress => dp.classifier(prog_names::TC_INGRESS).unwrap().test_run(opts),
        Hook::TcEgress => dp.classifier(prog_names::TC_EGRESS).unwrap().test_run(opts),
        Hook::TcUplink => dp.classifier(prog_names::TC_UPLINK).unwrap().test_run(opts),
    }
    .expect("BPF_PROG_TEST_RUN");
    let n = r.data_size_out as usize;
    out.truncate(n);
    (r.return_value, out)
}

fn run(dp: &mut Datapath, xdp: bool, frame: &[u8]) -> (u32, Vec<u8>) {
    run_at(dp, if xdp { Hook::Xdp } else { Hook::TcIngress }, frame)
}

/// TC ingress (a pod interface).
fn tc(dp: &mut Datapath, f: &Frame) -> (u32, Vec<u8>) {
    run(dp, false, &f.bytes())
}

/// TC egress (the interface the packet leaves by).
fn out(dp: &mut Datapath, f: &[u8]) -> (u32, Vec<u8>) {
    run_at(dp, Hook::TcEgress, f)
}

/// As a frame again, to send on.
fn frame(p: &kpr_lab::packet::Parsed, flags: u8) -> Frame {
    Frame { src: p.src, dst: p.dst, ..Frame::tcp("0.0.0.0", p.sport, "0.0.0.0", p.dport, flags) }
}

/// A TCP handshake from a pod through a ClusterIP (SYN and its DNAT, the SYN-ACK's reverse DNAT
/// at egress, the ACK that makes the flow assured): returns the ACK's rewritten packet.
fn handshake(l: &mut Loaded, client: &str, port: u16, vip: &str, vport: u16) -> kpr_lab::packet::Parsed {
    let (_, o) = tc(&mut l.dp, &Frame::tcp(client, port, vip, vport, SYN));
    let fwd = parse(&o);
    let synack = Frame { src: fwd.dst, dst: fwd.src, ..Frame::tcp("0.0.0.0", fwd.dport, "0.0.0.0", fwd.sport, SYN | ACK) };
    let (_, back) = out(&mut l.dp, &synack.bytes());
    let back = parse(&back);
    assert_eq!((back.src.to_string(), back.sport), (vip.to_string(), vport), "the SYN-ACK's reverse DNAT");
    let (_, o) = tc(&mut l.dp, &Frame::tcp(client, port, vip, vport, ACK));
    parse(&o)
}

/// A UDP flow from a pod through a ClusterIP made assured: a datagram and its DNAT, the
/// backend's answer (reverse DNAT at egress), and the client's next datagram. Returns that
/// datagram's rewritten packet.
fn udp_exchange(l: &mut Loaded, client: &str, port: u16, vip: &str, vport: u16) -> kpr_lab::packet::Parsed {
    let (_, o) = tc(&mut l.dp, &Frame::udp(client, port, vip, vport, b"q"));
    let fwd = parse(&o);
    let answer = Frame { src: fwd.dst, dst: fwd.src, ..Frame::udp("0.0.0.0", fwd.dport, "0.0.0.0", fwd.sport, b"a") };
    let (_, back) = out(&mut l.dp, &answer.bytes());
    assert_eq!((parse(&back).src.to_string(), parse(&back).sport), (vip.to_string(), vport), "the answer's reverse DNAT");
    let (_, o) = tc(&mut l.dp, &Frame::udp(client, port, vip, vport, b"q"));
    parse(&o)
}

fn assured_has(l: &Loaded, client: &str, port: u16) -> bool {
    l.conntrack(Table::Assured).iter().any(|(k, v)| !v.is_reply() && k.sport == port.to_be() && proxy_common::user::v4_addr(k.saddr) == ip(client))
}

fn counter_of(l: &Loaded, idx: u32) -> u64 {
    l.maps.counters().unwrap()[idx as usize]
}

#[test]
fn dnat_at_ingress_reverse_dnat_at_egress_keep_checksums_valid() {
    let mut l = load("dnat");
    let syn = Frame::tcp("10.244.0.5", 40000, "10.96.0.10", 80, SYN);
    let (v, o) = tc(&mut l.dp, &syn);
    assert_eq!(v, TC_ACT_OK);
    let p = parse(&o);
    assert!(WEB.contains(&p.dst.to_string().as_str()), "dst {}", p.dst);
    assert_eq!((p.src.to_string().as_str(), p.sport, p.dport), ("10.244.0.5", 40000, 8080));
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
    assert_eq!(o.len(), syn.bytes().len());
    // Not masqueraded: egress leaves the forward packet as netfilter saw it.
    let (v, o2) = out(&mut l.dp, &o);
    assert_eq!((v, &o2), (TC_ACT_OK, &o));

    // Every later packet of the flow goes to the same backend.
    for _ in 0..5 {
        let (v, out2) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40000, "10.96.0.10", 80, ACK));
        assert_eq!(v, TC_ACT_OK);
        assert_eq!(parse(&out2).dst, p.dst);
    }
    assert!(counter_of(&l, counter::ESTABLISHED) >= 5);

    // The reply crosses ingress untouched (netfilter must see backend -> client) and is
    // rewritten back to the VIP at egress.
    let reply = Frame::tcp(&p.dst.to_string(), 8080, "10.244.0.5", 40000, SYN | ACK);
    let (v, o3) = tc(&mut l.dp, &reply);
    assert_eq!((v, &o3), (TC_ACT_OK, &reply.bytes()), "ingress must not reverse the DNAT");
    let (v, o3) = out(&mut l.dp, &reply.bytes());
    assert_eq!(v, TC_ACT_OK);
    let r = parse(&o3);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dst.to_string().as_str(), r.dport), ("10.96.0.10", 80, "10.244.0.5", 40000));
    assert!(r.ip_csum_ok && r.l4_csum_ok, "{r:?}");
    assert!(counter_of(&l, counter::REVERSE_NAT) >= 1);

    // The handshake's last ACK after the reply moves the flow to the assured table.
    assert!(!assured_has(&l, "10.244.0.5", 40000), "a flow is embryonic until its handshake completes");
    let (_, o4) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40000, "10.96.0.10", 80, ACK));
    assert_eq!(parse(&o4).dst, p.dst);
    assert!(assured_has(&l, "10.244.0.5", 40000));
    assert_eq!(counter_of(&l, counter::FLOW_ASSURED), 1);
    assert!(l.conntrack(Table::Embryonic).is_empty(), "{:?}", l.conntrack(Table::Embryonic));
    let (_, o5) = out(&mut l.dp, &Frame::tcp(&p.dst.to_string(), 8080, "10.244.0.5", 40000, ACK).bytes());
    assert_eq!(parse(&o5).src.to_string(), "10.96.0.10", "assured replies are reversed too");
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
    let d = kpr_lab::desired(&y, &node);
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
fn nodeport_from_outside_dnat_at_the_uplink_masquerade_at_egress_and_back() {
    for uplink in [Hook::Xdp, Hook::TcUplink] {
        nodeport_from_outside(uplink);
    }
}

fn nodeport_from_outside(uplink: Hook) {
    let mut l = load("snat");
    let syn = Frame::tcp("198.18.0.1", 50000, NODE_IP, 30080, SYN);
    let (v, o) = run_at(&mut l.dp, uplink, &syn.bytes());
    assert_eq!(v, passed(uplink));
    let p = parse(&o);
    // DNAT only: netfilter's FORWARD sees the client, as under kube-proxy.
    assert_eq!((p.src.to_string().as_str(), p.sport, p.dst.to_string().as_str(), p.dport), ("198.18.0.1", 50000, "10.244.1.1", 8080));
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
    assert!(counter_of(&l, counter::SNAT) >= 1);
    // The masquerade happens at egress, after POSTROUTING.
    let (v, o) = out(&mut l.dp, &o);
    assert_eq!(v, TC_ACT_OK);
    let m = parse(&o);
    assert_eq!((m.src.to_string().as_str(), m.dst.to_string().as_str(), m.dport), (NODE_IP, "10.244.1.1", 8080));
    assert!(m.ip_csum_ok && m.l4_csum_ok, "{m:?}");
    // The backend's reply to the node: reverse SNAT at ingress (netfilter sees backend ->
    // client), reverse DNAT at egress.
    let reply = Frame::tcp("10.244.1.1", 8080, NODE_IP, m.sport, SYN | ACK);
    let (v, o) = tc(&mut l.dp, &reply);
    assert_eq!(v, TC_ACT_OK);
    let r = parse(&o);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dst.to_string().as_str(), r.dport), ("10.244.1.1", 8080, "198.18.0.1", 50000));
    assert!(r.ip_csum_ok && r.l4_csum_ok);
    let (v, o) = out(&mut l.dp, &o);
    assert_eq!(v, TC_ACT_OK);
    let r = parse(&o);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dst.to_string().as_str(), r.dport), (NODE_IP, 30080, "198.18.0.1", 50000));
    assert!(r.ip_csum_ok && r.l4_csum_ok);
    // The client's ACK completes the handshake; the whole flow (four entries) is assured.
    let (_, o) = run_at(&mut l.dp, uplink, &Frame::tcp("198.18.0.1", 50000, NODE_IP, 30080, ACK).bytes());
    let (_, o) = out(&mut l.dp, &o);
    assert_eq!((parse(&o).src.to_string().as_str(), parse(&o).sport), (NODE_IP, m.sport));
    assert_eq!(l.conntrack(Table::Assured).len(), 4, "{:?}", l.conntrack(Table::Assured));
    assert!(l.conntrack(Table::Embryonic).is_empty());
}

/// One masqueraded handshake from outside through the NodePort (the uplink at TC, then egress):
/// the SNAT port, or None where the egress dropped the SYN.
fn masqueraded_syn(l: &mut Loaded, client_port: u16) -> Option<u16> {
    let (_, o) = run_at(&mut l.dp, Hook::TcUplink, &Frame::tcp("198.18.0.1", client_port, NODE_IP, 30080, SYN).bytes());
    let (v, o) = out(&mut l.dp, &o);
    if v == TC_ACT_SHOT {
        return None;
    }
    let m = parse(&o);
    assert_eq!((m.src.to_string().as_str(), m.dst.to_string().as_str()), (NODE_IP, "10.244.1.1"));
    assert!(m.ip_csum_ok && m.l4_csum_ok, "{m:?}");
    Some(m.sport)
}

/// A closed masqueraded flow (a reset either way, or a FIN each way) gives its SNAT tuple to
/// the next flow that needs it, at once, as netfilter's NAT reuses a closed connection's
/// tuple; an open or half-closed one keeps it. The SNAT range here is one port, so every flow
/// wants the tuple 10.244.1.1:8080 -> NODE_IP:20000.
#[test]
fn a_closed_masqueraded_flow_gives_its_snat_tuple_to_the_next_flow_at_once() {
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    let mut cfg = datapath_config(NODE_IP, Some(("10.244.0.0", 16)));
    (cfg.snat_port_min, cfg.snat_port_max) = (20000, 20000);
    let mut l = Loaded::new("snat-reuse", &manifests(), &node, cfg);
    let reused = || counter::SNAT_PORT_REUSED;
    let held = masqueraded_syn(&mut l, 50001).expect("the first flow gets the port");
    assert_eq!(held, 20000);
    // The backend's packets: reverse SNAT at its interface's ingress, reverse DNAT at the
    // uplink's egress.
    let backend = |l: &mut Loaded, flags: u8| {
        let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, NODE_IP, 20000, flags));
        out(&mut l.dp, &o)
    };
    let client = |l: &mut Loaded, port: u16, flags: u8| {
        let (_, o) = run_at(&mut l.dp, Hook::TcUplink, &Frame::tcp("198.18.0.1", port, NODE_IP, 30080, flags).bytes());
        out(&mut l.dp, &o)
    };
    backend(&mut l, SYN | ACK);
    client(&mut l, 50001, ACK);
    // Open: the next flow finds no port and is dropped (counted), as netfilter's NAT drops
    // when its range is full.
    let no_port = counter_of(&l, counter::SNAT_NO_PORT);
    assert_eq!(masqueraded_syn(&mut l, 50002), None, "an open flow keeps its tuple");
    assert_eq!(counter_of(&l, counter::SNAT_NO_PORT), no_port + 1);
    // Half-closed (the client's FIN only; the backend may still send): still held.
    client(&mut l, 50001, FIN | ACK);
    assert_eq!(masqueraded_syn(&mut l, 50003), None, "a half-closed flow keeps its tuple");
    // A FIN each way: closed, the tuple is taken at once.
    let (_, o) = backend(&mut l, FIN | ACK);
    assert_eq!(parse(&o).dport, 50001, "the backend's FIN still reaches the first client");
    client(&mut l, 50001, ACK);
    let before = counter_of(&l, reused());
    assert_eq!(masqueraded_syn(&mut l, 50004), Some(20000), "a FIN each way frees the tuple");
    assert_eq!(counter_of(&l, reused()), before + 1);
    // Its replies are the new flow's, and the first flow's entries are gone.
    let (_, o) = backend(&mut l, SYN | ACK);
    assert_eq!(parse(&o).dport, 50004);
    assert!(!l
        .conntrack(Table::Embryonic)
        .iter()
        .chain(l.conntrack(Table::Assured).iter())
        .any(|(k, _)| k.sport == 50001u16.to_be() || k.dport == 50001u16.to_be()));
    // A reset from the client, in its handshake: closed too.
    client(&mut l, 50004, RST);
    assert_eq!(masqueraded_syn(&mut l, 50005), Some(20000), "the client's reset frees the tuple");
    // The backend refusing (a reset answering the SYN): closed.
    backend(&mut l, RST | ACK);
    assert_eq!(masqueraded_syn(&mut l, 50006), Some(20000), "the backend's reset frees the tuple");
    assert_eq!(counter_of(&l, reused()), before + 3);
    // An assured flow closed by the backend's reset, with the client reusing its own port at
    // once: its SYN starts a new flow on the tuple (not the reset one, which any other flow
    // could take).
    backend(&mut l, SYN | ACK);
    client(&mut l, 50006, ACK);
    assert!(assured_has(&l, "198.18.0.1", 50006));
    backend(&mut l, RST);
    assert_eq!(masqueraded_syn(&mut l, 50006), Some(20000), "the client's port, reused at once");
    backend(&mut l, SYN | ACK);
    client(&mut l, 50006, ACK);
    assert!(assured_has(&l, "198.18.0.1", 50006));
    assert_eq!(masqueraded_syn(&mut l, 50007), None, "the reopened flow is open again");
    // The backend closes first: it holds TIME_WAIT on the tuple, which is then taken only by
    // the last tries (after six that met it), and a clean one would be taken first.
    let (_, o) = backend(&mut l, FIN | ACK);
    assert_eq!(parse(&o).dport, 50006);
    client(&mut l, 50006, FIN | ACK);
    backend(&mut l, ACK);
    let (collisions, reused_before) = (counter_of(&l, counter::SNAT_PORT_COLLISION), counter_of(&l, reused()));
    assert_eq!(masqueraded_syn(&mut l, 50008), Some(20000), "the last resort: a tuple in the backend's TIME_WAIT");
    assert_eq!(counter_of(&l, counter::SNAT_PORT_COLLISION) - collisions, 6, "six tries passed it over");
    assert_eq!(counter_of(&l, reused()), reused_before + 1);
}

/// A port whose scopes agree has one entry, which the uplinks take too; under
/// externalTrafficPolicy Local its internal entry is marked split and the uplinks (XDP or TC)
/// take the external entry beside it.
#[test]
fn uplinks_take_a_ports_one_entry_where_its_scopes_agree_and_its_external_entry_where_they_differ() {
    for uplink in [Hook::Xdp, Hook::TcUplink] {
        scopes_at(uplink);
    }
}

fn scopes_at(uplink: Hook) {
    let mut y = manifests();
    y += "apiVersion: v1\nkind: Service\nmetadata: {name: np-local, namespace: fx}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.30\n  externalTrafficPolicy: Local\n  ports: [{name: p, port: 80, protocol: TCP, nodePort: 30081}]\n---\n";
    y += "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: np-local-x, namespace: fx, labels: {kubernetes.io/service-name: np-local}}\naddressType: IPv4\nports: [{name: p, port: 8080, protocol: TCP}]\nendpoints:\n- {addresses: [10.244.4.1], conditions: {ready: true}, nodeName: node-a}\n- {addresses: [10.244.4.2], conditions: {ready: true}, nodeName: node-b}\n---\n";
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    let mut l = Loaded::new("scopes", &y, &node, datapath_config(NODE_IP, Some(("10.244.0.0", 16))));
    let mut split: Vec<(u8, u8)> =
        l.maps.services().unwrap().iter().filter(|(k, _)| k.port_host() == 30081).map(|(k, v)| (k.scope, v.flags & proxy_common::SVC_F_SPLIT)).collect();
    split.sort();
    assert_eq!(
        split,
        [(proxy_common::SCOPE_INTERNAL, proxy_common::SVC_F_SPLIT), (proxy_common::SCOPE_EXTERNAL, 0)],
        "externalTrafficPolicy Local: an entry per scope"
    );
    let web: Vec<u8> = l.maps.services().unwrap().iter().filter(|(k, _)| k.addr[0] == u32::from_ne_bytes([10, 96, 0, 10])).map(|(k, _)| k.scope).collect();
    assert_eq!(web, [proxy_common::SCOPE_INTERNAL], "a ClusterIP: one entry");
    let mut from_outside = std::collections::BTreeSet::new();
    let mut from_pods = std::collections::BTreeSet::new();
    for i in 0..24u16 {
        // From outside: the ClusterIP through the fallback, the node port through its own
        // entry (the local endpoint, the client kept).
        let (v, o) = run_at(&mut l.dp, uplink, &Frame::tcp("198.18.0.1", 51000 + i, "10.96.0.10", 80, SYN).bytes());
        assert_eq!(v, passed(uplink));
        let p = parse(&o);
        assert!(WEB.contains(&p.dst.to_string().as_str()) && p.dport == 8080, "{p:?}");
        let (v, o) = run_at(&mut l.dp, uplink, &Frame::tcp("198.18.0.1", 52000 + i, NODE_IP, 30081, SYN).bytes());
        assert_eq!(v, passed(uplink));
        let p = parse(&o);
        from_outside.insert(p.dst.to_string());
        let (_, o) = out(&mut l.dp, &o);
        assert_eq!(parse(&o).src.to_string(), "198.18.0.1", "preserve-source: not masqueraded");
        // From a pod (TC): the internal entry, every endpoint.
        let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.7", 53000 + i, NODE_IP, 30081, SYN));
        from_pods.insert(parse(&o).dst.to_string());
    }
    assert_eq!(from_outside, std::collections::BTreeSet::from(["10.244.4.1".to_string()]));
    assert_eq!(from_pods.len(), 2, "{from_pods:?}");
}

#[test]
fn clusterip_from_a_pod_is_not_masqueraded_but_hairpin_is() {
    let mut l = load("hairpin");
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.7", 42000, "10.96.0.13", 80, SYN));
    let (_, o) = out(&mut l.dp, &o);
    assert_eq!(parse(&o).src.to_string(), "10.244.0.7");
    // The only backend of 10.96.0.16 is the client itself: masquerade to the node at egress.
    let (v, o) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 42001, "10.96.0.16", 80, SYN));
    assert_eq!(v, TC_ACT_OK);
    let d = parse(&o);
    assert_eq!((d.src.to_string().as_str(), d.dst.to_string().as_str(), d.dport), ("10.244.1.1", "10.244.1.1", 8080));
    let (_, o) = out(&mut l.dp, &o);
    let p = parse(&o);
    assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), (NODE_IP, "10.244.1.1"));
    assert!(p.ip_csum_ok && p.l4_csum_ok);
    let (_, back) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, NODE_IP, p.sport, SYN | ACK));
    let (_, back) = out(&mut l.dp, &back);
    let r = parse(&back);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dst.to_string().as_str(), r.dport), ("10.96.0.16", 80, "10.244.1.1", 42001));
    // A hairpin flow whose client port is the backend's port: its SNAT and reverse-DNAT keys
    // would meet, so the port moves.
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, "10.96.0.16", 80, SYN));
    let d = parse(&o);
    assert_ne!(d.sport, 8080, "{d:?}");
    let (_, o) = out(&mut l.dp, &o);
    let (_, back) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, NODE_IP, parse(&o).sport, SYN | ACK));
    let (_, back) = out(&mut l.dp, &back);
    let r = parse(&back);
    assert_eq!((r.src.to_string().as_str(), r.sport, r.dport), ("10.96.0.16", 80, 8080));
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
        aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(l.pins.path().join(proxy_common::map_names::AFFINITY)).unwrap())
            .unwrap()
            .try_into()
            .unwrap();
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
    for hook in [Hook::TcIngress, Hook::Xdp, Hook::TcUplink] {
        let (v, out) = run_at(&mut l.dp, hook, &syn.bytes());
        // Straight back out of the interface it came in by: through the stack, netfilter would
        // find no flow the error is about and drop it as INVALID.
        assert_eq!(v, if hook == Hook::Xdp { XDP_TX } else { TC_ACT_REDIRECT });
        let p = parse(&out);
        assert_eq!(p.proto, ICMP);
        assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), ("10.96.0.12", "10.244.0.9"));
        let (ty, code, qs, qd, qsp, qdp) = p.icmp.unwrap();
        assert_eq!((ty, code), (3, 3));
        assert_eq!((qs.to_string().as_str(), qd.to_string().as_str(), qsp, qdp), ("10.244.0.9", "10.96.0.12", 44000, 80));
        assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
        assert_eq!(out.len(), 70);
        assert_eq!(p.dst_mac, [2, 0, 0, 0, 0, 0xbb], "out of the same interface: MACs swapped");
    }
    // UDP too, from a short datagram (the frame grows).
    let (v, out) = tc(&mut l.dp, &Frame::udp("10.244.0.9", 44001, "10.96.0.18", 53, b"x"));
    assert_eq!(v, TC_ACT_REDIRECT);
    let p = parse(&out);
    assert_eq!(p.icmp.map(|i| (i.0, i.1, i.4, i.5)), Some((3, 3, 44001, 53)));
    assert!(p.ip_csum_ok && p.l4_csum_ok && out.len() == 70, "{p:?}");
    assert_eq!(counter_of(&l, counter::REJECT_NO_BACKEND), 4);
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
        // The same tuple after its conntrack entries are gone hashes to the same backend.
        l.clear_conntrack();
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
    for hook in [Hook::TcIngress, Hook::TcEgress, Hook::Xdp, Hook::TcUplink] {
        for (name, input) in &cases {
            let (v, out) = run_at(&mut l.dp, hook, input);
            let expected = if matches!(hook, Hook::Xdp | Hook::TcUplink) { passed(hook) } else { TC_ACT_OK };
            assert_eq!(v, expected, "{name}");
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
    assert!(l.conntrack(Table::Assured).is_empty() && l.conntrack(Table::Embryonic).is_empty(), "malformed packets must create no flow");
}

#[test]
fn fin_marks_the_flow_closing_and_a_new_syn_reschedules() {
    let mut l = load("closing");
    let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.13", 49000, "10.96.0.10", 80, SYN));
    let _first = parse(&out).dst;
    let (_, _) = tc(&mut l.dp, &Frame::tcp("10.244.0.13", 49000, "10.96.0.10", 80, FIN | ACK));
    let ct = l.conntrack(Table::Embryonic);
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
    let (_, ra) = out(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, "10.244.0.20", 51000, SYN | ACK).bytes());
    let (_, rb) = out(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, "10.244.0.20", b.sport, SYN | ACK).bytes());
    let (ra, rb) = (parse(&ra), parse(&rb));
    assert_eq!((ra.src.to_string().as_str(), ra.dport), ("10.96.0.13", 51000));
    assert_eq!((rb.src.to_string().as_str(), rb.sport, rb.dport), ("10.96.0.16", 80, 51000));
    assert!(rb.ip_csum_ok && rb.l4_csum_ok);
    // The second flow's later packets keep the moved port.
    let (_, b2) = tc(&mut l.dp, &Frame::tcp("10.244.0.20", 51000, "10.96.0.16", 80, ACK));
    assert_eq!(parse(&b2).sport, b.sport);
    assert_eq!(counter_of(&l, counter::SNAT), 0, "a port move is not a masquerade");
}

/// Rebuilds the assured table's hint from the table (both halves, as the collector's passes
/// do), then checks that it holds every key there and few others: the test that follows then
/// runs with probes the hint skips.
fn hint_rebuilt(l: &Loaded) {
    proxy_agent::dataplane::ebpf::kernel_maps::rebuild_hints_now(l.pins.path()).unwrap();
    let hint = Hint::<proxy_common::CtBucket>::open(l.pins.path()).unwrap();
    let held = l.conntrack(Table::Assured);
    assert!(!held.is_empty() && held.iter().all(|(k, _)| hint.may_hold(k)), "every assured key is hinted");
    let others = (1..=1000u16).map(|i| CtKey { sport: (20000 + i).to_be(), ..held[0].0 }).filter(|k| hint.may_hold(k)).count();
    assert!(others < 10, "{others} of 1,000 keys never seen are hinted: the rebuild cleared nothing");
}

#[test]
fn a_reply_tuple_held_by_an_assured_flow_or_a_udp_flow_moves_the_new_flows_port() {
    // A new flow claims its reply tuple by inserting it into the table it starts in (the
    // embryonic one); the tuple may also be held in the other (assured) table, by a TCP or a
    // UDP flow. Both cases must move the port as the embryonic clash does.
    let dns2 = svc("dns2", "10.96.0.20", 53, "UDP", "", "") + &slice("dns2", 5353, "UDP", &["10.244.1.3"]);
    let mut l = load_with("clash-assured", &dns2);
    let a = handshake(&mut l, "10.244.0.21", 51100, "10.96.0.13", 80);
    assert!(assured_has(&l, "10.244.0.21", 51100));
    assert_eq!((a.dst.to_string().as_str(), a.sport), ("10.244.1.1", 51100));
    // The assured table's hint as the collector keeps it: a new flow probes the table only for
    // keys it may hold, and the clash below must still be found.
    hint_rebuilt(&l);
    let collisions = counter_of(&l, counter::SNAT_PORT_COLLISION);
    let (_, b) = tc(&mut l.dp, &Frame::tcp("10.244.0.21", 51100, "10.96.0.16", 80, SYN));
    let b = parse(&b);
    assert_eq!(b.dst.to_string(), "10.244.1.1");
    assert_ne!(b.sport, 51100, "the assured flow holds 10.244.1.1:8080 -> 10.244.0.21:51100");
    assert!(b.ip_csum_ok && b.l4_csum_ok);
    assert_eq!(counter_of(&l, counter::SNAT_PORT_COLLISION), collisions + 1);
    let (_, rb) = out(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, "10.244.0.21", b.sport, SYN | ACK).bytes());
    let rb = parse(&rb);
    assert_eq!((rb.src.to_string().as_str(), rb.sport, rb.dport), ("10.96.0.16", 80, 51100));
    let (_, ra) = out(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, "10.244.0.21", 51100, ACK).bytes());
    assert_eq!(parse(&ra).src.to_string(), "10.96.0.13", "the assured flow's replies are its own");

    // One UDP socket's datagrams to two DNS VIPs with one backend, the first flow assured.
    let u1 = udp_exchange(&mut l, "10.244.0.21", 53000, "10.96.0.15", 53);
    assert!(assured_has(&l, "10.244.0.21", 53000));
    hint_rebuilt(&l);
    let (_, u2) = tc(&mut l.dp, &Frame::udp("10.244.0.21", 53000, "10.96.0.20", 53, b"q2"));
    let u2 = parse(&u2);
    assert_eq!((u1.dst.to_string().as_str(), u1.sport), ("10.244.1.3", 53000));
    assert_eq!(u2.dst.to_string(), "10.244.1.3");
    assert_ne!(u2.sport, 53000, "the first datagram's flow holds 10.244.1.3:5353 -> 10.244.0.21:53000");
    assert!(u2.ip_csum_ok && u2.l4_csum_ok);
    let (_, r2) = out(&mut l.dp, &Frame::udp("10.244.1.3", 5353, "10.244.0.21", u2.sport, b"a2").bytes());
    let r2 = parse(&r2);
    assert_eq!((r2.src.to_string().as_str(), r2.sport, r2.dport), ("10.96.0.20", 53, 53000));
    let (_, r1) = out(&mut l.dp, &Frame::udp("10.244.1.3", 5353, "10.244.0.21", 53000, b"a1").bytes());
    assert_eq!(parse(&r1).src.to_string(), "10.96.0.15");
    assert_eq!(counter_of(&l, counter::SNAT_PORT_COLLISION), collisions + 2);
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
    let first = handshake(&mut l, "10.244.0.30", 52000, "10.96.0.10", 80).dst;

    // Established packets come from the cache after one conntrack probe fills it.
    tc(&mut l.dp, &ack);
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
    assert_eq!(parse(&tc(&mut l.dp, &ack).1).dst, first);
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    let rest: Vec<&str> = WEB.iter().copied().filter(|b| *b != first.to_string()).collect();
    let y = manifests().replace(&slice("web", 8080, "TCP", &WEB), &slice("web", 8080, "TCP", &rest));
    l.syncer.sync(&mut l.maps, &kpr_lab::desired(&y, &node), cfg).unwrap();
    on_cpu(0);
    let second = handshake(&mut l, "10.244.0.30", 52000, "10.96.0.10", 80).dst;
    assert_ne!(second, first);
    on_cpu(other_cpu);
    assert_eq!(parse(&tc(&mut l.dp, &ack).1).dst, second, "a stale flow cache entry answered on CPU {other_cpu}");

    // Flows deleted from user space: after the invalidation nothing answers for them.
    l.clear_conntrack();
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
    let first = handshake(&mut l, "10.244.0.31", 53000, "10.96.0.10", 80).dst;
    let mut ct: HashMap<MapData, CtKey, CtValue> = proxy_agent::dataplane::ebpf::kernel_maps::open_typed(l.pins.path(), map_names::CONNTRACK).unwrap();
    let entries: Vec<(CtKey, CtValue)> = ct.iter().map(|e| e.unwrap()).collect();
    assert!(!entries.is_empty());
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

#[test]
fn icmp_errors_about_translated_flows_are_translated_back() {
    let mut l = load("icmp");
    // UDP through a ClusterIP to a backend that has no socket: its port unreachable, at egress
    // towards the client, must come from the VIP and quote the packet the client sent.
    let (_, o) = tc(&mut l.dp, &Frame::udp("10.244.0.40", 46100, "10.96.0.15", 53, b"query"));
    let sent = parse(&o);
    assert_eq!((sent.dst.to_string().as_str(), sent.dport), ("10.244.1.3", 5353));
    let quoted = Frame::udp("10.244.0.40", sent.sport, "10.244.1.3", 5353, b"query");
    let err = icmp_error("10.244.1.3", "10.244.0.40", 3, 3, &quoted, 8);
    let (_, i) = run_at(&mut l.dp, Hook::TcIngress, &err);
    assert_eq!(i, err, "ingress: not the hook that reverses the DNAT");
    let (v, o) = out(&mut l.dp, &err);
    assert_eq!(v, TC_ACT_OK);
    let p = parse(&o);
    assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), ("10.96.0.15", "10.244.0.40"));
    let (ty, code, qs, qd, qsp, qdp) = p.icmp.unwrap();
    assert_eq!((ty, code, qs.to_string().as_str(), qd.to_string().as_str(), qsp, qdp), (3, 3, "10.244.0.40", "10.96.0.15", 46100, 53));
    assert!(p.ip_csum_ok && p.l4_csum_ok && p.quote_ip_csum_ok, "{p:?}");

    // Fragmentation needed, sent by the node itself (a tunnel's smaller MTU) about a TCP
    // segment it was forwarding: the outer addresses are the node's and the client's; only the
    // quote changes, with a full TCP header quoted (its checksum follows).
    let fwd = handshake(&mut l, "10.244.0.41", 46200, "10.96.0.10", 80);
    let seg = Frame::tcp("10.244.0.41", fwd.sport, &fwd.dst.to_string(), 8080, ACK);
    let err = icmp_error(NODE_IP, "10.244.0.41", 3, 4, &seg, 20);
    let (_, o) = out(&mut l.dp, &err);
    let p = parse(&o);
    assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), (NODE_IP, "10.244.0.41"));
    let (ty, code, qs, qd, qsp, qdp) = p.icmp.unwrap();
    assert_eq!((ty, code, qs.to_string().as_str(), qd.to_string().as_str(), qsp, qdp), (3, 4, "10.244.0.41", "10.96.0.10", 46200, 80));
    assert!(p.l4_csum_ok && p.quote_ip_csum_ok, "{p:?}");
    let q = &o[14 + 20 + 8..];
    let mut quote = q[..20].to_vec();
    quote.extend_from_slice(&q[20..40]);
    let tcp_ok = kpr_lab::packet::parse(&[&o[..14], &quote[..]].concat()).l4_csum_ok;
    assert!(tcp_ok, "the quoted TCP checksum must follow the quote's rewrite");

    // A masqueraded flow: host unreachable from the backend to the node's address is reversed
    // at ingress (to the client, quoting client -> backend), then at egress (from the VIP).
    let (_, o) = run(&mut l.dp, true, &Frame::tcp("198.18.0.9", 51000, NODE_IP, 30080, SYN).bytes());
    let (_, o) = out(&mut l.dp, &o);
    let m = parse(&o);
    let err = icmp_error("10.244.1.1", NODE_IP, 3, 1, &frame(&m, SYN), 8);
    let (_, o) = run_at(&mut l.dp, Hook::TcIngress, &err);
    let p = parse(&o);
    assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), ("10.244.1.1", "198.18.0.9"));
    let q = p.icmp.unwrap();
    assert_eq!((q.2.to_string().as_str(), q.4, q.3.to_string().as_str(), q.5), ("198.18.0.9", 51000, "10.244.1.1", 8080));
    assert!(p.ip_csum_ok && p.l4_csum_ok && p.quote_ip_csum_ok, "{p:?}");
    let (_, o) = out(&mut l.dp, &o);
    let p = parse(&o);
    assert_eq!((p.src.to_string().as_str(), p.dst.to_string().as_str()), (NODE_IP, "198.18.0.9"));
    let q = p.icmp.unwrap();
    assert_eq!((q.2.to_string().as_str(), q.4, q.3.to_string().as_str(), q.5), ("198.18.0.9", 51000, NODE_IP, 30080));
    assert!(p.ip_csum_ok && p.l4_csum_ok && p.quote_ip_csum_ok, "{p:?}");
    assert_eq!(counter_of(&l, counter::ICMP_ERROR_NAT), 4);

    // About no flow: untouched.
    let stray = icmp_error("10.244.1.1", "10.244.0.50", 3, 3, &Frame::udp("10.244.0.50", 1, "10.244.1.1", 2, b""), 8);
    for hook in [Hook::TcIngress, Hook::TcEgress, Hook::Xdp, Hook::TcUplink] {
        assert_eq!(run_at(&mut l.dp, hook, &stray).1, stray);
    }
}

/// The CPUs this thread may run on.
fn allowed_cpus() -> Vec<usize> {
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }, 0);
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Moves this thread to `cpu` (BPF_PROG_TEST_RUN runs the program there).
fn pin_to_cpu(cpu: usize) {
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    assert_eq!(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) }, 0, "pin to CPU {cpu}");
}

/// The fixtures with a node and an embryonic table of `capacity` entries (the flood tests).
fn with_embryonic_capacity(name: &str, capacity: u32) -> Loaded {
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    let caps = proxy_agent::settings::Capacities { conntrack_new: capacity, ..Loaded::CAPACITIES };
    Loaded::with_capacities(name, &manifests(), &node, datapath_config(NODE_IP, Some(("10.244.0.0", 16))), caps)
}

#[test]
fn a_syn_flood_evicts_only_embryonic_flows() {
    // An embryonic table of 1,024 entries (512 flows): full long before any CPU's ring of
    // recent flows (CT_NEW_RING_SLOTS) wraps.
    let embryonic_capacity = 1024;
    let mut l = with_embryonic_capacity("flood", embryonic_capacity);
    // Everything on the first CPU, the last handshake on another one (test runs run on the
    // caller's CPU): its own part of the ring has nothing to evict, so it takes from the
    // flooded CPU's.
    let cpus: Vec<usize> = allowed_cpus().into_iter().take(2).collect();
    pin_to_cpu(cpus[0]);
    // Two assured flows, one of them masqueraded (four entries).
    let a = handshake(&mut l, "10.244.0.60", 54000, "10.96.0.10", 80);
    let (_, o) = run(&mut l.dp, true, &Frame::tcp("198.18.0.60", 54001, NODE_IP, 30080, SYN).bytes());
    let (_, o) = out(&mut l.dp, &o);
    let m = parse(&o);
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, NODE_IP, m.sport, SYN | ACK));
    out(&mut l.dp, &o);
    run(&mut l.dp, true, &Frame::tcp("198.18.0.60", 54001, NODE_IP, 30080, ACK).bytes());
    let assured = l.conntrack(Table::Assured);
    assert_eq!(assured.len(), 6);
    // Spoofed SYNs, several times what the embryonic table holds, each from another source:
    // none completes a handshake.
    let flood = |l: &mut Loaded, spoofed: std::ops::Range<u32>| {
        for i in spoofed {
            let src = std::net::Ipv4Addr::from(0x0af4_8000u32 + i);
            run(&mut l.dp, false, &Frame { src, ..Frame::tcp("0.0.0.0", 10_000 + (i % 50_000) as u16, "10.96.0.10", 80, SYN) }.bytes());
        }
    };
    flood(&mut l, 0..4_000);
    assert!(counter_of(&l, counter::NEW_FLOW) >= 4_000);
    assert_eq!(counter_of(&l, counter::CT_INSERT_FAILED), 0, "a full embryonic table must make room");
    assert_eq!(l.conntrack(Table::Assured), assured, "the flood touched the assured table");
    // The table is full of the flood (two entries a flow), and the flood's latest flows are in it.
    let embryonic = l.conntrack(Table::Embryonic);
    assert!(flood_fills(embryonic.len(), embryonic_capacity), "{} embryonic entries", embryonic.len());
    let last = std::net::Ipv4Addr::from(0x0af4_8000u32 + 3_999);
    assert!(embryonic.iter().any(|(k, _)| proxy_common::user::v4_addr(k.saddr) == last), "the flood's last SYN was not tracked");
    // Nothing completed or expired: each flood flow the table no longer holds (two entries a
    // flow) was evicted, and counted once.
    let evicted = counter_of(&l, counter::CT_EMBRYONIC_EVICTED);
    assert_eq!(evicted, 4_000 - embryonic.len() as u64 / 2, "evictions counted");
    // A new client still opens a connection during the flood, and it becomes assured: on the
    // flooded CPU, and on another one.
    handshake(&mut l, "10.244.0.61", 54002, "10.96.0.10", 80);
    assert!(assured_has(&l, "10.244.0.61", 54002), "a handshake completed during the flood is not assured");
    if let Some(&other) = cpus.get(1) {
        // The flood goes on (the handshake's promotion freed its entries), then a client on
        // another CPU.
        flood(&mut l, 4_000..4_100);
        assert!(flood_fills(l.conntrack(Table::Embryonic).len(), embryonic_capacity), "the flood refills the table");
        pin_to_cpu(other);
        handshake(&mut l, "10.244.0.62", 54003, "10.96.0.10", 80);
        assert!(assured_has(&l, "10.244.0.62", 54003), "a handshake on another CPU than the flood's is not assured");
        assert_eq!(counter_of(&l, counter::CT_INSERT_FAILED), 0, "the other CPU must make room too");
    } else {
        eprintln!("one CPU only: the handshake on another CPU than the flood's is not tried");
    }
    // The held flows still answer, forward and reply.
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.60", 54000, "10.96.0.10", 80, ACK));
    assert_eq!(parse(&o).dst, a.dst);
    let (_, o) = out(&mut l.dp, &Frame::tcp(&a.dst.to_string(), 8080, "10.244.0.60", 54000, ACK).bytes());
    assert_eq!(parse(&o).src.to_string(), "10.96.0.10");
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.1.1", 8080, NODE_IP, m.sport, ACK));
    assert_eq!(parse(&o).dst.to_string(), "198.18.0.60");
}

/// Whether a flood keeps the embryonic table as full as its design does. A full 4-way bucket
/// evicts a whole flow (its entries in other buckets too) for each new entry, which leaves
/// holes elsewhere: a flood of two-entry flows keeps about 80% of the entries (a simulation of
/// 256 buckets: 794-842 of 1,024), never under three quarters.
fn flood_fills(entries: usize, capacity: u32) -> bool {
    entries * 4 >= capacity as usize * 3
}

#[test]
fn a_bucket_full_of_another_cpus_flows_of_this_tick_still_gives_way() {
    // A new flow is stamped by the tick's coarse clock, past its CPU's previous stamp
    // (conntrack::kpr_new_flow_stamp), so another CPU's flood within the tick stamps its flows
    // later than this CPU's next one. A bucket full of them must still give way (its oldest),
    // or a client here fails until the tick ends. Made so: four flows written into the SYN's
    // bucket stamped just before now, and this CPU's previous stamp just before theirs.
    let mut l = load("later-stamps");
    let cpu = allowed_cpus()[0];
    pin_to_cpu(cpu);
    let buckets = Buckets::<CtBucket>::open(l.pins.path(), map_names::CONNTRACK_NEW).unwrap();
    let mask = buckets.buckets() - 1;
    let word = |a: &str| addr_words(ip(a))[0];
    let forward = |port: u16| CtKey {
        saddr: word("10.244.0.70"),
        daddr: word("10.96.0.10"),
        sport: port.to_be(),
        dport: 80u16.to_be(),
        proto: PROTO_TCP,
        dir: CT_DIR_INGRESS,
        _pad: 0,
    };
    // Client ports whose reply tuples (from any of the three backends) fall in other buckets:
    // the SYN evicts once, for its forward entry.
    let ports = (55_000..56_000u16).filter(|&p| {
        let key = forward(p);
        WEB.iter().all(|b| {
            CtKey { saddr: word(b), daddr: key.saddr, sport: 8080u16.to_be(), dport: key.sport, dir: CT_DIR_EGRESS, ..key }.bucket(mask) != key.bucket(mask)
        })
    });
    // Until an attempt's SYN is stamped before the four (no tick between its setup and its
    // SYN), at most 50 attempts.
    let mut stamped_before = false;
    for port in ports.take(50) {
        let key = forward(port);
        // A bucket an earlier attempt left entries in is passed over.
        if !buckets.read_batch(Some(key.bucket(mask)), 4).0.is_empty() {
            continue;
        }
        let others: Vec<CtKey> = (1..=u16::MAX)
            .map(|p| CtKey { saddr: word("10.244.9.9"), sport: p.to_be(), ..key })
            .filter(|k| k.bucket(mask) == key.bucket(mask))
            .take(4)
            .collect();
        let now = proxy_agent::dataplane::ebpf::kernel::monotonic_ns();
        for (i, k) in others.iter().enumerate() {
            let v = CtValue {
                last_seen_ns: now - 4 + i as u64,
                new_saddr: k.saddr,
                new_daddr: word(WEB[0]),
                new_sport: k.sport,
                new_dport: 8080u16.to_be(),
                ..Default::default()
            };
            assert!(buckets.insert(k, &v), "the bucket takes four entries");
        }
        set_last_stamp(&mut l, now - 10);
        let (evicted, failed) = (counter_of(&l, counter::CT_EMBRYONIC_EVICTED), counter_of(&l, counter::CT_INSERT_FAILED));
        let (verdict, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.70", port, "10.96.0.10", 80, SYN));
        assert_eq!(verdict, TC_ACT_OK, "the SYN was dropped: its bucket gave no way");
        assert!(WEB.contains(&parse(&o).dst.to_string().as_str()));
        assert_eq!(counter_of(&l, counter::CT_INSERT_FAILED), failed);
        assert_eq!(counter_of(&l, counter::CT_EMBRYONIC_EVICTED), evicted + 1);
        assert!(buckets.get(&others[0]).is_none(), "the oldest gives way");
        assert!(others[1..].iter().all(|k| buckets.get(k).is_some()), "the others stay");
        assert!(buckets.get(&key).is_some(), "the SYN's flow is tracked");
        // Stamped before the four (no tick came between): the case this test is for.
        if last_stamp(&mut l, cpu) == now - 9 {
            stamped_before = true;
            break;
        }
    }
    assert!(stamped_before, "a tick came between every attempt's setup and its SYN");
}

fn clock_map(l: &mut Loaded) -> aya::maps::PerCpuArray<&mut aya::maps::MapData, ClockCache> {
    aya::maps::PerCpuArray::try_from(l.dp.ebpf().map_mut(proxy_common::map_name!(CLOCK)).unwrap()).unwrap()
}

/// Sets every CPU's previous new-flow stamp (its clock read again at the next packet).
fn set_last_stamp(l: &mut Loaded, stamp: u64) {
    let cpus = aya::util::nr_cpus().unwrap();
    let values = aya::maps::PerCpuValues::try_from(vec![ClockCache { last_stamp_ns: stamp, ..Default::default() }; cpus]).unwrap();
    clock_map(l).set(0, values, 0).unwrap();
}

/// `cpu`'s last new flow's stamp.
fn last_stamp(l: &mut Loaded, cpu: usize) -> u64 {
    clock_map(l).get(&0, 0).unwrap()[cpu].last_stamp_ns
}

/// The entries of the flows whose client is `client:port`, in `table`.
fn entries_of(l: &Loaded, table: Table, client: &str, port: u16) -> Vec<(proxy_common::CtKey, proxy_common::CtValue)> {
    let (a, p) = (ip(client), port.to_be());
    let v4 = proxy_common::user::v4_addr;
    l.conntrack(table).into_iter().filter(|(k, _)| (v4(k.saddr) == a && k.sport == p) || (v4(k.daddr) == a && k.dport == p)).collect()
}

/// A UDP flow starts embryonic, as a TCP one does: the backend's answer is seen, and the
/// client's next datagram makes it assured (a spoofed source never sees the answer, so it never
/// gets a flow assured). A flow never answered stays embryonic.
#[test]
fn a_udp_flow_is_assured_by_the_clients_datagram_after_an_answer() {
    let mut l = load("udpassure");
    let (client, port) = ("10.244.0.65", 54020);
    let q = Frame::udp(client, port, "10.96.0.15", 53, b"q");
    let (new, assured) = (counter_of(&l, counter::NEW_FLOW), counter_of(&l, counter::FLOW_ASSURED));
    let (_, o) = tc(&mut l.dp, &q);
    let fwd = parse(&o);
    assert_eq!((fwd.dst.to_string().as_str(), fwd.dport), ("10.244.1.3", 5353));
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new + 1);
    assert_eq!(entries_of(&l, Table::Embryonic, client, port).len(), 2, "forward and reverse DNAT");
    assert!(entries_of(&l, Table::Assured, client, port).is_empty());
    // A second datagram before any answer: the same flow, still embryonic.
    let (_, o) = tc(&mut l.dp, &q);
    assert_eq!(parse(&o).dst, fwd.dst);
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new + 1);
    assert!(entries_of(&l, Table::Assured, client, port).is_empty());
    // The answer is translated and seen; the flow stays embryonic until the client sends again.
    let answer = Frame { src: fwd.dst, dst: fwd.src, ..Frame::udp("0.0.0.0", fwd.dport, "0.0.0.0", fwd.sport, b"a") };
    let (_, back) = out(&mut l.dp, &answer.bytes());
    let back = parse(&back);
    assert_eq!((back.src.to_string().as_str(), back.sport, back.l4_csum_ok), ("10.96.0.15", 53, true));
    let seen = entries_of(&l, Table::Embryonic, client, port);
    assert!(seen.iter().all(|(_, v)| v.flags & proxy_common::CT_F_SEEN_REPLY != 0), "{seen:?}");
    assert!(entries_of(&l, Table::Assured, client, port).is_empty());
    let (_, o) = tc(&mut l.dp, &q);
    assert_eq!(parse(&o).dst, fwd.dst);
    assert!(entries_of(&l, Table::Embryonic, client, port).is_empty());
    assert_eq!(entries_of(&l, Table::Assured, client, port).len(), 2, "assured by the datagram after the answer");
    assert_eq!(counter_of(&l, counter::FLOW_ASSURED), assured + 1);
    let (_, back) = out(&mut l.dp, &answer.bytes());
    assert_eq!(parse(&back).src.to_string(), "10.96.0.15", "answers translated from the assured table");
    // Never answered: embryonic however many datagrams the client sends.
    for _ in 0..3 {
        tc(&mut l.dp, &Frame::udp(client, port + 1, "10.96.0.15", 53, b"q"));
    }
    assert_eq!(entries_of(&l, Table::Embryonic, client, port + 1).len(), 2);
    assert_eq!(counter_of(&l, counter::FLOW_ASSURED), assured + 1);
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new + 2);
}

/// A UDP flood from spoofed sources, half of it answered by the backend, several times what the
/// embryonic table holds: it evicts only flows not assured. The assured flows (TCP and UDP) keep
/// their entries and their backends, and a new UDP client is still assured during the flood.
#[test]
fn a_udp_flood_evicts_only_flows_not_assured() {
    let embryonic_capacity = 1024;
    let mut l = with_embryonic_capacity("udpflood", embryonic_capacity);
    pin_to_cpu(allowed_cpus()[0]);
    let a = handshake(&mut l, "10.244.0.66", 54030, "10.96.0.10", 80);
    let u = udp_exchange(&mut l, "10.244.0.66", 54031, "10.96.0.15", 53);
    let assured = l.conntrack(Table::Assured);
    assert_eq!(assured.len(), 4);
    for i in 0..4_000u32 {
        let src = std::net::Ipv4Addr::from(0x0af4_8000u32 + i);
        let (_, o) = run(&mut l.dp, false, &Frame { src, ..Frame::udp("0.0.0.0", 10_000 + (i % 50_000) as u16, "10.96.0.15", 53, b"x") }.bytes());
        if i % 2 == 0 {
            let p = parse(&o);
            out(&mut l.dp, &Frame { src: p.dst, dst: p.src, ..Frame::udp("0.0.0.0", p.dport, "0.0.0.0", p.sport, b"a") }.bytes());
        }
    }
    assert_eq!(counter_of(&l, counter::CT_INSERT_FAILED), 0, "a full embryonic table must make room");
    assert_eq!(l.conntrack(Table::Assured), assured, "the flood touched the assured table");
    let embryonic = l.conntrack(Table::Embryonic);
    assert!(flood_fills(embryonic.len(), embryonic_capacity), "{} embryonic entries", embryonic.len());
    assert_eq!(counter_of(&l, counter::CT_EMBRYONIC_EVICTED), 4_000 - embryonic.len() as u64 / 2, "evictions counted");
    // The assured flows still answer, on their backends.
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.66", 54030, "10.96.0.10", 80, ACK));
    assert_eq!(parse(&o).dst, a.dst);
    let (_, o) = tc(&mut l.dp, &Frame::udp("10.244.0.66", 54031, "10.96.0.15", 53, b"q"));
    assert_eq!((parse(&o).dst, parse(&o).sport), (u.dst, u.sport));
    // A new client's flow is assured during the flood.
    udp_exchange(&mut l, "10.244.0.67", 54032, "10.96.0.15", 53);
    assert!(assured_has(&l, "10.244.0.67", 54032), "a UDP flow answered during the flood is not assured");
}

#[test]
fn a_flow_picked_up_mid_stream_becomes_assured_at_its_next_packet() {
    let mut l = load("pickup");
    // An ACK of a connection this node never saw open (its maps were lost, or it was someone
    // else's): a new flow, but no handshake to wait for.
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.70", 55000, "10.96.0.10", 80, ACK));
    let first = parse(&o).dst;
    assert!(!assured_has(&l, "10.244.0.70", 55000));
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.70", 55000, "10.96.0.10", 80, ACK));
    assert_eq!(parse(&o).dst, first);
    assert!(assured_has(&l, "10.244.0.70", 55000));
}

#[test]
fn the_objects_btf_loads_so_programs_carry_func_info() {
    // A type the kernel's BTF checker refuses (Rust's Option layout, say) makes aya load the
    // programs without BTF: no source lines in verifier logs, no func info for bpftool.
    let mut l = load("btf");
    for name in [prog_names::TC_INGRESS, prog_names::TC_EGRESS] {
        let info = l.dp.classifier(name).unwrap().info().unwrap();
        assert!(info.btf_id().is_some(), "{name} was loaded without the object's BTF");
    }
    let info = l.dp.xdp(prog_names::XDP_INGRESS).unwrap().info().unwrap();
    assert!(info.btf_id().is_some(), "the XDP program was loaded without the object's BTF");
}

#[test]
fn a_service_id_given_to_another_frontend_never_inherits_its_affinity() {
    use aya::maps::{HashMap, MapData};
    use proxy_common::{map_names, AffinityKey, AffinityValue};
    let mut l = load("affgen");
    let cfg = datapath_config(NODE_IP, Some(("10.244.0.0", 16)));
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![ip(NODE_IP)], ..Default::default() };
    // A client pinned to a backend of "sticky" (10.96.0.11).
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.80", 56000, "10.96.0.11", 80, SYN));
    let pinned = parse(&o).dst;
    let mut aff: HashMap<MapData, AffinityKey, AffinityValue> =
        proxy_agent::dataplane::ebpf::kernel_maps::open_typed(l.pins.path(), map_names::AFFINITY).unwrap();
    let stale: Vec<(AffinityKey, AffinityValue)> = aff.iter().map(|e| e.unwrap()).collect();
    assert_eq!(stale.len(), 1);
    // "sticky" goes; then a new affinity service whose only backend is another one gets its ids
    // back from the free list.
    let gone = manifests()
        .replace(&svc("sticky", "10.96.0.11", 80, "TCP", "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n", ""), "")
        .replace(&slice("sticky", 8080, "TCP", &BACKENDS), "");
    l.syncer.sync(&mut l.maps, &kpr_lab::desired(&gone, &node), cfg).unwrap();
    let other = BACKENDS.iter().find(|b| **b != pinned.to_string()).unwrap();
    let mut y = gone.clone();
    y += &svc("fresh", "10.96.0.19", 80, "TCP", "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n", "");
    y += &slice("fresh", 8080, "TCP", &[other]);
    l.syncer.sync(&mut l.maps, &kpr_lab::desired(&y, &node), cfg).unwrap();
    let reused = l.maps.services().unwrap().into_iter().find(|(k, _)| k.ip() == ip("10.96.0.19") && k.scope == 0).unwrap().1;
    assert_eq!(reused.service_id, stale[0].0.service_id, "the fixture needs the id reused");
    // The old entry is still there (the agent's purge has not run, say): it must not count.
    for (k, v) in &stale {
        aff.insert(k, v, 0).unwrap();
    }
    let hits = counter_of(&l, counter::AFFINITY_HIT);
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.80", 56001, "10.96.0.19", 80, SYN));
    assert_eq!(parse(&o).dst.to_string(), *other, "the earlier owner's affinity was inherited");
    assert_eq!(counter_of(&l, counter::AFFINITY_HIT), hits);
}

#[test]
fn the_collector_deletes_only_what_it_read_in_the_kernel_maps() {
    let mut l = load("ctdelete");
    udp_exchange(&mut l, "10.244.0.81", 57000, "10.96.0.15", 53);
    let entries = l.conntrack(Table::Assured);
    let (k, v) = *entries.iter().find(|(k, v)| k.role(v) == proxy_common::CtRole::Forward).unwrap();
    // The tuple gets a new flow between the read and the delete.
    let mut newer = v;
    newer.last_seen_ns += 1;
    let mut ct: aya::maps::HashMap<aya::maps::MapData, proxy_common::CtKey, proxy_common::CtValue> =
        proxy_agent::dataplane::ebpf::kernel_maps::open_typed(l.pins.path(), proxy_common::map_names::CONNTRACK).unwrap();
    ct.insert(k, newer, 0).unwrap();
    assert!(!l.maps.conntrack_mut().delete_if(Table::Assured, &k, &v).unwrap());
    assert_eq!(ct.get(&k, 0).unwrap(), newer, "the newer entry must survive");
    assert!(l.maps.conntrack_mut().delete_if(Table::Assured, &k, &newer).unwrap());
    assert!(ct.get(&k, 0).is_err());
    // A purge (the backend left): a stamp since the read does not save the flow, another flow
    // in the key does.
    let mut other_flow = newer;
    other_flow.backend_id += 1;
    ct.insert(k, other_flow, 0).unwrap();
    assert!(!l.maps.conntrack_mut().delete_if_same_flow(Table::Assured, &k, &v).unwrap());
    assert_eq!(ct.get(&k, 0).unwrap(), other_flow, "another flow's entry must survive");
    ct.insert(k, newer, 0).unwrap();
    assert!(l.maps.conntrack_mut().delete_if_same_flow(Table::Assured, &k, &v).unwrap());
    assert!(ct.get(&k, 0).is_err());
    // Batch reads page through the table.
    let (first, next) = l.maps.conntrack().read_batch(Table::Assured, None, 1).unwrap();
    assert_eq!(first.len(), 1);
    assert!(next.is_some() || l.conntrack(Table::Assured).len() == 1);
}

/// A flow the collector marked as past its Service's maximum connection age: the next TCP
/// packet from the client is answered with a reset from the service address (valid checksums,
/// sequence number = the packet's acknowledgement), straight back out; a marked UDP flow starts
/// over as a new flow (re-balanced).
#[test]
fn a_flow_past_its_maximum_age_is_reset_or_rebalanced() {
    let mut l = load("maxage");
    let client = "10.244.0.9";
    handshake(&mut l, client, 45000, "10.96.0.10", 80);
    let mark = |l: &mut Loaded, port: u16| {
        let (k, v) = l
            .conntrack(Table::Assured)
            .into_iter()
            .find(|(k, v)| !v.is_reply() && k.sport == port.to_be() && k.dir == proxy_common::CT_DIR_INGRESS)
            .expect("the forward entry");
        assert!(l.maps.conntrack_mut().set_flags_if(Table::Assured, &k, &v, proxy_common::CT_F_MAX_AGE).unwrap());
        l.maps.conntrack_mut().invalidate_flow_cache().unwrap();
    };
    mark(&mut l, 45000);
    let mut data = Frame { payload: b"ping".to_vec(), ..Frame::tcp(client, 45000, "10.96.0.10", 80, ACK) }.bytes();
    data[42..46].copy_from_slice(&5555u32.to_be_bytes()); // the client's acknowledgement
    let (v, out) = run(&mut l.dp, false, &data);
    assert_eq!(v, TC_ACT_REDIRECT, "straight back to the client");
    let p = parse(&out);
    assert_eq!((p.proto, p.src.to_string(), p.sport, p.dst.to_string(), p.dport), (TCP, "10.96.0.10".into(), 80, client.into(), 45000));
    assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
    assert_eq!(out[14 + 20 + 13], 0x04, "RST");
    assert_eq!(&out[38..42], &5555u32.to_be_bytes(), "sequence number = the packet's acknowledgement");
    assert_eq!(out.len(), 54);
    assert_eq!(counter_of(&l, counter::MAX_AGE_RESET), 1);

    // UDP: the marked flow's next datagram opens a new flow.
    udp_exchange(&mut l, client, 45001, "10.96.0.15", 53);
    mark(&mut l, 45001);
    let new_flows = counter_of(&l, counter::NEW_FLOW);
    let (v, out) = tc(&mut l.dp, &Frame::udp(client, 45001, "10.96.0.15", 53, b"q"));
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(parse(&out).dst.to_string(), "10.244.1.3", "DNATed by the new flow");
    assert_eq!(counter_of(&l, counter::NEW_FLOW), new_flows + 1, "a new flow");
    let fwd = l.conntrack(Table::Embryonic).into_iter().find(|(k, v)| !v.is_reply() && k.sport == 45001u16.to_be() && k.dir == proxy_common::CT_DIR_INGRESS);
    assert!(fwd.is_some_and(|(_, v)| v.flags & proxy_common::CT_F_MAX_AGE == 0), "the new flow is unmarked");
}

/// Least-connection and power of two choices read the active-flow counts (KPR_BE_ACTIVE_V1, as
/// the collector writes them) and add each new flow to its backend's count: least-connection
/// fills the least loaded backend until it catches up; P2C never picks the most loaded of three.
#[test]
fn least_connection_and_p2c_follow_the_active_flow_counts() {
    use proxy_agent::dataplane::ebpf::{
        kernel_maps::KernelBackendLoads,
        maps::{write_loads, BackendLoads},
    };
    let mut l = load("leastconn");
    let ids: std::collections::HashMap<String, u32> =
        l.maps.backends().unwrap().into_iter().filter(|(_, b)| b.port_host() == 8080).map(|(id, b)| (b.ip().to_string(), id)).collect();
    let id = |ip: &str| ids[ip];
    let mut loads = KernelBackendLoads::open(l.pins.path()).unwrap();
    let mut written = std::collections::HashMap::new();
    let set = |loads: &mut KernelBackendLoads, written: &mut std::collections::HashMap<u32, u32>, v: &[(&str, u32)]| {
        write_loads(loads, written, &v.iter().map(|(ip, n)| (id(ip), *n)).collect()).unwrap();
    };
    let picks = |l: &mut Loaded, vip: &str, first_port: u16, n: u16| -> std::collections::BTreeMap<String, u32> {
        let mut m = std::collections::BTreeMap::new();
        for port in first_port..first_port + n {
            let (_, out) = tc(&mut l.dp, &Frame::tcp("10.244.0.9", port, vip, 80, SYN));
            *m.entry(parse(&out).dst.to_string()).or_default() += 1;
        }
        m
    };
    // b1 holds 10 flows, b2 none, b3 5: the first 5 go to b2; then b2 and b3 share until they
    // reach b1's 10.
    set(&mut loads, &mut written, &[("10.244.3.1", 10), ("10.244.3.2", 0), ("10.244.3.3", 5)]);
    let first = picks(&mut l, "10.96.0.21", 46000, 5);
    assert_eq!(first, [("10.244.3.2".to_string(), 5)].into_iter().collect(), "the least loaded first");
    let next = picks(&mut l, "10.96.0.21", 46100, 10);
    assert!(!next.contains_key("10.244.3.1") && next.values().sum::<u32>() == 10, "b1 is the most loaded until the others reach it: {next:?}");
    // The data path added each flow to its backend's count.
    let active = |ip: &str| -> u32 {
        aya::maps::Array::<_, u32>::try_from(aya::maps::Map::Array(
            aya::maps::MapData::from_pin(l.pins.path().join(proxy_common::map_names::BACKEND_ACTIVE)).unwrap(),
        ))
        .unwrap()
        .get(&id(ip), 0)
        .unwrap()
    };
    assert_eq!(active("10.244.3.2") + active("10.244.3.3"), 5 + 5 + 10);
    // And to its new-connection count (KPR_BE_NEW_V2, one counter for all CPUs).
    let new = |ip: &str| l.maps.backend_new_connections(id(ip)).unwrap();
    assert_eq!((new("10.244.3.1"), new("10.244.3.2") + new("10.244.3.3")), (0, 15));
    // A count from the collector replaces the sum.
    set(&mut loads, &mut written, &[("10.244.3.1", 100), ("10.244.3.2", 3), ("10.244.3.3", 3)]);
    assert_eq!(active("10.244.3.2"), 3);
    // P2C: two distinct random backends, the less loaded wins: never the one with 100.
    let p2c = picks(&mut l, "10.96.0.22", 47000, 40);
    assert!(!p2c.contains_key("10.244.3.1") && p2c.len() == 2, "{p2c:?}");
    let _ = loads.set(id("10.244.3.1"), 0);
}

/// Outlier detection's data path half: a reset answering a new connection's SYN counts as a
/// refusal of its backend (KPR_BE_FAIL_V1); a completed handshake clears the count.
#[test]
fn a_reset_answering_a_syn_counts_as_a_refusal_until_a_handshake_completes() {
    let mut l = load("refusal");
    // "np" has one endpoint, 10.244.1.1:8080.
    for port in [48000, 48001] {
        let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.9", port, "10.96.0.13", 80, SYN));
        let fwd = parse(&o);
        assert_eq!(fwd.dst.to_string(), "10.244.1.1");
        let rst = Frame { src: fwd.dst, dst: fwd.src, ..Frame::tcp("0.0.0.0", fwd.dport, "0.0.0.0", fwd.sport, 0x04 | ACK) };
        let (v, back) = out(&mut l.dp, &rst.bytes());
        assert_eq!(v, TC_ACT_OK);
        assert_eq!(parse(&back).src.to_string(), "10.96.0.13", "the reset still reaches the client, from the service");
    }
    let f = fails(&l);
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].1, 2, "two refusals in a row: {f:?}");
    assert_eq!(refused_flows(&l), vec![48000, 48001], "the collector must not count them again as unanswered SYNs");
    // A handshake with the same backend: the refusals are no longer in a row.
    handshake(&mut l, "10.244.0.9", 48002, "10.96.0.13", 80);
    assert!(fails(&l).is_empty(), "{:?}", fails(&l));
}

/// Client ports of the embryonic flows marked refused (CT_F_REFUSED on the forward entry).
fn refused_flows(l: &Loaded) -> Vec<u16> {
    let mut ports: Vec<u16> = l
        .conntrack(Table::Embryonic)
        .iter()
        .filter(|(k, v)| k.role(v) == proxy_common::CtRole::Forward && v.flags & proxy_common::CT_F_REFUSED != 0)
        .map(|(k, _)| u16::from_be(k.sport))
        .collect();
    ports.sort();
    ports
}

/// (backend id, refusals in a row) from KPR_BE_FAIL_V1.
fn fails(l: &Loaded) -> Vec<(u32, u32)> {
    let m: aya::maps::HashMap<_, u32, u32> = aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(
        aya::maps::MapData::from_pin(l.pins.path().join(proxy_common::map_names::BACKEND_FAIL)).unwrap(),
    ))
    .unwrap();
    m.iter().map(|e| e.unwrap()).collect()
}

/// The same for a destination unreachable answering a SYN (a REJECT rule at the backend, a
/// host that is gone): one refusal per error, once though a masqueraded flow's error is
/// translated at two hooks; fragmentation needed refuses nothing.
#[test]
fn an_icmp_unreachable_answering_a_syn_counts_as_a_refusal() {
    let mut l = load("icmprefusal");
    // A pod's SYN to "np" (one endpoint, 10.244.1.1:8080); the errors go back at egress.
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.9", 48100, "10.96.0.13", 80, SYN));
    let fwd = parse(&o);
    let backend = fwd.dst.to_string();
    let mtu = icmp_error(&backend, "10.244.0.9", 3, 4, &frame(&fwd, SYN), 20);
    let (_, back) = out(&mut l.dp, &mtu);
    assert_eq!(parse(&back).src.to_string(), "10.96.0.13");
    assert!(fails(&l).is_empty(), "fragmentation needed is no refusal: {:?}", fails(&l));
    assert!(refused_flows(&l).is_empty());
    let refused = icmp_error(&backend, "10.244.0.9", 3, 3, &frame(&fwd, SYN), 8);
    let (_, back) = out(&mut l.dp, &refused);
    assert_eq!(parse(&back).src.to_string(), "10.96.0.13", "the error still reaches the client, from the service");
    assert_eq!(fails(&l).iter().map(|f| f.1).collect::<Vec<_>>(), vec![1]);
    assert_eq!(refused_flows(&l), vec![48100]);
    // From outside to the NodePort (masqueraded): host unreachable, reversed at ingress then at
    // egress, counts once.
    let (_, o) = run(&mut l.dp, true, &Frame::tcp("198.18.0.9", 51100, NODE_IP, 30080, SYN).bytes());
    let (_, o) = out(&mut l.dp, &o);
    let m = parse(&o);
    assert_eq!(m.dst.to_string(), backend);
    let err = icmp_error(&backend, NODE_IP, 3, 1, &frame(&m, SYN), 8);
    let (_, o) = run_at(&mut l.dp, Hook::TcIngress, &err);
    let (_, o) = out(&mut l.dp, &o);
    assert_eq!(parse(&o).dst.to_string(), "198.18.0.9");
    assert_eq!(fails(&l).iter().map(|f| f.1).collect::<Vec<_>>(), vec![2]);
    // An error about an established flow is no refusal of a new connection.
    let est = handshake(&mut l, "10.244.0.9", 48101, "10.96.0.13", 80);
    assert!(fails(&l).is_empty());
    let late = icmp_error(&backend, "10.244.0.9", 3, 3, &frame(&est, ACK), 8);
    out(&mut l.dp, &late);
    assert!(fails(&l).is_empty(), "{:?}", fails(&l));
}

/// UDP has no handshake, but a port unreachable answering a flow its backend never replied to
/// is a refusal all the same (a DNS pod whose server died while it stays ready): counted once
/// per flow, and a reply from the backend ends the refusals in a row and makes later errors
/// about that flow late ones.
#[test]
fn a_port_unreachable_answering_a_new_udp_flow_counts_as_a_refusal() {
    let mut l = load("udprefusal");
    // A pod's query to "dns" (one endpoint, 10.244.1.3:5353); the errors go back at egress.
    let query = |l: &mut Loaded, port: u16| {
        let (_, o) = tc(&mut l.dp, &Frame::udp("10.244.0.50", port, "10.96.0.15", 53, b"query"));
        let sent = parse(&o);
        assert_eq!((sent.dst.to_string().as_str(), sent.dport), ("10.244.1.3", 5353));
        Frame::udp("10.244.0.50", sent.sport, "10.244.1.3", 5353, b"query")
    };
    let refusals = |l: &Loaded| fails(l).iter().map(|f| f.1).collect::<Vec<_>>();
    let first = query(&mut l, 47100);
    let unreachable = icmp_error("10.244.1.3", "10.244.0.50", 3, 3, &first, 8);
    let (_, back) = out(&mut l.dp, &unreachable);
    assert_eq!(parse(&back).src.to_string(), "10.96.0.15", "the error still reaches the client, from the service");
    assert_eq!(refusals(&l), vec![1]);
    // The client asks again on the same flow: still one refused flow.
    query(&mut l, 47100);
    out(&mut l.dp, &unreachable);
    assert_eq!(refusals(&l), vec![1], "one count per flow");
    // Fragmentation needed is no refusal.
    let second = query(&mut l, 47101);
    out(&mut l.dp, &icmp_error("10.244.1.3", "10.244.0.50", 3, 4, &second, 8));
    assert_eq!(refusals(&l), vec![1]);
    out(&mut l.dp, &icmp_error("10.244.1.3", "10.244.0.50", 3, 3, &second, 8));
    assert_eq!(refusals(&l), vec![2]);
    // A flow the backend answers: the refusals are no longer in a row.
    let third = query(&mut l, 47102);
    let reply = Frame::udp("10.244.1.3", 5353, "10.244.0.50", third.sport, b"answer");
    let (_, o) = out(&mut l.dp, &reply.bytes());
    assert_eq!(parse(&o).src.to_string(), "10.96.0.15");
    assert!(fails(&l).is_empty(), "{:?}", fails(&l));
    // An error about that flow afterwards (the server died mid-conversation) is a late one.
    out(&mut l.dp, &icmp_error("10.244.1.3", "10.244.0.50", 3, 3, &third, 8));
    assert!(fails(&l).is_empty(), "{:?}", fails(&l));
}

fn set_flag(l: &mut Loaded, flag: u32) {
    let cfg = l.maps.config().unwrap();
    l.maps.set_config(proxy_common::DatapathConfig { flags: cfg.flags | flag, ..cfg }).unwrap();
}

/// A switch to IPVS mode drains the fast path (CFG_F_NO_NEW_FLOWS): its flows keep their
/// translation; a packet no flow knows goes on to the next TC program (IPVS mode's set
/// matching) untouched, and starts no flow.
#[test]
fn draining_fast_path_serves_its_flows_and_hands_everything_else_on() {
    let mut l = load("drain");
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40100, "10.96.0.10", 80, SYN));
    let backend = parse(&o).dst;
    let udp = Frame::udp("10.244.0.5", 40101, "10.96.0.15", 53, b"q");
    let (_, o) = tc(&mut l.dp, &udp);
    assert_eq!(parse(&o).dst.to_string(), "10.244.1.3");
    set_flag(&mut l, proxy_common::CFG_F_NO_NEW_FLOWS);
    let flows = l.conntrack(Table::Assured).len() + l.conntrack(Table::Embryonic).len();
    // The flows it has: translated as before, at ingress and egress.
    let (v, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40100, "10.96.0.10", 80, ACK));
    assert_eq!((v, parse(&o).dst), (TC_ACT_OK, backend));
    let (v, o) = out(&mut l.dp, &Frame::tcp(&backend.to_string(), 8080, "10.244.0.5", 40100, SYN | ACK).bytes());
    assert_eq!((v, parse(&o).src.to_string().as_str()), (TC_ACT_OK, "10.96.0.10"));
    let (v, o) = tc(&mut l.dp, &udp);
    assert_eq!((v, parse(&o).dst.to_string().as_str()), (TC_ACT_OK, "10.244.1.3"));
    // New connections, TCP and UDP, and traffic to no service: the next program's, untouched.
    for f in [
        Frame::tcp("10.244.0.5", 40102, "10.96.0.10", 80, SYN),
        Frame::udp("10.244.0.5", 40103, "10.96.0.15", 53, b"q"),
        Frame::tcp("10.244.0.5", 40104, "10.244.9.9", 80, SYN),
    ] {
        let (v, o) = tc(&mut l.dp, &f);
        assert_eq!((v, &o), (TC_ACT_UNSPEC, &f.bytes()));
    }
    // At XDP (no next program there), a pass.
    let nodeport = Frame::tcp("198.18.0.1", 50100, NODE_IP, 30080, SYN);
    assert_eq!(run(&mut l.dp, true, &nodeport.bytes()), (XDP_PASS, nodeport.bytes()));
    assert_eq!(l.conntrack(Table::Assured).len() + l.conntrack(Table::Embryonic).len(), flows, "no new flow while draining");
}

/// After a switch from IPVS mode (CFG_F_HANDOVER), a TCP packet of a connection the fast path
/// does not know, other than a SYN, is IPVS's: it passes untouched to the stack. A SYN still
/// starts a flow, and the fast path's own flows are unaffected.
#[test]
fn after_a_switch_from_ipvs_its_connections_pass_and_new_ones_are_balanced() {
    let mut l = load("handover");
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40200, "10.96.0.10", 80, SYN));
    let mine = parse(&o).dst;
    set_flag(&mut l, proxy_common::CFG_F_HANDOVER);
    for flags in [ACK, ACK | FIN, RST] {
        let f = Frame::tcp("10.244.0.5", 40201, "10.96.0.10", 80, flags);
        assert_eq!(tc(&mut l.dp, &f), (TC_ACT_OK, f.bytes()), "flags {flags:#x}");
        let f = Frame::tcp("198.18.0.1", 50201, NODE_IP, 30080, flags);
        assert_eq!(run(&mut l.dp, true, &f.bytes()), (XDP_PASS, f.bytes()), "NodePort, flags {flags:#x}");
    }
    assert!(counter_of(&l, counter::HANDOVER_PASS) >= 6);
    assert!(
        !l.conntrack(Table::Embryonic).iter().chain(l.conntrack(Table::Assured).iter()).any(|(k, _)| k.sport == 40201u16.to_be()),
        "no flow for IPVS's connection"
    );
    let (_, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40200, "10.96.0.10", 80, ACK));
    assert_eq!(parse(&o).dst, mine, "the fast path's own flow");
    let (v, o) = tc(&mut l.dp, &Frame::tcp("10.244.0.5", 40202, "10.96.0.10", 80, SYN));
    assert_eq!(v, TC_ACT_OK);
    assert!(WEB.contains(&parse(&o).dst.to_string().as_str()), "a SYN starts a flow");
}
