//! `kpr-vm-bench`: the IPVS sides of the A/B, inside the QEMU guest (Debian's IPVS kernel; run
//! by `cargo xtask bench`). The guest's CPU is emulated, so only ratios measured in the same
//! guest mean anything. Figures, never assertions.
//!
//! 1. Control plane: N services × 10 endpoints from nothing, and one change at N, into IPVS
//!    over netlink and into the BPF maps; the maps' memory from the kernel's map info.
//! 2. Traffic: new TCP connections per second and latency from a client outside the cluster
//!    CIDR through a ClusterIP (so every connection needs the masquerade), with the same IPVS
//!    state and sets for: kube-proxy's IPVS mode (iptables + ipset), kpr's IPVS mode (BPF set
//!    matching), kpr's eBPF fast path.
//!
//!   kpr-vm-bench [--cp-sizes 1000,10000] [--traffic-sizes 100,10000] [--seconds 3] [--runs 3]
//!                [--json FILE] [--svg FILE]
//!   kpr-vm-bench program-ipvs DIR     (internal: kube-proxy's side, run in the node namespace)
use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use kpr_bench::{bpf_map_memlock, clusterip_manifests, clusterips, median, set_clusterip};
use kpr_lab::{
    datapath_config,
    lab::{Cni, Lab, LabSpec, NODE_IP},
    must, sh, PinDir,
};
use proxy_agent::{
    dataplane::ebpf::kernel::{Capacities, Datapath},
    dataplane::ebpf::kernel_maps::KernelMaps,
    dataplane::ebpf::sync::Syncer,
    dataplane::ipvs::client::{NetlinkIpvs, ServiceId},
    dataplane::ipvs::desired::{desired_virtual_servers, SyncSettings},
    dataplane::ipvs::sync::IpvsSyncer,
    model::{self, BackendKey, DesiredState, FrontendKey, NodeInfo, Protocol},
    netlink::ctnetlink::FakeConntrack,
    netlink::{rtnl::NetlinkLinks, socket::Acks},
    settings::VipBinding,
};

fn vip(i: u32) -> IpAddr {
    IpAddr::from((0x0a60_0000u32 + 256 + i).to_be_bytes()) // 10.96.1.0 + i
}

fn ip(n: u32) -> IpAddr {
    IpAddr::from(n.to_be_bytes())
}

/// N ClusterIP services with `eps` endpoints each (addresses need not exist for programming).
fn desired(n: u32, eps: u32) -> DesiredState {
    clusterips(n, eps, vip, 0x0af5_0002, 0xff00)
}

/// One service's endpoints replaced by another set: the change applied at N.
fn change(d: &mut DesiredState, i: u32, round: u32) {
    let backends = (0..10).map(|j| BackendKey { ip: ip(0x0af6_0000 + round * 16 + j), port: 8080, proto: Protocol::Tcp }).collect();
    set_clusterip(d, i, vip(i), backends);
}

struct Cp {
    n: u32,
    /// One request at a time, the VIPs bound first (kpr before pipelining).
    ipvs_one_at_a_time_s: f64,
    /// Pipelined, the addresses bound beside, every request asking for an ACK (the previous
    /// release).
    ipvs_every_ack_s: f64,
    /// The binding's own time in it (overlapping).
    ipvs_every_ack_bind_s: f64,
    /// Pipelined, the addresses bound beside the IPVS writes (the agent's way).
    ipvs_program_s: f64,
    /// The binding's own time in it (overlapping).
    ipvs_bind_s: f64,
    /// The same with the IPv4 VIPs as local routes (`--ipvs-vip-binding route`).
    ipvs_routes_program_s: f64,
    /// The routes' own time in it (overlapping).
    ipvs_routes_bind_s: f64,
    ipvs_change_ms: f64,
    bpf_program_s: f64,
    bpf_change_ms: f64,
    bpf_map_bytes: u64,
}

/// How a run binds the VIPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bind {
    /// All of them before the first IPVS write, on the sync's thread (the previous release).
    First,
    /// As the agent does: on a thread of their own beside the IPVS writes.
    Beside,
}

/// Programs `n` services x 10 endpoints from nothing, in this process's network namespace,
/// through the agent's sync: (seconds binding the VIPs `binding`'s way, seconds in all).
/// `pipelined` false: one netlink request at a time (kpr before pipelining). With
/// `Bind::Beside` the binding's seconds overlap the IPVS writes. `acks`: which pipelined
/// requests ask for an ACK.
fn ipvs_program(n: u32, pipelined: bool, binding: VipBinding, bind: Bind, acks: Acks) -> (f64, f64) {
    let (mut ipvs, mut links) = (NetlinkIpvs::connect().expect("IPVS"), NetlinkLinks::connect().expect("rtnetlink"));
    if !pipelined {
        (ipvs, links) = (ipvs.one_at_a_time(), links.one_at_a_time());
    }
    if acks == Acks::Every {
        (ipvs, links) = (ipvs.ack_every_request(), links.ack_every_request());
    }
    let concurrent_binds = if bind == Bind::Beside { SyncSettings::default().concurrent_binds } else { usize::MAX };
    let settings = SyncSettings { vip_binding: binding, concurrent_binds, ..SyncSettings::default() };
    let vs = desired_virtual_servers(&desired(n, 10), &settings);
    let t = Instant::now();
    let st = IpvsSyncer::new(settings).sync(&mut ipvs, &mut links, &mut FakeConntrack::default(), &vs, None).expect("ipvs sync");
    let total_s = t.elapsed().as_secs_f64();
    assert!(st.errors.is_empty(), "{:?}", &st.errors[..st.errors.len().min(3)]);
    assert_eq!(st.addresses_bound, n as usize, "the sync bound every VIP");
    (st.bind_time.as_secs_f64(), total_s)
}

/// `ipvs_program` in a network namespace of its own (IPVS's tables, its trash of deleted
/// destinations, which every add searches, and kube-ipvs0 are per namespace: one run never
/// slows the next).
/// Returns [bind s, total s, one change ms (pipelined addresses bound beside only)].
fn ipvs_program_isolated(n: u32, pipelined: bool, binding: VipBinding, bind: Bind, acks: Acks) -> [f64; 3] {
    let ns = format!("kvb-{n}-{pipelined}-{binding:?}-{bind:?}-{acks:?}");
    must(&format!("ip netns add {ns}"));
    let exe = std::env::current_exe().expect("own path");
    let args = [n.to_string(), pipelined.to_string(), format!("{binding:?}"), format!("{bind:?}"), format!("{acks:?}")];
    let out = Command::new("ip").args(["netns", "exec", &ns]).arg(exe).arg("ipvs-program").args(args).output().expect("spawn");
    let _ = sh(&format!("ip netns del {ns}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ipvs-program {n}: {text}{}", String::from_utf8_lossy(&out.stderr));
    let v: Vec<f64> = text.split_whitespace().map(|x| x.parse().expect("seconds")).collect();
    [v[0], v[1], v[2]]
}

/// The median time of one change (one service's endpoints replaced) on the state
/// `ipvs_program` left: the incremental path, re-reading only that virtual server.
fn ipvs_changes(n: u32) -> f64 {
    let mut ipvs = NetlinkIpvs::connect().expect("IPVS");
    let mut links = NetlinkLinks::connect().expect("rtnetlink");
    let settings = SyncSettings::default();
    let mut syncer = IpvsSyncer::new(settings.clone());
    let mut ct = FakeConntrack::default();
    let mut d = desired(n, 10);
    let mut times = Vec::new();
    for r in 0..5 {
        let i = r * n / 5;
        change(&mut d, i, r);
        let only: BTreeSet<ServiceId> = [ServiceId::Addr { proto: 6, addr: vip(i), port: 80 }].into();
        let vs = desired_virtual_servers(&d, &settings);
        let t = Instant::now();
        syncer.sync(&mut ipvs, &mut links, &mut ct, &vs, Some(&only)).expect("ipvs change");
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    median(times)
}

fn control_plane(n: u32) -> Cp {
    let changes = 5;
    let _ = Command::new("modprobe").arg("ip_vs").status();
    let [_, ipvs_one_at_a_time_s, _] = ipvs_program_isolated(n, false, VipBinding::Address, Bind::First, Acks::Every);
    let [ipvs_every_ack_bind_s, ipvs_every_ack_s, _] = ipvs_program_isolated(n, true, VipBinding::Address, Bind::Beside, Acks::Every);
    let [ipvs_bind_s, ipvs_program_s, ipvs_change_ms] = ipvs_program_isolated(n, true, VipBinding::Address, Bind::Beside, Acks::Last);
    let [ipvs_routes_bind_s, ipvs_routes_program_s, _] = ipvs_program_isolated(n, true, VipBinding::Route, Bind::Beside, Acks::Last);

    // The BPF maps, same services.
    let pins = PinDir::new("vmbench");
    let caps = Capacities {
        services: 2 * n + 16,
        backends: (10 * n + 64).max(65_536),
        slots: 20 * n + 64,
        conntrack: 65_536,
        conntrack_new: 16_384,
        affinity: 16_384,
        ..Capacities::default()
    };
    let _dp = Datapath::load(pins.path(), caps).expect("load");
    let mut maps = KernelMaps::open(pins.path()).expect("maps");
    let mut bsync = Syncer::new(caps.services, caps.backends, 16);
    let cfg = datapath_config("198.18.0.1", Some(("10.244.0.0", 16)));
    let mut d = desired(n, 10);
    let t = Instant::now();
    bsync.sync(&mut maps, &d, cfg).expect("map sync");
    let bpf_program_s = t.elapsed().as_secs_f64();
    let mut times = Vec::new();
    for r in 0..changes {
        let i = r * n / changes;
        change(&mut d, i, r);
        let touched: BTreeSet<FrontendKey> = [FrontendKey { ip: vip(i), port: 80, proto: Protocol::Tcp, scope: proxy_agent::model::Scope::Both }].into();
        let t = Instant::now();
        bsync.sync_subset(&mut maps, &d, cfg, &touched).expect("map change");
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Cp {
        n,
        ipvs_one_at_a_time_s,
        ipvs_every_ack_s,
        ipvs_every_ack_bind_s,
        ipvs_program_s,
        ipvs_bind_s,
        ipvs_routes_program_s,
        ipvs_routes_bind_s,
        ipvs_change_ms,
        bpf_program_s,
        bpf_change_ms: median(times),
        bpf_map_bytes: bpf_map_memlock("self"),
    }
}

/// Manifests for the traffic part: N services on the lab's three backends.
fn manifests(n: u32) -> String {
    clusterip_manifests(n, "vb", |i| vip(i).to_string())
}

/// kube-proxy's side, run inside the node namespace: the IPVS state kube-proxy makes (the same
/// virtual servers as kpr's IPVS mode), plus its ipsets and iptables rules.
fn program_ipvs(dir: &Path) {
    let report = proxy_agent::source::manifests::load_dir(dir).expect("manifests");
    let node = NodeInfo { name: "node-a".into(), nodeport_addresses: vec![NODE_IP.parse().unwrap()], zone: None };
    let d = model::compute(&report.objects, &node, &Default::default());
    let settings = SyncSettings { node_addresses: node.nodeport_addresses.clone(), ..Default::default() };
    let vs = desired_virtual_servers(&d, &settings);
    // kube-proxy's IPVS proxier sysctls (vs.conntrack=1 is what lets MASQUERADE see IPVS's NAT);
    // they exist once ip_vs is loaded (a traffic-only run has not loaded it yet).
    let _ = Command::new("modprobe").arg("ip_vs").status();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let kver = proxy_agent::host::sysctl::kernel_version(release.trim()).unwrap_or((0, 0));
    for (k, v) in proxy_agent::host::sysctl::ipvs_sysctls(kver, false) {
        proxy_agent::host::sysctl::Sysctls::set(&mut proxy_agent::host::sysctl::ProcSysctls, k, v).expect("sysctl");
    }
    let mut ipvs = NetlinkIpvs::connect().expect("IPVS");
    let mut links = NetlinkLinks::connect().expect("rtnetlink");
    let st = IpvsSyncer::new(settings).sync(&mut ipvs, &mut links, &mut FakeConntrack::default(), &vs, None).expect("ipvs");
    assert!(st.errors.is_empty(), "{:?}", st.errors);
    let bound: BTreeSet<IpAddr> = vs.keys().filter_map(|id| if let ServiceId::Addr { addr, .. } = id { Some(*addr) } else { None }).collect();
    let sets = proxy_agent::dataplane::ipvs::sets::listing(&proxy_agent::dataplane::ipvs::sets::compute(&d, &node.nodeport_addresses, &bound));
    pipe("ipset", &["restore"], &kpr_lab::iptables::ipset_restore(&sets));
    pipe("iptables-restore", &["--noflush"], &kpr_lab::iptables::render_ipvs_mode("10.244.0.0/16"));
}

fn pipe(cmd: &str, args: &[&str], input: &str) {
    let mut c = Command::new(cmd).args(args).stdin(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

struct Traffic {
    n: u32,
    mode: &'static str,
    rate: f64,
    p50: f64,
    p99: f64,
    errors: u64,
    profile: Option<Profile>,
}

/// Where the guest's CPUs went during one run, from `perf record -a` (cpu-clock: TCG has no
/// PMU): each symbol's share, and the shares of the work that differs between the sides.
struct Profile {
    /// ("netfilter, IPVS, conntrack, NAT", %), ("BPF programs and maps", %), ("the rest", %).
    shares: Vec<(&'static str, f64)>,
    top: Vec<(f64, String)>,
}

/// The kernel work a side adds to a connection, by symbol name. Everything else (TCP/IP,
/// sockets, scheduling, the load generator and the servers) is the same work on every side.
const PROFILE_CLASSES: [(&str, &[&str]); 2] = [
    (
        "netfilter, IPVS, conntrack, NAT",
        &["ip_vs", "ipt_", "nft_", "ip_set", "hash_ip", "bitmap_", "xt_", "nf_", "__nf_", "iptable_", "masquerade", "ipv4_conntrack"],
    ),
    ("BPF programs and maps", &["bpf_", "htab_", "__htab", "array_map", "trie_", "lpm_", "__bpf", "___bpf"]),
];

/// Runs `workload` under `perf record -a`: sampling starts before the workload does and ends
/// with it (perf's start-up, slow under emulation, is outside the window).
fn profiled(label: &str, dir: &Path, workload: Command) -> Option<Profile> {
    let data = dir.join(format!("{label}.data"));
    let mut rec = Command::new("perf");
    rec.args(["record", "-e", "cpu-clock", "-a", "-F", "999", "-o"]).arg(&data).arg("--").arg(workload.get_program()).args(workload.get_args());
    let status = rec.stdout(Stdio::null()).stderr(Stdio::null()).status().map_err(|e| eprintln!("  profile {label}: perf: {e}")).ok()?;
    if !status.success() {
        eprintln!("  profile {label}: perf record: {status}");
        return None;
    }
    let report = Command::new("perf").args(["report", "--stdio", "--no-children", "--sort", "sym", "-i"]).arg(&data).output().ok()?;
    let text = String::from_utf8_lossy(&report.stdout).into_owned();
    std::fs::write(dir.join(format!("{label}.txt")), &text).ok()?;
    let rows: Vec<(f64, String)> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let pct = w.next()?.strip_suffix('%')?.parse().ok()?;
            let _kind = w.next()?;
            Some((pct, w.collect::<Vec<_>>().join(" ")))
        })
        .collect();
    let class = |sym: &str| PROFILE_CLASSES.iter().position(|(_, prefixes)| prefixes.iter().any(|p| sym.starts_with(p)));
    // Shares of the busy time: an idle CPU's samples say nothing about a connection's cost.
    let idle = |sym: &str| sym.contains("idle") || sym.contains("safe_halt");
    let busy: f64 = rows.iter().filter(|(_, s)| !idle(s)).map(|(p, _)| p).sum::<f64>().max(1e-9);
    let mut shares: Vec<(&'static str, f64)> = PROFILE_CLASSES.iter().map(|(name, _)| (*name, 0.0)).collect();
    let mut rest = 0.0;
    for (pct, sym) in rows.iter().filter(|(_, s)| !idle(s)) {
        let pct = pct * 100.0 / busy;
        match class(sym) {
            Some(i) => shares[i].1 += pct,
            None => rest += pct,
        }
    }
    shares.push(("the rest", rest));
    let rows: Vec<(f64, String)> = rows.into_iter().filter(|(_, s)| !idle(s)).map(|(p, s)| (p * 100.0 / busy, s)).collect();
    Some(Profile { shares, top: rows.into_iter().take(8).collect() })
}

fn measure(lab: &Lab, target: &str, secs: f64, runs: usize, profile: Option<(&Path, String)>) -> (f64, f64, f64, u64, Option<Profile>) {
    // One connection first: a side that does not work says why instead of printing zeros.
    let v = lab.peer("cl", &["burst", target, "tcp", "1"]);
    if v["errors"].as_u64() != Some(0) {
        eprintln!("  {target}: {v}");
    }
    let mut rs = Vec::new();
    let (mut p50s, mut p99s, mut errors) = (Vec::new(), Vec::new(), 0);
    // One more run under perf, not counted: sampling costs the guest time.
    let prof = profile.and_then(|(dir, label)| profiled(&label, dir, lab.peer_cmd("cl", &["rate", target, &secs.to_string()])));
    for _ in 0..runs {
        let v = lab.peer("cl", &["rate", target, &secs.to_string()]);
        rs.push(v["rate"].as_f64().unwrap_or(0.0));
        p50s.push(v["p50_us"].as_f64().unwrap_or(0.0));
        p99s.push(v["p99_us"].as_f64().unwrap_or(0.0));
        errors += v["errors"].as_u64().unwrap_or(0);
    }
    (median(rs), median(p50s), median(p99s), errors, prof)
}

fn wait_ipvs(lab: &Lab, target: &str) {
    let deadline = Instant::now() + Duration::from_secs(600);
    // The sets are written after IPVS in the same sync: wait for the sync's log line too.
    while !lab.agent_log().contains("synced")
        || !sh(&format!("ip netns exec {} ipvsadm -Ln -t {target} | grep -c -- '-> 10.244' | grep -qx 3", lab.ns("node"))).status.success()
    {
        assert!(Instant::now() < deadline, "IPVS never got {target}:\n{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn cleanup(lab: &mut Lab) {
    lab.kill_agent();
    let n = lab.ns("node");
    let _ = sh(&format!("{} --netns {n} --pin-dir {} cleanup", lab.kpr.display(), lab.pins.path().display()));
    let _ = sh(&format!(
        "ip netns exec {n} sh -c 'ipvsadm -C; ip link del kube-ipvs0; printf \"*nat\\nCOMMIT\\n*filter\\nCOMMIT\\n\" | iptables-restore; ipset destroy'"
    ));
}

fn traffic(sizes: &[u32], secs: f64, runs: usize, profile_dir: Option<&Path>) -> Vec<Traffic> {
    let dir = std::env::temp_dir().join(format!("kpr-vm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut lab = Lab::build_with("kvb", &dir, LabSpec { cni: Cni::Ptp, ..LabSpec::default() });
    // The backends cannot answer the client unless its connections are masqueraded (they
    // reach the node, not the client network): every side pays for the marking it does.
    for i in 1..=3 {
        let b = lab.ns(&format!("b{i}"));
        must(&format!("ip -n {b} route del 198.18.0.0/24"));
        must(&format!("ip -n {b} route add {NODE_IP}/32 via 10.244.{i}.1"));
    }
    let me = std::env::current_exe().unwrap();
    let mut out = Vec::new();
    for &n in sizes {
        std::fs::write(dir.join("services.yaml"), manifests(n)).unwrap();
        let target = format!("{}:80", vip(n / 2));
        eprintln!("  {n} services: kube-proxy IPVS (iptables + ipset)");
        must(&format!("ip netns exec {} {} program-ipvs {}", lab.ns("node"), me.display(), dir.display()));
        let (rate, p50, p99, errors, profile) = measure(&lab, &target, secs, runs, profile_dir.map(|d| (d, format!("{n}-ipvs+iptables"))));
        out.push(Traffic { n, mode: "ipvs+iptables", rate, p50, p99, errors, profile });
        cleanup(&mut lab);
        eprintln!("  {n} services: kpr IPVS mode (BPF sets)");
        lab.agent_args = vec!["--mode".into(), "ipvs".into()];
        lab.start_agent();
        wait_ipvs(&lab, &target);
        let (rate, p50, p99, errors, profile) = measure(&lab, &target, secs, runs, profile_dir.map(|d| (d, format!("{n}-ipvs+bpf"))));
        out.push(Traffic { n, mode: "ipvs+bpf", rate, p50, p99, errors, profile });
        cleanup(&mut lab);
        eprintln!("  {n} services: kpr eBPF fast path");
        lab.agent_args = vec!["--mode".into(), "ebpf".into()];
        lab.start_agent();
        let deadline = Instant::now() + Duration::from_secs(600);
        while !lab.services().as_array().is_some_and(|a| a.iter().any(|r| r["frontend"] == target.as_str())) {
            assert!(Instant::now() < deadline, "eBPF never got {target}");
            std::thread::sleep(Duration::from_millis(500));
        }
        let (rate, p50, p99, errors, profile) = measure(&lab, &target, secs, runs, profile_dir.map(|d| (d, format!("{n}-ebpf"))));
        out.push(Traffic { n, mode: "ebpf", rate, p50, p99, errors, profile });
        cleanup(&mut lab);
        for t in out.iter().filter(|t| t.n == n) {
            println!("{:>8} {:<14} {:>10.0} {:>9.0} {:>9.0} {:>7}", t.n, t.mode, t.rate, t.p50, t.p99, t.errors);
        }
    }
    drop(lab);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("program-ipvs") {
        return program_ipvs(Path::new(&args[2]));
    }
    if args.get(1).map(String::as_str) == Some("ipvs-program") {
        let (n, pipelined) = (args[2].parse().expect("N"), args[3] == "true");
        let binding = if args[4] == "Route" { VipBinding::Route } else { VipBinding::Address };
        let bind = if args[5] == "Beside" { Bind::Beside } else { Bind::First };
        let acks = if args[6] == "Every" { Acks::Every } else { Acks::Last };
        let (bind_s, total_s) = ipvs_program(n, pipelined, binding, bind, acks);
        let change_ms = if pipelined && binding == VipBinding::Address && bind == Bind::Beside && acks == Acks::Last { ipvs_changes(n) } else { 0.0 };
        return println!("{bind_s} {total_s} {change_ms}");
    }
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let list =
        |n: &str, d: &str| -> Vec<u32> { opt(n).unwrap_or_else(|| d.into()).split(',').filter(|s| !s.is_empty()).map(|s| s.parse().expect(n)).collect() };
    let cp_sizes = list("--cp-sizes", "1000,10000");
    let tr_sizes = list("--traffic-sizes", "100,10000");
    let secs: f64 = opt("--seconds").map(|s| s.parse().unwrap()).unwrap_or(3.0);
    let runs: usize = opt("--runs").map(|s| s.parse().unwrap()).unwrap_or(3);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    println!("machine: QEMU guest (TCG, emulated CPU: compare ratios only), Linux {} | {ncpu} CPUs", kernel.trim());

    println!("\ncontrol plane: N services x 10 endpoints from nothing; 1 change = one service's endpoints replaced (median of 5)");
    println!("1-by-1: one netlink request at a time, kube-ipvs0's addresses bound first (kpr before pipelining; kube-proxy too goes one at a time).");
    println!("every ack: pipelined (up to 128 requests per sendmsg), the addresses bound beside the IPVS writes on a thread of their own,");
    println!("every request asking for an ACK (the previous release); its bind: the binding's own time, overlapping.");
    println!("beside: the same, with only each datagram's last request asking for an ACK (failures are answered anyway; the default).");
    println!("routes: the same with the VIPs as local routes (--ipvs-vip-binding route). Each run in a fresh network namespace.");
    println!(
        "{:>8} {:>13} {:>14} {:>10} {:>11} {:>9} {:>11} {:>12} {:>10} {:>9} {:>13} {:>13} {:>13} {:>10} {:>11}",
        "services",
        "1-by-1 (s)",
        "every ack (s)",
        "its bind",
        "beside (s)",
        "its bind",
        "vs 1-by-1",
        "vs every ack",
        "routes (s)",
        "its bind",
        "IPVS 1 chg ms",
        "maps prog (s)",
        "maps 1 chg ms",
        "prog ratio",
        "BPF map MiB"
    );
    let mut cps = Vec::new();
    for &n in &cp_sizes {
        let c = control_plane(n);
        println!(
            "{:>8} {:>13.2} {:>14.2} {:>10.2} {:>11.2} {:>9.2} {:>10.2}x {:>11.2}x {:>10.2} {:>9.2} {:>13.2} {:>13.2} {:>13.2} {:>9.1}x {:>11.1}",
            c.n,
            c.ipvs_one_at_a_time_s,
            c.ipvs_every_ack_s,
            c.ipvs_every_ack_bind_s,
            c.ipvs_program_s,
            c.ipvs_bind_s,
            c.ipvs_one_at_a_time_s / c.ipvs_program_s.max(1e-9),
            c.ipvs_every_ack_s / c.ipvs_program_s.max(1e-9),
            c.ipvs_routes_program_s,
            c.ipvs_routes_bind_s,
            c.ipvs_change_ms,
            c.bpf_program_s,
            c.bpf_change_ms,
            c.ipvs_program_s / c.bpf_program_s.max(1e-9),
            c.bpf_map_bytes as f64 / 1048576.0
        );
        cps.push(c);
    }
    if let Some(c) = cps.iter().find(|c| c.n == 30_000) {
        kpr_bench::print_goal("IPVS mode programs 30,000 x 10 in the guest in < 60 s", &format!("{:.1} s (beside)", c.ipvs_program_s), c.ipvs_program_s < 60.0);
    }

    let mut tr = Vec::new();
    if !tr_sizes.is_empty() {
        println!("\ntraffic: new TCP connections from outside the cluster CIDR to a ClusterIP (masqueraded), {secs} s x {runs} runs, medians");
        println!("{:>8} {:<14} {:>10} {:>9} {:>9} {:>7}", "services", "mode", "conn/s", "p50 µs", "p99 µs", "errors");
        let profile_dir = opt("--profile").map(PathBuf::from);
        if let Some(d) = &profile_dir {
            std::fs::create_dir_all(d).unwrap();
            // BPF programs by name in the profile.
            let _ = std::fs::write("/proc/sys/net/core/bpf_jit_kallsyms", "1");
        }
        tr = traffic(&tr_sizes, secs, runs, profile_dir.as_deref());
        println!();
        for &n in &tr_sizes {
            let get = |m: &str| tr.iter().find(|t| t.n == n && t.mode == m).map(|t| t.rate).unwrap_or(0.0);
            let base = get("ipvs+iptables").max(1e-9);
            println!(
                "{n:>8} services: kpr IPVS mode {:.2}x kube-proxy IPVS; eBPF fast path {:.2}x kube-proxy IPVS",
                get("ipvs+bpf") / base,
                get("ebpf") / base
            );
            if n == 100 || n == 10_000 {
                let x = get("ebpf") / base;
                // The emulated guest's rates move by tens of percent between short runs.
                let short =
                    if secs * (runs as f64) < 9.0 { format!(" (only {runs} run(s) of {secs} s: a smoke figure, not a measure)") } else { String::new() };
                kpr_bench::print_goal(&format!("eBPF fast path >= 1.3x kube-proxy's IPVS mode at {n} services (guest)"), &format!("{x:.2}x{short}"), x >= 1.3);
            }
        }
        if tr.iter().any(|t| t.profile.is_some()) {
            println!("\nwhere the guest's CPUs go during a run (perf record -a, cpu-clock; one extra run per side, not in the rates above):");
            println!("{:>8} {:<14} {:>12} {:>12} {:>10}  top symbols", "services", "mode", "nf/IPVS/NAT", "BPF", "the rest");
            for t in &tr {
                let Some(p) = &t.profile else { continue };
                let top: Vec<String> = p.top.iter().take(4).map(|(pct, s)| format!("{s} {pct:.1}%")).collect();
                println!("{:>8} {:<14} {:>11.1}% {:>11.1}% {:>9.1}%  {}", t.n, t.mode, p.shares[0].1, p.shares[1].1, p.shares[2].1, top.join(", "));
            }
            for &n in &tr_sizes {
                let share = |m: &str| tr.iter().find(|t| t.n == n && t.mode == m).and_then(|t| t.profile.as_ref()).map(|p| p.shares[0].1 + p.shares[1].1);
                if let (Some(kp), Some(fast)) = (share("ipvs+iptables"), share("ebpf")) {
                    // Amdahl: a connection costs the same TCP work C on both sides plus the
                    // side's own share s: T = C / (1 - s), so T_kp / T_ebpf = (1 - s_ebpf) / (1 - s_kp).
                    let (kp, fast) = (kp / 100.0, fast / 100.0);
                    println!(
                        "{n:>8} services: netfilter/IPVS/BPF work is {:.1}% of busy CPU with kube-proxy's IPVS, {:.1}% with the fast path: predicted ratio {:.2}x; ceiling (a fast path costing nothing) {:.2}x",
                        kp * 100.0,
                        fast * 100.0,
                        (1.0 - fast) / (1.0 - kp).max(1e-9),
                        1.0 / (1.0 - kp).max(1e-9)
                    );
                }
            }
        }
    }
    if let Some(path) = opt("--json") {
        let cp: Vec<_> = cps.iter().map(|c| serde_json::json!({"services": c.n, "endpoints_per_service": 10, "ipvs_one_at_a_time_s": c.ipvs_one_at_a_time_s, "ipvs_every_ack_s": c.ipvs_every_ack_s, "ipvs_every_ack_bind_s": c.ipvs_every_ack_bind_s, "ipvs_program_s": c.ipvs_program_s, "ipvs_bind_s": c.ipvs_bind_s, "ipvs_routes_program_s": c.ipvs_routes_program_s, "ipvs_routes_bind_s": c.ipvs_routes_bind_s, "ipvs_one_change_ms": c.ipvs_change_ms, "bpf_program_s": c.bpf_program_s, "bpf_one_change_ms": c.bpf_change_ms, "bpf_map_memlock_bytes": c.bpf_map_bytes})).collect();
        let t: Vec<_> = tr
            .iter()
            .map(|t| serde_json::json!({"services": t.n, "mode": t.mode, "conn_per_s": t.rate, "p50_us": t.p50, "p99_us": t.p99, "errors": t.errors}))
            .collect();
        let doc = serde_json::json!({"kernel": kernel.trim(), "guest": "QEMU TCG", "seconds": secs, "runs": runs, "control_plane": cp, "traffic": t});
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        println!("wrote {path}");
    }
    if let Some(path) = opt("--svg") {
        let series = [("ipvs+iptables", "#d9534f"), ("ipvs+bpf", "#f0ad4e"), ("ebpf", "#2b7bb9")];
        let by: BTreeMap<(u32, &str), f64> = tr.iter().map(|t| ((t.n, t.mode), t.rate)).collect();
        let svg = kpr_bench::chart::bars("IPVS guest: new TCP connections per second through a ClusterIP (higher is better)", &tr_sizes, &series, |n, m| {
            by.get(&(n, m)).copied()
        });
        std::fs::write(&path, svg).unwrap();
        println!("wrote {path}");
    }
}
