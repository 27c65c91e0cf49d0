//! kpr-churn: sustained short connections on the paths users meet, side by side in one run:
//! direct to the pod (the ceiling), kube-proxy's iptables rules (rendered as kube-proxy renders
//! them, loaded with iptables-restore into the node namespace) and kpr, alternated cell by cell
//! on the same lab, client and traffic. The node carries kube-proxy's KUBE-FORWARD rules
//! (`ctstate INVALID -j DROP`) throughout.
//!
//! Paths: outside -> NodePort and outside -> ClusterIP (both masqueraded), pod -> ClusterIP (not
//! masqueraded), hairpin (a pod to its own Service, masqueraded), and pod -> ClusterIP over UDP
//! with a new socket per query (DNS-style). Each TCP connection does the whole handshake, a
//! request line and its answer, and a close: the client's FIN, or its RST (SO_LINGER 0). The
//! measured Service has one endpoint, so every masqueraded connection of a cell needs a SNAT
//! tuple towards the same backend and address. Prints connections/s, failed connections,
//! connect latency p50/p99 (UDP: the answer's), the connects that waited for a SYN's
//! retransmission, the agent's CPU and kpr's SNAT counters over the cell, and the goals'
//! ratios. Figures, not assertions.
//!
//!   kpr-churn [--sizes 1,30000] [--seconds 30] [--only TEXT] [--json FILE]
//!
//! `--only` keeps the paths whose name or close holds TEXT (e.g. `NodePort`, `rst`, `udp`).
use kpr_lab::{
    iptables::{render, Svc},
    lab::{backend_ip, Lab, CLUSTER_CIDR, NODE_IP},
};

/// The measured Services: TCP on one endpoint (b1) with a NodePort, UDP on the same pod.
const WEB: &str = "10.96.0.10";
const WEB_NODE_PORT: u16 = 30080;
const DNS: &str = "10.96.0.53";

/// The other Services: ClusterIPs outside the measured ones' /24.
fn filler_vip(i: u32) -> String {
    format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256)
}

/// `n` Services in all: n - 1 fillers, created first (kube-proxy's KUBE-SERVICES chain is walked
/// in order: the measured Services are at its end), then the measured TCP one; the UDP one
/// besides.
fn manifests(n: u32) -> String {
    let mut y = kpr_bench::clusterip_manifests(n.saturating_sub(1), "churn", filler_vip);
    let b1 = backend_ip(1);
    y += &format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: churn}}\nspec: {{type: NodePort, clusterIP: {WEB}, ports: [{{name: http, port: 80, targetPort: 8080, nodePort: {WEB_NODE_PORT}}}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, namespace: churn, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{{addresses: [{b1}]}}]\n---\n\
         apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: churn}}\nspec: {{clusterIP: {DNS}, ports: [{{name: dns, port: 53, targetPort: 5353, protocol: UDP}}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dns-1, namespace: churn, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{name: dns, port: 5353, protocol: UDP}}]\nendpoints: [{{addresses: [{b1}]}}]\n---\n"
    );
    y
}

/// The same Services as kube-proxy's iptables rules.
fn rules(n: u32, cluster_cidr: &str) -> String {
    let b1 = backend_ip(1);
    let mut svcs = kpr_bench::clusterip_rules(n.saturating_sub(1), "churn", filler_vip);
    svcs.push(Svc {
        name: "churn/web:http".into(),
        vip: WEB.into(),
        port: 80,
        proto: "tcp",
        node_port: Some(WEB_NODE_PORT),
        backends: vec![(b1.clone(), 8080)],
    });
    svcs.push(Svc { name: "churn/dns:dns".into(), vip: DNS.into(), port: 53, proto: "udp", node_port: None, backends: vec![(b1, 5353)] });
    render(&svcs, cluster_cidr)
}

/// One path: who connects, to what through a Service, to what directly, and whether kube-proxy
/// (and kpr) masquerade it.
struct Path {
    name: &'static str,
    client: &'static str,
    service: String,
    direct: String,
    masqueraded: bool,
    /// "fin", "rst" or "udp" (kpr-lab-peer churn's close).
    close: &'static str,
    /// The cluster CIDR both proxies are given: the pods', or one holding the outside client,
    /// which then counts as inside and is not masqueraded (the same path without masquerade).
    cluster_cidr: &'static str,
}

/// The outside client's side of the address space (198.18.0.2): as a cluster CIDR, its
/// connections to a ClusterIP are not masqueraded.
const CLIENT_INSIDE: &str = "128.0.0.0/1";

fn paths() -> Vec<Path> {
    let pod = format!("{}:8080", backend_ip(1));
    let mut v = Vec::new();
    let path =
        |name, client, service: String, masqueraded, close, cluster_cidr| Path { name, client, service, direct: pod.clone(), masqueraded, close, cluster_cidr };
    for close in ["fin", "rst"] {
        v.push(path("outside -> NodePort", "cl", format!("{NODE_IP}:{WEB_NODE_PORT}"), true, close, CLUSTER_CIDR));
        v.push(path("outside -> ClusterIP", "cl", format!("{WEB}:80"), true, close, CLUSTER_CIDR));
        v.push(path(UNMASQUERADED, "cl", format!("{WEB}:80"), false, close, CLIENT_INSIDE));
        v.push(path("pod -> ClusterIP", "pod", format!("{WEB}:80"), false, close, CLUSTER_CIDR));
        v.push(path("hairpin", "b1", format!("{WEB}:80"), true, close, CLUSTER_CIDR));
    }
    v.push(Path {
        name: "pod -> ClusterIP UDP",
        client: "pod",
        service: format!("{DNS}:53"),
        direct: format!("{}:5353", backend_ip(1)),
        masqueraded: false,
        close: "udp",
        cluster_cidr: CLUSTER_CIDR,
    });
    v
}

/// Outside -> ClusterIP with the client counted inside the cluster: the masquerade's reference.
const UNMASQUERADED: &str = "outside -> ClusterIP, unmasq.";

#[derive(Clone, Copy, Debug, Default)]
struct Cell {
    rate: f64,
    failed: u64,
    p50_us: f64,
    p99_us: f64,
    slow: u64,
}

/// kpr's SNAT counters over a cell, and the agent's CPU (% of one core) over it.
#[derive(Clone, Copy, Debug, Default)]
struct Snat {
    snat: u64,
    reused: u64,
    collisions: u64,
    no_port: u64,
    agent_cpu_pct: f64,
}

/// The agent's CPU time so far (user and system, every thread), in seconds.
fn agent_cpu_s(lab: &Lab) -> f64 {
    let Some(pid) = lab.agent_pid() else { return 0.0 };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command's closing parenthesis: the state is the first, utime the
    // 12th, stime the 13th (proc(5)'s fields 3, 14 and 15).
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf(3) has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
}

const MODES: [&str; 3] = ["direct", "iptables", "kpr"];

/// Each mode's clients draw ports from their own range: a port a client left in TIME_WAIT (or
/// a kernel conntrack entry another mode left) must not meet the next mode's connections.
fn client_ports(lab: &Lab, client: &str, mode: &str) {
    let range = match mode {
        "direct" => "1024 20999",
        "kpr" => "21000 42999",
        _ => "43000 65000",
    };
    kpr_lab::must(&format!("ip netns exec {} sysctl -qw net.ipv4.ip_local_port_range='{range}' net.ipv4.tcp_tw_reuse=1", lab.ns(client)));
}

fn churn(lab: &Lab, p: &Path, mode: &str, target: &str, secs: f64) -> Cell {
    client_ports(lab, p.client, mode);
    let v = lab.peer(p.client, &["churn", target, &secs.to_string(), p.close]);
    if let Some(e) = v["first_error"].as_str() {
        eprintln!("  {} ({}) via {mode}: {} failed, the first: {e}", p.name, p.close, v["errors"]);
    }
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    Cell {
        rate: f("rate"),
        failed: v["errors"].as_u64().unwrap_or(u64::MAX),
        p50_us: f("p50_us"),
        p99_us: f("p99_us"),
        slow: v["slow_connects"].as_u64().unwrap_or(0),
    }
}

fn snat_counters(lab: &Lab) -> Snat {
    let v: serde_json::Value = serde_json::from_str(&lab.cli(&["status", "--json"])).unwrap_or_default();
    let c = |k: &str| v["counters"][k].as_u64().unwrap_or(0);
    Snat { snat: c("snat"), reused: c("snat_port_reused"), collisions: c("snat_port_collision"), no_port: c("snat_no_port"), agent_cpu_pct: 0.0 }
}

fn fresh_conntrack(lab: &Lab) {
    kpr_lab::must(&format!("ip netns exec {} conntrack -F 2>/dev/null || true", lab.ns("node")));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let sizes: Vec<u32> = opt("--sizes").unwrap_or_else(|| "1,30000".into()).split(',').map(|s| s.parse().expect("--sizes: numbers")).collect();
    let secs: f64 = opt("--seconds").map(|s| s.parse().expect("--seconds: a number")).unwrap_or(30.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "machine: Linux {} | {} CPUs | {secs} s of back-to-back connections per cell, one client; direct, iptables and kpr alternated per cell",
        kernel.trim(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    println!("measured Service: one endpoint; the node has kube-proxy's KUBE-FORWARD rules (INVALID dropped)\n");
    let dir = std::env::temp_dir().join(format!("kpr-churn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut lab = Lab::build("kch", &dir);
    // The outside client reaches the pods directly for the ceiling (a router's route to the pod
    // network through the node); only the lab's namespaces are involved.
    kpr_lab::must(&format!("ip -n {} route add 10.244.0.0/16 via {NODE_IP}", lab.ns("cl")));
    let mut results = Vec::new();
    println!(
        "{:>8} {:<29} {:<5} {:<9} {:>9} {:>7} {:>9} {:>9} {:>6}  agent %cpu  kpr SNAT: new, reused, collisions, no port",
        "services", "path", "close", "mode", "conn/s", "failed", "p50 µs", "p99 µs", "slow"
    );
    for &n in &sizes {
        std::fs::write(dir.join("services.yaml"), manifests(n)).unwrap();
        let only = opt("--only").unwrap_or_default();
        for p in paths().into_iter().filter(|p| p.name.contains(&only) || p.close == only) {
            let rules = rules(n, p.cluster_cidr);
            lab.cluster_cidr = p.cluster_cidr.into();
            let mut row = Vec::new();
            for mode in MODES {
                fresh_conntrack(&lab);
                let (cell, snat) = match mode {
                    "direct" => (churn(&lab, &p, mode, &p.direct, secs), None),
                    "iptables" => {
                        lab.iptables_restore_with(&lab.ns("node"), &rules, false);
                        let cell = churn(&lab, &p, mode, &p.service, secs);
                        lab.iptables_restore_with(&lab.ns("node"), "*nat\nCOMMIT\n", false);
                        (cell, None)
                    }
                    _ => {
                        lab.start_agent();
                        lab.wait_backends(&format!("{WEB}:80"), 1);
                        lab.wait_backends(&format!("{DNS}:53"), 1);
                        // A node's agent runs long before its traffic: its start (programs,
                        // the first sync, the collector's first passes) is not the cell's.
                        std::thread::sleep(std::time::Duration::from_secs(2));
                        let (before, cpu_before, t) = (snat_counters(&lab), agent_cpu_s(&lab), std::time::Instant::now());
                        let cell = churn(&lab, &p, mode, &p.service, secs);
                        let after = snat_counters(&lab);
                        let agent_cpu_pct = 100.0 * (agent_cpu_s(&lab) - cpu_before) / t.elapsed().as_secs_f64();
                        lab.kill_agent();
                        lab.cli(&["cleanup"]);
                        let d = Snat {
                            snat: after.snat - before.snat,
                            reused: after.reused - before.reused,
                            collisions: after.collisions - before.collisions,
                            no_port: after.no_port - before.no_port,
                            agent_cpu_pct,
                        };
                        (cell, Some(d))
                    }
                };
                let snat_text =
                    snat.map(|s| format!("{:>7.1}  {}, {}, {}, {}", s.agent_cpu_pct, s.snat, s.reused, s.collisions, s.no_port)).unwrap_or_default();
                println!(
                    "{n:>8} {:<29} {:<5} {mode:<9} {:>9.0} {:>7} {:>9.0} {:>9.0} {:>6}  {snat_text}",
                    p.name, p.close, cell.rate, cell.failed, cell.p50_us, cell.p99_us, cell.slow
                );
                row.push((mode, cell, snat));
            }
            results.push((n, p, row));
        }
    }
    fresh_conntrack(&lab);
    drop(lab);
    let _ = std::fs::remove_dir_all(&dir);

    println!();
    let cell = |n: u32, name: &str, close: &str, mode: &str| {
        results
            .iter()
            .find(|(s, p, _)| *s == n && p.name == name && p.close == close)
            .and_then(|(_, _, row)| row.iter().find(|(m, _, _)| *m == mode).map(|(_, c, _)| *c))
    };
    for &n in &sizes {
        let (goal, label) = if n >= 30_000 { (5.0, "5x") } else { (0.9, "0.9x") };
        let mut worst: Option<(f64, String)> = None;
        let mut failed = 0;
        for (_, p, row) in results.iter().filter(|(s, _, _)| *s == n) {
            let get = |m: &str| row.iter().find(|(mode, _, _)| *mode == m).map(|(_, c, _)| *c).unwrap_or_default();
            let (kpr, ipt) = (get("kpr"), get("iptables"));
            let ratio = kpr.rate / ipt.rate.max(1e-9);
            failed += kpr.failed;
            println!(
                "{n:>8} services: {} ({}): kpr {:.2}x iptables, {:.0}% of direct",
                p.name,
                p.close,
                ratio,
                100.0 * kpr.rate / get("direct").rate.max(1e-9)
            );
            if worst.as_ref().is_none_or(|(r, _)| ratio < *r) {
                worst = Some((ratio, format!("{} ({})", p.name, p.close)));
            }
        }
        if let Some((r, which)) = worst {
            kpr_bench::print_goal(
                &format!("{n} services: every path >= {label} kube-proxy's iptables rules"),
                &format!("slowest {which} at {r:.2}x"),
                r >= goal,
            );
        }
        kpr_bench::print_goal(&format!("{n} services: 0 failed connections through kpr"), &format!("{failed} failed"), failed == 0);
        for close in ["fin", "rst"] {
            let (Some(masq), Some(plain)) = (cell(n, "outside -> ClusterIP", close, "kpr"), cell(n, UNMASQUERADED, close, "kpr")) else {
                continue;
            };
            let r = masq.rate / plain.rate.max(1e-9);
            kpr_bench::print_goal(
                &format!("{n} services: kpr's masqueraded rate within 10% of the same path unmasqueraded ({close})"),
                &format!("outside -> ClusterIP {:.0}/s masqueraded, {:.0}/s not: {r:.2}", masq.rate, plain.rate),
                r >= 0.9,
            );
        }
    }
    if let Some(path) = opt("--json") {
        let rows: Vec<_> = results
            .iter()
            .flat_map(|(n, p, row)| {
                row.iter().map(move |(mode, c, s)| {
                    serde_json::json!({"services": n, "path": p.name, "close": p.close, "masqueraded": p.masqueraded, "mode": mode,
                        "conn_per_s": c.rate, "failed": c.failed, "p50_us": c.p50_us, "p99_us": c.p99_us, "slow_connects": c.slow,
                        "agent_cpu_pct": s.map(|s| s.agent_cpu_pct),
                        "snat": s.map(|s| serde_json::json!({"new": s.snat, "reused": s.reused, "collisions": s.collisions, "no_port": s.no_port}))})
                })
            })
            .collect();
        std::fs::write(&path, serde_json::to_string_pretty(&serde_json::json!({"kernel": kernel.trim(), "seconds": secs, "results": rows})).unwrap()).unwrap();
        println!("wrote {path}");
    }
}
