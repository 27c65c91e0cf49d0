//! The namespace lab: one or two node namespaces on an underlay bridge, pods on each in the
//! shape a CNI gives them, a client outside the cluster on the underlay, and kpr on every node.
//! Used by the end-to-end tests and by the README's main command. Everything it creates is
//! removed on drop. No namespace has a route to anything outside the lab.
//!
//! CNI shapes (what the node sees of its pods):
//! - `Routed` (Calico-like): a pod has a /32 on eth0, a default route via the link-local
//!   gateway 169.254.1.1 that the node's `cali*` veth answers by proxy ARP, and the node a /32
//!   route per pod; other nodes' pod blocks are routed via their underlay address.
//! - `Vxlan` (Flannel-like): pods on the `cni0` bridge (bridge-nf-call-iptables on, as
//!   kube-proxy requires), `veth*` ports; other nodes' pod subnets over `flannel.1` (VXLAN, MTU
//!   1450, static FDB and neighbour entries as flannel writes them).
//! - `Ptp`: a /24 per pod veth with the gateway on the node side (the CNI ptp plugin's shape,
//!   and what the IPVS tests in the QEMU guest use).
//!
//! Addresses: underlay 198.18.0.0/24 (node A .1, the client .2, node B .3) and fd00:198::/64
//! (node A ::1, the client ::2); node A's pods in 10.244.0.0/20, node B's in 10.244.16.0/20;
//! LB IPs 203.0.113.0/24 and 2001:db8:203::/64, routed to node A.
//!
//! Netfilter: every node starts with kube-proxy's own KUBE-FORWARD rules (ctstate INVALID drop,
//! mark 0x4000 and RELATED,ESTABLISHED accept), which kube-proxy installs on every node unless
//! nf_conntrack_tcp_be_liberal is set. A test that wants none says so (`flush_netfilter`).
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{must, sh, sibling_bin, Netns, PinDir};

pub const NODE_IP: &str = "198.18.0.1";
pub const NODE_B_IP: &str = "198.18.0.3";
pub const CLIENT_IP: &str = "198.18.0.2";
pub const POD_IP: &str = "10.244.9.2";
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// Node A's IPv6 address on the underlay.
pub const NODE_IP6: &str = "fd00:198::1";
/// The client's IPv6 address on the underlay.
pub const CLIENT_IP6: &str = "fd00:198::2";

/// A pod's IPv6 address in the routed lab: 10.244.X.Y has fd00:10:244:X::Y.
pub fn pod_ip6(ip4: &str) -> String {
    let o: Vec<&str> = ip4.split('.').collect();
    format!("fd00:10:244:{}::{}", o[2], o[3])
}

pub fn backend_ip(i: usize) -> String {
    format!("10.244.{i}.2")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cni {
    Routed,
    Vxlan,
    Ptp,
}

impl Cni {
    /// The node-side name prefix of pod interfaces (what `--pod-iface-prefix` gets).
    pub fn prefix(self) -> &'static str {
        match self {
            Cni::Routed => "cali",
            Cni::Vxlan => "veth",
            Cni::Ptp => "h",
        }
    }
}

/// Which iptables front end writes the node's rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Iptables {
    Nft,
    Legacy,
}

impl Iptables {
    pub fn bin(self) -> &'static str {
        match self {
            Iptables::Nft => "iptables-nft",
            Iptables::Legacy => "iptables-legacy",
        }
    }
}

#[derive(Clone, Debug)]
pub struct LabSpec {
    pub nodes: usize,
    pub cni: Cni,
    pub iptables: Iptables,
    /// MTU of the pods' links (the tunnel's is 1450 whatever this is).
    pub pod_mtu: u32,
}

impl Default for LabSpec {
    fn default() -> Self {
        Self { nodes: 1, cni: Cni::Routed, iptables: Iptables::Nft, pod_mtu: 1500 }
    }
}

/// kube-proxy's KUBE-FORWARD rules (pkg/proxy/iptables): every node has them unless
/// nf_conntrack_tcp_be_liberal is set.
pub const KUBE_FORWARD_RULES: &str = "*filter\n\
:KUBE-FORWARD - [0:0]\n\
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n\
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
COMMIT\n";

/// A pod of the lab.
#[derive(Clone, Debug)]
pub struct Pod {
    /// Role: "pod" (a client), "b1".."b4" (backends, serving their name), "pod2".
    pub role: String,
    pub node: usize,
    pub ip: String,
}

/// One node: its namespace, agent and pins.
pub struct Node {
    pub name: String,
    pub ns: String,
    pub ip: String,
    pub pins: PinDir,
    agent: Option<Child>,
    pub agent_log: PathBuf,
    /// cgroup v2 of this node's "node processes" (connect-time balancing applies to it only).
    pub cgroup: PathBuf,
}

pub struct Lab {
    pub prefix: String,
    pub spec: LabSpec,
    pub nodes: Vec<Node>,
    pub pods: Vec<Pod>,
    pub manifests: PathBuf,
    /// Node A's pins and log (most tests have one node).
    pub pins: PinDir,
    pub agent_log: PathBuf,
    pub cgroup: PathBuf,
    pub kpr: PathBuf,
    peer: PathBuf,
    /// Appended to `kpr run` (e.g. --mode ipvs).
    pub agent_args: Vec<String>,
    /// The agents' `--cluster-cidr` (CLUSTER_CIDR unless a test moves a client inside it; empty:
    /// none).
    pub cluster_cidr: String,
    agent: Option<Child>,
    /// The underlay's "switch" ports run an XDP program, as a NIC peer would take frames (and
    /// the interfaces `replies_on_cpu0` gives one).
    xdp_pins: PinDir,
    // Dropped last: kills every process in the namespaces, then deletes them.
    _netns: Netns,
}

fn node_name(i: usize) -> String {
    ["node-a", "node-b"][i].to_string()
}

impl Lab {
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    /// One node, Calico-like pods, kube-proxy's netfilter rules: what most tests use.
    pub fn build(prefix: &str, manifests: &Path) -> Self {
        Self::build_with(prefix, manifests, LabSpec::default())
    }

    /// Builds the topology and starts the backend servers.
    // The backends' servers live as long as their namespaces, which end them.
    #[allow(clippy::zombie_processes)]
    pub fn build_with(prefix: &str, manifests: &Path, spec: LabSpec) -> Self {
        assert!((1..=2).contains(&spec.nodes), "one or two nodes");
        let mut pods = vec![
            Pod { role: "pod".into(), node: 0, ip: POD_IP.into() },
            Pod { role: "b1".into(), node: 0, ip: backend_ip(1) },
            Pod { role: "b2".into(), node: 0, ip: backend_ip(2) },
            Pod { role: "b3".into(), node: 0, ip: backend_ip(3) },
        ];
        if spec.nodes == 2 {
            pods.push(Pod { role: "b4".into(), node: 1, ip: "10.244.17.2".into() });
            pods.push(Pod { role: "pod2".into(), node: 1, ip: "10.244.25.2".into() });
        }
        let node_ns: Vec<String> = (0..spec.nodes).map(|i| if i == 0 { format!("{prefix}-node") } else { format!("{prefix}-nodeb") }).collect();
        let mut names: Vec<String> = vec![format!("{prefix}-cl")];
        if spec.cni != Cni::Ptp {
            names.push(format!("{prefix}-net"));
        }
        names.extend(node_ns.iter().cloned());
        names.extend(pods.iter().map(|p| format!("{prefix}-{}", p.role)));
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let netns = Netns::create(&refs);
        let cl = format!("{prefix}-cl");
        let node_ips = [NODE_IP, NODE_B_IP];

        // The underlay, and what a node's provisioning (or kpr's DaemonSet init container) sets.
        for (i, n) in node_ns.iter().enumerate() {
            must(&format!("ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1"));
            if spec.cni == Cni::Ptp {
                must(&format!("ip -n {n} link add up0 type veth peer name c0 netns {cl}"));
                must(&format!("ip -n {cl} addr add {CLIENT_IP}/24 dev c0"));
                must(&format!("ip -n {cl} link set c0 up"));
            } else {
                let net = format!("{prefix}-net");
                if i == 0 {
                    must(&format!("ip -n {net} link add br0 type bridge"));
                    must(&format!("ip -n {net} link set br0 up"));
                    must(&format!("ip -n {net} link add pc type veth peer name c0 netns {cl}"));
                    must(&format!("ip -n {net} link set pc master br0 up"));
                    must(&format!("ip -n {cl} addr add {CLIENT_IP}/24 dev c0"));
                    must(&format!("ip -n {cl} link set c0 up"));
                }
                let port = format!("p{}", ["a", "b"][i]);
                must(&format!("ip -n {net} link add {port} type veth peer name up0 netns {n}"));
                must(&format!("ip -n {net} link set {port} master br0 up"));
            }
            must(&format!("ip -n {n} addr add {}/24 dev up0", node_ips[i]));
            if i == 0 {
                must(&format!("ip -n {n} addr add {NODE_IP6}/64 dev up0 nodad"));
            }
            must(&format!("ip -n {n} link set up0 up"));
        }
        // The service and LB ranges are reached through node A, like a router would send them.
        must(&format!("ip -n {cl} route add 10.96.0.0/12 via {NODE_IP}"));
        must(&format!("ip -n {cl} route add 203.0.113.0/24 via {NODE_IP}"));
        must(&format!("ip -n {cl} addr add {CLIENT_IP6}/64 dev c0 nodad"));
        must(&format!("ip -n {cl} -6 route add 2001:db8:203::/64 via {NODE_IP6}"));

        if spec.cni == Cni::Routed {
            // Proxy ARP answers for the pods' gateway only if the node routes it elsewhere:
            // Calico's nodes have a default route; these, for safety, only this one.
            for n in &node_ns {
                must(&format!("ip -n {n} route add 169.254.1.1/32 dev up0"));
            }
        }
        for p in &pods {
            attach_pod(prefix, &node_ns[p.node], p, spec.cni, spec.pod_mtu);
        }
        match spec.cni {
            Cni::Routed if spec.nodes == 2 => {
                // What BGP would announce: each node's pod block via its underlay address.
                must(&format!("ip -n {} route add 10.244.16.0/20 via {NODE_B_IP} dev up0", node_ns[0]));
                must(&format!("ip -n {} route add 10.244.0.0/20 via {NODE_IP} dev up0", node_ns[1]));
            }
            Cni::Vxlan => vxlan_overlay(&node_ns, &node_ips),
            _ => {}
        }
        // Load generators open tens of thousands of short connections: let them reuse ports in
        // TIME_WAIT, or connect() itself becomes the bottleneck whatever the data plane.
        for role in ["cl", "pod"] {
            must(&format!("ip netns exec {prefix}-{role} sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range='1024 65000'"));
        }
        let peer = sibling_bin("kpr-lab-peer");
        for p in pods.iter().filter(|p| p.role.starts_with('b')) {
            Command::new("ip")
                .args(["netns", "exec", &format!("{prefix}-{}", p.role)])
                .arg(&peer)
                .args(["serve", &p.role, "8080", "5353"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start backend server");
        }
        // Wait until every server listens.
        let deadline = Instant::now() + Duration::from_secs(10);
        for p in pods.iter().filter(|p| p.role.starts_with('b')) {
            while !sh(&format!("ip netns exec {prefix}-{} sh -c 'cat /proc/net/tcp' | grep -q ':1F90 00000000:0000 0A'", p.role)).status.success() {
                assert!(Instant::now() < deadline, "backend {} did not start", p.role);
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let root = proxy_agent::dataplane::ebpf::kernel::cgroup2_root().expect("cgroup v2 hierarchy");
        let nodes: Vec<Node> = node_ns
            .iter()
            .enumerate()
            .map(|(i, ns)| {
                let tag = if i == 0 { prefix.to_string() } else { format!("{prefix}-b") };
                let cgroup = root.join(format!("kpr-{tag}"));
                let _ = std::fs::create_dir_all(&cgroup);
                // A log of this lab only (the name repeats across runs).
                let agent_log = std::env::temp_dir().join(format!("{tag}-agent.log"));
                let _ = std::fs::remove_file(&agent_log);
                Node { name: node_name(i), ns: ns.clone(), ip: node_ips[i].into(), pins: PinDir::new(&tag), agent: None, agent_log, cgroup }
            })
            .collect();
        // A NIC takes the frames an uplink's XDP_TX sends back; a veth peer only with an XDP
        // program of its own.
        let switch_pins = PinDir::new(&format!("{prefix}-switch"));
        match spec.cni {
            Cni::Ptp => crate::xdp_pass_on(&cl, &["c0"], switch_pins.path()),
            _ => crate::xdp_pass_on(&format!("{prefix}-net"), &["pa", "pb"][..spec.nodes], switch_pins.path()),
        }
        let (pins, agent_log, cgroup) = (PinDir(nodes[0].pins.0.clone()), nodes[0].agent_log.clone(), nodes[0].cgroup.clone());
        let lab = Self {
            prefix: prefix.into(),
            spec: spec.clone(),
            nodes,
            pods,
            manifests: manifests.into(),
            pins,
            agent_log,
            cgroup,
            kpr: sibling_bin("kpr"),
            peer,
            agent_args: Vec::new(),
            cluster_cidr: CLUSTER_CIDR.into(),
            agent: None,
            xdp_pins: switch_pins,
            _netns: netns,
        };
        for n in &lab.nodes {
            lab.iptables_restore(&n.ns, KUBE_FORWARD_RULES);
        }
        lab
    }

    /// Starts another server in a backend pod, answering with the pod's name, and waits for it.
    /// It lives as long as the pod's namespace, which ends it.
    #[allow(clippy::zombie_processes)]
    pub fn serve(&self, role: &str, tcp: u16, udp: u16) {
        Command::new("ip")
            .args(["netns", "exec", &self.ns(role)])
            .arg(&self.peer)
            .args(["serve", role, &tcp.to_string(), &udp.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sh(&format!("ip netns exec {} sh -c 'cat /proc/net/tcp' | grep -q ':{tcp:04X} 00000000:0000 0A'", self.ns(role))).status.success() {
            assert!(Instant::now() < deadline, "server {role}:{tcp} did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Loads rules with the lab's iptables front end (`iptables-restore --noflush` syntax).
    pub fn iptables_restore(&self, ns: &str, rules: &str) {
        self.iptables_restore_with(ns, rules, true);
    }

    /// The same; without `noflush` the tables named are replaced (as kube-proxy's full syncs
    /// do). Returns how long iptables-restore took.
    pub fn iptables_restore_with(&self, ns: &str, rules: &str, noflush: bool) -> Duration {
        let t = Instant::now();
        let bin = format!("{}-restore", self.spec.iptables.bin());
        let mut c = Command::new("ip")
            .args(["netns", "exec", ns, &bin])
            .args(noflush.then_some("--noflush"))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("iptables-restore");
        use std::io::Write;
        c.stdin.take().unwrap().write_all(rules.as_bytes()).unwrap();
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{bin} in {ns}: {}\n{rules}", String::from_utf8_lossy(&o.stderr));
        t.elapsed()
    }

    /// Runs the lab's iptables (or iptables-save) in a node's namespace.
    pub fn iptables(&self, ns: &str, args: &str) -> String {
        must(&format!("ip netns exec {ns} {} {args}", self.spec.iptables.bin()))
    }

    /// Removes every rule and chain from a node (a test about a rule-free node).
    pub fn flush_netfilter(&self, ns: &str) {
        for t in ["filter", "nat", "mangle", "raw"] {
            let _ = sh(&format!("ip netns exec {ns} {bin} -t {t} -F; ip netns exec {ns} {bin} -t {t} -X", bin = self.spec.iptables.bin()));
        }
    }

    /// Starts (or restarts) node A's agent on the manifest directory.
    pub fn start_agent(&mut self) {
        let m = self.manifests.clone();
        self.start_agent_with(&["--manifests".as_ref(), m.as_os_str()]);
    }

    /// Starts (or restarts) node A's agent with these source arguments (--manifests DIR, or
    /// --kubeconfig FILE).
    pub fn start_agent_with(&mut self, source: &[&std::ffi::OsStr]) {
        let cmd = self.agent_command(0, source);
        self.start_agent_command(cmd);
    }

    /// Starts every node's agent on the manifest directory.
    pub fn start_agents(&mut self) {
        self.start_agent();
        let m = self.manifests.clone();
        for i in 1..self.nodes.len() {
            let mut cmd = self.agent_command(i, &["--manifests".as_ref(), m.as_os_str()]);
            let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.nodes[i].agent_log).unwrap();
            let child = cmd.stdout(Stdio::null()).stderr(log).spawn().expect("start kpr");
            self.nodes[i].agent = Some(child);
        }
    }

    /// `kpr run` for node `i`, as the DaemonSet would run it there.
    pub fn agent_command(&self, i: usize, source: &[&std::ffi::OsStr]) -> Command {
        let n = &self.nodes[i];
        let mut c = Command::new(&self.kpr);
        c.arg("--netns").arg(&n.ns).arg("--pin-dir").arg(n.pins.path()).arg("run").args(source);
        c.args(["--uplink", "up0", "--pod-iface-prefix", self.spec.cni.prefix(), "--node-name", &n.name]);
        if !self.cluster_cidr.is_empty() {
            c.args(["--cluster-cidr", &self.cluster_cidr]);
        }
        if self.spec.cni == Cni::Vxlan {
            c.args(["--pod-iface", "flannel.1"]);
        }
        c.arg("--cgroup").arg(&n.cgroup).args(&self.agent_args).env("KPR_LOG", "info");
        c
    }

    /// Starts node A's agent from a command of the caller's (e.g. under reduced capabilities).
    pub fn start_agent_command(&mut self, mut cmd: Command) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.agent_log).unwrap();
        let child = cmd.stdout(Stdio::null()).stderr(log).spawn().expect("start kpr");
        self.agent = Some(child);
    }

    /// Pins somewhere else than the default test directory (cleaned on drop the same way).
    pub fn use_pins(&mut self, dir: PathBuf) {
        self.pins = PinDir(dir.clone());
        self.nodes[0].pins = PinDir(dir);
    }

    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(|c| c.id())
    }

    pub fn kill_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(&self.agent_log).unwrap_or_default()
    }

    /// `kpr services --json` as seen from a node's maps.
    pub fn services_of(&self, node: usize) -> serde_json::Value {
        let o = Command::new(&self.kpr).arg("--pin-dir").arg(self.nodes[node].pins.path()).args(["services", "--json"]).output().unwrap();
        serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null)
    }

    /// `kpr services --json` as seen from node A's maps.
    pub fn services(&self) -> serde_json::Value {
        let o = Command::new(&self.kpr).arg("--pin-dir").arg(self.pins.path()).args(["services", "--json"]).output().unwrap();
        serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null)
    }

    /// Waits until node A's maps satisfy `pred`.
    pub fn wait_for(&self, what: &str, pred: impl Fn(&serde_json::Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v = self.services();
            if pred(&v) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; maps: {v}\nagent log:\n{}", self.agent_log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits (30 s at most) until `kpr status` shows `has` and not `lacks` (an attached hook,
    /// say); on a timeout, the last status.
    pub fn wait_status(&self, has: &str, lacks: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.cli(&["status"]);
            if s.contains(has) && !s.contains(lacks) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(s);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until `frontend` (ip:port) has `n` backends for internal traffic (scope internal, or both), on every node
    /// that runs an agent.
    pub fn wait_backends(&self, frontend: &str, n: usize) {
        let has = |v: &serde_json::Value| {
            v.as_array().is_some_and(|rows| {
                rows.iter().any(|r| r["frontend"] == frontend && r["scope"] != "external" && r["backends"].as_array().map(|b| b.len()) == Some(n))
            })
        };
        self.wait_for(&format!("{frontend} with {n} backends"), has);
        for i in 1..self.nodes.len() {
            if self.nodes[i].agent.is_none() {
                continue;
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while !has(&self.services_of(i)) {
                assert!(Instant::now() < deadline, "node {} never had {frontend} with {n} backends", self.nodes[i].name);
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Runs kpr-lab-peer in a namespace of the lab and parses its JSON report. Role "host"
    /// is a process of node A itself (its namespace, inside its cgroup).
    pub fn peer(&self, role: &str, args: &[&str]) -> serde_json::Value {
        report(&format!("peer {args:?} in {role}"), self.peer_cmd(role, args).output().unwrap())
    }

    /// Starts kpr-lab-peer in the background; `finish` collects its report.
    pub fn peer_bg(&self, role: &str, args: &[&str]) -> Child {
        self.peer_cmd(role, args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    }

    /// Like `peer`, but the process also joins node A's cgroup (where the connect-time programs
    /// are attached), as a pod's processes sit under the cgroup root on a real node.
    pub fn peer_in_cgroup(&self, role: &str, args: &[&str]) -> serde_json::Value {
        let o = crate::in_cgroup_and_netns(&self.cgroup, &self.ns(role)).arg(&self.peer).args(args).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        serde_json::from_str(out.lines().last().unwrap_or(""))
            .unwrap_or_else(|_| panic!("peer {args:?} in {role} (cgroup): {out} {}", String::from_utf8_lossy(&o.stderr)))
    }

    /// The command running kpr-lab-peer in a lab namespace ("host": node A's processes).
    pub fn peer_cmd(&self, role: &str, args: &[&str]) -> Command {
        let mut c = if role == "host" {
            crate::in_cgroup_and_netns(&self.cgroup, &self.ns("node"))
        } else {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &self.ns(role)]);
            c
        };
        c.arg(&self.peer).args(args);
        c
    }

    pub fn finish(c: Child) -> serde_json::Value {
        report("peer", c.wait_with_output().unwrap())
    }

    /// Takes what reaches `role`'s interface `iface` on CPU 0, as a NIC queue whose interrupt
    /// is bound to one CPU: the pass XDP program on it (a veth then receives through NAPI),
    /// that NAPI in a thread of its own, pinned to CPU 0. A client there on another CPU
    /// (`peer_on_cpu`) then sends a handshake's last ACK from CPU 0, where its SYN-ACK was
    /// taken, while it sends its first data from its own CPU.
    pub fn replies_on_cpu0(&self, role: &str, iface: &str) {
        let ns = self.ns(role);
        if !must(&format!("ip -n {ns} link show {iface}")).contains(" xdp") {
            crate::xdp_pass_on(&ns, &[iface], self.xdp_pins.path());
        }
        must(&format!("ip netns exec {ns} sh -c 'echo 1 > /sys/class/net/{iface}/threaded'"));
        // The thread is napi/IFACE-ID: another lab's of the same name is pinned too, harmlessly.
        let threads = must(&format!("pgrep '^napi/{iface}-' || true"));
        assert!(!threads.trim().is_empty(), "no NAPI thread for {iface} in {ns}");
        for t in threads.split_whitespace() {
            must(&format!("taskset -p 1 {t}"));
        }
    }

    /// `peer` run on CPU `cpu` only.
    pub fn peer_on_cpu(&self, role: &str, cpu: u32, args: &[&str]) -> serde_json::Value {
        let peer = self.peer_cmd(role, args);
        let o = Command::new("taskset").arg("-c").arg(cpu.to_string()).arg(peer.get_program()).args(peer.get_args()).output().unwrap();
        report(&format!("peer {args:?} in {role} on CPU {cpu}"), o)
    }

    /// `kpr` with node A's pins.
    pub fn cli(&self, args: &[&str]) -> String {
        // In node A's namespace: `cleanup` reads and removes interfaces, IPVS and netfilter state there.
        let o = Command::new(&self.kpr).arg("--netns").arg(&self.nodes[0].ns).arg("--pin-dir").arg(self.pins.path()).args(args).output().unwrap();
        assert!(o.status.success(), "kpr {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

/// A kpr-lab-peer run's JSON report: its last line.
fn report(what: &str, o: std::process::Output) -> serde_json::Value {
    let out = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(out.lines().last().unwrap_or("")).unwrap_or_else(|_| panic!("{what}: {out} {}", String::from_utf8_lossy(&o.stderr)))
}

/// A pod's link, in the CNI's shape.
fn attach_pod(prefix: &str, node: &str, p: &Pod, cni: Cni, mtu: u32) {
    let ns = format!("{prefix}-{}", p.role);
    let host = match cni {
        // The ptp lab's historic names: hpod, hb1, ...
        Cni::Ptp => format!("h{}", p.role),
        _ => format!("{}{}", cni.prefix(), p.role),
    };
    let ip = &p.ip;
    must(&format!("ip -n {node} link add {host} mtu {mtu} type veth peer name eth0 netns {ns}"));
    must(&format!("ip -n {ns} link set eth0 up"));
    match cni {
        Cni::Routed => {
            must(&format!("ip -n {node} link set {host} up"));
            must(&format!("ip netns exec {node} sysctl -qw net.ipv4.conf.{host}.proxy_arp=1 net.ipv4.neigh.{host}.proxy_delay=0"));
            must(&format!("ip -n {node} route add {ip}/32 dev {host} scope link"));
            must(&format!("ip -n {ns} addr add {ip}/32 dev eth0"));
            must(&format!("ip -n {ns} route add 169.254.1.1 dev eth0 scope link"));
            must(&format!("ip -n {ns} route add default via 169.254.1.1 dev eth0"));
            // Dual-stack, Calico's way: a /128 per pod, the node's link-local as the gateway.
            let ip6 = pod_ip6(ip);
            must(&format!("ip -n {node} addr add fe80::1/64 dev {host} nodad"));
            must(&format!("ip -n {node} -6 route add {ip6}/128 dev {host}"));
            must(&format!("ip -n {ns} addr add {ip6}/128 dev eth0 nodad"));
            must(&format!("ip -n {ns} -6 route add default via fe80::1 dev eth0"));
        }
        Cni::Vxlan => {
            let (gw, subnet) = if ip.starts_with("10.244.") && ip.split('.').nth(2).is_some_and(|o| o.parse::<u8>().unwrap() >= 16) {
                ("10.244.16.1", "10.244.16.0")
            } else {
                ("10.244.0.1", "10.244.0.0")
            };
            if !sh(&format!("ip -n {node} link show cni0")).status.success() {
                must(&format!("ip -n {node} link add cni0 type bridge"));
                must(&format!("ip -n {node} addr add {gw}/20 dev cni0"));
                must(&format!("ip -n {node} link set cni0 up"));
                must(&format!("ip netns exec {node} sysctl -qw net.bridge.bridge-nf-call-iptables=1"));
            }
            let _ = subnet;
            must(&format!("ip -n {node} link set {host} master cni0 up"));
            must(&format!("ip -n {ns} addr add {ip}/20 dev eth0"));
            must(&format!("ip -n {ns} route add default via {gw}"));
        }
        Cni::Ptp => {
            let third = ip.split('.').nth(2).unwrap();
            must(&format!("ip -n {node} addr add 10.244.{third}.1/24 dev {host}"));
            must(&format!("ip -n {node} link set {host} up"));
            must(&format!("ip -n {ns} addr add {ip}/24 dev eth0"));
            must(&format!("ip -n {ns} route add 10.0.0.0/8 via 10.244.{third}.1"));
            must(&format!("ip -n {ns} route add 198.18.0.0/24 via 10.244.{third}.1"));
            must(&format!("ip -n {ns} route add 203.0.113.0/24 via 10.244.{third}.1"));
        }
    }
}

/// flannel's VXLAN backend between the nodes: flannel.1 with the node's /20's network address,
/// routes to the other nodes' subnets through it, and the static neighbour and FDB entries
/// flanneld writes for each peer.
fn vxlan_overlay(nodes: &[String], ips: &[&str]) {
    let vtep = ["10.244.0.0", "10.244.16.0"];
    for (i, n) in nodes.iter().enumerate() {
        must(&format!("ip -n {n} link add flannel.1 type vxlan id 1 local {} dev up0 dstport 8472 nolearning", ips[i]));
        must(&format!("ip -n {n} link set flannel.1 mtu 1450"));
        must(&format!("ip -n {n} addr add {}/32 dev flannel.1", vtep[i]));
        must(&format!("ip -n {n} link set flannel.1 up"));
    }
    let mac = |n: &str| must(&format!("ip -n {n} -br link show flannel.1")).split_whitespace().nth(2).unwrap_or("").to_string();
    for (i, n) in nodes.iter().enumerate() {
        for (j, peer) in nodes.iter().enumerate().filter(|(j, _)| *j != i) {
            let m = mac(peer);
            must(&format!("ip -n {n} route add {}/20 via {} dev flannel.1 onlink", vtep[j], vtep[j]));
            must(&format!("ip -n {n} neigh add {} lladdr {m} dev flannel.1 nud permanent", vtep[j]));
            must(&format!("bridge -n {n} fdb append {m} dev flannel.1 dst {}", ips[j]));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.kill_agent();
        for n in &mut self.nodes {
            if let Some(mut c) = n.agent.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        // Processes still in the lab cgroups, then the cgroups themselves.
        for n in &self.nodes {
            crate::remove_cgroup(&n.cgroup);
        }
        // PinDirs' drops detach the links and unpin the maps; Netns's drop removes the rest.
    }
}

/// Counts per backend name in a peer report (without "errors").
pub fn per_backend(v: &serde_json::Value) -> Vec<(String, u64)> {
    v.as_object().unwrap().iter().filter(|(k, _)| k.starts_with('b') && k.len() == 2).map(|(k, n)| (k.clone(), n.as_u64().unwrap())).collect()
}

pub fn errors(v: &serde_json::Value) -> u64 {
    v["errors"].as_u64().unwrap_or(u64::MAX)
}
