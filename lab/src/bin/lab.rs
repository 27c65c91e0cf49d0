//! kpr-lab: the README's main command. Builds the namespace lab, runs kpr on the example
//! Services, sends traffic from a pod and from outside the node, and shows where it went.
//! Everything is removed at the end (also on Ctrl-C or a failure).
//!
//!   kpr-lab [--manifests DIR] [--connections N] [--keep SECONDS] [--nodes 1|2] [--cni routed|vxlan]
use std::{
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use kpr_lab::lab::{errors, per_backend, Cni, Lab, LabSpec, NODE_IP, NODE_IP6};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// The "pod" role, its process placed in node A's cgroup.
const POD_IN_CGROUP: &str = "pod in the cgroup";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let manifests = opt("--manifests").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("deploy/examples"));
    let n: u64 = opt("--connections").map(|s| s.parse().expect("--connections N")).unwrap_or(300);
    let keep: u64 = opt("--keep").map(|s| s.parse().expect("--keep SECONDS")).unwrap_or(0);
    let nodes: usize = opt("--nodes").map(|s| s.parse().expect("--nodes 1|2")).unwrap_or(2);
    let cni = match opt("--cni").as_deref() {
        None | Some("routed") => Cni::Routed,
        Some("vxlan") => Cni::Vxlan,
        Some(other) => panic!("--cni {other}: routed or vxlan"),
    };
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let manifests = std::fs::canonicalize(&manifests).unwrap_or_else(|e| panic!("{}: {e}", manifests.display()));
    let spec = LabSpec { nodes: nodes.clamp(1, 2), cni, ..LabSpec::default() };
    let shape = if cni == Cni::Vxlan { "Flannel-like VXLAN overlay" } else { "Calico-like routed pods" };
    println!("==> building the lab: {} node(s), {shape}, kube-proxy's netfilter rules on each", spec.nodes);
    println!("    node-a (kpr-lab-node): pods pod, b1, b2, b3; node-b (kpr-lab-nodeb): b4, pod2; outside client kpr-lab-cl");
    let mut lab = Lab::build_with("kpr-lab", &manifests, spec);
    for n in &lab.nodes {
        let _ = std::fs::remove_file(&n.agent_log);
    }
    println!(
        "==> starting kpr on every node on {} (logs: {})",
        manifests.display(),
        lab.nodes.iter().map(|n| n.agent_log.display().to_string()).collect::<Vec<_>>().join(", ")
    );
    lab.start_agents();
    lab.wait_backends("10.96.0.10:80", 3);
    println!("\n==> kpr services (what the kernel maps hold)\n{}", lab.cli(&["services"]));

    let mut runs: Vec<(&str, &str, String, &str, u64)> = vec![
        ("pod -> ClusterIP web (random)", "pod", "10.96.0.10:80".into(), "tcp", n),
        ("pod -> ClusterIP web-rr (round-robin)", "pod", "10.96.0.11:80".into(), "tcp", n),
        ("pod -> ClusterIP sticky (ClientIP affinity)", "pod", "10.96.0.12:80".into(), "tcp", n / 5),
        ("pod -> ClusterIP dns (UDP, maglev)", "pod", "10.96.0.53:53".into(), "udp", n / 5),
        ("node process -> ClusterIP web (connect-time)", "host", "10.96.0.10:80".into(), "tcp", n),
        ("pod -> IPv6 ClusterIP web-dual (connect-time)", POD_IN_CGROUP, "[fd00:10:96::60]:80".into(), "tcp", n / 3),
        ("node process -> IPv6 ClusterIP web-dual (UDP)", "host", "[fd00:10:96::60]:53".into(), "udp", n / 5),
        ("outside -> NodePort web", "cl", format!("{NODE_IP}:30080"), "tcp", n),
        ("outside -> LoadBalancer shop", "cl", "203.0.113.10:80".into(), "tcp", n / 5),
        ("outside -> IPv6 NodePort web-dual", "cl", format!("[{NODE_IP6}]:30060"), "tcp", n / 3),
        ("outside -> IPv6 LoadBalancer web-dual (UDP)", "cl", "[2001:db8:203::60]:53".into(), "udp", n / 5),
        ("pod -> ClusterIP gone (no endpoints)", "pod", "10.96.0.99:80".into(), "tcp", 3),
    ];
    if lab.nodes.len() == 2 {
        runs.insert(runs.len() - 1, ("pod -> ClusterIP far (pod on node-b)", "pod", "10.96.0.30:80".into(), "tcp", n / 3));
        runs.insert(runs.len() - 1, ("outside -> NodePort far on node-a (to node-b)", "cl", format!("{NODE_IP}:30090"), "tcp", n / 3));
        runs.insert(runs.len() - 1, ("pod on node-b -> ClusterIP web", "pod2", "10.96.0.10:80".into(), "tcp", n));
    }
    println!("==> traffic ({n} connections per main run)");
    println!("{:<48} {:>6} {:>6} {:>6} {:>6} {:>7}", "", "b1", "b2", "b3", "b4", "failed");
    for (what, from, target, proto, count) in &runs {
        if INTERRUPTED.load(Ordering::Relaxed) {
            break;
        }
        let args = ["burst", target, proto, &count.to_string()];
        // A pod's process in the cgroup the connect-time programs are attached to (on a node,
        // the cgroup root holds every pod).
        let v = if *from == POD_IN_CGROUP { lab.peer_in_cgroup("pod", &args) } else { lab.peer(from, &args) };
        let pb: std::collections::BTreeMap<String, u64> = per_backend(&v).into_iter().collect();
        let cell = |b: &str| pb.get(b).map(|n| n.to_string()).unwrap_or_else(|| "-".into());
        let err = errors(&v);
        let note = v["first_error"].as_str().map(|e| format!("  ({e})")).unwrap_or_default();
        println!("{what:<48} {:>6} {:>6} {:>6} {:>6} {err:>7}{note}", cell("b1"), cell("b2"), cell("b3"), cell("b4"));
    }
    println!("\n==> kpr status (per-CPU counters of the data path)\n{}", lab.cli(&["status"]));
    let ct = lab.cli(&["conntrack"]);
    println!("==> kpr conntrack (first lines of {} flows)", ct.lines().count().saturating_sub(1));
    for l in ct.lines().take(6) {
        println!("{l}");
    }
    if keep > 0 {
        println!(
            "\n==> keeping the lab for {keep} s (Ctrl-C to stop). Try:\n  ip netns exec kpr-lab-pod {} burst 10.96.0.10:80 tcp 10\n  {} --pin-dir {} services",
            std::env::current_exe().unwrap().with_file_name("kpr-lab-peer").display(),
            lab.kpr.display(),
            lab.pins.path().display()
        );
        let mut left = keep * 10;
        while left > 0 && !INTERRUPTED.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            left -= 1;
        }
    }
    println!("\n==> cleaning up (agent stopped, links detached, maps unpinned, namespaces deleted)");
    drop(lab);
}
