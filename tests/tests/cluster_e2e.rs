//! End to end on realistic nodes: two nodes in each CNI shape (Calico-like routed pods,
//! Flannel-like VXLAN), kube-proxy's netfilter rules on every node, kpr on every node; a
//! netfilter matrix on one node; ICMP errors from backends and path MTU discovery through the
//! tunnel. Real TCP and UDP, zero failed connections where traffic should pass.
use std::path::PathBuf;

use kpr_lab::lab::{errors, per_backend, Cni, Iptables, Lab, LabSpec, NODE_B_IP, NODE_IP, POD_IP};

/// A Service and its EndpointSlice: (address, node) endpoints, each on `target`.
fn service(name: &str, vip: &str, port: u16, target: u16, proto: &str, eps: &[(&str, &str)], extra_spec: &str) -> String {
    let eps: String = eps.iter().map(|(a, n)| format!("- {{addresses: [\"{a}\"], conditions: {{ready: true}}, nodeName: {n}}}\n")).collect();
    let eps = if eps.is_empty() { " []\n".to_string() } else { format!("\n{eps}") };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: e2e}}\nspec:\n  clusterIP: {vip}\n{extra_spec}  ports:\n  - {{name: p, port: {port}, targetPort: {target}, protocol: {proto}}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: e2e, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: p, port: {target}, protocol: {proto}}}]\nendpoints:{eps}---\n"
    )
}

const B1: &str = "10.244.1.2";
const B2: &str = "10.244.2.2";
const B3: &str = "10.244.3.2";
const B4: &str = "10.244.17.2";

/// The services every test here uses. NodePorts are on every node's address.
fn manifests(dir: &PathBuf) {
    let mut y = String::new();
    let a = |ip| (ip, "node-a");
    // On node A's three backends; NodePort 30080.
    y += &service("web", "10.96.0.10", 80, 8080, "TCP", &[a(B1), a(B2), a(B3)], "  type: NodePort\n")
        .replace("protocol: TCP}", "protocol: TCP, nodePort: 30080}");
    y += &service("dns", "10.96.0.53", 53, 5353, "UDP", &[a(B1), a(B2), a(B3)], "");
    // Hairpin (b1's only backend is itself) and the policy target (b2 alone).
    y += &service("only-b1", "10.96.0.21", 80, 8080, "TCP", &[a(B1)], "");
    // b2's second server (port 9090, started by the policy test) behind its own service.
    y += &service("only-b2", "10.96.0.22", 80, 9090, "TCP", &[a(B2)], "");
    // On node B's backend, NodePort 30090 on both nodes.
    y += &service("far", "10.96.1.10", 80, 8080, "TCP", &[(B4, "node-b")], "  type: NodePort\n").replace("protocol: TCP}", "protocol: TCP, nodePort: 30090}");
    // externalTrafficPolicy Local with its endpoint on node A only.
    y += &service("local", "10.96.1.12", 80, 8080, "TCP", &[a(B1)], "  type: NodePort\n  externalTrafficPolicy: Local\n")
        .replace("protocol: TCP}", "protocol: TCP, nodePort: 30091}");
    // A UDP port nothing listens on, and a TCP port whose backend answers host unreachable.
    y += &service("udp-dead", "10.96.1.53", 53, 5999, "UDP", &[(B4, "node-b")], "");
    y += &service("hostun", "10.96.1.11", 80, 8081, "TCP", &[(B4, "node-b")], "");
    y += &service("gone", "10.96.0.99", 80, 8080, "TCP", &[], "");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("services.yaml"), y).unwrap();
}

fn lab(prefix: &str, spec: LabSpec) -> Lab {
    let dir = std::env::temp_dir().join(format!("kpr-cluster-{prefix}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    manifests(&dir);
    let mut lab = Lab::build_with(prefix, &dir, spec);
    lab.start_agents();
    lab.wait_backends("10.96.0.10:80", 3);
    lab.wait_backends("10.96.1.10:80", 1);
    lab
}

fn ok(v: &serde_json::Value, what: &str, n: u64) {
    assert_eq!(errors(v), 0, "{what}: {v}");
    let total: u64 = per_backend(v).iter().map(|(_, c)| c).sum();
    assert_eq!(total, n, "{what}: {v}");
}

/// Cross-node traffic in one CNI shape, with kube-proxy's INVALID drop on both nodes.
fn two_nodes(prefix: &str, cni: Cni) {
    let lab = lab(prefix, LabSpec { nodes: 2, cni, ..LabSpec::default() });
    // A pod on node A to a backend on node B, and back: the replies cross the other node's
    // uplink or the tunnel, and node A reverses the DNAT on the way to the pod.
    let v = lab.peer("pod", &["burst", "10.96.1.10:80", "tcp", "100"]);
    ok(&v, "pod on A -> ClusterIP -> backend on B", 100);
    assert_eq!(per_backend(&v), vec![("b4".to_string(), 100)]);
    // A pod on node B to backends on node A.
    let v = lab.peer("pod2", &["burst", "10.96.0.10:80", "tcp", "90"]);
    ok(&v, "pod on B -> ClusterIP -> backends on A", 90);
    let v = lab.peer("pod2", &["burst", "10.96.0.53:53", "udp", "30"]);
    ok(&v, "pod on B -> UDP ClusterIP -> A", 30);
    // Outside -> NodePort on node A -> backend on node B: masqueraded on A, so the reply comes
    // back to A (through the tunnel with VXLAN: the masquerade takes flannel.1's address).
    let v = lab.peer("cl", &["burst", &format!("{NODE_IP}:30090"), "tcp", "100"]);
    ok(&v, "outside -> NodePort on A -> backend on B", 100);
    let who = lab.peer("cl", &["who", &format!("{NODE_IP}:30090")]);
    let want_src = if cni == Cni::Vxlan { "10.244.0.0" } else { NODE_IP };
    assert_eq!((who["name"].as_str(), who["seen"].as_str()), (Some("b4"), Some(want_src)), "masquerade address: {who}");
    // And to node B's NodePort, whose backend is local there.
    let v = lab.peer("cl", &["burst", &format!("{NODE_B_IP}:30090"), "tcp", "50"]);
    ok(&v, "outside -> NodePort on B -> local backend", 50);
    // externalTrafficPolicy Local: node A serves with the client's address kept; node B has no
    // local endpoint and drops (kube-proxy's "has no local endpoints" verdict).
    let who = lab.peer("cl", &["who", &format!("{NODE_IP}:30091")]);
    assert_eq!((who["name"].as_str(), who["seen"].as_str()), (Some("b1"), Some("198.18.0.2")), "ETP Local keeps the client address: {who}");
    let v = lab.peer("cl", &["burst", &format!("{NODE_B_IP}:30091"), "tcp", "1"]);
    assert_eq!(errors(&v), 1, "ETP Local without a local endpoint must not be served: {v}");
    assert!(v["first_error"].as_str().unwrap().contains("timed out"), "dropped, not rejected: {v}");
    // A pod on node B reaches the same service through the ClusterIP (cluster-wide).
    let v = lab.peer("pod2", &["burst", "10.96.1.12:80", "tcp", "10"]);
    ok(&v, "pod on B -> ETP Local service's ClusterIP", 10);
    // No endpoints: rejected on node B too.
    let v = lab.peer("pod2", &["burst", "10.96.0.99:80", "tcp", "2"]);
    assert!(v["first_error"].as_str().unwrap_or("").contains("refused"), "{v}");

    // ICMP errors from a backend on the other node, about translated flows, reach the client
    // translated: a UDP port nothing listens on is refused at once...
    let v = lab.peer("pod", &["udpc", "10.96.1.53:53", "3"]);
    assert_eq!(errors(&v), 3, "{v}");
    assert!(v["first_error"].as_str().unwrap().contains("refused"), "port unreachable must surface as ECONNREFUSED: {v}");
    // ...and a backend answering host unreachable fails the connect at once.
    kpr_lab::must(&format!("ip netns exec {} iptables -A INPUT -p tcp --dport 8081 -j REJECT --reject-with icmp-host-unreachable", lab.ns("b4")));
    let t = std::time::Instant::now();
    let v = lab.peer("pod", &["burst", "10.96.1.11:80", "tcp", "2"]);
    assert_eq!(errors(&v), 2, "{v}");
    assert!(v["first_error"].as_str().unwrap().contains("No route to host"), "host unreachable: {v}");
    assert!(t.elapsed() < std::time::Duration::from_secs(4), "the error must arrive, not a timeout");
    let counters = lab.cli(&["status"]);
    assert!(counters.lines().any(|l| l.starts_with("icmp_error_nat") && !l.ends_with(" 0")), "{counters}");
}

#[test]
fn two_nodes_routed_calico_like() {
    two_nodes("kpc1", Cni::Routed);
}

#[test]
fn two_nodes_vxlan_flannel_like() {
    two_nodes("kpc2", Cni::Vxlan);
}

/// Path MTU discovery through a 1450-byte VXLAN tunnel from pods whose own links are 1500
/// bytes: uploads make node A send "fragmentation needed" about the DNATed packet, which only
/// helps the client translated back; downloads make node B send it to the backend.
#[test]
fn path_mtu_discovery_through_the_tunnel() {
    let lab = lab("kpc3", LabSpec { nodes: 2, cni: Cni::Vxlan, ..LabSpec::default() });
    for (role, target) in [("pod", "10.96.1.10:80"), ("pod2", "10.96.0.21:80")] {
        let v = lab.peer(role, &["bulk", target, "2000000"]);
        assert_eq!(errors(&v), 0, "{role} -> {target}: {v}");
        assert_eq!(v["bytes"].as_u64(), Some(4_000_000), "{v}");
    }
    // The client learnt the tunnel's MTU for the VIP.
    let route = kpr_lab::must(&format!("ip -n {} route get 10.96.1.10", lab.ns("pod")));
    assert!(route.contains("mtu 1450"), "{route}");
}

/// The matrix: each cell a fresh node with its own netfilter rules, the same traffic, no
/// failed connection.
fn matrix_cell(prefix: &str, spec: LabSpec, setup: impl FnOnce(&Lab)) -> Lab {
    let dir = std::env::temp_dir().join(format!("kpr-cluster-{prefix}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    manifests(&dir);
    let mut lab = Lab::build_with(prefix, &dir, spec);
    setup(&lab);
    lab.start_agent();
    lab.wait_backends("10.96.0.10:80", 3);
    let cases: [(&str, &str, &str, &str, u64); 6] = [
        ("pod -> ClusterIP", "pod", "10.96.0.10:80", "tcp", 60),
        ("outside -> NodePort (masquerade)", "cl", "198.18.0.1:30080", "tcp", 60),
        ("outside -> ClusterIP (off-cluster masquerade)", "cl", "10.96.0.10:80", "tcp", 30),
        ("hairpin", "b1", "10.96.0.21:80", "tcp", 30),
        ("node process -> ClusterIP", "host", "10.96.0.10:80", "tcp", 60),
        ("pod -> UDP ClusterIP", "pod", "10.96.0.53:53", "udp", 30),
    ];
    for (what, from, target, proto, n) in cases {
        let v = lab.peer(from, &["burst", target, proto, &n.to_string()]);
        ok(&v, &format!("{prefix}: {what}"), n);
    }
    lab
}

#[test]
fn netfilter_matrix_no_rules() {
    matrix_cell("kpm1", LabSpec::default(), |lab| lab.flush_netfilter(&lab.ns("node")));
}

#[test]
fn netfilter_matrix_kube_proxy_invalid_drop_nft_and_legacy() {
    for (prefix, iptables) in [("kpm2", Iptables::Nft), ("kpm3", Iptables::Legacy)] {
        let lab = matrix_cell(prefix, LabSpec { iptables, ..LabSpec::default() }, |_| {});
        let rules = lab.iptables(&lab.ns("node"), "-S KUBE-FORWARD");
        assert!(rules.contains("--ctstate INVALID -j DROP"), "{rules}");
        // The rule saw the traffic and dropped none of it (its counter stays at zero).
        let counts = lab.iptables(&lab.ns("node"), "-L KUBE-FORWARD -v -n -x");
        let invalid = counts.lines().find(|l| l.contains("INVALID")).unwrap();
        assert_eq!(invalid.split_whitespace().next(), Some("0"), "INVALID drops: {counts}");
    }
}

#[test]
fn netfilter_matrix_calico_like_policy_chain() {
    let lab = matrix_cell("kpm4", LabSpec::default(), |lab| {
        // A CNI's workload chain: established first, INVALID dropped, then the policy for b2's
        // port 9090: only the pod may reach it.
        lab.iptables_restore(
            &lab.ns("node"),
            "*filter\n:cali-FORWARD - [0:0]\n:cali-tw-b2 - [0:0]\n-I FORWARD 1 -j cali-FORWARD\n\
             -A cali-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
             -A cali-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
             -A cali-FORWARD -d 10.244.2.2/32 -p tcp --dport 9090 -j cali-tw-b2\n\
             -A cali-tw-b2 -s 10.244.9.2/32 -j ACCEPT\n\
             -A cali-tw-b2 -j DROP\nCOMMIT\n",
        );
        lab.serve("b2", 9090, 9091);
    });
    // Through the ClusterIP, the policy still sees the real client: the pod passes, the
    // outside client (denied) does not, though the masquerade would hide its address.
    let v = lab.peer("pod", &["burst", "10.96.0.22:80", "tcp", "20"]);
    ok(&v, "allowed source through a ClusterIP", 20);
    let v = lab.peer("cl", &["burst", "10.96.0.22:80", "tcp", "1"]);
    assert_eq!(errors(&v), 1, "the denied source stays denied: {v}");
    assert!(v["first_error"].as_str().unwrap().contains("timed out"), "{v}");
}

#[test]
fn netfilter_matrix_kube_proxy_rules_still_loaded_no_double_masquerade() {
    use kpr_lab::iptables::{render, Svc};
    let svc = |name: &str, vip: &str, node_port: Option<u16>, bes: &[&str]| Svc {
        name: format!("e2e/{name}:p"),
        vip: vip.into(),
        port: 80,
        proto: "tcp",
        node_port,
        backends: bes.iter().map(|b| (b.to_string(), 8080)).collect(),
    };
    let rules = render(&[svc("web", "10.96.0.10", Some(30080), &[B1, B2, B3]), svc("only-b1", "10.96.0.21", None, &[B1])], "10.244.0.0/16");
    let lab = matrix_cell("kpm5", LabSpec::default(), |lab| {
        // kube-proxy's whole nat table, as during a migration before its cleanup; its
        // KUBE-MARK-MASQ marks and KUBE-POSTROUTING would masquerade again what kpr did.
        let nat = rules.clone();
        lab.iptables_restore(&lab.ns("node"), &nat);
    });
    let who = lab.peer("cl", &["who", "198.18.0.1:30080"]);
    assert_eq!(who["seen"].as_str(), Some(NODE_IP), "{who}");
    let nat = lab.iptables(&lab.ns("node"), "-t nat -L KUBE-POSTROUTING -v -n -x");
    let masq = nat.lines().find(|l| l.contains("MASQUERADE")).unwrap_or_else(|| panic!("{nat}"));
    assert_eq!(masq.split_whitespace().next(), Some("0"), "kube-proxy's MASQUERADE saw kpr's traffic: {nat}");
    let dnat = lab.iptables(&lab.ns("node"), "-t nat -L KUBE-SERVICES -v -n -x");
    assert!(dnat.lines().filter(|l| l.contains("KUBE-SVC")).all(|l| l.split_whitespace().next() == Some("0")), "kube-proxy's DNAT saw a VIP: {dnat}");
}

/// kube-proxy's detectLocalMode by interface: a client is local (never masqueraded for being
/// off-cluster) when its packet comes from a pod interface, whatever its address.
#[test]
fn detect_local_by_interface() {
    for (prefix, cni, args) in [
        ("kpd1", Cni::Routed, ["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "cali"]),
        ("kpd2", Cni::Vxlan, ["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cni0"]),
    ] {
        let dir = std::env::temp_dir().join(format!("kpr-cluster-{prefix}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        manifests(&dir);
        let mut lab = Lab::build_with(prefix, &dir, LabSpec { cni, ..LabSpec::default() });
        lab.agent_args = args.iter().map(|s| s.to_string()).collect();
        lab.start_agent();
        lab.wait_backends("10.96.0.21:80", 1);
        let who = lab.peer("pod", &["who", "10.96.0.21:80"]);
        assert_eq!(who["seen"], "10.244.9.2", "{prefix}: a pod is local: {who}");
        let who = lab.peer("cl", &["who", "10.96.0.21:80"]);
        assert_eq!(who["seen"], NODE_IP, "{prefix}: the outside client is not: {who}");
    }
}

/// Short connections from outside through masqueraded paths, sustained past what the SNAT range
/// holds, with kube-proxy's INVALID drop on the node: closed flows give their SNAT tuples to new
/// ones at once (netfilter's NAT does), so no connection fails for want of a port. The node's
/// ephemeral range leaves kpr 4,096 SNAT ports (1024-5119); the client's resets and FINs send
/// more connections than that to one backend through one SNAT address within the closing
/// timeout. Where the server closes first it keeps TIME_WAIT on the tuple: those connections
/// still all connect.
#[test]
fn masqueraded_churn_outlasts_the_snat_range_in_every_close_order() {
    let lab = matrix_cell("kpch", LabSpec::default(), |lab| {
        kpr_lab::must(&format!("ip netns exec {} sysctl -qw net.ipv4.ip_local_port_range='5120 60999'", lab.ns("node")));
    });
    let status = || -> serde_json::Value { serde_json::from_str(&lab.cli(&["status", "--json"])).unwrap() };
    let counter = |s: &serde_json::Value, name: &str| s["counters"][name].as_u64().unwrap_or_else(|| panic!("{name}: {s}"));
    // Outside -> the ClusterIP with one endpoint (off-cluster: masqueraded), and outside -> the
    // NodePort (externalTrafficPolicy Cluster: masqueraded).
    // The NodePort's client ports are not the ClusterIP's: a client port reused towards another
    // frontend with the same backend meets its closed flow's reply tuple, which is not taken
    // over (docs/limitations.md), unlike the SNAT tuple this test is about.
    for (target, close, ports) in [("10.96.0.21:80", "rst", "10000 39999"), ("10.96.0.21:80", "fin", "10000 39999"), ("198.18.0.1:30080", "rst", "40000 65000")]
    {
        kpr_lab::must(&format!("ip netns exec {} sysctl -qw net.ipv4.ip_local_port_range='{ports}'", lab.ns("cl")));
        let before = status();
        let mut sent = 0;
        // Until the range has been used over at least once and a half, 60 s at most.
        for _ in 0..10 {
            let v = lab.peer("cl", &["churn", target, "6", close]);
            assert_eq!(errors(&v), 0, "{target} closed by {close}: {v}");
            sent += v["connections"].as_u64().unwrap();
            if sent > 6_144 {
                break;
            }
        }
        let after = status();
        assert!(sent > 6_144, "{target} closed by {close}: only {sent} connections in 60 s");
        assert_eq!(counter(&after, "snat_no_port"), counter(&before, "snat_no_port"), "{target} closed by {close}: {after}");
        assert!(counter(&after, "snat_port_reused") > counter(&before, "snat_port_reused"), "{target} closed by {close}: no tuple reused: {after}");
    }
    kpr_lab::must(&format!("ip netns exec {} sysctl -qw net.ipv4.ip_local_port_range='1024 9999'", lab.ns("cl")));
    let v = lab.peer("cl", &["churn", "10.96.0.21:80", "6", "server"]);
    assert_eq!(errors(&v), 0, "closed by the server first: {v}");
    assert!(v["connections"].as_u64().unwrap() > 100, "{v}");
    // DNS-style UDP, a new socket a query, through the masquerade: the tuples are held for the
    // UDP timeout, as netfilter holds them. 1,500 queries over three backends stay well inside
    // the range.
    let v = lab.peer("cl", &["burst", "10.96.0.53:53", "udp", "1500"]);
    ok(&v, "outside -> UDP ClusterIP, a socket a query", 1500);
    assert_eq!(counter(&status(), "snat_no_port"), 0);
}

/// kube-proxy's masqueradeAll masquerades traffic to a ClusterIP only: an externalTrafficPolicy
/// Local NodePort keeps the client's address, from outside and from a pod.
#[test]
fn masquerade_all_leaves_external_traffic_policy_local_alone() {
    let dir = std::env::temp_dir().join(format!("kpr-cluster-kpma-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    manifests(&dir);
    let mut lab = Lab::build("kpma", &dir);
    lab.agent_args = vec!["--masquerade-all".into()];
    lab.start_agent();
    lab.wait_backends("10.96.0.21:80", 1);
    let seen = |role: &str, target: &str| lab.peer(role, &["who", target])["seen"].as_str().unwrap_or_default().to_string();
    let local = format!("{NODE_IP}:30091");
    assert_eq!(seen("cl", &local), kpr_lab::lab::CLIENT_IP, "outside -> externalTrafficPolicy Local NodePort");
    assert_eq!(seen("pod", &local), POD_IP, "pod -> externalTrafficPolicy Local NodePort");
    assert_ne!(seen("pod", "10.96.0.21:80"), POD_IP, "pod -> ClusterIP: masqueraded");
}

/// Without a local-traffic detector (no cluster CIDR) kube-proxy tells no pod from any other
/// client: a pod's traffic to an externalTrafficPolicy Local NodePort takes the node's own
/// endpoints (none on node B: dropped, as from outside), and nobody is masqueraded for being
/// outside the cluster.
#[test]
fn without_a_local_detector_pods_are_external_clients() {
    let dir = std::env::temp_dir().join(format!("kpr-cluster-kpnd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    manifests(&dir);
    let mut lab = Lab::build_with("kpnd", &dir, LabSpec { nodes: 2, ..LabSpec::default() });
    lab.cluster_cidr = String::new();
    lab.start_agents();
    lab.wait_backends("10.96.1.10:80", 1);
    let v = lab.peer("pod2", &["burst", &format!("{NODE_B_IP}:30091"), "tcp", "1"]);
    assert_eq!(errors(&v), 1, "no endpoint on node B: dropped as for an outside client: {v}");
    let who = |role: &str, target: &str| lab.peer(role, &["who", target]);
    let v = who("pod", &format!("{NODE_IP}:30091"));
    assert_eq!((v["name"].as_str(), v["seen"].as_str()), (Some("b1"), Some(POD_IP)), "{v}");
    let v = who("cl", "10.96.0.21:80");
    assert_eq!(v["seen"].as_str(), Some(kpr_lab::lab::CLIENT_IP), "no detector: not masqueraded for being off-cluster: {v}");
    // ClusterIPs from pods are unchanged: every endpoint, wherever it runs.
    ok(&lab.peer("pod2", &["burst", "10.96.0.10:80", "tcp", "30"]), "pod on B -> ClusterIP", 30);
}
