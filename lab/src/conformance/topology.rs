//! kube-proxy's fake proxier's node, rebuilt with namespaces, and each row sent through kpr.
//!
//! - `node`: the node. Its uplink `up0` holds 192.168.0.2/24, 192.168.1.2/24 and
//!   192.168.99.11/24 (the fake's eth0); a server answers "node" on every port the rows use, so
//!   traffic left to the node's own sockets shows as untouched, not as a reject. Its default
//!   route leads to `sink`.
//! - A namespace per pod address (10.0.0.0/8): every endpoint, and every pod that is a client,
//!   on a Calico-shaped veth (`cali*`, a /32 route, proxy ARP). Each answers "endpoint" on
//!   every port the endpoints use.
//! - `world`: the clients outside the cluster (203.0.113.0/24 and any other source), on the
//!   uplink's link.
//! - `sink`: takes what the node routes on untranslated (a ClusterIP nobody serves, a
//!   load-balancer IP the node does not own) and answers "sink": untouched too.
//!
//! The node's own clients run in its namespace and the agent's cgroup, as a node's processes do.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::{agrees, answer_of, documented, documents, Difference, Outcome, Row, Run, Settings};
use crate::{must, sh, sibling_bin, Netns, PinDir};

/// The fake proxier's node name, IPs and pod CIDR.
pub const NODE_NAME: &str = "test-node";
pub const NODE_IPS: [&str; 3] = ["192.168.0.2", "192.168.1.2", "192.168.99.11"];
pub const POD_CIDR: &str = "10.0.0.0/8";

fn in_pod_cidr(a: Ipv4Addr) -> bool {
    a.octets()[0] == 10
}

fn on_node(a: Ipv4Addr) -> bool {
    a.is_loopback() || NODE_IPS.contains(&a.to_string().as_str())
}

pub struct ConformanceLab {
    prefix: String,
    dir: PathBuf,
    pins: PinDir,
    cgroup: PathBuf,
    kpr: PathBuf,
    peer: PathBuf,
    /// Pod address → its namespace.
    pods: BTreeMap<Ipv4Addr, String>,
    /// `kpr run` arguments that pick the mode (e.g. --mode ipvs).
    mode_args: Vec<String>,
    agent: Option<Child>,
    log: PathBuf,
    next_port: u16,
    /// The world's pass program (unpinned on drop).
    _switch: PinDir,
    // Dropped last.
    _netns: Netns,
}

/// The first source port a probe uses; each probe takes the next ones, so no two connections of
/// a run share a 5-tuple.
const FIRST_PORT: u16 = 10_000;

impl ConformanceLab {
    /// Builds the node for every run of the suite: the pods every table names, the world's
    /// clients, and servers on every port a row or an endpoint uses.
    #[allow(clippy::zombie_processes)]
    pub fn build(prefix: &str, runs: &[Run], mode_args: &[&str]) -> Self {
        let (mut pod_ips, mut world_ips, mut sink_ips) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        let (mut row_ports, mut endpoint_ports, mut health_ports) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        for run in runs {
            health_ports.extend(health_check_ports(&run.objects));
            for (addr, port) in endpoints_of(&run.objects) {
                pod_ips.insert(addr);
                endpoint_ports.insert(port);
            }
            for r in &run.rows {
                let f = &r.flow;
                row_ports.insert(f.port);
                match f.source {
                    s if on_node(s) => {}
                    s if in_pod_cidr(s) => {
                        pod_ips.insert(s);
                    }
                    s => {
                        world_ips.insert(s);
                    }
                }
                if !on_node(f.destination) && !in_pod_cidr(f.destination) {
                    sink_ips.insert(f.destination);
                }
            }
        }
        let pods: BTreeMap<Ipv4Addr, String> = pod_ips.iter().enumerate().map(|(i, a)| (*a, format!("{prefix}-p{i}"))).collect();
        let (node, world, sink) = (format!("{prefix}-node"), format!("{prefix}-world"), format!("{prefix}-sink"));
        let mut names = vec![node.clone(), world.clone(), sink.clone()];
        names.extend(pods.values().cloned());
        let netns = Netns::create(&names.iter().map(String::as_str).collect::<Vec<_>>());

        must(&format!("ip netns exec {node} sysctl -qw net.ipv4.ip_forward=1"));
        must(&format!("ip -n {node} link add up0 type veth peer name w0 netns {world}"));
        for a in NODE_IPS {
            must(&format!("ip -n {node} addr add {a}/24 dev up0"));
        }
        must(&format!("ip -n {node} link set up0 up"));
        must(&format!("ip -n {world} link set w0 up"));
        for a in &world_ips {
            must(&format!("ip -n {world} addr add {a}/32 dev w0"));
            must(&format!("ip -n {node} route add {a}/32 dev up0 scope link"));
        }
        // Every connection the world opens leaves for the node, also to an address the world
        // itself holds: a load balancer that sends from its own IP ("same node to LB" rows).
        // Its own sockets' routes come from table 100, looked up before the local table.
        must(&format!("ip -n {world} route add 192.168.0.0/24 dev w0 scope link table 100"));
        must(&format!("ip -n {world} route add default via 192.168.0.2 dev w0 table 100"));
        must(&format!("ip -n {world} rule add pref 10 iif lo lookup 100"));
        must(&format!("ip -n {world} rule add pref 20 lookup local"));
        must(&format!("ip -n {world} rule del pref 0"));

        // The sink: any address the rows aim at that is neither the node's nor a pod's is local
        // there, so whatever the node routes on untranslated is answered.
        must(&format!("ip -n {node} link add sk0 type veth peer name s0 netns {sink}"));
        must(&format!("ip -n {node} addr add 169.254.9.1/30 dev sk0"));
        must(&format!("ip -n {node} link set sk0 up"));
        must(&format!("ip -n {sink} addr add 169.254.9.2/30 dev s0"));
        must(&format!("ip -n {sink} link set s0 up"));
        must(&format!("ip -n {sink} route add default via 169.254.9.1"));
        for a in &sink_ips {
            must(&format!("ip -n {sink} route add local {a}/32 dev lo"));
        }
        must(&format!("ip -n {node} route add default via 169.254.9.2"));

        for (i, (addr, ns)) in pods.iter().enumerate() {
            let host = format!("cali{i}");
            must(&format!("ip -n {node} link add {host} type veth peer name eth0 netns {ns}"));
            must(&format!("ip -n {node} link set {host} up"));
            must(&format!("ip netns exec {node} sysctl -qw net.ipv4.conf.{host}.proxy_arp=1 net.ipv4.neigh.{host}.proxy_delay=0"));
            must(&format!("ip -n {node} route add {addr}/32 dev {host} scope link"));
            must(&format!("ip -n {ns} addr add {addr}/32 dev eth0"));
            must(&format!("ip -n {ns} link set eth0 up"));
            must(&format!("ip -n {ns} route add 169.254.1.1 dev eth0 scope link"));
            must(&format!("ip -n {ns} route add default via 169.254.1.1 dev eth0"));
        }

        let peer = sibling_bin("kpr-lab-peer");
        let list = |s: &BTreeSet<u16>| s.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
        let serve = |ns: &str, name: &str, addr: &str, ports: &str| {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&peer).args(["serve-at", name, addr, ports]).stdout(Stdio::piped()).stderr(Stdio::null());
            let mut child = c.spawn().expect("start a server");
            // It prints "ready" once every port is bound.
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
            assert_eq!(line.trim(), "ready", "server {name} in {ns}");
        };
        for (addr, ns) in &pods {
            serve(ns, "endpoint", &addr.to_string(), &list(&endpoint_ports));
        }
        // kpr's own health-check servers answer on those ports.
        let addrs = |s: &mut dyn Iterator<Item = String>| s.collect::<Vec<_>>().join(",");
        serve(&node, "node", &addrs(&mut NODE_IPS.iter().chain(&["127.0.0.1"]).map(|a| a.to_string())), &list(&(&row_ports - &health_ports)));
        serve(&sink, "sink", &addrs(&mut sink_ips.iter().map(Ipv4Addr::to_string)), &list(&row_ports));
        // kpr's uplink may send frames back with XDP_TX: a veth peer takes them only with an XDP
        // program of its own, as a NIC always does.
        let pins = PinDir::new(prefix);
        let switch = PinDir::new(&format!("{prefix}-switch"));
        crate::xdp_pass_on(&world, &["w0"], switch.path());

        let root = proxy_agent::dataplane::ebpf::kernel::cgroup2_root().expect("cgroup v2 hierarchy");
        let cgroup = root.join(format!("kpr-{prefix}"));
        let _ = std::fs::create_dir_all(&cgroup);
        let dir = std::env::temp_dir().join(format!("kpr-{prefix}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("manifests")).unwrap();
        let log = dir.join("agent.log");
        Self {
            prefix: prefix.into(),
            dir,
            pins,
            cgroup,
            kpr: sibling_bin("kpr"),
            peer,
            pods,
            mode_args: mode_args.iter().map(|s| s.to_string()).collect(),
            agent: None,
            log,
            next_port: FIRST_PORT,
            _switch: switch,
            _netns: netns,
        }
    }

    fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    /// kube-proxy's configuration file for a table's settings.
    fn config(&self, s: &Settings) -> String {
        let cidr = if s.local_detector.as_deref() == Some("none") { "" } else { POD_CIDR };
        let npa = s.node_port_addresses.clone().unwrap_or_default();
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nclusterCIDR: \"{cidr}\"\n\
             nodePortAddresses: {}\niptables: {{masqueradeAll: {m}}}\nnftables: {{masqueradeAll: {m}}}\n",
            serde_json::to_string(&npa).unwrap(),
            m = s.masquerade_all
        )
    }

    /// Restarts the agent on a table's state and settings, and waits for its first sync.
    pub fn load(&mut self, run: &Run) {
        self.stop_agent();
        std::fs::write(self.dir.join("config.yaml"), self.config(&run.settings)).unwrap();
        std::fs::write(self.dir.join("manifests/objects.yaml"), &run.objects).unwrap();
        let mut c = Command::new(&self.kpr);
        c.arg("--netns").arg(self.ns("node")).arg("--pin-dir").arg(self.pins.path()).arg("run");
        c.arg("--config").arg(self.dir.join("config.yaml")).arg("--manifests").arg(self.dir.join("manifests"));
        c.args(["--uplink", "up0", "--pod-iface-prefix", "cali", "--node-name", NODE_NAME]).arg("--cgroup").arg(&self.cgroup);
        c.args(&self.mode_args).env("KPR_LOG", "info");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        self.agent = Some(c.stdout(Stdio::null()).stderr(log).spawn().expect("start kpr"));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let o = sh(&format!("ip netns exec {} {} get 127.0.0.1:10256 /livez", self.ns("node"), self.peer.display()));
            let body = String::from_utf8_lossy(&o.stdout);
            if body.contains("\"lastUpdated\":\"2") {
                return;
            }
            assert!(Instant::now() < deadline, "{} {}: no sync within 60 s\n{}", run.table, run.case, self.agent_log());
            assert!(self.agent.as_mut().unwrap().try_wait().unwrap().is_none(), "kpr exited on {} {}:\n{}", run.table, run.case, self.agent_log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn agent_log(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn stop_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            // SIGTERM: the agent leaves its state for the next one, as on an upgrade.
            let _ = sh(&format!("kill -TERM {}", c.id()));
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends one row and says what it met.
    pub fn probe(&mut self, row: &Row) -> super::Answer {
        let f = &row.flow;
        match super::probe::Proto::parse(&f.protocol) {
            None => return super::Answer { output: super::Output::Other(format!("{} is not probed", f.protocol)), masq: None },
            Some(super::probe::Proto::Sctp) if !super::probe::sctp_available() => {
                return super::Answer { output: super::Output::Other("no SCTP in this kernel".into()), masq: None };
            }
            Some(_) => {}
        }
        // Enough tries to meet every expected endpoint (a miss is under 1 in 10,000 with three).
        let want = match super::Output::parse(&f.output) {
            super::Output::Endpoints(e) => e.len(),
            _ => 1,
        };
        let count = (want as u16 * 10).clamp(4, 40);
        let first = self.next_port;
        self.next_port = if first > 60_000 { FIRST_PORT } else { first + count };
        let args = ["probe", &f.source.to_string(), &first.to_string(), &format!("{}:{}", f.destination, f.port), &f.protocol, &count.to_string(), &want.to_string()];
        let mut c = if on_node(f.source) {
            crate::in_cgroup_and_netns(&self.cgroup, &self.ns("node"))
        } else {
            let mut c = Command::new("ip");
            let ns = self.pods.get(&f.source).cloned().unwrap_or_else(|| self.ns("world"));
            c.args(["netns", "exec", &ns]);
            c
        };
        let o = c.arg(&self.peer).args(args).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        let report: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or(""))
            .unwrap_or_else(|_| panic!("probe {args:?}: {out} {}", String::from_utf8_lossy(&o.stderr)));
        answer_of(&report, f.source, !on_node(f.source))
    }

    /// Runs every table: loads its state, sends its rows, and judges them for `mode`.
    pub fn run_all(&mut self, runs: &[Run], mode: &str, known: &[Difference]) -> Vec<Outcome> {
        let mut out = Vec::new();
        for run in runs {
            self.load(run);
            let affinity = run.objects.contains("ClientIP");
            let mut undocumented = false;
            for row in &run.rows {
                let got = self.probe(row);
                let ok = agrees(&row.flow, &got, affinity);
                let doc = if ok { None } else { documented(known, row, mode, &got) };
                undocumented |= !ok && doc.is_none();
                out.push(Outcome { row: row.clone(), got, agrees: ok, documented: doc });
            }
            if undocumented {
                // What kpr made of the table, for the failure's reader.
                let o = Command::new(&self.kpr).arg("--netns").arg(self.ns("node")).arg("--pin-dir").arg(self.pins.path()).arg("services").output().unwrap();
                let not = sh(&format!("ip netns exec {} {} get 127.0.0.1:10249 /notProgrammed", self.ns("node"), self.peer.display()));
                eprintln!(
                    "{} [{}]: kpr services:\n{}\nnot programmed: {}",
                    run.table,
                    run.case,
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&not.stdout)
                );
            }
        }
        self.stop_agent();
        out
    }
}

impl Drop for ConformanceLab {
    fn drop(&mut self) {
        self.stop_agent();
        crate::remove_cgroup(&self.cgroup);
        let _ = sh(&format!("{} --netns {} --pin-dir {} cleanup", self.kpr.display(), self.ns("node"), self.pins.path().display()));
    }
}

/// The Services' health-check node ports.
fn health_check_ports(objects: &str) -> Vec<u16> {
    documents(objects).iter().filter_map(|v| v["spec"]["healthCheckNodePort"].as_u64()).map(|p| p as u16).collect()
}

/// Every endpoint (address, port) of a table's EndpointSlices.
fn endpoints_of(objects: &str) -> Vec<(Ipv4Addr, u16)> {
    let mut out = Vec::new();
    for v in documents(objects) {
        if v["kind"].as_str() != Some("EndpointSlice") {
            continue;
        }
        let ports: Vec<u16> = v["ports"].as_sequence().map(|s| s.iter().filter_map(|p| p["port"].as_u64()).map(|p| p as u16).collect()).unwrap_or_default();
        for e in v["endpoints"].as_sequence().into_iter().flatten() {
            for a in e["addresses"].as_sequence().into_iter().flatten() {
                if let Some(a) = a.as_str().and_then(|a| a.parse().ok()) {
                    for p in &ports {
                        out.push((a, *p));
                    }
                }
            }
        }
    }
    out
}
