//! The lab and the tests' shared harness: root/bpffs checks, pin-directory and namespace guards
//! that clean up on drop (also when a test fails), and the packet builder.
pub mod conformance;
pub mod fake_api;
pub mod iptables;
pub mod lab;
pub mod packet;

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use proxy_agent::{
    dataplane::ebpf::kernel::{self, Capacities, Datapath},
    dataplane::ebpf::kernel_maps::KernelMaps,
    dataplane::ebpf::maps::DatapathMaps,
    dataplane::ebpf::maps::Table,
    dataplane::ebpf::sync::Syncer,
    model::{self, DesiredState, ModelConfig, NodeInfo},
    source::manifests::{self, LoadReport},
};
use proxy_common::{CtKey, CtValue, DatapathConfig};

pub fn require_root() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "kernel tests need root (CAP_BPF, CAP_NET_ADMIN): run them through `cargo xtask test` or sudo");
}

pub fn mount_bpffs() {
    let st = Command::new("mountpoint").args(["-q", "/sys/fs/bpf"]).status();
    if !matches!(st, Ok(s) if s.success()) {
        let _ = std::fs::create_dir_all("/sys/fs/bpf");
        let ok = Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]).status().map(|s| s.success()).unwrap_or(false);
        assert!(ok, "cannot mount bpffs on /sys/fs/bpf");
    }
}

/// A pin directory that is cleaned (links detached, maps unpinned) on drop.
pub struct PinDir(pub PathBuf);

impl PinDir {
    pub fn new(name: &str) -> Self {
        require_root();
        mount_bpffs();
        let p = PathBuf::from(format!("/sys/fs/bpf/kpr-test-{name}-{}", std::process::id()));
        let _ = kernel::cleanup(&p);
        Self(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        // Pins only: the lab's interfaces go with their namespaces, and the machine's own are
        // never touched.
        let _ = kernel::unpin_all(&self.0);
    }
}

pub fn sh(cmd: &str) -> Output {
    Command::new("sh").arg("-c").arg(cmd).output().expect("sh")
}

/// Runs a command and panics with its output when it fails.
pub fn must(cmd: &str) -> String {
    let o = sh(cmd);
    assert!(o.status.success(), "`{cmd}` failed: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A command that runs in network namespace `ns` as a process of `cgroup` (a node's process,
/// where the connect-time programs are attached): the program and its arguments follow. It
/// joins the cgroup before `ip netns exec`, which remounts /sys and hides it.
pub fn in_cgroup_and_netns(cgroup: &Path, ns: &str) -> Command {
    let mut c = Command::new("sh");
    c.args(["-c", "echo $$ > \"$0/cgroup.procs\" && exec ip netns exec \"$@\""]).arg(cgroup).arg(ns);
    c
}

/// Ends the processes left in a lab's cgroup, then removes it.
pub fn remove_cgroup(cg: &Path) {
    if let Ok(pids) = std::fs::read_to_string(cg.join("cgroup.procs")) {
        for pid in pids.lines() {
            let _ = sh(&format!("kill -9 {pid}"));
        }
    }
    for _ in 0..50 {
        if std::fs::remove_dir(cg).is_ok() || !cg.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Network namespaces deleted on drop.
pub struct Netns(pub Vec<String>);

impl Netns {
    pub fn create(names: &[&str]) -> Self {
        require_root();
        let me = Self(names.iter().map(|s| s.to_string()).collect());
        for n in names {
            let _ = sh(&format!("ip netns del {n} 2>/dev/null"));
            must(&format!("ip netns add {n}"));
            must(&format!("ip -n {n} link set lo up"));
        }
        me
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = sh(&format!("ip netns pids {n} 2>/dev/null | xargs -r kill -9 2>/dev/null; ip netns del {n} 2>/dev/null"));
        }
    }
}

/// Parses manifests and computes the desired state, asserting no object was rejected.
pub fn desired(yaml: &str, node: &NodeInfo) -> DesiredState {
    let mut r = LoadReport::default();
    manifests::load_text("fixture.yaml", yaml, &mut r);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // As eBPF mode with its connect-time programs: IPv6 served, without the per-flow features.
    let d = model::compute(&r.objects, node, &ModelConfig { ipv6: model::Ipv6Reach::AllWithoutFlowFeatures, ..ModelConfig::default() });
    let problems: Vec<_> = d.problems().collect();
    assert!(problems.is_empty(), "{problems:?}");
    d
}

/// A loaded (not attached) fast path whose maps hold `yaml`'s services.
pub struct Loaded {
    pub pins: PinDir,
    pub dp: Datapath,
    pub maps: KernelMaps,
    pub syncer: Syncer,
}

impl Loaded {
    pub fn new(name: &str, yaml: &str, node: &NodeInfo, cfg: DatapathConfig) -> Self {
        Self::with_capacities(name, yaml, node, cfg, Self::CAPACITIES)
    }

    /// The fixtures' map sizes.
    pub const CAPACITIES: Capacities = Capacities {
        services: 8192,
        backends: 8192,
        slots: 65536,
        conntrack: 65536,
        conntrack_new: 16384,
        conntrack6: proxy_common::limits::MAX_CONNTRACK6,
        conntrack6_new: proxy_common::limits::MAX_CONNTRACK6_NEW,
        affinity: 16384,
    };

    pub fn with_capacities(name: &str, yaml: &str, node: &NodeInfo, cfg: DatapathConfig, caps: Capacities) -> Self {
        let pins = PinDir::new(name);
        let dp = Datapath::load(pins.path(), caps).expect("load eBPF object");
        let mut maps = KernelMaps::open(pins.path()).expect("open maps");
        let mut syncer = Syncer::new(4096, caps.backends, 16);
        let d = desired(yaml, node);
        let st = syncer.sync(&mut maps, &d, cfg).expect("sync");
        assert!(st.errors.is_empty(), "{:?}", st.errors);
        Self { pins, dp, maps, syncer }
    }

    /// Every conntrack entry of a table.
    pub fn conntrack(&self, table: Table) -> Vec<(CtKey, CtValue)> {
        self.maps.conntrack().entries(table).expect("read conntrack")
    }

    /// Deletes every flow (both tables) and invalidates the flow cache.
    pub fn clear_conntrack(&mut self) {
        for table in Table::ALL {
            for (k, v) in self.conntrack(table) {
                self.maps.conntrack_mut().delete_if(table, &k, &v).expect("delete");
            }
        }
        self.maps.conntrack_mut().invalidate_flow_cache().expect("invalidate");
    }
}

/// Attaches kpr's pass-only XDP program to interfaces of namespace `ns` (links pinned under
/// `pin_dir`, detached when it is cleaned): a veth delivers the frames its peer sends back with
/// XDP_TX only when it runs an XDP program itself, as a NIC always takes them.
pub fn xdp_pass_on(ns: &str, ifaces: &[&str], pin_dir: &Path) {
    use aya::programs::{links::FdLink, Xdp, XdpMode};
    let (ns, ifaces, pin_dir) = (ns.to_string(), ifaces.iter().map(|s| s.to_string()).collect::<Vec<_>>(), pin_dir.to_path_buf());
    std::thread::spawn(move || {
        proxy_agent::host::netif::enter_netns(&ns).expect("enter the namespace");
        let small = Capacities { services: 16, backends: 16, slots: 16, conntrack: 16, conntrack_new: 16, conntrack6: 16, conntrack6_new: 16, affinity: 16 };
        let mut dp = Datapath::load_object(&pin_dir, small).expect("load the object");
        let prog: &mut Xdp = dp.ebpf().program_mut(proxy_common::prog_names::XDP_PASS).unwrap().try_into().unwrap();
        prog.load().expect("load the pass program");
        for i in &ifaces {
            let id = prog.attach(i, XdpMode::default()).unwrap_or_else(|e| panic!("attach XDP to {i} in {ns}: {e}"));
            let link = FdLink::try_from(prog.take_link(id).unwrap()).unwrap();
            link.pin(pin_dir.join("links").join(format!("xdp_{ns}_{i}"))).expect("pin");
        }
    })
    .join()
    .expect("xdp pass thread");
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

pub fn datapath_config(snat: &str, cluster_cidr: Option<(&str, u32)>) -> DatapathConfig {
    use proxy_common::user::addr_words;
    let (c, l) = cluster_cidr.map(|(a, l)| (addr_words(ip(a)), l)).unwrap_or(([0; 4], 0));
    DatapathConfig {
        snat_addr: addr_words(ip(snat)),
        cluster_cidr: c,
        cluster_cidr_len: l,
        flags: 0,
        ct_tcp_timeout_s: 3600,
        ct_udp_timeout_s: 60,
        snat_port_min: 0,
        snat_port_max: 0,
        cluster_cidr6_len: 0,
        cluster_cidr6: [0; 4],
        host_netns_cookie: 0,
    }
}

/// Path of a binary built beside the test binary (target/<profile>/NAME).
pub fn sibling_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // Binaries live in target/<profile>/, test executables in target/<profile>/deps/.
    let dir = exe.parent().unwrap();
    let p = if dir.join(name).exists() { dir.join(name) } else { dir.parent().unwrap().join(name) };
    assert!(p.exists(), "{} not built: run `cargo build --workspace` (cargo xtask test does)", p.display());
    p
}
