//! `kpr-vm-tests`: IPVS mode in a real IPVS kernel (Debian's, under QEMU: `cargo xtask
//! vm-test`). The stock `ipvsadm` is the oracle: every check compares its `-Sn` or
//! `-Ln --stats` output with what the manifests and the client's calls imply. Traffic is real
//! TCP and UDP across namespaces built inside the guest. Refuses to run outside a VM guest
//! unless KPR_VM_TESTS_ANYWHERE=1 (it flushes the root namespace's IPVS table).
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use kpr_lab::{
    lab::{errors, per_backend, Cni, Lab, LabSpec, NODE_IP, NODE_IP6},
    must, sh,
};
use proxy_agent::dataplane::ipvs::client::{flags, DestConfig, FwdMethod, Ipvs, NetlinkIpvs, ServiceConfig, ServiceId, Timeouts, TunType, Write};

const PREFIX: &str = "kvm";

fn sorted_lines(s: &str) -> Vec<String> {
    let mut v: Vec<String> = s.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect();
    v.sort();
    v
}

fn expect_lines(what: &str, got: &str, want: &[&str]) -> Result<()> {
    let (got, mut want_v) = (sorted_lines(got), want.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    want_v.sort();
    ensure!(got == want_v, "{what}: ipvsadm shows\n{}\nexpected\n{}", got.join("\n"), want_v.join("\n"));
    Ok(())
}

fn ipvsadm(ns: Option<&str>, args: &str) -> String {
    match ns {
        Some(ns) => must(&format!("ip netns exec {ns} ipvsadm {args}")),
        None => must(&format!("ipvsadm {args}")),
    }
}

fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> Result<()>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match f() {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e.context(format!("waited {secs} s for {what}"))),
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// The client alone, in the guest's root namespace: every attribute ipvsadm can set, read back
/// by ipvsadm and by our decoder.
fn client_api() -> Result<()> {
    let _ = Command::new("modprobe").arg("ip_vs").status();
    let mut ipvs = NetlinkIpvs::connect()?;
    ipvs.flush()?;
    let info = ipvs.info()?;
    let header = ipvsadm(None, "-Ln");
    let version =
        format!("IP Virtual Server version {}.{}.{} (size={})", info.version >> 16, (info.version >> 8) & 0xff, info.version & 0xff, info.conn_tab_size);
    ensure!(header.starts_with(&version), "info: we read {version:?}, ipvsadm says {:?}", header.lines().next());

    let tcp = ServiceId::Addr { proto: 6, addr: "10.0.0.1".parse()?, port: 80 };
    let udp = ServiceId::Addr { proto: 17, addr: "10.0.0.2".parse()?, port: 53 };
    let sctp = ServiceId::Addr { proto: 132, addr: "10.0.0.3".parse()?, port: 9 };
    let fwm = ServiceId::Fwmark { v6: false, mark: 7 };
    let tcp6 = ServiceId::Addr { proto: 6, addr: "fd00::1".parse()?, port: 80 };
    let cfg = |id, sched: &str, fl, t, nm| ServiceConfig { id, scheduler: sched.into(), flags: fl, timeout_s: t, netmask: nm, pe_name: None };
    // IPv6: the persistence netmask is a prefix length (-M 64).
    ipvs.add_service(&cfg(tcp6, "rr", flags::PERSISTENT, 60, 64))?;
    ipvs.add_dest(&tcp6, &DestConfig::new("fd00:1::1".parse()?, 8080, FwdMethod::Masq, 1))?;
    // Without persistence, as the agent adds a ClusterIP: the netmask is the whole address.
    let udp6 = ServiceId::Addr { proto: 17, addr: "fd00::2".parse()?, port: 53 };
    ipvs.add_service(&cfg(udp6, "rr", 0, 0, 128))?;
    ipvs.add_service(&cfg(tcp, "wrr", flags::PERSISTENT, 300, 0xffff_ff00))?;
    ipvs.add_service(&cfg(udp, "sh", flags::SH_FALLBACK | flags::SH_PORT, 0, u32::MAX))?;
    ipvs.add_service(&cfg(sctp, "mh", flags::MH_PORT, 0, u32::MAX))?;
    ipvs.add_service(&cfg(fwm, "lc", flags::ONEPACKET, 0, u32::MAX))?;
    ensure!(ipvs.add_service(&cfg(tcp, "rr", 0, 0, u32::MAX)).err().and_then(|e| e.errno()) == Some(libc::EEXIST), "a second add must be EEXIST");
    let mut d = DestConfig::new("10.1.0.1".parse()?, 8080, FwdMethod::Masq, 5);
    d.upper_threshold = 100;
    d.lower_threshold = 10;
    ipvs.add_dest(&tcp, &d)?;
    ipvs.add_dest(&tcp, &DestConfig::new("10.1.0.2".parse()?, 80, FwdMethod::Route, 2))?;
    let mut gue = DestConfig::new("10.1.0.3".parse()?, 80, FwdMethod::Tunnel, 1);
    gue.tun_type = Some(TunType::Gue);
    gue.tun_port = Some(6080);
    ipvs.add_dest(&tcp, &gue)?;
    ipvs.add_dest(&udp, &DestConfig::new("10.1.0.4".parse()?, 5353, FwdMethod::Masq, 1))?;
    ipvs.add_dest(&fwm, &DestConfig::new("10.1.0.5".parse()?, 0, FwdMethod::Tunnel, 3))?;
    expect_lines(
        "client add",
        &ipvsadm(None, "-Sn"),
        &[
            "-A -t 10.0.0.1:80 -s wrr -p 300 -M 255.255.255.0",
            "-a -t 10.0.0.1:80 -r 10.1.0.1:8080 -m -w 5",
            "-a -t 10.0.0.1:80 -r 10.1.0.2:80 -g -w 2",
            // Tunnel flags 0: ipvsadm spells it --tun-nocsum.
            "-a -t 10.0.0.1:80 -r 10.1.0.3:80 -i -w 1 --tun-type gue --tun-port 6080 --tun-nocsum",
            "-A -u 10.0.0.2:53 -s sh -b sh-fallback,sh-port",
            "-a -u 10.0.0.2:53 -r 10.1.0.4:5353 -m -w 1",
            "-A --sctp-service 10.0.0.3:9 -s mh -b mh-port",
            "-A -f 7 -s lc -o",
            "-a -f 7 -r 10.1.0.5:0 -i -w 3 --tun-type ipip",
            "-A -t [fd00::1]:80 -s rr -p 60 -M 64",
            "-a -t [fd00::1]:80 -r [fd00:1::1]:8080 -m -w 1",
            "-A -u [fd00::2]:53 -s rr",
        ],
    )?;
    // -S leaves thresholds out; --thresholds shows them.
    let th = ipvsadm(None, "-Ln --thresholds -t 10.0.0.1:80");
    ensure!(
        th.lines().any(|l| l.contains("10.1.0.1:8080") && l.split_whitespace().collect::<Vec<_>>().windows(2).any(|w| w == ["100", "10"])),
        "thresholds:\n{th}"
    );
    // Read back through our decoder: the same configuration.
    let svcs = ipvs.services()?;
    ensure!(svcs.len() == 6, "services: {svcs:?}");
    let t = svcs.iter().find(|s| s.config.id == tcp).context("tcp service listed")?;
    ensure!(t.config.scheduler == "wrr" && t.config.timeout_s == 300 && t.config.netmask == 0xffff_ff00, "{t:?}");
    let t6 = svcs.iter().find(|s| s.config.id == tcp6).context("IPv6 service listed")?;
    ensure!(t6.config.netmask == 64 && t6.config.timeout_s == 60, "{t6:?}");
    let d6: std::net::IpAddr = "fd00:1::1".parse()?;
    ensure!(ipvs.dests(&tcp6)?.iter().any(|x| x.config.addr == d6), "IPv6 dest read back");
    let dests = ipvs.dests(&tcp)?;
    ensure!(dests.len() == 3, "{dests:?}");
    ensure!(dests.iter().any(|x| x.config == d), "masq dest read back: {dests:?}");
    ensure!(dests.iter().any(|x| x.config.tun_type == Some(TunType::Gue) && x.config.tun_port == Some(6080)), "gue read back: {dests:?}");
    // Set, then delete (twice: idempotent).
    ipvs.update_service(&cfg(tcp, "rr", 0, 0, u32::MAX))?;
    ipvs.update_dest(&tcp, &DestConfig::new("10.1.0.2".parse()?, 80, FwdMethod::Route, 0))?;
    ipvs.del_dest(&tcp, "10.1.0.3".parse()?, 80)?;
    ipvs.del_dest(&tcp, "10.1.0.3".parse()?, 80)?;
    ipvs.del_service(&sctp)?;
    ipvs.del_service(&sctp)?;
    ensure!(ipvs.service(&sctp)?.is_none(), "deleted service still there");
    let sn = ipvsadm(None, "-Sn");
    ensure!(
        sn.contains("-A -t 10.0.0.1:80 -s rr\n") && sn.contains("-a -t 10.0.0.1:80 -r 10.1.0.2:80 -g -w 0") && !sn.contains("10.1.0.3") && !sn.contains("sctp"),
        "after set/delete:\n{sn}"
    );
    // Timeouts, as `ipvsadm -L --timeout` shows them.
    ipvs.set_timeouts(&Timeouts { tcp_s: 901, tcp_fin_s: 61, udp_s: 301 })?;
    let t = ipvs.timeouts()?;
    ensure!(t == Timeouts { tcp_s: 901, tcp_fin_s: 61, udp_s: 301 }, "{t:?}");
    let shown = ipvsadm(None, "-L --timeout");
    ensure!(shown.contains("Timeout (tcp tcpfin udp): 901 61 301"), "{shown}");
    ipvs.set_timeouts(&Timeouts { tcp_s: 900, tcp_fin_s: 120, udp_s: 300 })?;
    ipvs.flush()?;
    ensure!(ipvsadm(None, "-Sn").trim().is_empty(), "flush left services");
    Ok(())
}

/// Every program of the object passes this kernel's verifier: the fast path's too (the guest's
/// 6.1 counts the frames of a call chain against 512 bytes more strictly than 6.18 does), and
/// IPVS mode's set programs.
fn programs_load() -> Result<()> {
    let pins = kpr_lab::PinDir::new("vmload");
    let small = proxy_agent::settings::Capacities {
        services: 128,
        backends: 128,
        slots: 512,
        conntrack: 1024,
        conntrack_new: 256,
        conntrack6: 1024,
        conntrack6_new: 256,
        affinity: 256,
    };
    let mut dp = proxy_agent::dataplane::ebpf::kernel::Datapath::load_object(pins.path(), small)?;
    dp.load_fast_path()?;
    dp.load_ipset()?;
    // This kernel's verifier work for each hook, beside kpr-bench's on the host: the limit
    // is this older kernel's to reach first.
    println!("verifier on this kernel: instructions processed (of 1,000,000 a program): {}", dp.verifier_work());
    Ok(())
}

/// Pipelined writes (many per sendmsg): each write gets its own outcome, a failure in the middle
/// costs only itself, and a batch larger than one datagram lands whole (ipvsadm the oracle).
fn pipelined_writes() -> Result<()> {
    let mut ipvs = NetlinkIpvs::connect()?;
    ipvs.flush()?;
    let svc = |a: &str| ServiceConfig {
        id: ServiceId::Addr { proto: 6, addr: a.parse().unwrap(), port: 80 },
        scheduler: "rr".into(),
        flags: 0,
        timeout_s: 0,
        netmask: u32::MAX,
        pe_name: None,
    };
    let (a, missing) = (svc("10.2.0.1"), svc("10.2.0.2"));
    let dest = |ip: &str| DestConfig::new(ip.parse().unwrap(), 8080, FwdMethod::Masq, 1);
    let writes = vec![
        Write::AddService(a.clone()),
        Write::AddService(a.clone()),
        Write::AddDest(a.id, dest("10.3.0.1")),
        Write::AddDest(missing.id, dest("10.3.0.2")),
        Write::DelDest(a.id, "10.3.0.9".parse()?, 8080),
        Write::AddDest(a.id, dest("10.3.0.3")),
    ];
    let errnos: Vec<Option<i32>> = ipvs.apply(&writes).iter().map(|r| r.as_ref().err().map(|e| e.errno().unwrap_or(-1))).collect();
    ensure!(
        errnos == [None, Some(libc::EEXIST), None, Some(libc::ESRCH), None, None],
        "per-write outcomes {errnos:?}: want the second add EEXIST, the destination of a missing service ESRCH, the rest ok"
    );
    expect_lines(
        "after a batch with failures",
        &ipvsadm(None, "-Sn"),
        &["-A -t 10.2.0.1:80 -s rr", "-a -t 10.2.0.1:80 -r 10.3.0.1:8080 -m -w 1", "-a -t 10.2.0.1:80 -r 10.3.0.3:8080 -m -w 1"],
    )?;
    // 2,000 services x 5 destinations: far more than one datagram's worth of requests.
    let mut big = Vec::new();
    for i in 0..2000u32 {
        let s = svc(&format!("10.4.{}.{}", i / 250, i % 250 + 1));
        big.push(Write::AddService(s.clone()));
        for j in 1..=5 {
            big.push(Write::AddDest(s.id, dest(&format!("10.5.{}.{j}", i % 250))));
        }
    }
    let failed = ipvs.apply(&big).into_iter().filter(Result::is_err).count();
    ensure!(failed == 0, "{failed} of {} pipelined writes failed", big.len());
    let sn = ipvsadm(None, "-Sn");
    let (services, dests) = (sn.lines().filter(|l| l.starts_with("-A ")).count(), sn.lines().filter(|l| l.starts_with("-a ")).count());
    ensure!((services, dests) == (2001, 10_002), "ipvsadm shows {services} services and {dests} destinations, want 2001 and 10002");
    ipvs.flush()?;
    Ok(())
}

fn node(lab: &Lab) -> String {
    lab.ns("node")
}

fn kpr(lab: &Lab, args: &[&str]) -> Result<String> {
    let o = Command::new(&lab.kpr).arg("--netns").arg(node(lab)).arg("--pin-dir").arg(lab.pins.path()).args(args).output()?;
    ensure!(o.status.success(), "kpr {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

const BASE_STATE: &[&str] = &[
    "-A -t 10.96.0.10:80 -s rr",
    "-a -t 10.96.0.10:80 -r 10.244.1.2:8080 -m -w 1",
    "-a -t 10.96.0.10:80 -r 10.244.2.2:8080 -m -w 1",
    "-a -t 10.96.0.10:80 -r 10.244.3.2:8080 -m -w 1",
    "-A -t 198.18.0.1:30080 -s rr",
    "-a -t 198.18.0.1:30080 -r 10.244.1.2:8080 -m -w 1",
    "-a -t 198.18.0.1:30080 -r 10.244.2.2:8080 -m -w 1",
    "-a -t 198.18.0.1:30080 -r 10.244.3.2:8080 -m -w 1",
    "-A -t 192.0.2.80:80 -s rr",
    "-a -t 192.0.2.80:80 -r 10.244.1.2:8080 -m -w 1",
    "-a -t 192.0.2.80:80 -r 10.244.2.2:8080 -m -w 1",
    "-a -t 192.0.2.80:80 -r 10.244.3.2:8080 -m -w 1",
    "-A -u 10.96.0.53:53 -s rr",
    "-a -u 10.96.0.53:53 -r 10.244.1.2:5353 -m -w 1",
    "-a -u 10.96.0.53:53 -r 10.244.2.2:5353 -m -w 1",
    "-a -u 10.96.0.53:53 -r 10.244.3.2:5353 -m -w 1",
    "-A -t 10.96.0.12:80 -s rr -p 60",
    "-a -t 10.96.0.12:80 -r 10.244.1.2:8080 -m -w 1",
    "-a -t 10.96.0.12:80 -r 10.244.2.2:8080 -m -w 1",
    "-a -t 10.96.0.12:80 -r 10.244.3.2:8080 -m -w 1",
    "-A -t 10.96.0.30:80 -s rr",
    "-a -t 10.96.0.30:80 -r 10.244.1.2:8080 -m -w 1",
    "-A -t 10.96.0.40:8080 -s rr",
    "-a -t 10.96.0.40:8080 -r 10.244.2.2:8080 -g -w 1",
    "-A -t 10.96.0.41:8080 -s rr",
    "-a -t 10.96.0.41:8080 -r 10.244.3.2:8080 -i -w 1 --tun-type ipip",
    "-A -t 10.96.0.20:80 -s rr",
    "-a -t 10.96.0.20:80 -r 10.244.2.2:8080 -m -w 1",
    "-a -t 10.96.0.20:80 -r 10.244.3.2:8080 -m -w 1",
    "-A -t 198.18.0.1:30081 -s rr",
    "-a -t 198.18.0.1:30081 -r 10.244.2.2:8080 -m -w 1",
    "-a -t 198.18.0.1:30081 -r 10.244.3.2:8080 -m -w 1",
    "-A -t 203.0.113.10:80 -s rr",
    "-a -t 203.0.113.10:80 -r 10.244.2.2:8080 -m -w 1",
    "-a -t 203.0.113.10:80 -r 10.244.3.2:8080 -m -w 1",
];

fn sn(lab: &Lab) -> String {
    ipvsadm(Some(&node(lab)), "-Sn")
}

/// The agent's first sync: the kernel state, the VIPs, the listings.
fn programs_the_manifests(lab: &Lab) -> Result<()> {
    wait_until("the manifests in IPVS", 60, || expect_lines("agent state", &sn(lab), BASE_STATE))?;
    let addrs = must(&format!("ip -n {} -4 -o addr show dev kube-ipvs0", node(lab)));
    let bound: BTreeSet<&str> = addrs.split_whitespace().filter(|w| w.ends_with("/32")).collect();
    let want: BTreeSet<&str> = [
        "10.96.0.10/32",
        "10.96.0.12/32",
        "10.96.0.20/32",
        "10.96.0.30/32",
        "10.96.0.40/32",
        "10.96.0.41/32",
        "10.96.0.53/32",
        "192.0.2.80/32",
        "203.0.113.10/32",
    ]
    .into();
    ensure!(bound == want, "kube-ipvs0 holds {bound:?}, expected {want:?} (never the node address)");
    // kpr ipvs agrees with ipvsadm -Ln.
    let list = kpr(lab, &["ipvs"])?;
    for l in ["TCP  10.96.0.12:80 rr persistent 60", "  -> 10.244.2.2:8080", "UDP  10.96.0.53:53 rr"] {
        ensure!(list.contains(l), "kpr ipvs lacks {l:?}:\n{list}");
    }
    let sets = kpr(lab, &["ipset"])?;
    for (set, member) in [
        ("KUBE-CLUSTER-IP", "10.96.0.10,tcp:80"),
        ("KUBE-CLUSTER-IP", "10.96.0.53,udp:53"),
        ("KUBE-EXTERNAL-IP", "192.0.2.80,tcp:80"),
        ("KUBE-LOAD-BALANCER", "203.0.113.10,tcp:80"),
        ("KUBE-LOAD-BALANCER-FW", "203.0.113.10,tcp:80"),
        ("KUBE-LOAD-BALANCER-SOURCE-CIDR", "203.0.113.10,tcp:80,198.18.0.0/24"),
        ("KUBE-LOOP-BACK", "10.244.1.2,tcp:8080,10.244.1.2"),
        ("KUBE-NODE-PORT-TCP", "30081"),
        ("KUBE-IPVS-IPS", "10.96.0.41"),
    ] {
        let block = sets.split("\n\n").find(|b| b.starts_with(&format!("Name: {set}\n"))).with_context(|| format!("set {set} listed:\n{sets}"))?;
        ensure!(block.lines().any(|l| l == member), "{set} lacks {member}:\n{block}");
    }
    // The constant rule set, whatever the number of services.
    let nat = must(&format!("ip netns exec {} iptables-save -t nat", node(lab)));
    let n = nat.lines().filter(|l| l.starts_with("-A KPR-POSTROUTING")).count();
    ensure!(n == 5, "KPR-POSTROUTING has {n} rules:\n{nat}");
    Ok(())
}

fn burst(lab: &Lab, role: &str, target: &str, proto: &str, n: &str) -> serde_json::Value {
    lab.peer(role, &["burst", target, proto, n])
}

/// Real traffic through IPVS NAT, with masquerade doing the work: the backends have no route
/// back to the client network, so answers reach it only if the node rewrote the source.
fn nat_traffic_with_masquerade(lab: &Lab) -> Result<()> {
    for i in 1..=3 {
        must(&format!("ip -n {} route del 198.18.0.0/24", lab.ns(&format!("b{i}"))));
    }
    let ok = |what: &str, v: &serde_json::Value, backends: usize| -> Result<()> {
        ensure!(errors(v) == 0 && per_backend(v).len() == backends, "{what}: {v}");
        println!("  {what}: {v}");
        Ok(())
    };
    ok("pod -> ClusterIP (no masquerade needed)", &burst(lab, "pod", "10.96.0.10:80", "tcp", "30"), 3)?;
    ok("client -> ClusterIP (masqueraded: outside the cluster CIDR)", &burst(lab, "cl", "10.96.0.10:80", "tcp", "30"), 3)?;
    ok("client -> NodePort", &burst(lab, "cl", &format!("{NODE_IP}:30080"), "tcp", "30"), 3)?;
    must(&format!("ip -n {} route add 192.0.2.0/24 via {NODE_IP}", lab.ns("cl")));
    ok("client -> externalIP", &burst(lab, "cl", "192.0.2.80:80", "tcp", "30"), 3)?;
    ok("client -> LoadBalancer IP (allowed source range)", &burst(lab, "cl", "203.0.113.10:80", "tcp", "20"), 2)?;
    ok("pod -> ClusterIP UDP", &burst(lab, "pod", "10.96.0.53:53", "udp", "30"), 3)?;
    ok("client -> ClusterIP UDP (masqueraded)", &burst(lab, "cl", "10.96.0.53:53", "udp", "30"), 3)?;
    // Hairpin: a backend reaching itself through its service (KUBE-LOOP-BACK).
    let v = burst(lab, "b1", "10.96.0.10:80", "tcp", "30");
    ensure!(errors(&v) == 0 && per_backend(&v).iter().any(|(b, _)| b == "b1"), "hairpin b1 -> ClusterIP -> b1: {v}");
    println!("  hairpin: {v}");
    // Source-range firewall: the pod is outside 198.18.0.0/24 and no endpoint of the service.
    let v = burst(lab, "pod", "203.0.113.10:80", "tcp", "1");
    ensure!(errors(&v) == 1, "pod -> LB IP must be dropped by the firewall: {v}");
    // KUBE-IPVS-FILTER: a new connection to a VIP at a port no service has is rejected (as
    // kube-proxy's `--ctstate NEW ... -j REJECT`), not answered by the node's own sockets.
    let v = burst(lab, "pod", "10.96.0.10:81", "tcp", "1");
    ensure!(errors(&v) == 1 && v["first_error"].as_str().unwrap_or("").contains("refused"), "VIP:81 must be refused: {v}");
    // Counters: ipvsadm --stats against what we sent and what our decoder reads.
    let stats = ipvsadm(Some(&node(lab)), "-Ln --stats -t 10.96.0.10:80");
    let conns: u64 =
        stats.lines().find(|l| l.starts_with("TCP")).and_then(|l| l.split_whitespace().nth(2)).and_then(|c| c.parse().ok()).context("stats line")?;
    ensure!(conns == 90, "ipvsadm --stats counts {conns} connections to 10.96.0.10:80, we made 90:\n{stats}");
    let ours: serde_json::Value = serde_json::from_str(&kpr(lab, &["ipvs", "--json"])?)?;
    let row = ours.as_array().and_then(|r| r.iter().find(|r| r["service"] == "TCP 10.96.0.10:80")).context("row")?;
    ensure!(row["stats"]["conns"] == 90, "kpr ipvs --json stats: {row}");
    let status = kpr(lab, &["status", "--json"])?;
    let st: serde_json::Value = serde_json::from_str(&status)?;
    ensure!(st["counters"]["set_masq_mark"].as_u64().unwrap_or(0) > 0 && st["counters"]["set_reject_filter"].as_u64().unwrap_or(0) > 0, "{status}");
    Ok(())
}

fn edit(lab: &Lab, file: &str, f: impl FnOnce(String) -> String) -> Result<()> {
    let p = lab.manifests.join(file);
    let text = std::fs::read_to_string(&p)?;
    std::fs::write(&p, f(text))?;
    Ok(())
}

/// A scheduler and weights from annotations: the virtual server is updated in place.
fn scheduler_change(lab: &Lab) -> Result<()> {
    edit(lab, "web.yaml", |t| {
        t.replacen("  namespace: default\n", "  namespace: default\n  annotations: {kpr.io/ipvs-scheduler: wrr, kpr.io/ipvs-weights: \"10.244.1.2=3\"}\n", 1)
    })?;
    wait_until("wrr with weights", 30, || {
        let s = sn(lab);
        ensure!(s.contains("-A -t 10.96.0.10:80 -s wrr\n") && s.contains("-a -t 10.96.0.10:80 -r 10.244.1.2:8080 -m -w 3\n"), "{s}");
        Ok(())
    })?;
    let stats = ipvsadm(Some(&node(lab)), "-Ln --stats -t 10.96.0.10:80");
    ensure!(stats.lines().any(|l| l.starts_with("TCP") && l.split_whitespace().nth(2) == Some("90")), "counters reset: the service was re-created:\n{stats}");
    Ok(())
}

/// Endpoint churn: UDP goes at once; TCP drains at weight 0 while a connection lives.
// A failed check leaves the held connection's client to end by itself (it holds for seconds).
#[allow(clippy::zombie_processes)]
fn graceful_termination(lab: &Lab) -> Result<std::process::Child> {
    // Conntrack entries answered by the backend about to go: there are some now...
    let ct = |lab: &Lab| -> Result<usize> {
        let me = std::env::current_exe()?;
        Ok(must(&format!("ip netns exec {} {} ct-count 17 10.96.0.53 53 10.244.3.2 5353", node(lab), me.display())).trim().parse()?)
    };
    let v = burst(lab, "pod", "10.96.0.53:53", "udp", "9");
    ensure!(errors(&v) == 0, "{v}");
    let before = ct(lab)?;
    ensure!(before > 0, "no conntrack entry answered by 10.244.3.2 before its removal");
    edit(lab, "dns.yaml", |t| t.replace("- {addresses: [\"10.244.3.2\"], conditions: {ready: true}, nodeName: node-a}\n", ""))?;
    wait_until("UDP destination removed", 30, || {
        let s = sn(lab);
        ensure!(!s.contains("-a -u 10.96.0.53:53 -r 10.244.3.2:5353"), "{s}");
        Ok(())
    })?;
    // ...and none once it is removed (deleted over ctnetlink, not left to time out).
    wait_until("conntrack entries of the removed UDP backend deleted", 10, || {
        let after = ct(lab)?;
        ensure!(after == 0, "{after} conntrack entries still lead to the removed UDP backend (were {before})");
        Ok(())
    })?;
    let v = burst(lab, "pod", "10.96.0.53:53", "udp", "20");
    ensure!(errors(&v) == 0 && per_backend(&v).len() == 2, "UDP after removal: {v}");

    let mut hold = lab.peer_bg("pod", &["hold", "10.96.0.30:80", "12"]);
    // Wait for the connection before removing its backend.
    let mut line = String::new();
    {
        use std::io::BufRead;
        let out = hold.stdout.as_mut().context("hold stdout")?;
        std::io::BufReader::new(out).read_line(&mut line)?;
    }
    ensure!(line.trim() == "connected", "hold: {line}");
    edit(lab, "drain.yaml", |t| t.replace("10.244.1.2", "10.244.2.2"))?;
    wait_until("draining at weight 0", 30, || {
        let s = sn(lab);
        ensure!(s.contains("-a -t 10.96.0.30:80 -r 10.244.1.2:8080 -m -w 0\n") && s.contains("-a -t 10.96.0.30:80 -r 10.244.2.2:8080 -m -w 1\n"), "{s}");
        Ok(())
    })?;
    let v = burst(lab, "pod", "10.96.0.30:80", "tcp", "10");
    ensure!(per_backend(&v) == vec![("b2".to_string(), 10)], "new connections avoid the draining backend: {v}");
    Ok(hold)
}

fn graceful_termination_finishes(lab: &Lab, hold: std::process::Child) -> Result<()> {
    let v = Lab::finish(hold);
    ensure!(errors(&v) == 0 && per_backend(&v).len() == 1 && per_backend(&v)[0].0 == "b1", "the live connection kept working on its backend: {v}");
    // Gone once IPVS counts no connection (TIME_WAIT counts as inactive for two minutes).
    wait_until("drained destination deleted", 240, || {
        let s = sn(lab);
        ensure!(!s.contains("10.96.0.30:80 -r 10.244.1.2"), "{s}");
        Ok(())
    })
}

/// Services added at run time for kube_proxy_ipvs_semantics.
const SEMANTICS: &str = "apiVersion: v1
kind: Service
metadata: {name: nodeip, namespace: default}
spec:
  clusterIP: 10.96.0.22
  externalIPs: [198.18.0.1]
  ports: [{name: p, port: 8088, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: nodeip-1, namespace: default, labels: {kubernetes.io/service-name: nodeip}}
addressType: IPv4
ports: [{name: p, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.2], conditions: {ready: true}, nodeName: node-a}]
---
apiVersion: v1
kind: Service
metadata: {name: guarded, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.23
  loadBalancerSourceRanges: [192.0.2.0/24]
  ports: [{name: p, port: 80, targetPort: 8080, nodePort: 30083, protocol: TCP}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.11}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: guarded-1, namespace: default, labels: {kubernetes.io/service-name: guarded}}
addressType: IPv4
ports: [{name: p, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.2.2], conditions: {ready: true}, nodeName: node-a}]
";

/// kube-proxy's IPVS-mode semantics: an ExternalIP that is a node address is served but not
/// bound on kube-ipvs0 (shouldBind), and its virtual server goes with its service; the node
/// itself may not reach a LoadBalancer IP whose source ranges exclude it
/// (KUBE-IPVS-OUT-FILTER), and may reach one whose ranges hold it.
fn kube_proxy_ipvs_semantics(lab: &Lab) -> Result<()> {
    let file = lab.manifests.join("semantics.yaml");
    std::fs::write(&file, SEMANTICS)?;
    wait_until("the new services in IPVS", 60, || {
        let s = sn(lab);
        ensure!(s.contains("-A -t 198.18.0.1:8088") && s.contains("-A -t 203.0.113.11:80"), "{s}");
        Ok(())
    })?;
    let addrs = must(&format!("ip -n {} -4 -o addr show dev kube-ipvs0", node(lab)));
    ensure!(!addrs.contains(" 198.18.0.1/") && addrs.contains(" 203.0.113.11/32"), "kube-ipvs0: {addrs}");
    let v = burst(lab, "cl", "198.18.0.1:8088", "tcp", "10");
    ensure!(errors(&v) == 0 && per_backend(&v) == vec![("b1".to_string(), 10)], "client -> ExternalIP on the node's address: {v}");
    let v = burst(lab, "host", "203.0.113.11:80", "tcp", "1");
    ensure!(errors(&v) == 1 && v["first_error"].as_str().unwrap_or("").contains("not permitted"), "the node -> an LB IP its ranges exclude: {v}");
    let v = burst(lab, "host", "203.0.113.10:80", "tcp", "5");
    ensure!(errors(&v) == 0, "the node -> an LB IP whose ranges hold it: {v}");
    std::fs::remove_file(&file)?;
    wait_until("their virtual servers gone", 60, || {
        let s = sn(lab);
        ensure!(!s.contains("198.18.0.1:8088") && !s.contains("203.0.113.11"), "{s}");
        Ok(())
    })
}

/// An SCTP Service (ClusterIP and NodePort) in IPVS mode: SCTP virtual servers, kube-proxy's
/// SCTP sets, and real SCTP associations from outside the cluster CIDR, which reach the
/// backends only masqueraded (they have no route back): the set program matched SCTP.
fn sctp_service(lab: &Lab) -> Result<()> {
    let file = lab.manifests.join("sctp.yaml");
    std::fs::write(
        &file,
        "apiVersion: v1\nkind: Service\nmetadata: {name: sig, namespace: demo}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.60\n  ports: [{name: s, port: 9000, targetPort: 8080, protocol: SCTP, nodePort: 30090}]\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: sig-1, namespace: demo, labels: {kubernetes.io/service-name: sig}}\naddressType: IPv4\n\
         ports: [{name: s, port: 8080, protocol: SCTP}]\nendpoints:\n- {addresses: [10.244.1.2], conditions: {ready: true}}\n- {addresses: [10.244.2.2], conditions: {ready: true}}\n- {addresses: [10.244.3.2], conditions: {ready: true}}\n",
    )?;
    let want = [
        "-A --sctp-service 10.96.0.60:9000 -s rr",
        "-a --sctp-service 10.96.0.60:9000 -r 10.244.1.2:8080 -m -w 1",
        "-a --sctp-service 10.96.0.60:9000 -r 10.244.2.2:8080 -m -w 1",
        "-a --sctp-service 10.96.0.60:9000 -r 10.244.3.2:8080 -m -w 1",
        "-A --sctp-service 198.18.0.1:30090 -s rr",
        "-a --sctp-service 198.18.0.1:30090 -r 10.244.1.2:8080 -m -w 1",
        "-a --sctp-service 198.18.0.1:30090 -r 10.244.2.2:8080 -m -w 1",
        "-a --sctp-service 198.18.0.1:30090 -r 10.244.3.2:8080 -m -w 1",
    ];
    wait_until("the SCTP service in IPVS", 60, || {
        let s = sn(lab);
        let ours: Vec<&str> = s.lines().filter(|l| l.contains("--sctp-service")).collect();
        expect_lines("SCTP virtual servers", &ours.join("\n"), &want)
    })?;
    let sets = kpr(lab, &["ipset"])?;
    for (set, member) in [("KUBE-CLUSTER-IP", "10.96.0.60,sctp:9000"), ("KUBE-NODE-PORT-SCTP-HASH", "198.18.0.1,sctp:30090")] {
        let block = sets.split("\n\n").find(|b| b.starts_with(&format!("Name: {set}\n"))).with_context(|| format!("set {set} listed:\n{sets}"))?;
        ensure!(block.lines().any(|l| l == member), "{set} lacks {member}:\n{block}");
    }
    for (what, target) in [("client -> ClusterIP SCTP (masqueraded)", "10.96.0.60:9000".to_string()), ("client -> NodePort SCTP", format!("{NODE_IP}:30090"))] {
        let v = burst(lab, "cl", &target, "sctp", "30");
        ensure!(errors(&v) == 0 && per_backend(&v).len() == 3, "{what}: {v}");
        println!("  {what}: {v}");
    }
    std::fs::remove_file(&file)?;
    wait_until("the SCTP virtual servers gone", 60, || {
        let s = sn(lab);
        ensure!(!s.contains("--sctp-service"), "{s}");
        Ok(())
    })
}

/// IPv6 in IPVS mode: a dual-stack Service's IPv6 virtual servers (ipvsadm the oracle), its
/// VIPs on kube-ipvs0, kube-proxy's KUBE-6-* sets, the ip6tables rules, the IPv6 source-range
/// firewall for the node's own sockets, and real IPv6 TCP and UDP. The backends have an IPv6 route to the cluster only, so the client outside it (on the
/// underlay) is answered only when the node masqueraded it: through ClusterIP (off the IPv6
/// cluster CIDR), NodePort on the node's IPv6 address, and the LoadBalancer IP.
fn ipv6_service(lab: &Lab) -> Result<()> {
    let (n, cl) = (node(lab), lab.ns("cl"));
    // (The lab gives node A its IPv6 underlay address, NODE_IP6, and IPv6 forwarding, and the
    // client its own, CLIENT_IP6.)
    for net in ["fd00:96::/112", "2001:db8::/64"] {
        must(&format!("ip -n {cl} route add {net} via {NODE_IP6}"));
    }
    for (role, third) in [("b1", 1), ("b2", 2), ("b3", 3), ("pod", 9)] {
        let ns = lab.ns(role);
        must(&format!("ip -n {n} addr add fd00:244:{third}::1/64 dev h{role} nodad"));
        must(&format!("ip -n {ns} addr add fd00:244:{third}::2/64 dev eth0 nodad"));
        // The cluster and its services; never the client's underlay.
        for net in ["fd00:244::/32", "fd00:96::/112"] {
            must(&format!("ip -n {ns} route add {net} via fd00:244:{third}::1"));
        }
    }
    let file = lab.manifests.join("dual.yaml");
    std::fs::write(
        &file,
        "apiVersion: v1\nkind: Service\nmetadata: {name: dual, namespace: demo}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.70\n  clusterIPs: [10.96.0.70, \"fd00:96::70\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  loadBalancerSourceRanges: [\"fd00:198::2/128\"]\n\
         \x20 ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30086}, {name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30087}]\n\
         status: {loadBalancer: {ingress: [{ip: \"2001:db8::70\"}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: dual-6, namespace: demo, labels: {kubernetes.io/service-name: dual}}\naddressType: IPv6\n\
         ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]\nendpoints:\n\
         - {addresses: [\"fd00:244:1::2\"], conditions: {ready: true}}\n- {addresses: [\"fd00:244:2::2\"], conditions: {ready: true}}\n- {addresses: [\"fd00:244:3::2\"], conditions: {ready: true}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: dual-4, namespace: demo, labels: {kubernetes.io/service-name: dual}}\naddressType: IPv4\n\
         ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]\nendpoints:\n- {addresses: [10.244.1.2], conditions: {ready: true}}\n",
    )?;
    let mut want: Vec<String> = Vec::new();
    for (vs, proto, bport) in [
        ("[fd00:96::70]:80", "-t", 8080),
        ("[fd00:96::70]:53", "-u", 5353),
        ("[2001:db8::70]:80", "-t", 8080),
        ("[2001:db8::70]:53", "-u", 5353),
        ("[fd00:198::1]:30086", "-t", 8080),
        ("[fd00:198::1]:30087", "-u", 5353),
    ] {
        want.push(format!("-A {proto} {vs} -s rr"));
        for i in 1..=3 {
            want.push(format!("-a {proto} {vs} -r [fd00:244:{i}::2]:{bport} -m -w 1"));
        }
    }
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    wait_until("the IPv6 virtual servers", 60, || {
        let s = sn(lab);
        let ours: Vec<&str> = s.lines().filter(|l| l.contains('[')).collect();
        expect_lines("IPv6 virtual servers", &ours.join("\n"), &want)
    })?;
    // The IPv4 half beside it, with its own family's endpoint.
    let s = sn(lab);
    ensure!(
        s.contains("-A -t 10.96.0.70:80 -s rr")
            && s.contains("-a -t 10.96.0.70:80 -r 10.244.1.2:8080 -m -w 1")
            && !s.lines().any(|l| l.starts_with("-a -t 10.96.0.70:80 -r [")),
        "{s}"
    );
    let addrs = must(&format!("ip -n {n} -6 -o addr show dev kube-ipvs0"));
    for vip in ["fd00:96::70/128", "2001:db8::70/128"] {
        ensure!(addrs.contains(vip), "kube-ipvs0 lacks {vip}:\n{addrs}");
    }
    let sets = kpr(lab, &["ipset"])?;
    for (set, member) in [
        ("KUBE-6-CLUSTER-IP", "fd00:96::70,tcp:80"),
        ("KUBE-6-CLUSTER-IP", "fd00:96::70,udp:53"),
        ("KUBE-6-LOAD-BALANCER", "2001:db8::70,tcp:80"),
        ("KUBE-6-NODE-PORT-TCP", "30086"),
        ("KUBE-6-LOOP-BACK", "fd00:244:2::2,tcp:8080,fd00:244:2::2"),
        ("KUBE-6-IPVS-IPS", "fd00:96::70"),
        ("KUBE-6-LOAD-BALANCER-SOURCE-CIDR", "2001:db8::70,tcp:80,fd00:198::2/128"),
        ("KPR-6-LOAD-BALANCER-NODE-DENY", "2001:db8::70,tcp:80"),
        ("KUBE-CLUSTER-IP", "10.96.0.70,tcp:80"),
    ] {
        let block = sets.split("\n\n").find(|b| b.starts_with(&format!("Name: {set}\n"))).with_context(|| format!("set {set} listed:\n{sets}"))?;
        ensure!(block.lines().any(|l| l == member), "{set} lacks {member}:\n{block}");
    }
    let nat6 = must(&format!("ip netns exec {n} ip6tables-save -t nat"));
    let rules = nat6.lines().filter(|l| l.starts_with("-A KPR-POSTROUTING")).count();
    ensure!(rules == 5 && nat6.contains("-A POSTROUTING -j KPR-POSTROUTING"), "ip6tables KPR-POSTROUTING:\n{nat6}");
    for (what, role, target, proto) in [
        ("pod -> IPv6 ClusterIP (no masquerade needed)", "pod", "[fd00:96::70]:80", "tcp"),
        ("client -> IPv6 ClusterIP (masqueraded: off the IPv6 cluster CIDR)", "cl", "[fd00:96::70]:80", "tcp"),
        ("client -> IPv6 ClusterIP UDP (masqueraded)", "cl", "[fd00:96::70]:53", "udp"),
        ("client -> IPv6 NodePort", "cl", "[fd00:198::1]:30086", "tcp"),
        ("client -> IPv6 NodePort UDP", "cl", "[fd00:198::1]:30087", "udp"),
        ("client -> IPv6 LoadBalancer IP", "cl", "[2001:db8::70]:80", "tcp"),
    ] {
        let v = burst(lab, role, target, proto, "30");
        ensure!(errors(&v) == 0 && per_backend(&v).len() == 3, "{what}: {v}");
        println!("  {what}: {v}");
    }
    // KUBE-IPVS-OUT-FILTER over IPv6: the node's own address is outside the LB's source range.
    let v = burst(lab, "host", "[2001:db8::70]:80", "tcp", "1");
    ensure!(errors(&v) == 1 && v["first_error"].as_str().unwrap_or("").contains("not permitted"), "the node -> an IPv6 LB IP its ranges exclude: {v}");
    // Hairpin over IPv6: a backend reaching itself through its service (KUBE-6-LOOP-BACK).
    let v = burst(lab, "b1", "[fd00:96::70]:80", "tcp", "30");
    ensure!(errors(&v) == 0 && per_backend(&v).iter().any(|(b, _)| b == "b1"), "IPv6 hairpin b1 -> ClusterIP -> b1: {v}");
    // KUBE-IPVS-FILTER: an IPv6 VIP at a port no service has is refused (ICMPv6 port unreachable).
    let v = burst(lab, "pod", "[fd00:96::70]:81", "tcp", "1");
    ensure!(errors(&v) == 1 && v["first_error"].as_str().unwrap_or("").contains("refused"), "[fd00:96::70]:81 must be refused: {v}");
    std::fs::remove_file(&file)?;
    wait_until("the IPv6 virtual servers gone", 60, || {
        let s = sn(lab);
        ensure!(!s.contains('['), "{s}");
        let addrs = must(&format!("ip -n {n} -6 -o addr show dev kube-ipvs0"));
        ensure!(!addrs.contains("fd00:96::70"), "kube-ipvs0 still holds the IPv6 VIP:\n{addrs}");
        Ok(())
    })
}

/// DR and TUN: the real servers hold the VIP themselves and answer the client directly.
fn dr_and_tun_traffic(lab: &Lab) -> Result<()> {
    let (b2, b3, n, cl) = (lab.ns("b2"), lab.ns("b3"), node(lab), lab.ns("cl"));
    for b in [&b2, &b3] {
        must(&format!("ip -n {b} route add 198.18.0.0/24 via 10.244.{}.1", if *b == b2 { 2 } else { 3 }));
    }
    // DR: VIP on lo, no ARP for it (the documented backend setup).
    must(&format!("ip -n {b2} addr add 10.96.0.40/32 dev lo"));
    must(&format!("ip netns exec {b2} sysctl -qw net.ipv4.conf.all.arp_ignore=1 net.ipv4.conf.all.arp_announce=2"));
    // TUN: ipip decapsulation on tunl0, VIP on lo, no reverse-path check on the tunnel.
    let _ = Command::new("modprobe").arg("ipip").status();
    must(&format!("ip -n {b3} link set tunl0 up"));
    must(&format!("ip -n {b3} addr add 10.96.0.41/32 dev lo"));
    must(&format!("ip netns exec {b3} sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.tunl0.rp_filter=0"));
    // The answers leave the backends with the VIP as source and cross the node back.
    must(&format!("ip netns exec {n} sysctl -qw net.ipv4.conf.all.accept_local=1 net.ipv4.conf.all.rp_filter=0"));
    for i in 1..=3 {
        must(&format!("ip netns exec {n} sysctl -qw net.ipv4.conf.hb{i}.rp_filter=0 net.ipv4.conf.hb{i}.accept_local=1"));
    }
    let v = lab.peer("cl", &["burst", "10.96.0.40:8080", "tcp", "10"]);
    ensure!(errors(&v) == 0 && per_backend(&v) == vec![("b2".to_string(), 10)], "DR: {v} ({cl})");
    let v = lab.peer("cl", &["burst", "10.96.0.41:8080", "tcp", "10"]);
    ensure!(errors(&v) == 0 && per_backend(&v) == vec![("b3".to_string(), 10)], "TUN: {v}");
    Ok(())
}

/// A restart rewrites nothing: same state, and the counters show no destination re-created.
fn restart_changes_nothing(lab: &mut Lab) -> Result<()> {
    let before = sn(lab);
    // IPVS folds its per-CPU counters every 2 s: let them settle first.
    std::thread::sleep(Duration::from_millis(2500));
    let stats_before = ipvsadm(Some(&node(lab)), "-Ln --stats");
    let log_len = lab.agent_log().len();
    lab.kill_agent();
    lab.start_agent();
    wait_until("first sync after restart", 60, || {
        let log = lab.agent_log();
        ensure!(log[log_len.min(log.len())..].contains("synced"), "no sync yet");
        Ok(())
    })?;
    let log = lab.agent_log();
    let line = log[log_len..].lines().find(|l| l.contains("synced")).unwrap_or("").to_string();
    ensure!(line.contains("writes=0") && line.contains("deletes=0"), "the first sync after a restart wrote: {line}");
    ensure!(sn(lab) == before, "state changed across the restart");
    std::thread::sleep(Duration::from_millis(2500));
    let stats_after = ipvsadm(Some(&node(lab)), "-Ln --stats");
    // A re-created destination would count from zero again.
    let conns = |s: &str| -> Vec<(String, u64)> {
        let mut svc = String::new();
        let mut v = Vec::new();
        for l in s.lines() {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                ["->", addr, n, ..] => v.push((format!("{svc} {addr}"), n.parse().unwrap_or(0))),
                [p, addr, ..] if *p == "TCP" || *p == "UDP" => svc = format!("{p} {addr}"),
                _ => {}
            }
        }
        v
    };
    let (b, a) = (conns(&stats_before), conns(&stats_after));
    ensure!(b.len() == a.len() && b.len() > 20, "destinations differ: {b:?} / {a:?}");
    for ((k1, n1), (k2, n2)) in b.iter().zip(&a) {
        ensure!(k1 == k2 && n2 >= n1, "{k1}: {n1} connections before the restart, {k2}: {n2} after (re-created?)");
    }
    Ok(())
}

/// IPv4 virtual IPs as kpr's local routes: the VIPs move off kube-ipvs0's addresses (IPv6 ones
/// stay), every path still answers, IPVS is not touched; and back.
fn vip_binding_routes(lab: &mut Lab) -> Result<()> {
    let n = node(lab);
    // Empty until the first sync made kube-ipvs0.
    let out = |cmd: String| String::from_utf8_lossy(&sh(&cmd).stdout).into_owned();
    let v4_addrs = || -> BTreeSet<String> {
        out(format!("ip -n {n} -4 -o addr show dev kube-ipvs0")).split_whitespace().filter_map(|w| w.strip_suffix("/32")).map(str::to_string).collect()
    };
    let routes = || -> BTreeSet<String> {
        out(format!("ip -n {n} -4 route show table local proto 107"))
            .lines()
            .filter_map(|l| l.strip_prefix("local ").and_then(|r| r.split_whitespace().next()).map(str::to_string))
            .collect()
    };
    wait_until("the VIPs bound", 60, || {
        ensure!(v4_addrs().contains("10.96.0.10") && v4_addrs().contains("203.0.113.10"), "kube-ipvs0: {:?}", v4_addrs());
        Ok(())
    })?;
    let v6_before = out(format!("ip -n {n} -6 -o addr show dev kube-ipvs0"));
    let vips = v4_addrs();
    ensure!(routes().is_empty(), "before: routes {:?}", routes());
    let state = sn(lab);
    let traffic = |lab: &Lab, how: &str| -> Result<()> {
        // Each virtual server's real servers with a weight (earlier checks change some).
        let state = sn(lab);
        let serving = |vs: &str| state.lines().filter(|l| l.starts_with(&format!("-a {vs} ")) && !l.ends_with(" -w 0")).count();
        for (role, target, proto) in
            [("cl", "10.96.0.10:80", "tcp"), ("pod", "10.96.0.53:53", "udp"), ("cl", "203.0.113.10:80", "tcp"), ("node", "10.96.0.10:80", "tcp")]
        {
            let flag = if proto == "tcp" { "-t" } else { "-u" };
            let backends = serving(&format!("{flag} {target}"));
            ensure!(backends > 0, "{how}: {target} has no real server:\n{state}");
            let v = burst(lab, role, target, proto, "12");
            ensure!(errors(&v) == 0 && per_backend(&v).len() == backends, "{how}: {role} -> {target} {proto}: {v}");
        }
        let v = burst(lab, "pod", "10.96.0.10:81", "tcp", "1");
        ensure!(errors(&v) == 1 && v["first_error"].as_str().unwrap_or("").contains("refused"), "{how}: VIP:81 must be refused: {v}");
        println!("  {how}: ClusterIP TCP and UDP, LoadBalancer IP, from the node, VIP:81 refused");
        Ok(())
    };
    let restart = |lab: &mut Lab, binding: &str| {
        lab.kill_agent();
        lab.agent_args.retain(|a| !a.starts_with("--ipvs-vip-binding"));
        lab.agent_args.push(format!("--ipvs-vip-binding={binding}"));
        lab.start_agent();
    };
    restart(lab, "route");
    wait_until("the VIPs as routes", 60, || {
        ensure!(routes() == vips && v4_addrs().is_empty(), "routes {:?}, IPv4 addresses {:?}", routes(), v4_addrs());
        Ok(())
    })?;
    ensure!(out(format!("ip -n {n} -6 -o addr show dev kube-ipvs0")) == v6_before, "IPv6 VIPs stay addresses");
    ensure!(sn(lab) == state, "IPVS changed with the binding");
    traffic(lab, "VIPs as local routes")?;
    restart(lab, "address");
    wait_until("the VIPs as addresses again", 60, || {
        ensure!(routes().is_empty() && v4_addrs() == vips, "routes {:?}, IPv4 addresses {:?}", routes(), v4_addrs());
        Ok(())
    })?;
    traffic(lab, "VIPs as addresses again")
}

/// `kpr cleanup` leaves nothing of IPVS mode behind.
fn cleanup_leaves_nothing(lab: &mut Lab) -> Result<()> {
    lab.kill_agent();
    kpr(lab, &["cleanup"])?;
    let n = node(lab);
    ensure!(sn(lab).trim().is_empty(), "IPVS services left: {}", sn(lab));
    ensure!(!sh(&format!("ip -n {n} link show kube-ipvs0")).status.success(), "kube-ipvs0 left");
    for (save, table) in [("iptables-save", "nat"), ("iptables-save", "filter"), ("ip6tables-save", "nat"), ("ip6tables-save", "filter")] {
        let s = must(&format!("ip netns exec {n} {save} -t {table}"));
        ensure!(!s.contains("KPR"), "{save} {table} rules left:\n{s}");
    }
    let pins: Vec<PathBuf> = std::fs::read_dir(lab.pins.path()).map(|r| r.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    ensure!(pins.is_empty(), "pins left: {pins:?}");
    for i in ["up0", "hb1", "hpod"] {
        let f = must(&format!("tc -n {n} filter show dev {i} ingress"));
        ensure!(f.trim().is_empty(), "tc filter left on {i}: {f}");
    }
    Ok(())
}

/// A held TCP connection, once it is established.
// A failed check leaves the held connection's client to end by itself (it holds for seconds).
#[allow(clippy::zombie_processes)]
fn held(lab: &Lab, role: &str, target: &str, secs: &str) -> Result<std::process::Child> {
    let mut hold = lab.peer_bg(role, &["hold", target, secs]);
    let mut line = String::new();
    {
        use std::io::BufRead;
        let out = hold.stdout.as_mut().context("hold stdout")?;
        std::io::BufReader::new(out).read_line(&mut line)?;
    }
    ensure!(line.trim() == "connected", "hold {role} -> {target}: {line}");
    Ok(hold)
}

/// New connections IPVS counted for a virtual server (ipvsadm --stats).
fn ipvs_conns(lab: &Lab, vs: &str) -> Result<u64> {
    // IPVS folds its per-CPU counters every 2 s.
    std::thread::sleep(Duration::from_millis(2500));
    let stats = ipvsadm(Some(&node(lab)), &format!("-Ln --stats -t {vs}"));
    stats.lines().find(|l| l.starts_with("TCP")).and_then(|l| l.split_whitespace().nth(2)).and_then(|c| c.parse().ok()).context("stats line")
}

/// Switching modes on a running node keeps established TCP connections, both ways
/// (from a pod to a ClusterIP, from a client outside to a NodePort, masqueraded); new
/// connections go to the new mode at once; the old mode's objects go once its connections
/// have ended.
fn mode_switch(lab: &mut Lab) -> Result<()> {
    let n = node(lab);
    let ipvs_args = lab.agent_args.clone();
    let ebpf_args: Vec<String> = ipvs_args.iter().map(|a| if a == "ipvs" { "ebpf".to_string() } else { a.clone() }).collect();
    let nodeport = format!("{NODE_IP}:30080");
    let finished = |what: &str, h: std::process::Child| -> Result<()> {
        let v = Lab::finish(h);
        ensure!(errors(&v) == 0 && per_backend(&v).len() == 1, "{what}: the held connection broke or moved: {v}");
        println!("  {what}: {v}");
        Ok(())
    };
    // (The checks before may have changed the manifests: the state is whatever they program.)
    let programmed = |lab: &Lab| -> Result<String> {
        let s = sn(lab);
        ensure!(s.contains("-a -t 10.96.0.10:80 -r") && s.contains(&format!("-a -t {nodeport} -r")), "not programmed yet:\n{s}");
        Ok(s)
    };
    lab.kill_agent();
    lab.agent_args = ipvs_args.clone();
    lab.start_agent();
    wait_until("IPVS mode programmed", 60, || programmed(lab).map(|_| ()))?;
    std::thread::sleep(Duration::from_secs(2));
    let state = sorted_lines(&programmed(lab)?);
    // Held long enough to keep IPVS mode's state (it goes once they end) through the checks
    // below that read its counters: on a loaded emulated guest the switch and those checks
    // have taken over 30 s.
    let under_ipvs = [held(lab, "pod", "10.96.0.10:80", "60")?, held(lab, "cl", &nodeport, "60")?];

    // IPVS -> eBPF.
    let log_len = lab.agent_log().len();
    lab.kill_agent();
    lab.agent_args = ebpf_args;
    lab.start_agent();
    wait_until("the fast path's handover from IPVS", 60, || {
        ensure!(lab.agent_log()[log_len..].contains("IPVS keeps serving its established connections"), "no handover logged");
        let v = burst(lab, "pod", "10.96.0.10:80", "tcp", "3");
        ensure!(errors(&v) == 0, "{v}");
        Ok(())
    })?;
    let status = kpr(lab, &["status"])?;
    ensure!(status.contains("handover: connections of the proxy before"), "kpr status shows the handover:\n{status}");
    let before = ipvs_conns(lab, "10.96.0.10:80")?;
    let v = burst(lab, "pod", "10.96.0.10:80", "tcp", "10");
    ensure!(errors(&v) == 0 && per_backend(&v).len() >= 2, "new connections under the fast path: {v}");
    let v = burst(lab, "cl", &nodeport, "tcp", "10");
    ensure!(errors(&v) == 0, "new NodePort connections under the fast path: {v}");
    ensure!(ipvs_conns(lab, "10.96.0.10:80")? == before, "new connections must bypass IPVS once the fast path runs");
    let under_ebpf = [held(lab, "pod", "10.96.0.10:80", "75")?, held(lab, "cl", &nodeport, "75")?];
    let [a, b] = under_ipvs;
    finished("pod -> ClusterIP held across IPVS -> eBPF", a)?;
    finished("client -> NodePort held across IPVS -> eBPF", b)?;
    wait_until("IPVS mode's state removed once its connections ended", 30, || {
        ensure!(sn(lab).trim().is_empty(), "IPVS still has:\n{}", sn(lab));
        ensure!(!sh(&format!("ip -n {n} link show kube-ipvs0")).status.success(), "kube-ipvs0 left");
        let nat = must(&format!("ip netns exec {n} iptables-save -t nat"));
        ensure!(!nat.contains("KPR-POSTROUTING"), "fixed rules left:\n{nat}");
        let up = must(&format!("tc -n {n} filter show dev up0 ingress"));
        ensure!(!up.contains("kpr_tc_ipset"), "set matching left on the uplink: {up}");
        Ok(())
    })?;

    // eBPF -> IPVS.
    let log_len = lab.agent_log().len();
    lab.kill_agent();
    lab.agent_args = ipvs_args;
    lab.start_agent();
    wait_until("IPVS mode programmed behind the draining fast path", 60, || {
        ensure!(lab.agent_log()[log_len..].contains("switch from the eBPF fast path: it keeps serving its flows"), "no drain logged");
        let now = sorted_lines(&sn(lab));
        ensure!(now == state, "IPVS state after the switch back:\n{}\nexpected\n{}", now.join("\n"), state.join("\n"));
        Ok(())
    })?;
    let status = kpr(lab, &["status"])?;
    ensure!(status.contains("handover: the fast path serves its remaining flows"), "kpr status shows the drain:\n{status}");
    let v = burst(lab, "pod", "10.96.0.10:80", "tcp", "10");
    ensure!(errors(&v) == 0 && per_backend(&v).len() >= 2, "new connections under IPVS: {v}");
    let v = burst(lab, "cl", &nodeport, "tcp", "10");
    ensure!(errors(&v) == 0, "new NodePort connections under IPVS: {v}");
    let conns = ipvs_conns(lab, "10.96.0.10:80")?;
    ensure!(conns >= 10, "new connections must go to IPVS while the fast path drains: IPVS counted {conns}");
    let [a, b] = under_ebpf;
    finished("pod -> ClusterIP held across eBPF -> IPVS", a)?;
    finished("client -> NodePort held across eBPF -> IPVS", b)?;
    wait_until("the fast path detached once its flows ended", 90, || {
        for i in ["up0", "hpod", "hb1"] {
            let f = must(&format!("tc -n {n} filter show dev {i} ingress")) + &must(&format!("tc -n {n} filter show dev {i} egress"));
            ensure!(!["kpr_tc_ingress", "kpr_tc_uplink", "kpr_tc_egress"].iter().any(|p| f.contains(p)), "fast path still on {i}: {f}");
        }
        ensure!(!must(&format!("ip -n {n} link show up0")).contains("xdp"), "XDP still on up0");
        Ok(())
    })?;
    let f = must(&format!("tc -n {n} filter show dev hpod ingress"));
    ensure!(f.contains("kpr_tc_ipset"), "the set matching stays: {f}");
    let status = kpr(lab, &["status"])?;
    ensure!(!status.contains("handover:"), "the drain is over:\n{status}");
    let v = burst(lab, "pod", "10.96.0.10:80", "tcp", "10");
    ensure!(errors(&v) == 0 && per_backend(&v).len() >= 2, "IPVS mode alone: {v}");
    lab.kill_agent();
    kpr(lab, &["cleanup"])?;
    Ok(())
}

/// kube-proxy's packet-flow tables sent through kpr in IPVS mode (the host sends them through
/// eBPF mode): every row agrees or is a difference `tests/conformance/differences.yaml` lists
/// for IPVS with its reason. The matrix goes to KPR_VM_OUT/conformance-ipvs.md.
fn conformance_ipvs() -> Result<()> {
    use kpr_lab::conformance::{self, topology::ConformanceLab};
    let dir = conformance::data_dir();
    let runs = conformance::suite(&dir);
    let known = conformance::differences(&dir);
    let mut lab = ConformanceLab::build("kcv", &runs, &["--mode", "ipvs"]);
    let outcomes = lab.run_all(&runs, "ipvs", &known);
    let matrix = conformance::matrix("ipvs", &outcomes, &known);
    if let Some(out) = std::env::var_os("KPR_VM_OUT") {
        std::fs::write(Path::new(&out).join("conformance-ipvs.md"), &matrix)?;
    }
    let failures = conformance::failures(&known, "ipvs", &outcomes);
    println!("{}", matrix.lines().filter(|l| l.starts_with("- IPVS")).collect::<String>());
    ensure!(failures.is_empty(), "{} rows fail:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}

fn manifests_copy() -> Result<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("vm-manifests");
    let dst = std::env::temp_dir().join(format!("kpr-vm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst)?;
    for e in std::fs::read_dir(src)?.flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name()))?;
    }
    Ok(dst)
}

/// `kpr-vm-tests ct-count PROTO VIP PORT BACKEND BPORT`: conntrack entries of that service
/// answered by that backend, in the caller's network namespace (run with `ip netns exec`).
fn ct_count(args: &[String]) -> Result<usize> {
    let p = |i: usize| args.get(i).context("ct-count PROTO VIP PORT BACKEND BPORT");
    let mut ct = proxy_agent::netlink::ctnetlink::NetlinkConntrack::connect().map_err(anyhow::Error::msg)?;
    ct.count(p(0)?.parse()?, p(1)?.parse()?, p(2)?.parse()?, p(3)?.parse()?, p(4)?.parse()?).map_err(anyhow::Error::msg)
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("ct-count") {
        match ct_count(&argv[2..]) {
            Ok(n) => println!("{n}"),
            Err(e) => {
                eprintln!("{e:#}");
                std::process::exit(1);
            }
        }
        return;
    }
    if std::env::var_os("KPR_VM_OUT").is_none() && std::env::var_os("KPR_VM_TESTS_ANYWHERE").is_none() {
        eprintln!("kpr-vm-tests runs inside the QEMU guest: `cargo xtask vm-test` (it flushes this kernel's IPVS table)");
        std::process::exit(2);
    }
    let filter = std::env::args().nth(1).unwrap_or_default();
    let mut results: Vec<(&str, Result<()>)> = Vec::new();
    let mut run = |name: &'static str, r: Result<()>| {
        match &r {
            Ok(()) => println!("test vm::{name} ... ok"),
            Err(e) => println!("test vm::{name} ... FAILED\n{e:#}"),
        }
        results.push((name, r));
    };
    let wanted = |name: &str| filter.is_empty() || name.contains(&filter);
    if wanted("client_api") {
        run("client_api", client_api());
    }
    if wanted("programs_load") {
        run("programs_load", programs_load());
    }
    if wanted("pipelined_writes") {
        run("pipelined_writes", pipelined_writes());
    }
    if wanted("conformance") {
        run("conformance", conformance_ipvs());
    }
    // `lab:NAME`: the lab, then only that check (a quicker turn while working on one).
    let lab_only = filter.strip_prefix("lab:").map(str::to_string);
    let pick = |name: &str| lab_only.as_deref().is_none_or(|o| o == name);
    if wanted("lab") || lab_only.is_some() {
        let setup = (|| -> Result<Lab> {
            let mut lab = Lab::build_with(PREFIX, &manifests_copy()?, LabSpec { cni: Cni::Ptp, ..LabSpec::default() });
            // The IPv6 cluster CIDR beside the lab's IPv4 one (ipv6_service).
            lab.agent_args = vec!["--mode".into(), "ipvs".into(), "--cluster-cidr".into(), "fd00:244::/32".into()];
            lab.start_agent();
            Ok(lab)
        })();
        match setup {
            Err(e) => run("lab_setup", Err(e)),
            Ok(mut lab) => {
                if pick("programs_the_manifests") {
                    run("programs_the_manifests", programs_the_manifests(&lab));
                }
                if pick("nat_traffic_with_masquerade") {
                    run("nat_traffic_with_masquerade", nat_traffic_with_masquerade(&lab));
                }
                if pick("scheduler_change") {
                    run("scheduler_change", scheduler_change(&lab));
                }
                if pick("kube_proxy_ipvs_semantics") {
                    run("kube_proxy_ipvs_semantics", kube_proxy_ipvs_semantics(&lab));
                }
                if pick("sctp_service") {
                    run("sctp_service", sctp_service(&lab));
                }
                if pick("ipv6_service") {
                    run("ipv6_service", ipv6_service(&lab));
                }
                // The drain is finished after the other checks: TIME_WAIT lasts two minutes.
                let hold = if !pick("graceful_termination") {
                    None
                } else {
                    match graceful_termination(&lab) {
                        Ok(h) => {
                            run("graceful_termination", Ok(()));
                            Some(h)
                        }
                        Err(e) => {
                            run("graceful_termination", Err(e));
                            None
                        }
                    }
                };
                if pick("dr_and_tun_traffic") {
                    run("dr_and_tun_traffic", dr_and_tun_traffic(&lab));
                }
                if pick("restart_changes_nothing") {
                    run("restart_changes_nothing", restart_changes_nothing(&mut lab));
                }
                if pick("vip_binding_routes") {
                    run("vip_binding_routes", vip_binding_routes(&mut lab));
                }
                if let Some(h) = hold {
                    run("graceful_termination_finishes", graceful_termination_finishes(&lab, h));
                }
                if pick("cleanup_leaves_nothing") {
                    run("cleanup_leaves_nothing", cleanup_leaves_nothing(&mut lab));
                }
                if pick("mode_switch") {
                    run("mode_switch", mode_switch(&mut lab));
                }
                if results.iter().any(|(_, r)| r.is_err()) {
                    println!("--- agent log ---\n{}", lab.agent_log());
                }
            }
        }
    }
    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    let passed = results.len() - failed;
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!("test result: {verdict}. {passed} passed; {failed} failed (kpr-vm-tests, in the IPVS guest)");
    if let Some(out) = std::env::var_os("KPR_VM_OUT") {
        let _ = std::fs::write(Path::new(&out).join("summary.txt"), format!("{passed} passed; {failed} failed\n"));
    }
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
