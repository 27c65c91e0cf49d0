//! The namespace lab: a client namespace (outside the cluster), a node namespace where kpr runs,
//! a pod namespace (a client inside the cluster) and three backend namespaces with TCP and UDP
//! servers. Used by the end-to-end tests and by the README's main command. Everything it creates
//! is removed on drop. No namespace has a route to anything but the others.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{must, sh, sibling_bin, Netns, PinDir};

pub const NODE_IP: &str = "198.18.0.1";
pub const CLIENT_IP: &str = "198.18.0.2";
pub const POD_IP: &str = "10.244.9.2";
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";

pub fn backend_ip(i: usize) -> String {
    format!("10.244.{i}.2")
}

pub struct Lab {
    pub prefix: String,
    pub pins: PinDir,
    pub manifests: PathBuf,
    agent: Option<Child>,
    pub agent_log: PathBuf,
    pub kpr: PathBuf,
    peer: PathBuf,
    /// cgroup v2 of the lab's "node processes" (connect-time balancing applies to it only).
    pub cgroup: PathBuf,
    /// Appended to `kpr run` (e.g. --mode ipvs).
    pub agent_args: Vec<String>,
    // Dropped last: kills every process in the namespaces, then deletes them.
    _netns: Netns,
}

impl Lab {
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    /// Builds the topology and starts the backend servers.
    pub fn build(prefix: &str, manifests: &Path) -> Self {
        let names: Vec<String> = ["cl", "node", "pod", "b1", "b2", "b3"].iter().map(|r| format!("{prefix}-{r}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let netns = Netns::create(&refs);
        let node = format!("{prefix}-node");
        let link = |ns: &str, inner: &str, outer: &str, inner_cidr: &str, outer_cidr: &str| {
            must(&format!("ip -n {node} link add {outer} type veth peer name {inner} netns {ns}"));
            must(&format!("ip -n {node} addr add {outer_cidr} dev {outer}"));
            must(&format!("ip -n {node} link set {outer} up"));
            must(&format!("ip -n {ns} addr add {inner_cidr} dev {inner}"));
            must(&format!("ip -n {ns} link set {inner} up"));
        };
        // What a node's provisioning (or kpr's DaemonSet init container) sets.
        must(&format!("ip netns exec {node} sysctl -qw net.ipv4.ip_forward=1"));
        let cl = format!("{prefix}-cl");
        link(&cl, "c0", "up0", &format!("{CLIENT_IP}/24"), &format!("{NODE_IP}/24"));
        // The service and LB ranges are reached through the node, like a router would send them.
        must(&format!("ip -n {cl} route add 10.96.0.0/12 via {NODE_IP}"));
        must(&format!("ip -n {cl} route add 203.0.113.0/24 via {NODE_IP}"));
        let pod = format!("{prefix}-pod");
        link(&pod, "eth0", "hpod", &format!("{POD_IP}/24"), "10.244.9.1/24");
        must(&format!("ip -n {pod} route add 10.0.0.0/8 via 10.244.9.1"));
        must(&format!("ip -n {pod} route add {NODE_IP}/32 via 10.244.9.1"));
        must(&format!("ip -n {pod} route add 203.0.113.0/24 via 10.244.9.1"));
        // Load generators open tens of thousands of short connections: let them reuse ports in
        // TIME_WAIT, or connect() itself becomes the bottleneck whatever the data plane.
        for ns in [&cl, &pod] {
            must(&format!("ip netns exec {ns} sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range='1024 65000'"));
        }
        for i in 1..=3 {
            let b = format!("{prefix}-b{i}");
            link(&b, "eth0", &format!("hb{i}"), &format!("{}/24", backend_ip(i)), &format!("10.244.{i}.1/24"));
            must(&format!("ip -n {b} route add 10.0.0.0/8 via 10.244.{i}.1"));
            must(&format!("ip -n {b} route add 198.18.0.0/24 via 10.244.{i}.1"));
        }
        let peer = sibling_bin("kpr-lab-peer");
        for i in 1..=3 {
            let b = format!("{prefix}-b{i}");
            Command::new("ip")
                .args(["netns", "exec", &b])
                .arg(&peer)
                .args(["serve", &format!("b{i}"), "8080", "5353"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start backend server");
        }
        // Wait until every server listens.
        let deadline = Instant::now() + Duration::from_secs(10);
        for i in 1..=3 {
            while !sh(&format!("ip netns exec {prefix}-b{i} sh -c 'cat /proc/net/tcp' | grep -q ':1F90 00000000:0000 0A'")).status.success() {
                assert!(Instant::now() < deadline, "backend b{i} did not start");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let pins = PinDir::new(prefix);
        let cgroup = proxy_agent::kernel::cgroup2_root().expect("cgroup v2 hierarchy").join(format!("kpr-{prefix}"));
        let _ = std::fs::create_dir_all(&cgroup);
        let agent_log = std::env::temp_dir().join(format!("{prefix}-agent.log"));
        Self {
            prefix: prefix.into(),
            pins,
            manifests: manifests.into(),
            agent: None,
            agent_log,
            kpr: sibling_bin("kpr"),
            peer,
            cgroup,
            agent_args: Vec::new(),
            _netns: netns,
        }
    }

    /// Starts (or restarts) the agent in the node namespace, on the manifest directory.
    pub fn start_agent(&mut self) {
        let m = self.manifests.clone();
        self.start_agent_with(&["--manifests".as_ref(), m.as_os_str()]);
    }

    /// Starts (or restarts) the agent with these source arguments (--manifests DIR, or
    /// --kubeconfig FILE).
    pub fn start_agent_with(&mut self, source: &[&std::ffi::OsStr]) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.agent_log).unwrap();
        let child = Command::new(&self.kpr)
            .arg("--netns")
            .arg(self.ns("node"))
            .arg("--pin-dir")
            .arg(self.pins.path())
            .arg("run")
            .args(source)
            .args(["--uplink", "up0", "--pod-iface-prefix", "h", "--node-name", "node-a", "--cluster-cidr", CLUSTER_CIDR])
            .arg("--cgroup")
            .arg(&self.cgroup)
            .args(&self.agent_args)
            .env("KPR_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kpr");
        self.agent = Some(child);
    }

    /// Starts the agent from a command of the caller's (e.g. under reduced capabilities).
    pub fn start_agent_command(&mut self, mut cmd: Command) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.agent_log).unwrap();
        let child = cmd.env("NO_COLOR", "1").stdout(Stdio::null()).stderr(log).spawn().expect("start kpr");
        self.agent = Some(child);
    }

    /// Pins somewhere else than the default test directory (cleaned on drop the same way).
    pub fn use_pins(&mut self, dir: PathBuf) {
        self.pins = PinDir(dir);
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

    /// `kpr services --json` as seen from the maps.
    pub fn services(&self) -> serde_json::Value {
        let o = Command::new(&self.kpr).arg("--pin-dir").arg(self.pins.path()).args(["services", "--json"]).output().unwrap();
        serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null)
    }

    /// Waits until the maps satisfy `pred`.
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

    /// Waits until `frontend` (ip:port) has `n` backends in the internal scope.
    pub fn wait_backends(&self, frontend: &str, n: usize) {
        self.wait_for(&format!("{frontend} with {n} backends"), |v| {
            v.as_array().is_some_and(|rows| {
                rows.iter().any(|r| r["frontend"] == frontend && r["scope"] == "internal" && r["backends"].as_array().map(|b| b.len()) == Some(n))
            })
        });
    }

    /// Runs kpr-lab-peer in a namespace of the lab and parses its JSON report. Role "host"
    /// is a process of the node itself (node namespace, inside the lab's cgroup).
    pub fn peer(&self, role: &str, args: &[&str]) -> serde_json::Value {
        let o = self.peer_cmd(role, args).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        let last = out.lines().last().unwrap_or("");
        serde_json::from_str(last).unwrap_or_else(|_| panic!("peer {args:?} in {role}: {out} {}", String::from_utf8_lossy(&o.stderr)))
    }

    /// Starts kpr-lab-peer in the background; `finish` collects its report.
    pub fn peer_bg(&self, role: &str, args: &[&str]) -> Child {
        self.peer_cmd(role, args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    }

    fn peer_cmd(&self, role: &str, args: &[&str]) -> Command {
        let mut c;
        if role == "host" {
            // Join the cgroup before `ip netns exec`, which remounts /sys and hides it.
            c = Command::new("sh");
            c.args(["-c", "echo $$ > \"$0/cgroup.procs\" && exec ip netns exec \"$@\""])
                .arg(&self.cgroup)
                .arg(self.ns("node"))
                .arg(&self.peer);
        } else {
            c = Command::new("ip");
            c.args(["netns", "exec", &self.ns(role)]).arg(&self.peer);
        }
        c.args(args);
        c
    }

    pub fn finish(c: Child) -> serde_json::Value {
        let o = c.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        serde_json::from_str(out.lines().last().unwrap_or("")).unwrap_or_else(|_| panic!("peer output: {out}"))
    }

    pub fn cli(&self, args: &[&str]) -> String {
        let o = Command::new(&self.kpr).arg("--pin-dir").arg(self.pins.path()).args(args).output().unwrap();
        assert!(o.status.success(), "kpr {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.kill_agent();
        // Processes still in the lab cgroup, then the cgroup itself.
        if let Ok(pids) = std::fs::read_to_string(self.cgroup.join("cgroup.procs")) {
            for pid in pids.lines() {
                let _ = sh(&format!("kill -9 {pid}"));
            }
        }
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // PinDir's drop detaches the links and unpins the maps; Netns's drop removes the rest.
    }
}

/// Counts per backend name in a peer report (without "errors").
pub fn per_backend(v: &serde_json::Value) -> Vec<(String, u64)> {
    v.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with('b') && k.len() == 2)
        .map(|(k, n)| (k.clone(), n.as_u64().unwrap()))
        .collect()
}

pub fn errors(v: &serde_json::Value) -> u64 {
    v["errors"].as_u64().unwrap_or(u64::MAX)
}
