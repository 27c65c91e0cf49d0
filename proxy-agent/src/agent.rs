//! The agent loop: watch the manifests, compute the desired state, sync the maps by difference,
//! attach to new pod interfaces, and collect idle conntrack and affinity entries. A failed step
//! is logged and counted; the loop goes on.
use std::{
    collections::{BTreeSet, HashMap},
    net::IpAddr,
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use aya::programs::XdpMode;
use ipnet::IpNet;
use proxy_common::{
    user::addr_words, DatapathConfig, CFG_F_MASQUERADE_ALL, CT_DIR_FORWARD, CT_F_CLOSING, PROTO_TCP,
};
use tracing::{error, info, warn};

use crate::{
    kernel::{self, Capacities, Datapath, Hook, KernelMaps},
    manifests,
    maps::DatapathMaps,
    model::{self, ModelConfig, NodeInfo, Scheduler},
    netif,
    sync::Syncer,
    sysctl::{fast_path_sysctls, ProcSysctls, Sysctls},
};

pub static STOP: AtomicBool = AtomicBool::new(false);

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub manifests: PathBuf,
    pub pin_dir: PathBuf,
    /// XDP on these (north-south).
    pub uplinks: Vec<String>,
    /// TC ingress on these, and on every interface whose name starts with a prefix.
    pub pod_ifaces: Vec<String>,
    pub pod_iface_prefixes: Vec<String>,
    /// Connect-time balancing for the node's own processes on this cgroup (v2); None: off.
    pub cgroup: Option<PathBuf>,
    pub node_name: String,
    /// Empty: the uplinks' IPv4 addresses.
    pub nodeport_addresses: Vec<IpAddr>,
    /// Default: the first NodePort address.
    pub snat_ip: Option<IpAddr>,
    pub cluster_cidr: Option<IpNet>,
    pub masquerade_all: bool,
    pub scheduler: Scheduler,
    pub xdp_mode: XdpMode,
    pub sync_period: Duration,
    pub ct_tcp_timeout_s: u32,
    pub ct_udp_timeout_s: u32,
    /// Idle closing TCP flows are collected after this.
    pub ct_closing_timeout_s: u32,
    pub capacities: Capacities,
    /// Stop after the first sync (tests, benchmarks).
    pub once: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            manifests: PathBuf::from("deploy/examples"),
            pin_dir: PathBuf::from(kernel::DEFAULT_BPFFS).join(proxy_common::PROJECT),
            uplinks: Vec::new(),
            pod_ifaces: Vec::new(),
            pod_iface_prefixes: Vec::new(),
            cgroup: None,
            node_name: String::new(),
            nodeport_addresses: Vec::new(),
            snat_ip: None,
            cluster_cidr: None,
            masquerade_all: false,
            scheduler: Scheduler::Random,
            xdp_mode: XdpMode::Default,
            sync_period: Duration::from_secs(30),
            ct_tcp_timeout_s: 86_400,
            ct_udp_timeout_s: 120,
            ct_closing_timeout_s: 10,
            capacities: Capacities::default(),
            once: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Kernel(#[from] kernel::KernelError),
    #[error(transparent)]
    Map(#[from] crate::maps::MapError),
    #[error("no address for NodePorts and SNAT: give --node-ip or an uplink with an IPv4 address")]
    NoNodeAddress,
}

pub struct Agent {
    cfg: AgentConfig,
    dp: Datapath,
    maps: KernelMaps,
    syncer: Syncer,
    attached: BTreeSet<(String, &'static str)>,
    pub syncs: u64,
    pub sync_failures: u64,
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> Result<Self, AgentError> {
        let mut dp = Datapath::load(&cfg.pin_dir, cfg.capacities)?;
        if let Some(cg) = &cfg.cgroup {
            dp.attach_cgroup(cg)?;
            info!(cgroup = %cg.display(), "connect-time balancing attached");
        }
        let maps = KernelMaps::open(&cfg.pin_dir)?;
        Ok(Self { cfg, dp, maps, syncer: Syncer::default(), attached: BTreeSet::new(), syncs: 0, sync_failures: 0 })
    }

    fn node_addresses(&self) -> Vec<IpAddr> {
        if !self.cfg.nodeport_addresses.is_empty() {
            return self.cfg.nodeport_addresses.clone();
        }
        self.cfg.uplinks.iter().flat_map(|u| netif::ipv4_addresses(u)).collect()
    }

    fn datapath_config(&self, node_addrs: &[IpAddr]) -> Result<DatapathConfig, AgentError> {
        let snat = self.cfg.snat_ip.or_else(|| node_addrs.first().copied()).ok_or(AgentError::NoNodeAddress)?;
        let (cidr, len) = match self.cfg.cluster_cidr {
            Some(net) => (addr_words(net.network()), u32::from(net.prefix_len())),
            None => ([0; 4], 0),
        };
        Ok(DatapathConfig {
            snat_addr: addr_words(snat),
            cluster_cidr: cidr,
            cluster_cidr_len: len,
            flags: if self.cfg.masquerade_all { CFG_F_MASQUERADE_ALL } else { 0 },
            ct_tcp_timeout_s: self.cfg.ct_tcp_timeout_s,
            ct_udp_timeout_s: self.cfg.ct_udp_timeout_s,
        })
    }

    /// Attaches XDP to the uplinks and TC to pod interfaces not attached yet.
    pub fn attach_interfaces(&mut self) {
        let present = netif::interfaces();
        let mut wanted: Vec<(String, Hook)> = Vec::new();
        for u in &self.cfg.uplinks {
            wanted.push((u.clone(), Hook::Xdp));
        }
        for i in &present {
            if self.cfg.pod_ifaces.contains(i) || self.cfg.pod_iface_prefixes.iter().any(|p| i.starts_with(p.as_str())) {
                wanted.push((i.clone(), Hook::TcIngress));
            }
        }
        let mut sysctl_ifaces = Vec::new();
        for (iface, hook) in wanted {
            let tag = if hook == Hook::Xdp { "xdp" } else { "tc" };
            if self.attached.contains(&(iface.clone(), tag)) {
                continue;
            }
            match self.dp.attach(&iface, hook, self.cfg.xdp_mode) {
                Ok(()) => {
                    info!(iface = %iface, hook = tag, "attached");
                    self.attached.insert((iface.clone(), tag));
                    sysctl_ifaces.push(iface);
                }
                Err(e) => error!(iface = %iface, hook = tag, error = %e, "attach failed"),
            }
        }
        // Links of interfaces that are gone.
        for (iface, hook) in kernel::attached_links(&self.cfg.pin_dir) {
            if hook != Hook::Cgroup && !present.contains(&iface) {
                let _ = kernel::detach(&self.cfg.pin_dir, &iface, hook);
                self.attached.retain(|(i, _)| i != &iface);
            }
        }
        if !sysctl_ifaces.is_empty() {
            let mut sys = ProcSysctls;
            for (k, v) in fast_path_sysctls(&sysctl_ifaces) {
                if let Err(e) = sys.set(&k, v) {
                    warn!(error = %e, "sysctl");
                }
            }
        }
    }

    /// One full sync from the manifest directory.
    pub fn sync_once(&mut self) -> Result<crate::sync::SyncStats, AgentError> {
        let report = manifests::load_dir(&self.cfg.manifests).map_err(|e| {
            crate::maps::MapError::Other { map: "-", message: e.to_string() }
        })?;
        for e in &report.errors {
            warn!(error = %e, "object skipped");
        }
        let node_addrs = self.node_addresses();
        let node = NodeInfo { name: self.cfg.node_name.clone(), nodeport_addresses: node_addrs.clone() };
        let desired = model::compute(&report.objects, &node, &ModelConfig { default_scheduler: self.cfg.scheduler });
        for e in &desired.errors {
            warn!(error = %e, "service field ignored");
        }
        let dcfg = self.datapath_config(&node_addrs)?;
        let start = Instant::now();
        let st = self.syncer.sync(&mut self.maps, &desired, dcfg).map_err(|e| match e {
            crate::sync::SyncError::Map(m) => AgentError::Map(m),
        })?;
        for e in &st.errors {
            warn!(error = %e, "frontend not programmed");
        }
        self.syncs += 1;
        info!(
            frontends = st.frontends,
            backends = st.backends,
            writes = st.writes,
            deletes = st.deletes,
            ms = start.elapsed().as_secs_f64() * 1e3,
            "synced"
        );
        Ok(st)
    }

    /// Deletes idle flows (both directions) and expired affinity entries.
    pub fn collect_garbage(&mut self) -> Result<(usize, usize), AgentError> {
        let now = kernel::monotonic_ns();
        let mut flows = 0;
        for (k, v) in self.maps.conntrack()? {
            let timeout = if v.flags & CT_F_CLOSING != 0 {
                self.cfg.ct_closing_timeout_s
            } else if k.proto == PROTO_TCP {
                self.cfg.ct_tcp_timeout_s
            } else {
                self.cfg.ct_udp_timeout_s
            };
            if now.saturating_sub(v.last_seen_ns) > u64::from(timeout) * 1_000_000_000 {
                self.maps.del_conntrack(k)?;
                if k.dir == CT_DIR_FORWARD {
                    flows += 1;
                }
            }
        }
        let timeouts: HashMap<u32, u32> =
            self.maps.services()?.into_iter().map(|(_, v)| (v.service_id, v.affinity_timeout_s)).collect();
        let mut aff = 0;
        for (k, v) in self.maps.affinity()? {
            let t = timeouts.get(&k.service_id).copied().unwrap_or(0);
            if now.saturating_sub(v.last_used_ns) > u64::from(t) * 1_000_000_000 {
                self.maps.del_affinity(k)?;
                aff += 1;
            }
        }
        Ok((flows, aff))
    }

    pub fn run(&mut self) {
        let mut last_fp = None;
        let mut last_full = Instant::now() - self.cfg.sync_period * 2;
        let mut last_gc = Instant::now();
        let mut last_attach = Instant::now() - Duration::from_secs(10);
        while !STOP.load(Ordering::Relaxed) {
            if last_attach.elapsed() >= Duration::from_secs(1) {
                self.attach_interfaces();
                last_attach = Instant::now();
            }
            let fp = manifests::fingerprint(&self.cfg.manifests).ok();
            if fp != last_fp || last_full.elapsed() >= self.cfg.sync_period {
                match self.sync_once() {
                    Ok(_) => {
                        last_fp = fp;
                        last_full = Instant::now();
                    }
                    Err(e) => {
                        self.sync_failures += 1;
                        error!(error = %e, failures = self.sync_failures, "sync failed; retrying");
                    }
                }
                if self.cfg.once {
                    return;
                }
            }
            if last_gc.elapsed() >= Duration::from_secs(5) {
                match self.collect_garbage() {
                    Ok((f, a)) if f + a > 0 => info!(flows = f, affinity = a, "collected idle entries"),
                    Ok(_) => {}
                    Err(e) => warn!(error = %e, "conntrack gc failed"),
                }
                last_gc = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        info!("stopping; programs and maps stay in place (run `kpr cleanup` to remove them)");
    }
}
