//! Migration from kube-proxy to kpr and the rollback, in the lab (root): kube-proxy's iptables
//! rules as kube-proxy renders them serve the lab's ClusterIP; kpr starts and `kpr cleanup
//! --kube-proxy --keep-kpr` removes kube-proxy's state; then `kpr cleanup` and kube-proxy's rules
//! again. New connections must work after each switch; the connections in flight across each
//! switch are counted and printed (kept their backend / moved / failed), not assumed.
use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdout, Stdio},
};

use kpr_lab::{
    iptables::{render, Svc},
    lab::{backend_ip, errors, Lab},
};

const VIP: &str = "10.96.0.10";
const HELD: usize = 30;

fn web() -> Vec<Svc> {
    vec![Svc {
        name: "demo/web:http".into(),
        vip: VIP.into(),
        port: 80,
        proto: "tcp",
        node_port: None,
        backends: (1..=3).map(|b| (backend_ip(b), 8080)).collect(),
    }]
}

const WEB_YAML: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: demo}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: 8080}]}\n---\n\
apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\n\
ports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.244.1.2], conditions: {ready: true}}, {addresses: [10.244.2.2], conditions: {ready: true}}, {addresses: [10.244.3.2], conditions: {ready: true}}]\n";

/// Connections opened now and checked after the switch.
struct InFlight {
    child: Child,
    out: BufReader<ChildStdout>,
}

fn hold(lab: &Lab) -> InFlight {
    let mut child = lab.peer_cmd("pod", &["hold-many", &format!("{VIP}:80"), &HELD.to_string()]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    InFlight { child, out }
}

fn check(mut h: InFlight, switch: &str) -> serde_json::Value {
    h.child.stdin.take().unwrap().write_all(b"check\n").unwrap();
    let mut line = String::new();
    h.out.read_line(&mut line).unwrap();
    let _ = h.child.wait();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    println!(
        "in flight across {switch}: {HELD} connections: {} kept their backend, {} moved, {} failed (first error: {})",
        v["same"], v["moved"], v["errors"], v["first_error"]
    );
    assert_eq!(v["same"].as_u64().unwrap() + v["moved"].as_u64().unwrap() + v["errors"].as_u64().unwrap(), HELD as u64, "{v}");
    v
}

fn new_connections_work(lab: &Lab, through: &str) {
    let v = lab.peer("pod", &["burst", &format!("{VIP}:80"), "tcp", "30"]);
    assert_eq!(errors(&v), 0, "new connections through {through}: {v}");
}

#[test]
fn migrate_from_kube_proxy_and_roll_back() {
    let dir = std::env::temp_dir().join(format!("kpr-migrate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("web.yaml"), WEB_YAML).unwrap();
    let mut lab = Lab::build("kpm", &dir);
    let node = lab.ns("node");
    let kube_proxy_rules = render(&web(), "10.244.0.0/16");

    // kube-proxy serves the cluster.
    lab.iptables_restore(&node, &kube_proxy_rules);
    new_connections_work(&lab, "kube-proxy's rules");
    let held = hold(&lab);

    // Migrate: kpr starts, then kube-proxy's state goes.
    lab.start_agent();
    lab.wait_backends(&format!("{VIP}:80"), 3);
    let out = lab.cli(&["cleanup", "--kube-proxy", "--keep-kpr"]);
    assert!(out.contains("removed kube-proxy's"), "{out}");
    assert!(!lab.iptables(&node, "-t nat -S").contains("KUBE-SERVICES"), "kube-proxy's rules are gone");
    new_connections_work(&lab, "kpr");
    let status = lab.cli(&["status"]);
    assert!(status.lines().any(|l| l.starts_with("new_flow") && l.split_whitespace().nth(1) != Some("0")), "kpr carried them: {status}");
    // kube-proxy's DNAT lives on in conntrack; the fast path leaves those connections to it
    // (and keeps conntrack running once kube-proxy's rules are gone).
    let v = check(held, "kube-proxy -> kpr");
    assert_eq!(v["same"], HELD as u64, "every connection kube-proxy carried keeps its backend across the switch: {v}");
    assert!(lab.agent_log().contains("connections a proxy before kpr translated (conntrack) keep their backend"), "the handover was logged");
    let status = lab.cli(&["status"]);
    assert!(status.lines().any(|l| l.starts_with("handover_pass") && l.split_whitespace().nth(1) != Some("0")), "{status}");

    // Roll back: kpr goes, kube-proxy's rules come back (kube-proxy rewrites them at start).
    let held = hold(&lab);
    lab.kill_agent();
    lab.cli(&["cleanup"]);
    // At once: no program of kpr's runs on any interface (links are detached, not only unpinned).
    let attached = kpr_lab::must(&format!("ip netns exec {node} bpftool -j net show"));
    assert!(!attached.contains("kpr_"), "kpr's programs still attached after cleanup: {attached}");
    // (bpftool 7.1 does not list TCX links: traffic tells. With neither kpr nor kube-proxy's
    // rules, nothing answers for the ClusterIP.)
    let v = lab.peer("pod", &["burst", &format!("{VIP}:80"), "tcp", "1"]);
    assert_eq!(errors(&v), 1, "a connection to the ClusterIP right after `kpr cleanup` still went through kpr: {v}");
    lab.iptables_restore(&node, &kube_proxy_rules);
    new_connections_work(&lab, "kube-proxy's rules after the rollback");
    check(held, "kpr -> kube-proxy (rollback)");
    drop(lab);
    let _ = std::fs::remove_dir_all(&dir);
}
