//! kpr-bench: per-packet cost of the fast path in the running kernel (BPF_PROG_TEST_RUN), at
//! several service counts, side by side with a program that only passes the packet (the floor
//! on this machine). Prints a table and writes JSON. Figures, never assertions on time.
//!
//!   kpr-bench [--sizes 1,1000,10000,100000] [--repeat 1000000] [--new-flows 2000] [--runs 5]
//!             [--json FILE]
use std::{collections::BTreeMap, io::Write, net::Ipv4Addr, time::Instant};

use aya::{
    maps::{HashMap as AyaHashMap, MapData},
    programs::{TestRun, TestRunOptions},
};
use kpr_bench::{median, Spread};
use kpr_lab::{
    datapath_config,
    packet::{frame6, Frame, ACK, SYN, TCP},
    PinDir,
};
use proxy_agent::{
    dataplane::ebpf::kernel::{Capacities, Datapath},
    dataplane::ebpf::kernel_maps::{Buckets, Hint, KernelMaps},
    dataplane::ebpf::sync::Syncer,
    model::{BackendKey, DesiredState, Frontend, FrontendKey, Protocol},
};
use proxy_common::{
    counter, map_names, prog_names, CtBucket, CtBucket6, CtKey, CtKey6, CtValue, CtValue6, DatapathConfig, CFG_F_NO_FLOW_CACHE, CT_DIR_EGRESS, CT_DIR_INGRESS,
};

fn vip(i: u32) -> std::net::IpAddr {
    let n = 0x0a60_0000u32 + i; // 10.96.0.0 + i
    std::net::IpAddr::from(n.to_be_bytes())
}

/// The IPv6 service the IPv6 rows hit (a clusterIP a router sends to the node: the uplink's
/// kpr_tc_ingress6 serves it as it serves IPv6 NodePorts and LB IPs), on 3 endpoints.
const VIP6: &str = "fd00:96::1";
const BACKENDS6: [&str; 3] = ["fd00:244::2", "fd00:244::3", "fd00:244::4"];
/// A client outside the node.
const CLIENT6: &str = "2001:db8:c::1";

/// N services on 3 endpoints each, spread over 60,000 addresses of 10.244.0.0/16, the IPv6
/// one, and UDP on the last one's address and port (a new UDP flow starts in the embryonic table, as a TCP one).
fn desired(n: u32) -> DesiredState {
    let mut d = kpr_bench::clusterips(n, 3, vip, 0x0af4_0002, 60_000);
    let backends = BACKENDS6.iter().map(|b| BackendKey { ip: b.parse().unwrap(), port: 8080, proto: Protocol::Tcp }).collect();
    kpr_bench::set_clusterip(&mut d, n, VIP6.parse().unwrap(), backends);
    let (key, fe) = d.frontends.iter().find(|(k, _)| k.ip == vip(n - 1)).map(|(k, f)| (*k, f.clone())).expect("the last service");
    let udp = Frontend { backends: fe.backends.iter().map(|b| BackendKey { proto: Protocol::Udp, ..b }).collect(), ..fe };
    d.frontends.insert(FrontendKey { proto: Protocol::Udp, ..key }, udp);
    d
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Prog {
    Tc,
    TcEgress,
    Xdp,
    /// The fast path with its flow cache off: every established packet probes conntrack.
    TcNoCache,
    TcEgressNoCache,
    XdpNoCache,
    TcPass,
    XdpPass,
    /// IPVS mode's kube-proxy set matching (kpr_tc_ipset).
    TcIpset,
    /// IPv6 from outside: the uplink's kpr_tc_ingress6, and kpr_tc_egress (the reply).
    Tc6,
    TcEgress6,
}

impl Prog {
    fn name(self) -> &'static str {
        match self {
            Prog::Tc => "tc ingress",
            Prog::TcEgress => "tc egress",
            Prog::Xdp => "xdp ingress",
            Prog::TcNoCache => "tc in, no cache",
            Prog::TcEgressNoCache => "tc eg, no cache",
            Prog::XdpNoCache => "xdp in, no cache",
            Prog::TcPass => "tc pass (floor)",
            Prog::XdpPass => "xdp pass (floor)",
            Prog::TcIpset => "tc ipset (ipvs)",
            Prog::Tc6 => "tc ingress6",
            Prog::TcEgress6 => "tc egress (IPv6)",
        }
    }
    fn fast_path(self) -> bool {
        !matches!(self, Prog::TcPass | Prog::XdpPass | Prog::TcIpset)
    }
    fn egress(self) -> bool {
        matches!(self, Prog::TcEgress | Prog::TcEgressNoCache | Prog::TcEgress6)
    }
    fn no_cache(self) -> bool {
        matches!(self, Prog::TcNoCache | Prog::TcEgressNoCache | Prog::XdpNoCache)
    }
    fn tc(self) -> bool {
        !matches!(self, Prog::Xdp | Prog::XdpNoCache | Prog::XdpPass)
    }
}

/// The cost of `n` new flows' first packets through `p` (mean and percentiles), each from the
/// next client port (`port`, wrapping to 1024): `frame` builds the packet for a port.
fn first_packets(dp: &mut Datapath, p: Prog, n: u32, port: &mut u16, frame: impl Fn(u16) -> Vec<u8>) -> Spread {
    let costs = (0..n)
        .map(|_| {
            *port = if *port == u16::MAX { 1024 } else { *port + 1 };
            run(dp, p, &frame(*port), 1).0
        })
        .collect();
    Spread::of(costs)
}

/// One BPF_PROG_TEST_RUN: the kernel's mean time per repetition, and the packet after the last.
fn run(dp: &mut Datapath, p: Prog, frame: &[u8], repeat: u32) -> (f64, Vec<u8>) {
    let mut out = vec![0u8; 256];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat, ..Default::default() };
    let r = match p {
        Prog::Tc | Prog::TcNoCache => dp.classifier(prog_names::TC_INGRESS).unwrap().test_run(opts),
        Prog::TcEgress | Prog::TcEgressNoCache => dp.classifier(prog_names::TC_EGRESS).unwrap().test_run(opts),
        Prog::TcPass => dp.classifier(prog_names::TC_PASS).unwrap().test_run(opts),
        Prog::TcIpset => dp.classifier(prog_names::TC_IPSET).unwrap().test_run(opts),
        Prog::Tc6 => dp.classifier(prog_names::TC_INGRESS6).unwrap().test_run(opts),
        Prog::TcEgress6 => dp.classifier(prog_names::TC_EGRESS).unwrap().test_run(opts),
        Prog::Xdp | Prog::XdpNoCache => dp.xdp(prog_names::XDP_INGRESS).unwrap().test_run(opts),
        Prog::XdpPass => dp.xdp(prog_names::XDP_PASS).unwrap().test_run(opts),
    }
    .expect("BPF_PROG_TEST_RUN");
    out.truncate(r.data_size_out as usize);
    (r.duration.as_nanos() as f64, out)
}

fn addr(raw: u32) -> Ipv4Addr {
    Ipv4Addr::from(raw.to_ne_bytes())
}

fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Vec<u8> {
    Frame { src, dst, ..Frame::tcp("0.0.0.0", sport, "0.0.0.0", dport, flags) }.bytes()
}

/// The (src, sport, dst, dport) of a frame.
fn tuple(f: &[u8]) -> (Ipv4Addr, u16, Ipv4Addr, u16) {
    let p = kpr_lab::packet::parse(f);
    (p.src, p.sport, p.dst, p.dport)
}

/// BPF_PROG_TEST_RUN runs the program `repeat` times on one buffer, so from the second run on
/// it sees the packet the first one rewrote. To time a conntrack hit on every repetition, the
/// measured entry gets a mirror keyed by its rewritten tuple (same hook, same role) that
/// rewrites it back: the packet alternates between the two tuples, and every repetition is a
/// hit with a full NAT rewrite (address and port, L3 and L4 checksums). Returns the frame that
/// hits `key`.
fn ping_pong(ct: &mut AyaHashMap<MapData, CtKey, CtValue>, hint: &Hint<CtBucket>, key: CtKey) -> Vec<u8> {
    let v = ct.get(&key, 0).expect("the measured entry is assured");
    let mirror = CtKey { saddr: v.new_saddr, daddr: v.new_daddr, sport: v.new_sport, dport: v.new_dport, ..key };
    let back = CtValue { new_saddr: key.saddr, new_daddr: key.daddr, new_sport: key.sport, new_dport: key.dport, ..v };
    hint.noting(&mirror, || ct.insert(mirror, back, 0)).expect("insert the mirror");
    tcp(addr(key.saddr), u16::from_be(key.sport), addr(key.daddr), u16::from_be(key.dport), ACK)
}

/// `ping_pong` for an IPv6 entry.
fn ping_pong6(ct: &mut AyaHashMap<MapData, CtKey6, CtValue6>, hint: &Hint<CtBucket6>, key: CtKey6) -> Vec<u8> {
    let v = ct.get(&key, 0).expect("the measured IPv6 entry");
    let mirror = CtKey6 { saddr: v.new_saddr, daddr: v.new_daddr, sport: v.new_sport, dport: v.new_dport, ..key };
    let back = CtValue6 { new_saddr: key.saddr, new_daddr: key.daddr, new_sport: key.sport, new_dport: key.dport, ..v };
    hint.noting(&mirror, || ct.insert(mirror, back, 0)).expect("insert the mirror");
    let a = |w: [u32; 4]| proxy_common::user::words_addr(w).to_string();
    frame6(&a(key.saddr), &a(key.daddr), TCP, u16::from_be(key.sport), u16::from_be(key.dport), ACK, &[])
}

/// The IPv6 rows' frames: a flow from outside through kpr_tc_ingress6 (its SYN, the backend's
/// SYN-ACK at egress, the client's ACK, which makes it assured), its two entries given mirrors,
/// both IPv6 tables emptied first (the earlier size's flows must not help, or fill, this one's).
/// Returns (forward, reply) frames.
fn ipv6_flow(dp: &mut Datapath, ct6: &mut AyaHashMap<MapData, CtKey6, CtValue6>, hint6: &Hint<CtBucket6>, ct6_new: &Buckets<CtBucket6>) -> (Vec<u8>, Vec<u8>) {
    for (k, _) in ct6.iter().filter_map(Result::ok).collect::<Vec<_>>() {
        let _ = ct6.remove(&k);
    }
    for (k, _) in ct6_new.read_all() {
        let _ = ct6_new.delete_if(&k, |_| true);
    }
    let (_, fwd) = run(dp, Prog::Tc6, &frame6(CLIENT6, VIP6, TCP, 999, 80, SYN, &[]), 1);
    let f = kpr_lab::packet::parse6(&fwd);
    run(dp, Prog::TcEgress6, &frame6(&f.dst.to_string(), CLIENT6, TCP, f.dport, f.sport, SYN | ACK, &[]), 1);
    run(dp, Prog::Tc6, &frame6(CLIENT6, VIP6, TCP, 999, 80, ACK, &[]), 1);
    let entries: Vec<(CtKey6, CtValue6)> = ct6.iter().filter_map(Result::ok).collect();
    let of = |dir: u8| entries.iter().find(|(k, _)| k.dir == dir).expect("the primed IPv6 flow").0;
    (ping_pong6(ct6, hint6, of(CT_DIR_INGRESS)), ping_pong6(ct6, hint6, of(CT_DIR_EGRESS)))
}

/// Deletes every flow, and every CPU's cached copy.
fn clear_conntrack(maps: &mut KernelMaps) {
    let tables = proxy_agent::dataplane::ebpf::maps::DatapathMaps::conntrack_mut(maps);
    for table in proxy_agent::dataplane::ebpf::maps::Table::ALL {
        for (k, v) in tables.entries(table).expect("read conntrack") {
            let _ = tables.delete_if(table, &k, &v);
        }
    }
    tables.invalidate_flow_cache().expect("invalidate the flow cache");
}

/// Fails the run when a figure did not measure what its column says.
fn check(what: &str, got: u64, want: u64) {
    if got != want {
        fail(&format!("{what}: counted {got} packets, expected {want}; the figure would be wrong"));
    }
}

/// Ends the run with an error (exit status 101). It unwinds rather than exits, so the pin
/// directory's drop removes what the run pinned under /sys/fs/bpf.
fn fail(why: &str) -> ! {
    eprintln!("kpr-bench: {why}");
    std::panic::resume_unwind(Box::new(why.to_string()))
}

/// A flow through `first` (the ingress program the client's packets meet), with its handshake
/// completed through the programs themselves: its entries are assured.
fn assured_flow(dp: &mut Datapath, first: Prog, syn: Vec<u8>) {
    let (_, fwd) = run(dp, first, &syn, 1);
    let (_, left) = run(dp, Prog::TcEgress, &fwd, 1);
    let (s, sp, d, dp_) = tuple(&left);
    let (_, back) = run(dp, Prog::Tc, &tcp(d, dp_, s, sp, SYN | ACK), 1);
    run(dp, Prog::TcEgress, &back, 1);
    let (s, sp, d, dp_) = tuple(&syn);
    run(dp, first, &tcp(s, sp, d, dp_, ACK), 1);
}

/// A full read of the service and slot maps, what every full sync and metrics scrape starts
/// from: the agent's batched reads (BPF_MAP_LOOKUP_BATCH) against a per-entry iteration (two
/// system calls an entry), median of `runs` each, in milliseconds.
fn map_read(pins: &PinDir, maps: &KernelMaps, runs: usize) -> serde_json::Value {
    use proxy_agent::dataplane::ebpf::{kernel_maps::open_typed, maps::DatapathMaps};
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    let mut entries = 0;
    let batched = median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                entries = maps.services().expect("services").len() + maps.slots().expect("slots").len();
                ms(t)
            })
            .collect(),
    );
    let services: AyaHashMap<MapData, proxy_common::ServiceKey, proxy_common::ServiceValue> = open_typed(pins.path(), map_names::SERVICES).unwrap();
    let slots: AyaHashMap<MapData, proxy_common::SlotKey, u32> = open_typed(pins.path(), map_names::SLOTS).unwrap();
    let iterated = median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                let n = services.iter().filter(Result::is_ok).count() + slots.iter().filter(Result::is_ok).count();
                check("entries read by iteration", n as u64, entries as u64);
                ms(t)
            })
            .collect(),
    );
    println!(
        "full read of the service and slot maps ({entries} entries; every full sync and metrics scrape starts with it), median of {runs}: batched {batched:.1} ms, per-entry iteration {iterated:.1} ms: {:.1}x",
        iterated / batched
    );
    serde_json::json!({"entries": entries, "batched_ms": batched, "iterated_ms": iterated})
}

/// The conntrack collector's round over busy flows (stamped 5 s ago) against the same flows
/// quiet for 20 s, past a closing TCP flow's timeout, which is what every round cost before
/// the collector skipped busy entries: their other entries are looked up, a system call each.
fn collector_round(pins: &PinDir, ct: &mut AyaHashMap<MapData, CtKey, CtValue>, runs: usize) -> serde_json::Value {
    use proxy_agent::dataplane::ebpf::{
        conntrack::{keys_of_forward, Gc, Timeouts},
        kernel_maps::KernelConntrack,
    };
    const FLOWS: u32 = 16_384;
    const S: u64 = 1_000_000_000;
    let stamped = 1_000 * S;
    let (client, vip, backend) = (u32::from_ne_bytes([10, 244, 201, 0]), u32::from_ne_bytes([10, 96, 0, 1]), u32::from_ne_bytes([10, 244, 2, 2]));
    for i in 0..FLOWS {
        let (saddr, sport) = (client, (1024 + i as u16).to_be());
        let k = CtKey { saddr, daddr: vip, sport, dport: 80u16.to_be(), proto: proxy_common::PROTO_TCP, dir: proxy_common::CT_DIR_INGRESS, _pad: 0 };
        let v = CtValue {
            last_seen_ns: stamped,
            new_saddr: saddr,
            new_daddr: backend,
            new_sport: sport,
            new_dport: 8080u16.to_be(),
            backend_id: 1,
            service_id: 1,
            ..CtValue::default()
        };
        let reply = CtValue { new_saddr: vip, new_daddr: saddr, new_sport: 80u16.to_be(), new_dport: sport, flags: proxy_common::CT_F_REPLY, ..v };
        ct.insert(k, v, 0).expect("conntrack insert");
        ct.insert(keys_of_forward(&k, &v).0, reply, 0).expect("conntrack insert");
    }
    let mut tables = KernelConntrack::open(pins.path()).expect("open conntrack");
    let mut time = |after: u64| -> f64 {
        let times: Vec<f64> = (0..runs)
            .map(|_| {
                let mut gc = Gc::new(Timeouts::default(), 2 * FLOWS as usize);
                let t = Instant::now();
                let st = gc.round(&mut tables, stamped + after).expect("collector round");
                let ms = t.elapsed().as_secs_f64() * 1e3;
                if st.read != 2 * FLOWS as usize || st.entries != 0 {
                    fail(&format!("collector: read {} entries and deleted {}, expected {} and 0; the figure would be wrong", st.read, st.entries, 2 * FLOWS));
                }
                ms
            })
            .collect();
        median(times)
    };
    let (busy, quiet) = (time(5 * S), time(20 * S));
    println!(
        "\nconntrack collector, one round over {FLOWS} flows ({} entries), median of {runs}: busy flows {busy:.1} ms; the same flows quiet for 20 s (every round before busy entries were skipped) {quiet:.1} ms: {:.1}x",
        2 * FLOWS,
        quiet / busy
    );
    serde_json::json!({"flows": FLOWS, "busy_ms": busy, "quiet_ms": quiet})
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let sizes: Vec<u32> = opt("--sizes").unwrap_or_else(|| "1,1000,10000,100000".into()).split(',').map(|s| s.parse().expect("--sizes")).collect();
    // An even count: each measured ping-pong flow ends as it began, which is checked.
    let repeat: u32 = opt("--repeat").map(|s| s.parse().unwrap()).unwrap_or(1_000_000).max(2) & !1;
    let new_flows: u32 = opt("--new-flows").map(|s| s.parse().unwrap()).unwrap_or(2000);
    let runs: usize = opt("--runs").map(|s| s.parse().unwrap()).unwrap_or(5);
    let json_out = opt("--json");

    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_default();
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    println!("machine: Linux {} | {cpu} | {ncpu} CPUs", kernel.trim());
    println!("method: BPF_PROG_TEST_RUN, 54-byte TCP frames, median of {runs} runs of {repeat} repetitions: forward = a hit on an established flow's forward entry (ingress: DNAT; egress: masquerade), reply = on a reply entry (ingress: reverse masquerade; egress: reverse DNAT), other = a packet of no service and no flow; new = {new_flows} distinct SYNs, 1 repetition each (the mean; the fast path's percentiles follow each size's rows). The fast path answers repeated hits from its per-CPU flow cache; the 'no cache' rows probe conntrack for every packet");

    let pins = PinDir::new("bench");
    let max = *sizes.iter().max().unwrap();
    let caps = Capacities {
        services: (2 * max + 16).max(1024),
        backends: 65_536,
        slots: (6 * max + 64).max(4096),
        conntrack: 1_048_576,
        conntrack_new: 262_144,
        affinity: 65_536,
        // IPv6's tables at their defaults.
        ..Capacities::default()
    };
    let mut dp = Datapath::load(pins.path(), caps).expect("load");
    dp.load_ipset().expect("load the IPVS-mode set matching");
    // An older kernel, which prunes less, may refuse what this one accepts (the CI guest's
    // 6.1 prints its own).
    println!("verifier: instructions processed (of 1,000,000 a program): {}", dp.verifier_work());
    // What the new-flow rows pay for each of their calls on this CPU (its return mitigation
    // decides much of it): compare machines with it.
    let calls = match kpr_bench::call_cost::measure(200_000) {
        Ok((local, helper)) => {
            println!(
                "calls: a BPF-to-BPF call and its return {local:.1} ns, a helper call (bpf_get_prandom_u32) {helper:.1} ns ({})",
                kpr_bench::call_cost::return_mitigations()
            );
            serde_json::json!({"bpf_to_bpf_ns": local, "helper_ns": helper})
        }
        Err(e) => {
            println!("calls: not measured: {e}");
            serde_json::Value::Null
        }
    };
    let mut maps = KernelMaps::open(pins.path()).unwrap();
    let mut set_maps = proxy_agent::dataplane::ipvs::sets::KernelSetMaps::open(pins.path()).unwrap();
    let mut syncer = Syncer::new(caps.services, caps.backends, 16);
    let cfg = datapath_config("192.0.2.1", Some(("10.244.0.0", 16)));

    let mut ct: AyaHashMap<MapData, CtKey, CtValue> =
        proxy_agent::dataplane::ebpf::kernel_maps::open_typed(pins.path(), map_names::CONNTRACK).expect("open conntrack");
    let mut ct6: AyaHashMap<MapData, CtKey6, CtValue6> =
        proxy_agent::dataplane::ebpf::kernel_maps::open_typed(pins.path(), map_names::CONNTRACK6).expect("open IPv6 conntrack");
    let ct6_new = Buckets::<CtBucket6>::open(pins.path(), map_names::CONNTRACK6_NEW).expect("open IPv6 embryonic conntrack");
    let (hint, hint6) = (
        Hint::<CtBucket>::open(pins.path()).expect("open the assured table's hint"),
        Hint::<CtBucket6>::open(pins.path()).expect("open IPv6's assured table's hint"),
    );
    // IPv6: a packet of no service and no flow (to a pod).
    let other6 = frame6(CLIENT6, "fd00:244::99", TCP, 1000, 8080, ACK, &[]);
    let counters = |maps: &KernelMaps| proxy_agent::dataplane::ebpf::maps::DatapathMaps::counters(maps).expect("counters");
    // A pod (not masqueraded) and a client outside the cluster CIDR (masqueraded): between them
    // every entry kind of a flow is measured: DNAT at ingress, reverse SNAT at ingress, SNAT at
    // egress, reverse DNAT at egress.
    let pod = ("10.244.200.1".parse::<Ipv4Addr>().unwrap(), 999u16);
    let outside = ("198.18.200.1".parse::<Ipv4Addr>().unwrap(), 998u16);
    // Pod-to-pod traffic: no service, no flow; what most packets on a node are.
    let other = tcp(pod.0, pod.1, "10.244.250.250".parse().unwrap(), 8080, ACK);

    let mut results: Vec<BTreeMap<String, serde_json::Value>> = Vec::new();
    println!(
        "\n{:>9} {:<18} {:>10} {:>7} {:>10} {:>7} {:>10} {:>7} {:>10} {:>7}",
        "services", "program", "forward ns", "x floor", "reply ns", "x floor", "other ns", "x floor", "new ns", "x floor"
    );
    let mut flow_port = 1024u16;
    let mut new_udp = Vec::new();
    for &n in &sizes {
        let t = Instant::now();
        let d = desired(n);
        let st = syncer.sync(&mut maps, &d, cfg).expect("sync");
        // The same services as kube-proxy's IPVS-mode sets (CLUSTER-IP, LOOP-BACK, IPVS-IPS).
        let bound = d.frontends.keys().map(|k| k.ip).collect();
        let sets = proxy_agent::dataplane::ipvs::sets::compute(&d, &["192.0.2.1".parse().unwrap()], &bound);
        proxy_agent::dataplane::ipvs::sets::sync(&mut set_maps, &sets).expect("sets");
        eprintln!("  programmed {n} services ({} frontends, {} map writes) in {:.2}s", st.frontends, st.writes + st.deletes, t.elapsed().as_secs_f64());
        // The service hit is the last one programmed: nothing favours it in the hash table.
        let target = match vip(n - 1) {
            std::net::IpAddr::V4(a) => a,
            _ => unreachable!(),
        };
        // A new flow's cost depends on the conntrack tables' history, not only on what they hold:
        // fresh maps hand out their preallocated entries in address order (neighbours share
        // cache lines), tables that have had flows come and go do not (measured: 0.70-0.76 us on
        // fresh maps, 0.85-1.0 us on the same size right after). One round of as many flows as
        // the size's measurement creates, then cleared, so every size measures what a node that
        // has run a while pays.
        if n == sizes[0] {
            for i in 0..4 * new_flows {
                let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 244, 202, 0)) + (i >> 14));
                run(&mut dp, Prog::Tc, &tcp(src, 1024 + (i & 0x3fff) as u16, target, 80, SYN), 1);
            }
            clear_conntrack(&mut maps);
        }
        // The measured entries and their mirrors must sit in distinct flow cache slots (it is
        // direct-mapped), or every repetition would evict the other and probe conntrack:
        // clients' ports are tried until they do.
        let (frames_in, frames_out) = (|| {
            for attempt in 0..64u16 {
                let pod = (pod.0, pod.1 + attempt);
                let outside = (outside.0, outside.1 + attempt);
                assured_flow(&mut dp, Prog::Tc, tcp(pod.0, pod.1, target, 80, SYN));
                assured_flow(&mut dp, Prog::Xdp, tcp(outside.0, outside.1, target, 80, SYN));
                let entries = proxy_agent::dataplane::ebpf::conntrack::assemble(&ct.iter().map(|e| e.unwrap()).collect::<Vec<_>>());
                let flow_of = |c: (Ipv4Addr, u16)| {
                    entries
                        .iter()
                        .find(|f| f.forward.is_some_and(|(k, _)| addr(k.saddr) == c.0 && u16::from_be(k.sport) == c.1))
                        .cloned()
                        .expect("the primed flow is assured")
                };
                let (pf, of) = (flow_of(pod), flow_of(outside));
                let measured = [pf.forward.unwrap(), of.reverse_snat.expect("reverse SNAT"), of.snat.expect("SNAT"), pf.reverse_dnat.unwrap()];
                let mut slots = std::collections::BTreeSet::new();
                let distinct = measured.iter().all(|(k, v)| {
                    let mirror = CtKey { saddr: v.new_saddr, daddr: v.new_daddr, sport: v.new_sport, dport: v.new_dport, ..*k };
                    slots.insert(k.flow_cache_slot()) && slots.insert(mirror.flow_cache_slot())
                });
                if !distinct {
                    clear_conntrack(&mut maps);
                    continue;
                }
                // Ingress: DNAT (the pod's flow) and reverse SNAT (the outside client's); egress:
                // SNAT (the outside client's) and reverse DNAT (the pod's).
                let fin = (ping_pong(&mut ct, &hint, measured[0].0), ping_pong(&mut ct, &hint, measured[1].0));
                let fout = (ping_pong(&mut ct, &hint, measured[2].0), ping_pong(&mut ct, &hint, measured[3].0));
                return (fin, fout);
            }
            panic!("no client ports whose entries fit distinct flow cache slots");
        })();
        let (fwd6, rev6) = ipv6_flow(&mut dp, &mut ct6, &hint6, &ct6_new);
        // The assured tables' hints as a running agent's collector keeps them (a load sets every
        // bit, where every new flow probes the assured table).
        proxy_agent::dataplane::ebpf::kernel_maps::rebuild_hints_now(pins.path()).expect("rebuild the hints");
        let mut floor: BTreeMap<bool, [f64; 4]> = BTreeMap::new();
        let mut spreads = Vec::new();
        let mut in_order = Vec::new();
        for p in [
            Prog::TcPass,
            Prog::XdpPass,
            Prog::Tc,
            Prog::TcEgress,
            Prog::Xdp,
            Prog::TcNoCache,
            Prog::TcEgressNoCache,
            Prog::XdpNoCache,
            Prog::TcIpset,
            Prog::Tc6,
            Prog::TcEgress6,
        ] {
            let lb = p.fast_path();
            let flags = if p.no_cache() { cfg.flags | CFG_F_NO_FLOW_CACHE } else { cfg.flags };
            proxy_agent::dataplane::ebpf::maps::DatapathMaps::set_config(&mut maps, DatapathConfig { flags, ..cfg }).expect("config");
            let mut timed = |frame: &[u8], counter: Option<u32>| {
                let before = counters(&maps);
                let t = median(
                    (0..runs)
                        .map(|_| {
                            let (ns, out) = run(&mut dp, p, frame, repeat);
                            if lb && out != frame {
                                fail(&format!("{}: an even number of ping-pong rewrites did not restore the packet", p.name()));
                            }
                            ns
                        })
                        .collect(),
                );
                let after = counters(&maps);
                if lb {
                    let total = u64::from(repeat) * runs as u64;
                    let delta = |c: u32| after[c as usize] - before[c as usize];
                    // Without the cache every hit probes conntrack; with it, each of the two
                    // tuples misses on its first packet of a run (the cache is per CPU) and
                    // once every FLOW_CACHE_REFRESH_JIFFIES (25 ms at HZ=1000, the shortest).
                    let misses = delta(counter::FLOW_CACHE_MISS);
                    let refreshes = (t * f64::from(repeat) / 25e6).ceil() as u64;
                    if p.no_cache() {
                        let want = if counter.is_some() { total } else { 0 };
                        check(&format!("{} {}", p.name(), counter::NAMES[counter::FLOW_CACHE_MISS as usize]), misses, want);
                    } else if counter.is_some() && misses > 2 * runs as u64 * (1 + refreshes) {
                        fail(&format!("{}: {misses} flow cache misses in {total} hits: the figure would time conntrack, not the cache", p.name()));
                    }
                    for c in [counter::ESTABLISHED, counter::REVERSE_NAT, counter::NEW_FLOW] {
                        let want = if Some(c) == counter { total } else { 0 };
                        check(&format!("{} {}", p.name(), counter::NAMES[c as usize]), delta(c), want);
                    }
                }
                t
            };
            // IPv6: the forward entry is at the uplink's ingress, the reply's at egress.
            let (fwd, rev, oth) = match p {
                Prog::Tc6 => (timed(&fwd6, Some(counter::ESTABLISHED)), f64::NAN, timed(&other6, None)),
                Prog::TcEgress6 => (f64::NAN, timed(&rev6, Some(counter::REVERSE_NAT)), timed(&other6, None)),
                _ => {
                    let (fwd_frame, rev_frame) = if p.egress() { &frames_out } else { &frames_in };
                    (timed(fwd_frame, Some(counter::ESTABLISHED)), timed(rev_frame, Some(counter::REVERSE_NAT)), timed(&other, None))
                }
            };
            // A new flow's first packet; egress creates none (its first packet there completes
            // a masquerade, measured in the forward column's first repetition only).
            let spread = (!p.egress()).then(|| {
                first_packets(&mut dp, p, new_flows, &mut flow_port, |port| {
                    if p == Prog::Tc6 {
                        let src = if port == 1024 { "2001:db8:c::3" } else { "2001:db8:c::2" };
                        frame6(src, VIP6, TCP, port, 80, SYN, &[])
                    } else {
                        let src = if port == 1024 { "10.244.201.1" } else { "10.244.200.2" };
                        Frame::tcp(src, port, &target.to_string(), 80, SYN).bytes()
                    }
                })
            });
            let newf = spread.map_or(f64::NAN, |s| s.mean);
            let fig = [fwd, rev, oth, newf];
            if matches!(p, Prog::TcPass | Prog::XdpPass) {
                floor.insert(p.tc(), fig);
            }
            let x: Vec<f64> = fig.iter().zip(floor[&p.tc()]).map(|(a, b)| a / b).collect();
            println!("{n:>9} {:<18} {fwd:>10.1} {:>7.2} {rev:>10.1} {:>7.2} {oth:>10.1} {:>7.2} {newf:>10.1} {:>7.2}", p.name(), x[0], x[1], x[2], x[3]);
            let _ = std::io::stdout().flush();
            let mut row = BTreeMap::new();
            row.insert("services".into(), n.into());
            row.insert("program".into(), p.name().into());
            for (i, name) in ["established_forward", "established_reply", "no_service", "new_flow"].iter().enumerate() {
                if fig[i].is_finite() {
                    row.insert(format!("{name}_ns"), fig[i].into());
                    row.insert(format!("{name}_x_floor"), x[i].into());
                }
            }
            if let Some(s) = spread.filter(|_| p.fast_path()) {
                for (q, ns) in [("p50", s.p50), ("p90", s.p90), ("p99", s.p99)] {
                    row.insert(format!("new_flow_{q}_ns"), ns.into());
                }
                spreads.push(format!("{} {}", p.name(), s.percentiles()));
                in_order.push(format!("{} {}", p.name(), s.in_order()));
                row.insert("new_flow_first_ns".into(), s.first.into());
                row.insert("new_flow_last_half_ns".into(), s.last_half.into());
            }
            results.push(row);
        }
        println!("{n:>9} new flow, each of {new_flows} SYNs (ns): {}", spreads.join("; "));
        println!("{n:>9} new flow, in the order sent (ns; the first ones after other work run cold): {}", in_order.join("; "));
        // A new UDP flow: its first datagram; it starts in the embryonic table, as a TCP flow
        // does, and is not cached until assured.
        proxy_agent::dataplane::ebpf::maps::DatapathMaps::set_config(&mut maps, cfg).expect("config");
        let mut udp = Vec::new();
        for p in [Prog::Tc, Prog::Xdp] {
            let before = counters(&maps)[counter::NEW_FLOW as usize];
            let s = first_packets(&mut dp, p, new_flows, &mut flow_port, |port| Frame::udp("10.244.200.3", port, &target.to_string(), 80, b"q").bytes());
            check(&format!("{} new UDP flows", p.name()), counters(&maps)[counter::NEW_FLOW as usize] - before, u64::from(new_flows));
            udp.push(format!("{} {:.1} ns ({})", p.name(), s.mean, s.percentiles()));
            new_udp.push(serde_json::json!({"services": n, "program": p.name(), "new_udp_flow_ns": s.mean, "new_udp_flow_p50_ns": s.p50, "new_udp_flow_p90_ns": s.p90, "new_udp_flow_p99_ns": s.p99}));
        }
        println!("{n:>9} new UDP flow (first datagram, mean of {new_flows}): {}", udp.join(", "));
        // A UDP flow never answered stays embryonic and uncached: each datagram probes the
        // assured table (a miss), then the embryonic one.
        let mut unanswered = Vec::new();
        for p in [Prog::Tc, Prog::Xdp] {
            let frame = Frame::udp("10.244.200.4", 999, &target.to_string(), 80, b"q").bytes();
            run(&mut dp, p, &frame, 1);
            let before = counters(&maps)[counter::NEW_FLOW as usize];
            let ns = median((0..runs).map(|_| run(&mut dp, p, &frame, repeat).0).collect());
            check(&format!("{} an unanswered UDP flow's datagrams", p.name()), counters(&maps)[counter::NEW_FLOW as usize] - before, 0);
            unanswered.push(format!("{} {ns:.1} ns", p.name()));
            new_udp.push(serde_json::json!({"services": n, "program": p.name(), "unanswered_udp_datagram_ns": ns}));
        }
        println!("{n:>9} datagram of a UDP flow never answered (embryonic, uncached; median of {runs} runs): {}", unanswered.join(", "));
        // Flows of this size must not help the next one.
        clear_conntrack(&mut maps);
    }
    // Flatness: each program's established-flow cost at the largest size vs the smallest.
    let (lo, hi) = (sizes[0], max);
    for p in [Prog::Tc, Prog::TcEgress, Prog::Xdp, Prog::TcNoCache, Prog::TcEgressNoCache, Prog::XdpNoCache, Prog::TcIpset, Prog::Tc6].map(Prog::name) {
        let get = |n: u32| results.iter().find(|r| r["services"] == n && r["program"] == p).map(|r| r["established_forward_ns"].as_f64().unwrap());
        if let (Some(a), Some(b)) = (get(lo), get(hi)) {
            println!("{p}: established-flow (forward) cost at {hi} services is {:.2}x that at {lo}", b / a);
        }
    }
    // The new-flow goal (at most 1 µs at every size), over the rows that open a flow (the
    // floors and IPVS mode's set matching open none).
    let new_flow: Vec<(u32, &str, f64)> = results
        .iter()
        .filter(|r| [Prog::Tc, Prog::Xdp, Prog::TcNoCache, Prog::XdpNoCache, Prog::Tc6].iter().any(|p| r["program"] == p.name()))
        .filter_map(|r| Some((r["services"].as_u64()? as u32, r["program"].as_str()?, r["new_flow_ns"].as_f64()?)))
        .collect();
    if let Some(&(n, p, worst)) = new_flow.iter().max_by(|a, b| a.2.total_cmp(&b.2)) {
        let within = new_flow.iter().filter(|r| r.2 <= 1000.0).count();
        let floors: Vec<f64> = results
            .iter()
            .filter(|r| r["program"] == Prog::TcPass.name() || r["program"] == Prog::XdpPass.name())
            .filter_map(|r| r["new_flow_ns"].as_f64())
            .collect();
        let (lo, hi) = floors.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &f| (lo.min(f), hi.max(f)));
        let medians: Vec<f64> = results
            .iter()
            .filter(|r| new_flow.iter().any(|(n, p, _)| r["services"] == *n && r["program"] == *p))
            .filter_map(|r| r["new_flow_p50_ns"].as_f64())
            .collect();
        let (p50_lo, p50_hi) = medians.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &f| (lo.min(f), hi.max(f)));
        kpr_bench::print_goal(
            "a new flow <= 1 us at every size (BPF_PROG_TEST_RUN)",
            &format!(
                "slowest {:.2} us ({p} at {n} services), {within} of {} rows within (means; the rows' per-flow medians {p50_lo:.0}-{p50_hi:.0} ns); one-repetition floor {lo:.0}-{hi:.0} ns",
                worst / 1e3,
                new_flow.len()
            ),
            within == new_flow.len(),
        );
    }
    let collector = collector_round(&pins, &mut ct, runs);
    let read = map_read(&pins, &maps, runs);
    if let Some(path) = json_out {
        let doc = serde_json::json!({"kernel": kernel.trim(), "cpu": cpu, "cpus": ncpu, "repeat": repeat, "new_flows": new_flows, "runs": runs, "results": results, "new_udp_flow": new_udp, "collector": collector, "map_read": read, "calls": calls});
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        println!("wrote {path}");
    }
}
