//! kpr-ab: connection rate and latency through a ClusterIP, side by side in one run and on the
//! same lab and traffic: kpr's eBPF data plane, kube-proxy's iptables rules (rendered as
//! kube-proxy renders them, loaded with iptables-restore into the node namespace), and direct
//! to the pod IP (the ceiling). Also the control-plane cost of both: programming N services and
//! applying one change. IPv6 beside them: an IPv6 Service through kpr (eBPF mode balances it at
//! connect time) against direct to the pod's IPv6 address. Prints a table, writes JSON and an SVG
//! chart. Figures, not assertions. Last, north-south bulk transfer through the lab's uplink (a
//! veth) with the fast path's IPv4 ingress at XDP and at TC, alternated: what `--xdp-mode auto`
//! picks for a veth.
//!
//!   kpr-ab [--sizes 100,1000,10000,30000] [--seconds 3] [--uplink-mib 64] [--json FILE] [--svg FILE]
use std::time::Instant;

use kpr_lab::{
    iptables::{render, Svc},
    lab::{backend_ip, pod_ip6, Lab},
};

/// The IPv6 Service's address, beside the N IPv4 ones.
const VIP6: &str = "fd00:10:96::ab";

fn vip(i: u32) -> String {
    format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256)
}

fn services(n: u32) -> Vec<Svc> {
    kpr_bench::clusterip_rules(n, "ab", vip)
}

fn manifests(n: u32) -> String {
    kpr_bench::clusterip_manifests(n, "ab", vip)
}

/// An IPv6 Service on the lab's three backends' IPv6 addresses.
fn manifest6() -> String {
    let eps: Vec<String> = (1..=3).map(|b| format!("{{addresses: [\"{}\"]}}", pod_ip6(&backend_ip(b)))).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: v6, namespace: ab}}\nspec: {{clusterIP: \"{VIP6}\", clusterIPs: [\"{VIP6}\"], ipFamilies: [IPv6], ports: [{{name: http, port: 80, targetPort: 8080}}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: v6-1, namespace: ab, labels: {{kubernetes.io/service-name: v6}}}}\naddressType: IPv6\nports: [{{name: http, port: 8080}}]\nendpoints: [{}]\n---\n",
        eps.join(", ")
    )
}

struct Row {
    services: u32,
    mode: &'static str,
    rate: f64,
    p50: f64,
    p99: f64,
    errors: u64,
    program_s: f64,
    change_ms: f64,
}

fn measure(lab: &Lab, mode: &str, target: &str, secs: f64) -> (f64, f64, f64, u64) {
    client_ports(lab, mode);
    let args = ["rate", target, &secs.to_string()];
    // kpr's IPv6 is balanced at connect time: the pod's process sits in the cgroup the agent
    // attached to (on a node, the cgroup root holds every pod).
    let v = if mode == "ebpf6" { lab.peer_in_cgroup("pod", &args) } else { lab.peer("pod", &args) };
    if let Some(e) = v["first_error"].as_str() {
        eprintln!("  {target}: {} errors, the first: {e}", v["errors"]);
    }
    (v["rate"].as_f64().unwrap_or(0.0), v["p50_us"].as_f64().unwrap_or(0.0), v["p99_us"].as_f64().unwrap_or(0.0), v["errors"].as_u64().unwrap_or(0))
}

/// Each data plane's cells draw client ports from their own range. The load generator reuses a
/// port within seconds (tcp_tw_reuse); a port whose TIME_WAIT another data plane left (kube-proxy:
/// pod:p -> VIP in conntrack, kpr: pod:p -> backend) stalls a handshake now and then, a clash
/// that is the harness's, not the data plane's.
fn client_ports(lab: &Lab, mode: &str) {
    let range = match mode.trim_end_matches('6') {
        "direct" => "10000 24999",
        "ebpf" => "25000 39999",
        _ => "40000 59999",
    };
    kpr_lab::must(&format!("ip netns exec {} sysctl -qw net.ipv4.ip_local_port_range='{range}'", lab.ns("pod")));
}

/// Each cell starts from a clean kernel conntrack. The load generator reuses its ports within
/// seconds (tcp_tw_reuse), and a data plane's leftover entries clash with the next one's: under
/// kube-proxy's DNAT the kernel tracks pod:p -> VIP, under kpr pod:p -> backend, whose reply
/// tuple is the same, and a new flow whose reply tuple another entry holds is dropped until
/// that entry times out (the same holds for a live migration; see docs/operations.md).
fn fresh_conntrack(lab: &Lab) {
    kpr_lab::must(&format!("ip netns exec {} conntrack -F 2>/dev/null || true", lab.ns("node")));
}

/// One iptables-restore of the whole nat table (it replaces the table, as a kube-proxy full
/// sync does); returns its duration.
fn restore(lab: &Lab, rules: &str) -> f64 {
    lab.iptables_restore_with(&lab.ns("node"), rules, false).as_secs_f64()
}

/// North-south bulk transfer (one TCP connection, `mib` MiB up and as much down) from the
/// client namespace to the example NodePort, with the uplink's IPv4 ingress at XDP (`--xdp-mode
/// native`, on the veth) and at TC (`off`, what auto picks on a veth), three alternated pairs of
/// three transfers each. Only the upload crosses the uplink's ingress. Returns the medians in
/// MiB/s (XDP, TC), or None where a side failed.
fn uplink_bulk(lab: &mut Lab, dir: &std::path::Path, mib: usize) -> Option<(f64, f64)> {
    let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/web.yaml");
    for f in ["services.yaml", "v6.yaml"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    std::fs::copy(src, dir.join("web.yaml")).ok()?;
    let target = format!("{}:30080", kpr_lab::lab::NODE_IP);
    let bytes = (mib << 20).to_string();
    let (mut xdp, mut tc) = (Vec::new(), Vec::new());
    println!("\nuplink bulk: {mib} MiB up and down through {target}, XDP (native, on the veth) and TC alternated");
    for _ in 0..3 {
        for (mode, out) in [("native", &mut xdp), ("off", &mut tc)] {
            lab.kill_agent();
            lab.agent_args = vec!["--xdp-mode".into(), mode.into()];
            lab.start_agent();
            lab.wait_backends("10.96.0.10:80", 3);
            // The pinned maps outlive an agent: wait for this one's hook instead.
            let (hook, other) = if mode == "off" { ("tc_uplink on up0", "xdp on up0") } else { ("xdp on up0", "tc_uplink on up0") };
            if let Err(status) = lab.wait_status(hook, other) {
                eprintln!("  --xdp-mode {mode}: {hook} never alone on the uplink: {status}");
                return None;
            }
            for _ in 0..3 {
                let v = lab.peer("cl", &["bulk", &target, &bytes]);
                if v["errors"] != 0 {
                    eprintln!("  --xdp-mode {mode}: {v}");
                    return None;
                }
                out.push((2 * mib) as f64 / v["seconds"].as_f64()?);
            }
        }
    }
    lab.kill_agent();
    lab.agent_args.clear();
    lab.cli(&["cleanup"]);
    println!("  XDP: {}", xdp.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(" "));
    println!("  TC:  {}", tc.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(" "));
    Some((kpr_bench::median(xdp), kpr_bench::median(tc)))
}

fn svg(rows: &[Row]) -> String {
    let mut sizes: Vec<u32> = rows.iter().map(|r| r.services).collect();
    sizes.dedup();
    let series = [("direct", "#888888"), ("ebpf", "#2b7bb9"), ("iptables", "#d9534f")];
    kpr_bench::chart::bars("New TCP connections per second through a ClusterIP (higher is better)", &sizes, &series, |n, m| {
        rows.iter().find(|r| r.services == n && r.mode == m).map(|r| r.rate)
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let sizes: Vec<u32> = opt("--sizes").unwrap_or_else(|| "100,1000,10000,30000".into()).split(',').map(|s| s.parse().unwrap()).collect();
    let secs: f64 = opt("--seconds").map(|s| s.parse().unwrap()).unwrap_or(3.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!(
        "machine: Linux {} | {} CPUs | {secs} s of back-to-back connections from one pod per cell",
        kernel.trim(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    println!("target: the last-created service (the end of kube-proxy's KUBE-SERVICES chain)");
    println!("program: N services from nothing; 1 change: one service's endpoints (eBPF through the manifest-directory source, which re-reads every file; the Kubernetes source's figure is kpr-scale's) vs. kube-proxy's full iptables-restore\n");
    let dir = std::env::temp_dir().join(format!("kpr-ab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut lab = Lab::build("kab", &dir);
    let mut rows = Vec::new();
    println!("{:>8} {:<9} {:>10} {:>9} {:>9} {:>7} {:>12} {:>12}", "services", "mode", "conn/s", "p50 µs", "p99 µs", "errors", "program (s)", "1 change (ms)");
    for &n in &sizes {
        let target = format!("{}:80", vip(n - 1));
        // Direct to the pod: the ceiling.
        let (rate, p50, p99, errors) = measure(&lab, "direct", &format!("{}:8080", backend_ip(1)), secs);
        rows.push(Row { services: n, mode: "direct", rate, p50, p99, errors, program_s: 0.0, change_ms: 0.0 });
        let (rate, p50, p99, errors) = measure(&lab, "direct6", &format!("[{}]:8080", pod_ip6(&backend_ip(1))), secs);
        rows.push(Row { services: n, mode: "direct6", rate, p50, p99, errors, program_s: 0.0, change_ms: 0.0 });
        // eBPF: the agent programs N services (and the IPv6 one) from a manifest directory.
        std::fs::write(dir.join("v6.yaml"), manifest6()).unwrap();
        std::fs::write(dir.join("services.yaml"), manifests(n)).unwrap();
        let t = Instant::now();
        lab.start_agent();
        // One entry a ClusterIP port (both scopes).
        lab.wait_for(&format!("{n} services"), |v| v.as_array().is_some_and(|a| a.len() > n as usize));
        let program_s = t.elapsed().as_secs_f64();
        // One change: the last service gets a fourth endpoint... the same three, reordered.
        let t = Instant::now();
        std::fs::write(
            dir.join("services.yaml"),
            manifests(n).replacen(
                &format!("endpoints: [{{addresses: [{}]}}, {{addresses: [{}]}}, {{addresses: [{}]}}]", backend_ip(1), backend_ip(2), backend_ip(3)),
                &format!("endpoints: [{{addresses: [{}]}}, {{addresses: [{}]}}]", backend_ip(1), backend_ip(2)),
                1,
            ),
        )
        .unwrap();
        lab.wait_for("one change", |v| {
            v.as_array().is_some_and(|a| a.iter().any(|r| r["frontend"] == format!("{}:80", vip(0)) && r["backends"].as_array().map(|b| b.len()) == Some(2)))
        });
        let change_ms = t.elapsed().as_secs_f64() * 1e3;
        let (rate, p50, p99, errors) = measure(&lab, "ebpf", &target, secs);
        rows.push(Row { services: n, mode: "ebpf", rate, p50, p99, errors, program_s, change_ms });
        let (rate, p50, p99, errors) = measure(&lab, "ebpf6", &format!("[{VIP6}]:80"), secs);
        rows.push(Row { services: n, mode: "ebpf6", rate, p50, p99, errors, program_s: 0.0, change_ms: 0.0 });
        lab.kill_agent();
        fresh_conntrack(&lab);
        lab.cli(&["cleanup"]);
        // kube-proxy's iptables rules.
        let rules = render(&services(n), "10.244.0.0/16");
        let program_s = restore(&lab, &rules);
        let changed = render(&services(n)[..], "10.244.0.0/16").replacen(
            &"-m statistic --mode random --probability 0.33333333333 -j".to_string(),
            "-m statistic --mode random --probability 0.33333333334 -j",
            1,
        );
        // kube-proxy rewrites the table on a change (one iptables-restore).
        let change_ms = restore(&lab, &changed) * 1e3;
        let (rate, p50, p99, errors) = measure(&lab, "iptables", &target, secs);
        rows.push(Row { services: n, mode: "iptables", rate, p50, p99, errors, program_s, change_ms });
        restore(&lab, "*nat\nCOMMIT\n");
        fresh_conntrack(&lab);

        for r in rows.iter().filter(|r| r.services == n) {
            println!(
                "{:>8} {:<9} {:>10.0} {:>9.0} {:>9.0} {:>7} {:>12.2} {:>12.1}",
                r.services, r.mode, r.rate, r.p50, r.p99, r.errors, r.program_s, r.change_ms
            );
        }
    }
    let mib: usize = opt("--uplink-mib").map(|s| s.parse().unwrap()).unwrap_or(64);
    let uplink = uplink_bulk(&mut lab, &dir, mib);
    println!();
    for &n in &sizes {
        let get = |m: &str| rows.iter().find(|r| r.services == n && r.mode == m).map(|r| r.rate).unwrap_or(0.0);
        println!(
            "{n:>8} services: eBPF at {:.0}% of direct; {:.2}x iptables; IPv6 (connect time) at {:.0}% of direct IPv6",
            100.0 * get("ebpf") / get("direct"),
            get("ebpf") / get("iptables").max(1e-9),
            100.0 * get("ebpf6") / get("direct6").max(1e-9)
        );
    }
    if let Some((xdp, tc)) = uplink {
        println!("uplink (a veth), bulk from outside to a NodePort: TC ingress {tc:.0} MiB/s, {:.2}x XDP's {xdp:.0} MiB/s", tc / xdp.max(1e-9));
    }
    if let Some(path) = opt("--json") {
        let v: Vec<_> = rows.iter().map(|r| serde_json::json!({"services": r.services, "mode": r.mode, "conn_per_s": r.rate, "p50_us": r.p50, "p99_us": r.p99, "errors": r.errors, "program_s": r.program_s, "one_change_ms": r.change_ms})).collect();
        let uplink = uplink.map(|(xdp, tc)| serde_json::json!({"xdp_mib_per_s": xdp, "tc_mib_per_s": tc}));
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&serde_json::json!({"kernel": kernel.trim(), "seconds": secs, "results": v, "uplink_bulk": uplink})).unwrap(),
        )
        .unwrap();
        println!("wrote {path}");
    }
    if let Some(path) = opt("--svg") {
        std::fs::write(&path, svg(&rows)).unwrap();
        println!("wrote {path}");
    }
    drop(lab);
    let _ = std::fs::remove_dir_all(&dir);
}
