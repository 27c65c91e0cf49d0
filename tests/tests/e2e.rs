//! End to end in network namespaces: real TCP and UDP through the programs attached by the real
//! agent, from a pod (TC) and from outside the node (the uplink: TC on the lab's veth, XDP when
//! asked), to three backend namespaces.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use kpr_lab::lab::{errors, per_backend, Lab, NODE_IP, NODE_IP6};

fn examples_copy(name: &str) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let dst = std::env::temp_dir().join(format!("kpr-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

fn lab(prefix: &str) -> Lab {
    let m = examples_copy(prefix);
    let mut lab = Lab::build(prefix, &m);
    lab.start_agent();
    lab.wait_backends("10.96.0.10:80", 3);
    lab
}

fn assert_even(v: &serde_json::Value, total: u64, what: &str) {
    let pb = per_backend(v);
    assert_eq!(errors(v), 0, "{what}: {v}");
    assert_eq!(pb.len(), 3, "{what}: every backend must be reached: {v}");
    // Random choices are binomial: 4.5 standard deviations (26% of even at 600) fail a fair
    // scheduler about once in 100,000 checks, and still catch a backend left out or favoured.
    let expected = total as f64 / 3.0;
    let allowed = 4.5 * (total as f64 * (1.0 / 3.0) * (2.0 / 3.0)).sqrt();
    for (b, n) in &pb {
        let dev = (*n as f64 - expected).abs();
        assert!(
            dev <= allowed,
            "{what}: backend {b} got {n} of {total} ({:.0}% off even, {:.0}% allowed): {v}",
            100.0 * dev / expected,
            100.0 * allowed / expected
        );
    }
    println!("{what}: {pb:?}");
}

#[test]
fn clusterip_nodeport_udp_lb_and_reject_on_real_traffic() {
    let lab = lab("kpe1");
    // East-west from a pod (TC ingress), random and round-robin, 600 connections each.
    assert_even(&lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "600"]), 600, "pod -> ClusterIP random");
    assert_even(&lab.peer("pod", &["burst", "10.96.0.11:80", "tcp", "600"]), 600, "pod -> ClusterIP round-robin");
    // North-south from outside the node (the uplink's TC ingress: a veth under --xdp-mode auto).
    assert_even(&lab.peer("cl", &["burst", &format!("{NODE_IP}:30080"), "tcp", "600"]), 600, "client -> NodePort random");
    assert_even(&lab.peer("cl", &["burst", "10.96.0.10:80", "tcp", "600"]), 600, "client -> ClusterIP random");
    // A pod reaching the NodePort on the node's address goes through TC.
    let v = lab.peer("pod", &["burst", &format!("{NODE_IP}:30080"), "tcp", "60"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "pod -> NodePort: {v}");
    // UDP through Maglev.
    let v = lab.peer("pod", &["burst", "10.96.0.53:53", "udp", "90"]);
    assert_eq!(errors(&v), 0, "{v}");
    assert!(per_backend(&v).len() >= 2, "maglev spreads UDP flows: {v}");
    // LoadBalancer IP: allowed source range from outside.
    let v = lab.peer("cl", &["burst", "203.0.113.10:80", "tcp", "30"]);
    assert_eq!(errors(&v), 0, "{v}");
    assert!(per_backend(&v).iter().all(|(b, _)| b == "b2" || b == "b3"), "{v}");
    // No endpoints: refused at once, not a timeout.
    let t = Instant::now();
    let v = lab.peer("pod", &["burst", "10.96.0.99:80", "tcp", "3"]);
    assert_eq!(errors(&v), 3, "{v}");
    assert!(v["first_error"].as_str().unwrap().contains("refused"), "{v}");
    assert!(t.elapsed() < Duration::from_secs(2), "reject must not wait for a timeout");
    let v = lab.peer("cl", &["burst", "10.96.0.99:80", "tcp", "2"]);
    assert!(v["first_error"].as_str().unwrap().contains("refused"), "from outside too: {v}");

    // The node's own processes: connect-time balancing (TCP connect, UDP sendmsg/recvmsg).
    assert_even(&lab.peer("host", &["burst", "10.96.0.10:80", "tcp", "600"]), 600, "node process -> ClusterIP random");
    let v = lab.peer("host", &["burst", "10.96.0.53:53", "udp", "30"]);
    assert_eq!(errors(&v), 0, "UDP answers must appear to come from the service address: {v}");
    let v = lab.peer("host", &["burst", "10.96.0.99:80", "tcp", "2"]);
    assert!(v["first_error"].as_str().unwrap().contains("not permitted"), "no endpoints: connect() fails at once: {v}");

    // The operator views show the kernel state.
    let services = lab.cli(&["services"]);
    assert!(services.contains("10.96.0.10:80") && services.contains("10.244.1.2:8080"), "{services}");
    // What the agent cannot program is listed with its reason (deploy/examples/dual-stack.yaml:
    // SCTP in eBPF mode), and the rest of that Service is served.
    assert!(services.contains("not programmed:") && services.contains("Service demo/web-dual spec.ports[2].protocol"), "{services}");
    let skipped: serde_json::Value = serde_json::from_str(&lab.cli(&["services", "--skipped", "--json"])).unwrap();
    let listed = |object: &str| {
        skipped.as_array().unwrap().iter().filter(|e| e["object"] == object).map(|e| e["field"].as_str().unwrap().to_string()).collect::<Vec<_>>()
    };
    assert_eq!(listed("Service demo/web-dual"), ["spec.ports[2].protocol"], "{skipped}");
    assert!(listed("EndpointSlice demo/web-dual-6").is_empty(), "{skipped}");
    let v = lab.peer("pod", &["burst", "10.96.0.60:80", "tcp", "10"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 2), "the IPv4 half of the dual-stack Service: {v}");
    // Its IPv6 half, at connect time: a pod's sockets (the agent's cgroup holds them, as the
    // cgroup root does on a node) and the node's, TCP and UDP (the answer must come from the
    // service address: recvmsg6).
    lab.wait_backends("[fd00:10:96::60]:80", 2);
    let in_cgroup = |role: &str, args: &[&str]| if role == "host" { lab.peer(role, args) } else { lab.peer_in_cgroup(role, args) };
    for role in ["pod", "host"] {
        let v = in_cgroup(role, &["burst", "[fd00:10:96::60]:80", "tcp", "60"]);
        assert_eq!((errors(&v), per_backend(&v).len()), (0, 2), "{role} -> IPv6 ClusterIP TCP: {v}");
        let v = in_cgroup(role, &["burst", "[fd00:10:96::60]:53", "udp", "30"]);
        assert_eq!(errors(&v), 0, "{role} -> IPv6 ClusterIP UDP: {v}");
        assert!(per_backend(&v).iter().all(|(b, _)| b == "b1" || b == "b2"), "{v}");
    }
    // From outside the node, per packet (kpr_tc_ingress6 on the uplink, masqueraded by kpr's
    // ip6tables rule): the IPv6 NodePort on the node's IPv6 address and the IPv6 LB IP, TCP and
    // UDP (the answer must come from the address asked).
    for target in [format!("[{NODE_IP6}]:30060"), "[2001:db8:203::60]:80".to_string()] {
        let v = lab.peer("cl", &["burst", &target, "tcp", "60"]);
        assert_eq!((errors(&v), per_backend(&v).len()), (0, 2), "outside -> IPv6 {target}: {v}");
    }
    for target in [format!("[{NODE_IP6}]:30061"), "[2001:db8:203::60]:53".to_string()] {
        let v = lab.peer("cl", &["burst", &target, "udp", "30"]);
        assert_eq!(errors(&v), 0, "outside -> IPv6 {target} (UDP): {v}");
        assert!(per_backend(&v).iter().all(|(b, _)| b == "b1" || b == "b2"), "{v}");
    }
    // externalTrafficPolicy Cluster: every one of those connections was masqueraded, by
    // netfilter, as kpr_tc_ingress6 marked it (a NAT rule sees a connection's first packet).
    let masq = kpr_lab::must(&format!("ip netns exec {} ip6tables -t nat -L KPR-EBPF6-POSTROUTING -v -n -x", lab.nodes[0].ns));
    let masqueraded: u64 = masq.lines().find(|l| l.contains("MASQUERADE")).and_then(|l| l.split_whitespace().next()?.parse().ok()).unwrap_or(0);
    assert!(masqueraded >= 2 * 60, "{masq}");
    // One unconnected UDP socket's datagrams, each balanced at sendmsg, keep one backend (the
    // Service's scheduler is random): the node's IPv4 socket, a pod's IPv6 one, and the node's
    // IPv6 socket to the IPv4-mapped address (the kernel hands that one to sendmsg4).
    for (role, target) in [("host", "10.96.0.60:53"), ("pod", "[fd00:10:96::60]:53"), ("host", "[::ffff:10.96.0.60]:53")] {
        let v = in_cgroup(role, &["udpu", target, "20"]);
        assert_eq!((errors(&v), per_backend(&v).len()), (0, 1), "{role} -> {target}, one unconnected socket: {v}");
    }
    // An IPv6 socket of the node reaching an IPv4 Service through its IPv4-mapped address
    // (Java's default); a pod's goes out as IPv4, through TC (the pod in the cgroup: connect6
    // runs, and leaves it alone).
    assert_even(&lab.peer("host", &["burst", "[::ffff:10.96.0.10]:80", "tcp", "600"]), 600, "node IPv6 socket -> IPv4-mapped ClusterIP");
    let v = lab.peer("host", &["burst", "[::ffff:10.96.0.53]:53", "udp", "20"]);
    assert_eq!(errors(&v), 0, "the answer shows the IPv4-mapped service address: {v}");
    let v = lab.peer_in_cgroup("pod", &["burst", "[::ffff:10.96.0.10]:80", "tcp", "30"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "pod IPv6 socket -> IPv4-mapped ClusterIP: {v}");
    let ct = lab.cli(&["conntrack"]);
    assert!(ct.contains("10.96.0.10:80"), "{ct}");
    // The IPv6 packet path's flows too, masqueraded by netfilter (externalTrafficPolicy Cluster).
    assert!(ct.lines().any(|l| l.contains(&format!("[{NODE_IP6}]:30060")) && l.contains("netfilter")), "{ct}");
    let status = lab.cli(&["status"]);
    assert!(status.contains("new_flow") && status.contains("tc_uplink on up0") && status.contains("tc_egress on calipod"), "{status}");
    assert!(!status.contains("xdp on up0"), "a veth's XDP copies every frame: TC under auto: {status}");
}

/// The uplink's IPv4 ingress moves between XDP and TC with `--xdp-mode` across restarts; the
/// other goes once the new one runs, and traffic from outside goes on through either.
#[test]
fn uplink_ingress_moves_between_xdp_and_tc_across_restarts() {
    let mut lab = lab("kpe5");
    let wait_status = |lab: &Lab, has: &str, lacks: &str| {
        if let Err(s) = lab.wait_status(has, lacks) {
            panic!("status never showed {has:?} without {lacks:?}: {s}\n{}", lab.agent_log());
        }
    };
    wait_status(&lab, "tc_uplink on up0", "xdp on up0");
    for (mode, has, lacks) in [("native", "xdp on up0", "tc_uplink on up0"), ("auto", "tc_uplink on up0", "xdp on up0")] {
        lab.kill_agent();
        lab.agent_args = vec!["--xdp-mode".into(), mode.into()];
        lab.start_agent();
        wait_status(&lab, has, lacks);
        assert_even(&lab.peer("cl", &["burst", &format!("{NODE_IP}:30080"), "tcp", "600"]), 600, &format!("client -> NodePort, --xdp-mode {mode}"));
        let v = lab.peer("cl", &["burst", "10.96.0.99:80", "tcp", "2"]);
        assert!(v["first_error"].as_str().unwrap().contains("refused"), "the reject goes back out of the uplink, --xdp-mode {mode}: {v}");
    }
}

#[test]
fn removed_backend_gets_no_new_connections_but_keeps_established_ones() {
    let lab = lab("kpe2");
    let held = lab.peer_bg("pod", &["hold", "10.96.0.10:80", "4"]);
    std::thread::sleep(Duration::from_millis(800));
    // Which backend holds the connection: conntrack says.
    let flows: serde_json::Value = serde_json::from_str(&lab.cli(&["conntrack", "--json"])).unwrap();
    let backend = flows.as_array().unwrap().iter().find(|f| f["frontend"] == "10.96.0.10:80").expect("held flow")["backend"].as_str().unwrap().to_string();
    let ip = backend.split(':').next().unwrap().to_string();
    let web = lab.manifests.join("web.yaml");
    let text = std::fs::read_to_string(&web).unwrap();
    let removed = text.replace(&format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: node-a\n"), "");
    assert_ne!(text, removed);
    std::fs::write(&web, removed).unwrap();
    lab.wait_backends("10.96.0.10:80", 2);
    let name = format!("b{}", ip.split('.').nth(2).unwrap());
    let v = lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "120"]);
    assert_eq!(errors(&v), 0, "{v}");
    assert!(per_backend(&v).iter().all(|(b, _)| *b != name), "removed backend {name} got new connections: {v}");
    let h = Lab::finish(held);
    assert_eq!(errors(&h), 0, "the established connection broke: {h}");
    assert_eq!(per_backend(&h).len(), 1, "{h}");
    assert_eq!(per_backend(&h)[0].0, name);
    assert!(per_backend(&h)[0].1 > 30, "{h}");
}

#[test]
fn client_ip_affinity_pins_a_client() {
    let lab = lab("kpe3");
    let v = lab.peer("pod", &["burst", "10.96.0.12:80", "tcp", "60"]);
    assert_eq!(errors(&v), 0);
    assert_eq!(per_backend(&v).len(), 1, "affinity must pin: {v}");
    let v2 = lab.peer("cl", &["burst", "10.96.0.12:80", "tcp", "30"]);
    assert_eq!(per_backend(&v2).len(), 1, "{v2}");
}

#[test]
fn sigkill_of_the_agent_during_traffic_fails_no_connection() {
    let mut lab = lab("kpe4");
    let stream = lab.peer_bg("pod", &["stream", "10.96.0.10:80", "4"]);
    let outside = lab.peer_bg("cl", &["stream", &format!("{NODE_IP}:30080"), "4"]);
    let held = lab.peer_bg("pod", &["hold", "10.96.0.11:80", "4"]);
    std::thread::sleep(Duration::from_millis(1000));
    lab.kill_agent();
    std::thread::sleep(Duration::from_millis(1000));
    lab.start_agent();
    for (what, c) in [("pod stream", stream), ("outside stream", outside), ("held", held)] {
        let v = Lab::finish(c);
        assert_eq!(errors(&v), 0, "{what}: {v}");
        let n: u64 = per_backend(&v).iter().map(|(_, n)| n).sum();
        assert!(n > 20, "{what}: too little traffic to mean anything: {v}");
        println!("{what}: {v}");
    }
    // The restarted agent took over the same maps and changed nothing. Its first sync may
    // still be under way on a loaded machine: the traffic above never waited for it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while lab.agent_log().matches("synced").count() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(lab.agent_log().matches("synced").count() >= 2, "{}", lab.agent_log());
}

#[test]
fn cleanup_removes_kube_proxys_leftovers_and_nothing_else() {
    use kpr_lab::{must, Netns, PinDir};
    let _ns = Netns::create(&["kpe7-node"]);
    let x = |c: &str| must(&format!("ip netns exec kpe7-node {c}"));
    // kube-proxy's: iptables mode chains, IPVS mode's, its ipsets, its nftables table, kube-ipvs0.
    x("iptables -t nat -N KUBE-SERVICES");
    x("iptables -t nat -N KUBE-SVC-ABCDEF");
    x("iptables -t nat -N KUBE-MARK-MASQ");
    x("iptables -t nat -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000");
    x("iptables -t nat -A KUBE-SERVICES -j KUBE-SVC-ABCDEF");
    x("iptables -t nat -A PREROUTING -m comment --comment kubernetes-service-portals -j KUBE-SERVICES");
    x("iptables -t filter -N KUBE-FORWARD");
    x("iptables -t filter -A FORWARD -j KUBE-FORWARD");
    x("iptables -t mangle -N KUBE-PROXY-CANARY");
    x("ipset create KUBE-CLUSTER-IP hash:ip,port");
    x("ipset create KUBE-NODE-PORT-TCP bitmap:port range 0-65535");
    x("nft add table ip kube-proxy");
    x("ip link add kube-ipvs0 type veth peer name kipvs-peer"); // (this kernel has no dummy links)
                                                                // Others': kubelet's chains, a CNI's KUBE-* set, another nftables table, the node's own rules.
    x("iptables -t filter -N KUBE-FIREWALL");
    x("iptables -t filter -A INPUT -j KUBE-FIREWALL");
    x("iptables -t mangle -N KUBE-KUBELET-CANARY");
    x("iptables -t nat -N KUBE-MARK-DROP");
    x("iptables -t nat -N MINE");
    x("iptables -t nat -A PREROUTING -j MINE");
    x("ipset create KUBE-MYCNI-PODS hash:ip");
    x("ipset create MINE-SET hash:ip");
    x("nft add table inet mycni");
    let pins = PinDir::new("kpe7");
    let out = must(&format!("{} --netns kpe7-node --pin-dir {} cleanup --kube-proxy", kpr_lab::sibling_bin("kpr").display(), pins.path().display()));
    assert!(
        out.contains("removed kube-proxy's")
            && out.contains("ipset KUBE-CLUSTER-IP destroyed")
            && out.contains("kube-ipvs0")
            && out.contains("nftables table ip kube-proxy"),
        "{out}"
    );
    let nat = x("iptables-save -t nat");
    for gone in ["KUBE-SERVICES", "KUBE-SVC-ABCDEF", "KUBE-MARK-MASQ"] {
        assert!(!nat.contains(gone), "{gone} stayed: {nat}");
    }
    assert!(nat.contains(":MINE") && nat.contains("-A PREROUTING -j MINE") && nat.contains(":KUBE-MARK-DROP"), "others' rules stay: {nat}");
    let filter = x("iptables-save -t filter");
    assert!(
        !filter.contains("KUBE-FORWARD") && filter.contains(":KUBE-FIREWALL") && filter.contains("-A INPUT -j KUBE-FIREWALL"),
        "kubelet's KUBE-FIREWALL stays: {filter}"
    );
    let mangle = x("iptables-save -t mangle");
    assert!(!mangle.contains("KUBE-PROXY-CANARY") && mangle.contains("KUBE-KUBELET-CANARY"), "{mangle}");
    let mut sets: Vec<String> = x("ipset list -n").lines().map(str::to_string).collect();
    sets.sort();
    assert_eq!(sets, ["KUBE-MYCNI-PODS", "MINE-SET"]);
    let tables = x("nft list tables");
    assert!(!tables.contains("kube-proxy") && tables.contains("table inet mycni"), "{tables}");
    assert!(!x("ip -br link").contains("kube-ipvs0"));
    // Idempotent.
    let again =
        must(&format!("{} --netns kpe7-node --pin-dir {} cleanup --kube-proxy --keep-kpr", kpr_lab::sibling_bin("kpr").display(), pins.path().display()));
    assert!(again.contains("no kube-proxy leftovers found") && !again.contains("pinned objects"), "{again}");
}
