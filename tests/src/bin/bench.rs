//! kpr-bench: per-packet cost of the fast path in the running kernel (BPF_PROG_TEST_RUN), at
//! several service counts, side by side with a program that only passes the packet (the floor
//! on this machine). Prints a table and writes JSON. Figures, never assertions on time.
//!
//!   kpr-bench [--sizes 1,1000,10000,100000] [--repeat 1000000] [--new-flows 2000] [--runs 5]
//!             [--json FILE]
use std::{collections::BTreeMap, io::Write, time::Instant};

use aya::programs::{TestRun, TestRunOptions};
use kpr_tests::{bench::median, datapath_config, packet::{Frame, SYN, ACK}, PinDir};
use proxy_agent::{
    kernel::{Capacities, Datapath, KernelMaps},
    model::DesiredState,
    sync::Syncer,
};
use proxy_common::prog_names;

fn vip(i: u32) -> std::net::IpAddr {
    let n = 0x0a60_0000u32 + i; // 10.96.0.0 + i
    std::net::IpAddr::from(n.to_be_bytes())
}

/// N services on 3 endpoints each, spread over 60,000 addresses of 10.244.0.0/16.
fn desired(n: u32) -> DesiredState {
    kpr_tests::bench::clusterips(n, 3, vip, 0x0af4_0002, 60_000)
}

#[derive(Clone, Copy)]
enum Prog {
    Tc,
    Xdp,
    TcPass,
    XdpPass,
    /// IPVS mode's kube-proxy set matching (kpr_tc_ipset).
    TcIpset,
}

impl Prog {
    fn name(self) -> &'static str {
        match self {
            Prog::Tc => "tc fast path",
            Prog::Xdp => "xdp fast path",
            Prog::TcPass => "tc pass (floor)",
            Prog::XdpPass => "xdp pass (floor)",
            Prog::TcIpset => "tc ipset (ipvs)",
        }
    }
}

fn run(dp: &mut Datapath, p: Prog, frame: &[u8], repeat: u32) -> f64 {
    let mut out = vec![0u8; 256];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat, ..Default::default() };
    let r = match p {
        Prog::Tc => dp.classifier(prog_names::TC_INGRESS).unwrap().test_run(opts),
        Prog::TcPass => dp.classifier(prog_names::TC_PASS).unwrap().test_run(opts),
        Prog::TcIpset => dp.classifier(prog_names::TC_IPSET).unwrap().test_run(opts),
        Prog::Xdp => dp.xdp(prog_names::XDP_INGRESS).unwrap().test_run(opts),
        Prog::XdpPass => dp.xdp(prog_names::XDP_PASS).unwrap().test_run(opts),
    }
    .expect("BPF_PROG_TEST_RUN");
    r.duration.as_nanos() as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let sizes: Vec<u32> = opt("--sizes").unwrap_or_else(|| "1,1000,10000,100000".into()).split(',').map(|s| s.parse().expect("--sizes")).collect();
    let repeat: u32 = opt("--repeat").map(|s| s.parse().unwrap()).unwrap_or(1_000_000);
    let new_flows: u32 = opt("--new-flows").map(|s| s.parse().unwrap()).unwrap_or(2000);
    let runs: usize = opt("--runs").map(|s| s.parse().unwrap()).unwrap_or(5);
    let json_out = opt("--json");

    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())).unwrap_or_default();
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    println!("machine: Linux {} | {cpu} | {ncpu} CPUs", kernel.trim());
    println!("method: BPF_PROG_TEST_RUN, 54-byte TCP frame; established = one flow repeated {repeat}x (median of {runs} runs); new flow = {new_flows} distinct SYNs, 1 run each (mean)");

    let pins = PinDir::new("bench");
    let max = *sizes.iter().max().unwrap();
    let caps = Capacities {
        services: (2 * max + 16).max(1024),
        frontends: (2 * max + 16).max(1024),
        backends: 65_536,
        slots: (6 * max + 64).max(4096),
        conntrack: 1_048_576,
    };
    let mut dp = Datapath::load(pins.path(), caps).expect("load");
    dp.load_ipset().expect("load the IPVS-mode set matching");
    let mut maps = KernelMaps::open(pins.path()).unwrap();
    let mut set_maps = proxy_agent::sets::KernelSetMaps::open(pins.path()).unwrap();
    let mut syncer = Syncer::new(caps.services, 16);
    let cfg = datapath_config("192.0.2.1", Some(("10.244.0.0", 16)));

    let mut results: Vec<BTreeMap<String, serde_json::Value>> = Vec::new();
    println!("\n{:>9} {:<18} {:>14} {:>10} {:>14} {:>10}", "services", "program", "established ns", "x floor", "new flow ns", "x floor");
    let mut flow_port = 1024u16;
    for &n in &sizes {
        let t = Instant::now();
        let d = desired(n);
        let st = syncer.sync(&mut maps, &d, cfg).expect("sync");
        // The same services as kube-proxy's IPVS-mode sets (CLUSTER-IP, LOOP-BACK, IPVS-IPS).
        let bound = d.frontends.keys().map(|k| k.ip).collect();
        let sets = proxy_agent::sets::compute(&d, &["192.0.2.1".parse().unwrap()], &bound);
        proxy_agent::sets::sync(&mut set_maps, &sets).expect("sets");
        eprintln!("  programmed {n} services ({} frontends, {} map writes) in {:.2}s", st.frontends, st.writes + st.deletes, t.elapsed().as_secs_f64());
        // The service hit is the last one programmed: nothing favours it in the hash table.
        let target = vip(n - 1).to_string();
        let mut floor_est = BTreeMap::new();
        let mut floor_new = BTreeMap::new();
        for p in [Prog::TcPass, Prog::XdpPass, Prog::Tc, Prog::Xdp, Prog::TcIpset] {
            let est_frame = Frame::tcp("10.244.200.1", 999, &target, 80, ACK).bytes();
            // Prime the flow (the first packet creates it).
            run(&mut dp, p, &Frame::tcp("10.244.200.1", 999, &target, 80, SYN).bytes(), 1);
            let est = median((0..runs).map(|_| run(&mut dp, p, &est_frame, repeat)).collect());
            let mut total = 0.0;
            for _ in 0..new_flows {
                flow_port = if flow_port == u16::MAX { 1024 } else { flow_port + 1 };
                let src = if flow_port == 1024 { "10.244.201.1" } else { "10.244.200.2" };
                total += run(&mut dp, p, &Frame::tcp(src, flow_port, &target, 80, SYN).bytes(), 1);
            }
            let newf = total / f64::from(new_flows);
            let is_tc = matches!(p, Prog::Tc | Prog::TcPass | Prog::TcIpset);
            let (fe, fnw) = match p {
                Prog::TcPass | Prog::XdpPass => {
                    floor_est.insert(is_tc, est);
                    floor_new.insert(is_tc, newf);
                    (est, newf)
                }
                _ => (floor_est[&is_tc], floor_new[&is_tc]),
            };
            println!("{n:>9} {:<18} {est:>14.1} {:>10.2} {newf:>14.1} {:>10.2}", p.name(), est / fe, newf / fnw);
            let _ = std::io::stdout().flush();
            let mut row = BTreeMap::new();
            row.insert("services".into(), n.into());
            row.insert("program".into(), p.name().into());
            row.insert("established_ns".into(), est.into());
            row.insert("established_x_floor".into(), (est / fe).into());
            row.insert("new_flow_ns".into(), newf.into());
            row.insert("new_flow_x_floor".into(), (newf / fnw).into());
            results.push(row);
        }
        // Flows of this size must not help the next one.
        for (k, _) in proxy_agent::maps::DatapathMaps::conntrack(&maps).unwrap() {
            let _ = proxy_agent::maps::DatapathMaps::del_conntrack(&mut maps, k);
        }
    }
    // Flatness: each program's established cost at the largest size vs the smallest.
    let (lo, hi) = (sizes[0], max);
    for p in ["tc fast path", "xdp fast path", "tc ipset (ipvs)"] {
        let get = |n: u32| results.iter().find(|r| r["services"] == n && r["program"] == p).map(|r| r["established_ns"].as_f64().unwrap());
        if let (Some(a), Some(b)) = (get(lo), get(hi)) {
            println!("{p}: established cost at {hi} services is {:.2}x that at {lo}", b / a);
        }
    }
    if let Some(path) = json_out {
        let doc = serde_json::json!({"kernel": kernel.trim(), "cpu": cpu, "cpus": ncpu, "repeat": repeat, "new_flows": new_flows, "runs": runs, "results": results});
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        println!("wrote {path}");
    }
}
