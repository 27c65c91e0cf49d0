//! kpr-scale: the control plane at scale, through the whole pipeline. The real `kpr run`
//! watches an in-process API server holding N Services × E endpoints and programs real BPF
//! maps. Prints the initial sync time (first watch event to the last map write, as the agent
//! logs it), one change's latency from the API write to the kernel map (p50/p99 over several
//! changes, measured by reading the map), and the agent's peak RSS. Figures, not assertions.
//!
//!   kpr-scale [--services 10000] [--endpoints 10] [--changes 50] [--wrap heaptrack] [--keep]
use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use kpr_lab::{
    fake_api::{FakeApi, Kind},
    PinDir,
};
use serde_json::json;

fn service(i: u32) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": format!("s{i}"), "namespace": "scale"},
        "spec": {"clusterIP": format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256), "ports": [{"name": "http", "port": 80}]}})
}

fn slice(i: u32, endpoints: u32, generation: u32) -> serde_json::Value {
    let eps: Vec<_> = (0..endpoints)
        .map(|j| {
            let n = i * endpoints + j + generation * 7;
            json!({"addresses": [format!("10.{}.{}.{}", 128 + (n / 65536) % 64, (n / 256) % 256, n % 256)], "conditions": {"ready": true}, "nodeName": "n1"})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("s{i}-1"), "namespace": "scale", "labels": {"kubernetes.io/service-name": format!("s{i}")}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}], "endpoints": eps})
}

fn vm_hwm_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn frontend_key(i: u32) -> proxy_common::ServiceKey {
    let vip: std::net::IpAddr = service(i)["spec"]["clusterIP"].as_str().unwrap().parse().unwrap();
    proxy_common::ServiceKey::new(vip, 80, proxy_common::PROTO_TCP, proxy_common::SCOPE_INTERNAL)
}

/// Whether the kernel's service map holds all `n` frontends. The harness shares the agent's
/// two cores, so it looks cheaply: 256 of the keys spread over the services first, and counts
/// the whole map (batched reads, a few system calls) only once those are all there. Walking
/// the map key by key every poll took about a core from the sync it was timing.
fn all_frontends_in(pins: &PinDir, n: u32) -> bool {
    use aya::maps::{HashMap, IterableMap, Map, MapData};
    let Ok(data) = MapData::from_pin(pins.path().join(proxy_common::map_names::SERVICES)) else {
        return false;
    };
    let Ok(services): Result<HashMap<MapData, proxy_common::ServiceKey, proxy_common::ServiceValue>, _> = Map::from_map_data(data).unwrap().try_into() else {
        return false;
    };
    let step = (n / 256).max(1);
    if !(0..n).step_by(step as usize).chain([n - 1]).all(|i| services.get(&frontend_key(i), 0).is_ok()) {
        return false;
    }
    let fd = services.map().fd();
    let (mut count, mut cursor) = (0, None);
    loop {
        let Ok((batch, next)) =
            proxy_agent::dataplane::ebpf::bpf_batch::lookup_batch::<proxy_common::ServiceKey, proxy_common::ServiceValue>(fd, cursor, 16_384)
        else {
            return false;
        };
        count += batch.len();
        match next {
            Some(c) => cursor = Some(c),
            None => return count >= n as usize,
        }
    }
}

/// The agent, killed when the run ends, also when an assertion fails on the way (it would
/// otherwise keep running, and syncing, after the harness is gone).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |n: &str, d: u32| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).map(|s| s.parse().unwrap()).unwrap_or(d);
    let (n, e, changes) = (opt("--services", 10_000).max(1), opt("--endpoints", 10), opt("--changes", 50));
    // Two threads for the stand-in API server: it serves the Service and EndpointSlice lists
    // side by side, as an API server does, instead of being the initial sync's bottleneck.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let api = rt.block_on(FakeApi::start());
    for i in 0..n {
        api.apply(Kind::Service, service(i));
        api.apply(Kind::Slice, slice(i, e, 0));
    }
    api.apply(Kind::Node, json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}));
    let pins = PinDir::new("scale");
    let dir = std::env::temp_dir().join(format!("kpr-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    api.kubeconfig(&dir.join("kubeconfig"));
    let log = dir.join("agent.log");
    let start = Instant::now();
    // `--wrap heaptrack` (or another command) runs the agent under it, for a heap profile.
    let wrap = args.iter().position(|a| a == "--wrap").and_then(|i| args.get(i + 1)).cloned();
    let mut cmd = match &wrap {
        Some(w) => {
            let mut c = Command::new(w);
            c.arg(kpr_lab::sibling_bin("kpr"));
            c
        }
        None => Command::new(kpr_lab::sibling_bin("kpr")),
    };
    let mut agent = KillOnDrop(
        cmd.arg("--pin-dir")
            .arg(pins.path())
            .args(["run", "--kubeconfig"])
            .arg(dir.join("kubeconfig"))
            .args([
                "--node-name",
                "n1",
                "--node-ip",
                "192.0.2.1",
                "--cgroup",
                "none",
                "--healthz-bind-address",
                "",
                "--metrics-bind-address",
                "",
                "--min-sync-period",
                "0",
            ])
            // Room for what the cluster needs: the capacities are flags.
            .args(["--max-backends", &(n * e + n * e / 4).max(proxy_common::limits::MAX_BACKENDS).to_string()])
            // Room for two frontends (service ids) a port, as under externalTrafficPolicy Local.
            .args(["--max-services", &(2 * n + n / 2).max(proxy_common::limits::MAX_SERVICES).to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start kpr"),
    );
    // Initial sync: until the maps hold every frontend (one a ClusterIP port: both scopes).
    let want = n as usize;
    loop {
        if all_frontends_in(&pins, n) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(300), "initial sync did not finish; see {}", log.display());
        std::thread::sleep(Duration::from_millis(5));
    }
    let initial = start.elapsed();
    // The agent logs its sync's duration after the last write, which this loop may see first.
    let synced_ms = || -> Vec<f64> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("synced"))
            .filter_map(|l| l.split("ms=").nth(1)?.split_whitespace().next()?.parse().ok())
            .collect()
    };
    let wait = Instant::now();
    let mut logged = synced_ms();
    while logged.is_empty() && wait.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
        logged = synced_ms();
    }
    println!("services: {n} x {e} endpoints ({} frontends, {} slots)", want, want * e as usize);
    println!(
        "initial sync: {:.2} s from agent start to all frontends in the kernel (the sync itself: {:.0} ms)",
        initial.as_secs_f64(),
        logged.first().copied().unwrap_or(f64::NAN)
    );

    // One change at a time: a service's endpoints replaced; latency until its slot 1 changed.
    let mut lat = Vec::new();
    for c in 0..changes {
        let i = (c * 97) % n;
        let key = frontend_key(i);
        let maps = {
            use aya::maps::{HashMap, Map, MapData};
            let svc: HashMap<MapData, proxy_common::ServiceKey, proxy_common::ServiceValue> =
                Map::from_map_data(MapData::from_pin(pins.path().join(proxy_common::map_names::SERVICES)).unwrap()).unwrap().try_into().unwrap();
            let slots: HashMap<MapData, proxy_common::SlotKey, u32> =
                Map::from_map_data(MapData::from_pin(pins.path().join(proxy_common::map_names::SLOTS)).unwrap()).unwrap().try_into().unwrap();
            (svc, slots)
        };
        let read = || -> Option<u32> {
            let id = maps.0.get(&key, 0).ok()?.service_id;
            maps.1.get(&proxy_common::SlotKey { service_id: id, slot: 1 }, 0).ok()
        };
        let old = read();
        let t = Instant::now();
        api.apply(Kind::Slice, slice(i, e, c + 1));
        loop {
            if read() != old {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "change {c} never reached the kernel");
            std::hint::spin_loop();
        }
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(20));
    }
    let hwm = vm_hwm_kb(agent.0.id());
    let maps_bytes = kpr_bench::bpf_map_memlock(&agent.0.id().to_string());
    if wrap.is_some() {
        // The agent under the wrapper: a graceful stop, so the profiler writes its data.
        let _ = Command::new("pkill").args(["-TERM", "-f"]).arg(pins.path()).status();
        let _ = agent.0.wait();
    }
    drop(agent);
    let p99 = percentile(&mut lat.clone(), 0.99);
    println!(
        "one change, API write -> kernel map: p50 {:.1} ms, p99 {p99:.1} ms, max {:.1} ms ({changes} changes)",
        percentile(&mut lat.clone(), 0.5),
        percentile(&mut lat, 1.0)
    );
    // VmHWM is in KiB; the goals are in MB (10^6 bytes): the same memory reads 4.9% more in MB
    // than in MiB.
    let rss_mb = hwm as f64 * 1024.0 / 1e6;
    println!("agent peak RSS: {rss_mb:.1} MB ({:.1} MiB); BPF maps (kernel memlock, map info): {:.1} MiB", hwm as f64 / 1024.0, maps_bytes as f64 / 1048576.0);
    // The control plane's goals, at the sizes they name.
    match (n, e) {
        (100_000, 10) => {
            let s = initial.as_secs_f64();
            kpr_bench::print_goal("initial sync < 5 s at 100,000 x 10", &format!("{s:.2} s"), s < 5.0);
            kpr_bench::print_goal("one change at p99 < 50 ms at 100,000 x 10", &format!("{p99:.1} ms"), p99 < 50.0);
            kpr_bench::print_goal("agent RSS < 250 MB at 100,000 x 10", &format!("{rss_mb:.1} MB"), rss_mb < 250.0);
        }
        (10_000, 10) => kpr_bench::print_goal("agent RSS < 100 MB at 10,000 x 10", &format!("{rss_mb:.1} MB"), rss_mb < 100.0),
        _ => {}
    }
    let inc: Vec<f64> = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("synced") && l.contains("full=false"))
        .filter_map(|l| l.split("ms=").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect();
    if !inc.is_empty() {
        println!(
            "incremental sync inside the agent: p50 {:.1} ms, p99 {:.1} ms ({} syncs)",
            percentile(&mut inc.clone(), 0.5),
            percentile(&mut inc.clone(), 0.99),
            inc.len()
        );
    }
    // `--keep` leaves the agent's log for a look at where its time went.
    if args.iter().any(|a| a == "--keep") {
        println!("agent log: {}", log.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
