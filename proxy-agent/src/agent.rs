//! The agent loop: watch the manifests, compute the desired state, sync the maps by difference,
//! attach to new pod interfaces, and collect idle conntrack and affinity entries. A failed step
//! is logged and counted; the loop goes on.
use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime},
};

use aya::programs::XdpMode;
use ipnet::IpNet;
use proxy_common::{user::addr_words, DatapathConfig, CFG_F_MASQUERADE_ALL};
use tracing::{error, info, warn};

use crate::{
    dataplane::ebpf::kernel::{self, Capacities, Datapath, Hook, KernelMaps},
    dataplane::ebpf::maps::DatapathMaps,
    dataplane::ebpf::sync::{RemovedBackend, Syncer},
    dataplane::ipvs::client::{Ipvs, IpvsError, NetlinkIpvs, Timeouts},
    dataplane::ipvs::sync::{self as ipvs_sync, IpvsSettings, IpvsSyncer},
    host::netif,
    host::sysctl::{ProcSysctls, Sysctls, FAST_PATH_SYSCTLS},
    model::objects::Objects,
    model::{self, ModelConfig, NodeInfo, Scheduler},
    netlink::ctnetlink::NetlinkConntrack,
    netlink::rtnl::NetlinkLinks,
    serve::metrics::{SharedStats, Stats},
    source::kube as kube_source,
    source::manifests,
};

pub static STOP: AtomicBool = AtomicBool::new(false);

/// A failed sync is retried after this, doubling up to syncPeriod.
const RETRY_MIN: Duration = Duration::from_secs(1);

/// The conntrack collector reads at most this many entries of each table per round...
const GC_BATCH: usize = 16_384;
/// ...every this often: a full pass over 524,288 entries takes about 8 s.
const GC_INTERVAL: Duration = Duration::from_millis(250);

/// Which data plane programs services.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// The eBPF fast path (XDP/TC/connect-time); IPVS is not programmed.
    #[default]
    Ebpf,
    /// Linux IPVS over netlink, with the BPF set-matching program for masquerade marks and
    /// filtering instead of iptables/ipset.
    Ipvs,
    /// The eBPF fast path where the kernel verifies and loads it, else IPVS.
    Auto,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Ipvs => "ipvs",
            Mode::Auto => "auto",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ebpf" | "" => Ok(Mode::Ebpf),
            "ipvs" => Ok(Mode::Ipvs),
            "auto" => Ok(Mode::Auto),
            other => Err(format!("unknown mode {other:?} (expected ebpf, ipvs or auto)")),
        }
    }
}

/// kube-proxy's detectLocalMode: what makes a client local.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum DetectLocal {
    /// Its address is in the cluster CIDR (clusterCIDR, --cluster-cidr).
    #[default]
    ClusterCidr,
    /// Its address is in this node's pod CIDR (the Node's spec.podCIDRs).
    NodeCidr,
    /// Its packet came from a port of this bridge (detectLocal.bridgeInterface).
    BridgeInterface(String),
    /// Its packet came in on an interface whose name starts so (detectLocal.interfaceNamePrefix).
    InterfaceNamePrefix(String),
}

impl DetectLocal {
    /// Whether traffic arriving on `iface` (a port of bridge `master`) is local.
    pub fn is_local(&self, iface: &str, master: Option<&str>) -> bool {
        match self {
            DetectLocal::BridgeInterface(br) => iface == br || master == Some(br.as_str()),
            DetectLocal::InterfaceNamePrefix(p) => iface.starts_with(p.as_str()),
            DetectLocal::ClusterCidr | DetectLocal::NodeCidr => false,
        }
    }

    /// From kube-proxy's detectLocalMode and detectLocal fields.
    pub fn from_config(mode: &str, bridge: Option<&str>, prefix: Option<&str>) -> Result<Self, String> {
        let need = |v: Option<&str>, field: &str| v.filter(|s| !s.is_empty()).map(str::to_string).ok_or(format!("detectLocalMode {mode} needs {field}"));
        match mode {
            "" | "ClusterCIDR" => Ok(DetectLocal::ClusterCidr),
            "NodeCIDR" => Ok(DetectLocal::NodeCidr),
            "BridgeInterface" => Ok(DetectLocal::BridgeInterface(need(bridge, "detectLocal.bridgeInterface")?)),
            "InterfaceNamePrefix" => Ok(DetectLocal::InterfaceNamePrefix(need(prefix, "detectLocal.interfaceNamePrefix")?)),
            other => Err(format!("unknown detectLocalMode {other:?} (ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix)")),
        }
    }
}

/// IPVS mode's settings (kube-proxy's ipvs.* configuration).
#[derive(Clone, Debug, Default)]
pub struct IpvsModeConfig {
    /// Default scheduler; per Service: annotation kpr.io/ipvs-scheduler. None: rr.
    pub scheduler: Option<String>,
    pub strict_arp: bool,
    /// Zero fields leave the kernel's value.
    pub timeouts: Timeouts,
    pub exclude_cidrs: Vec<IpNet>,
}

/// IPVS mode's kernel handles.
struct IpvsPlane {
    ipvs: NetlinkIpvs,
    links: NetlinkLinks,
    ct: Option<NetlinkConntrack>,
    syncer: IpvsSyncer,
    sets: crate::dataplane::ipvs::sets::KernelSetMaps,
    /// What the set maps hold after the last sync (None: read them at the next one).
    sets_mirror: Option<crate::dataplane::ipvs::sets::Sets>,
}

/// Sets what differs; a failure is a warning (in a cluster the init container sets them, as
/// /proc/sys is read-only in an unprivileged container).
fn set_sysctls(list: &[(&str, &str)]) {
    for (k, v) in list {
        if let Err(e) = ProcSysctls.set(k, v) {
            warn!(error = %e, "cannot set {k}={v}: set it on the host (the DaemonSet's init container does)");
        }
    }
}

/// The node's network namespace cookie, for connect-time balancing of its own processes only.
fn host_netns_cookie() -> u64 {
    netif::netns_cookie().unwrap_or_else(|| {
        warn!("the kernel has no SO_NETNS_COOKIE (Linux < 5.14): connect-time balancing applies to pods' sockets too, with the node's address for their affinity and source ranges");
        0
    })
}

/// The masquerade port range for this node (its namespace's ephemeral range decides).
fn masquerade_ports() -> (u16, u16) {
    let local = ProcSysctls.get("net.ipv4.ip_local_port_range").unwrap_or_default();
    match crate::host::sysctl::snat_port_range(&local) {
        Some(r) => {
            info!(ephemeral = %local, snat_ports = %format!("{}-{}", r.0, r.1), "masquerade source ports");
            r
        }
        None => {
            let r = (proxy_common::SNAT_PORT_MIN, proxy_common::SNAT_PORT_MAX);
            warn!(ephemeral = %local, snat_ports = %format!("{}-{}", r.0, r.1), "net.ipv4.ip_local_port_range leaves no 4096 ports outside it and the NodePort range for masquerade: using the default range, which the node's own connections may also use");
            r
        }
    }
}

/// Opens IPVS, loading the module first if the kernel has it as one.
pub fn connect_ipvs() -> Result<NetlinkIpvs, IpvsError> {
    match NetlinkIpvs::connect() {
        Err(IpvsError::NoIpvs) => {
            let _ = std::process::Command::new("modprobe").arg("ip_vs").status();
            NetlinkIpvs::connect()
        }
        r => r,
    }
}

/// Where Services and EndpointSlices come from. Both feed the same pipeline.
#[derive(Clone, Debug)]
pub enum Source {
    /// A directory of manifests, watched (the embedded default for the lab and tests).
    Dir(PathBuf),
    /// The Kubernetes API, through kube-rs watchers (kube_source.rs).
    Kube(Arc<kube_source::Shared>),
}

/// kube-proxy's bounded-frequency runner: at most `burst` syncs at once, then one per
/// `min_interval`.
#[derive(Debug)]
pub struct Limiter {
    min_interval: Duration,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Limiter {
    pub fn new(min_interval: Duration, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self { min_interval, burst, tokens: burst, last: Instant::now() }
    }
    pub fn try_take(&mut self, now: Instant) -> bool {
        if self.min_interval.is_zero() {
            return true;
        }
        let refill = now.duration_since(self.last).as_secs_f64() / self.min_interval.as_secs_f64();
        self.tokens = (self.tokens + refill).min(self.burst);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub source: Source,
    pub pin_dir: PathBuf,
    /// XDP on these (north-south).
    pub uplinks: Vec<String>,
    /// TC ingress on these, and on every interface whose name starts with a prefix.
    pub pod_ifaces: Vec<String>,
    pub pod_iface_prefixes: Vec<String>,
    /// Connect-time balancing for the node's own processes on this cgroup (v2); None: off.
    pub cgroup: Option<PathBuf>,
    pub node_name: String,
    /// Zone for topology hints when no Node object says it (the directory source).
    pub node_zone: Option<String>,
    /// Empty: the uplinks' IPv4 addresses.
    pub nodeport_addresses: Vec<IpAddr>,
    /// Default: the first NodePort address.
    pub snat_ip: Option<IpAddr>,
    pub cluster_cidr: Option<IpNet>,
    /// How a local client (a pod of this node, never masqueraded for being off-cluster) is
    /// told from one outside the cluster (kube-proxy's detectLocalMode).
    pub detect_local: DetectLocal,
    pub masquerade_all: bool,
    pub scheduler: Scheduler,
    pub xdp_mode: XdpMode,
    /// Full resync period (kube-proxy's syncPeriod).
    pub sync_period: Duration,
    /// Least time between two event-driven syncs (minSyncPeriod), and how many may come in a
    /// burst before that applies.
    pub min_sync_period: Duration,
    pub burst_syncs: u32,
    pub ct_tcp_timeout_s: u32,
    pub ct_udp_timeout_s: u32,
    /// Idle closing TCP flows are collected after this.
    pub ct_closing_timeout_s: u32,
    pub capacities: Capacities,
    pub mode: Mode,
    pub ipvs: IpvsModeConfig,
    /// Stop after the first sync (tests, benchmarks).
    pub once: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            source: Source::Dir(PathBuf::from("deploy/examples")),
            pin_dir: PathBuf::from(kernel::DEFAULT_BPFFS).join(proxy_common::PROJECT),
            uplinks: Vec::new(),
            pod_ifaces: Vec::new(),
            pod_iface_prefixes: Vec::new(),
            cgroup: None,
            node_name: String::new(),
            node_zone: None,
            nodeport_addresses: Vec::new(),
            snat_ip: None,
            cluster_cidr: None,
            detect_local: DetectLocal::default(),
            masquerade_all: false,
            scheduler: Scheduler::Random,
            xdp_mode: XdpMode::Default,
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
            burst_syncs: 2,
            ct_tcp_timeout_s: 86_400,
            ct_udp_timeout_s: 120,
            ct_closing_timeout_s: 10,
            capacities: Capacities::default(),
            mode: Mode::Ebpf,
            ipvs: IpvsModeConfig::default(),
            once: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Kernel(#[from] kernel::KernelError),
    #[error(transparent)]
    Map(#[from] crate::dataplane::ebpf::maps::MapError),
    #[error("no address for NodePorts and SNAT: give --node-ip or an uplink with an IPv4 address")]
    NoNodeAddress,
    #[error(transparent)]
    Ipvs(#[from] IpvsError),
    #[error(transparent)]
    IpvsSync(#[from] ipvs_sync::IpvsSyncError),
    #[error("{0}")]
    Link(#[from] crate::netlink::rtnl::LinkError),
    #[error("installing the fixed netfilter rules (needs iptables with the bpf, ipvs and addrtype matches): {0}")]
    Netfilter(crate::migration::CleanupError),
    #[error("mode auto: the eBPF fast path does not load ({fast_path}) and IPVS is not usable ({ipvs})")]
    NoMode { fast_path: String, ipvs: String },
}

pub struct Agent {
    cfg: AgentConfig,
    dp: Datapath,
    maps: KernelMaps,
    syncer: Syncer,
    attached: BTreeSet<(String, Hook)>,
    /// What KPR_IFACE_V1 holds.
    ifaces: std::collections::BTreeMap<u32, proxy_common::IfaceInfo>,
    /// The Node's IPv4 pod CIDR (detectLocalMode NodeCIDR).
    node_pod_cidr: Option<IpNet>,
    pub stats: SharedStats,
    /// healthCheckNodePort servers (need a tokio runtime; None in tools and tests without one).
    pub health_checks: Option<crate::serve::healthcheck::HealthChecks>,
    /// The desired state last programmed, updated per changed service between full syncs.
    last_desired: Option<model::DesiredState>,
    last_node_version: Option<String>,
    /// Where objects that cannot be programmed are sent as Kubernetes Events (kube source).
    pub events: Option<tokio::sync::mpsc::UnboundedSender<crate::model::objects::ObjectError>>,
    reported: BTreeSet<String>,
    /// The mode in force (auto resolved).
    pub mode: Mode,
    ipvs: Option<IpvsPlane>,
    /// The conntrack collector's inbox: (service id, backend id) pairs whose flows go at once.
    gc: Option<std::sync::mpsc::Sender<BTreeSet<RemovedBackend>>>,
    /// Masquerade source ports (see sysctl::snat_port_range).
    snat_ports: (u16, u16),
    /// This namespace's cookie: connect-time balancing is for its sockets only.
    host_netns_cookie: u64,
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> Result<Self, AgentError> {
        let mut dp = Datapath::load_object(&cfg.pin_dir, cfg.capacities)?;
        let mode = match cfg.mode {
            Mode::Ebpf => {
                dp.load_fast_path()?;
                Mode::Ebpf
            }
            Mode::Ipvs => Mode::Ipvs,
            Mode::Auto => match dp.load_fast_path() {
                Ok(()) => Mode::Ebpf,
                Err(fast) => match connect_ipvs() {
                    Ok(_) => {
                        warn!(error = %fast, "mode auto: the eBPF fast path does not load on this kernel; using IPVS");
                        Mode::Ipvs
                    }
                    Err(e) => return Err(AgentError::NoMode { fast_path: fast.to_string(), ipvs: e.to_string() }),
                },
            },
        };
        info!(mode = mode.name(), requested = cfg.mode.name(), "data plane mode");
        let ipvs = if mode == Mode::Ipvs { Some(Self::start_ipvs(&cfg, &mut dp)?) } else { None };
        if let Some(cg) = &cfg.cgroup {
            if mode == Mode::Ipvs {
                dp.attach_cgroup(cg, &proxy_common::prog_names::SOCK_IPVS)?;
                info!(cgroup = %cg.display(), "node connections to LB IPs outside their source ranges refused at connect time");
            } else {
                dp.attach_cgroup(cg, &proxy_common::prog_names::SOCK)?;
                info!(cgroup = %cg.display(), "connect-time balancing attached");
            }
        }
        let maps = KernelMaps::open(&cfg.pin_dir)?;
        let stats = Arc::new(std::sync::Mutex::new(Stats::new(cfg.sync_period * 2)));
        stats.lock().unwrap().mode = mode.name();
        Ok(Self {
            cfg,
            dp,
            maps,
            syncer: Syncer::default(),
            attached: BTreeSet::new(),
            ifaces: Default::default(),
            node_pod_cidr: None,
            stats,
            health_checks: None,
            last_desired: None,
            last_node_version: None,
            events: None,
            reported: BTreeSet::new(),
            mode,
            ipvs,
            gc: None,
            snat_ports: masquerade_ports(),
            host_netns_cookie: host_netns_cookie(),
        })
    }

    /// IPVS mode's one-time setup: the netlink handles, the proxier's sysctls, the timeouts.
    fn start_ipvs(cfg: &AgentConfig, dp: &mut Datapath) -> Result<IpvsPlane, AgentError> {
        let mut ipvs = connect_ipvs()?;
        let loopback = dp.load_ipset()?;
        crate::dataplane::ipvs::rules::install(&mut crate::migration::SystemNetfilter, &loopback).map_err(AgentError::Netfilter)?;
        let info = ipvs.info()?;
        info!(version = format!("{}.{}.{}", info.version >> 16, (info.version >> 8) & 0xff, info.version & 0xff), conn_tab = info.conn_tab_size, "IPVS");
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let kver = crate::host::sysctl::kernel_version(release.trim()).unwrap_or((0, 0));
        set_sysctls(&crate::host::sysctl::ipvs_sysctls(kver, cfg.ipvs.strict_arp));
        let t = cfg.ipvs.timeouts;
        if t.tcp_s + t.tcp_fin_s + t.udp_s > 0 {
            ipvs.set_timeouts(&t)?;
        }
        let ct = match NetlinkConntrack::connect() {
            Ok(c) => Some(c),
            Err(e) => {
                warn!(error = %e, "no ctnetlink: conntrack entries of removed UDP backends will not be cleared");
                None
            }
        };
        let settings = IpvsSettings {
            scheduler: cfg.ipvs.scheduler.clone().unwrap_or_else(|| ipvs_sync::DEFAULT_SCHEDULER.into()),
            exclude_cidrs: cfg.ipvs.exclude_cidrs.clone(),
            ..IpvsSettings::default()
        };
        let sets = crate::dataplane::ipvs::sets::KernelSetMaps::open(&cfg.pin_dir)?;
        Ok(IpvsPlane { ipvs, links: NetlinkLinks::connect()?, ct, syncer: IpvsSyncer::new(settings), sets, sets_mirror: None })
    }

    /// IPVS mode's sync: virtual servers, destinations and kube-ipvs0 addresses.
    fn program_ipvs(
        &mut self,
        desired: &model::DesiredState,
        node_addrs: &[IpAddr],
        touched: Option<&BTreeSet<model::FrontendKey>>,
    ) -> Result<crate::dataplane::ebpf::sync::SyncStats, AgentError> {
        let plane = self.ipvs.as_mut().expect("IPVS mode");
        plane.syncer.settings.node_addresses = node_addrs.to_vec();
        let vs = ipvs_sync::desired_virtual_servers(desired, &plane.syncer.settings);
        let only: Option<BTreeSet<crate::dataplane::ipvs::client::ServiceId>> =
            touched.map(|t| t.iter().map(|k| crate::dataplane::ipvs::client::ServiceId::Addr { proto: k.proto.number(), addr: k.ip, port: k.port }).collect());
        let mut noct = crate::netlink::ctnetlink::FakeConntrack::default();
        let ct: &mut dyn crate::netlink::ctnetlink::ConntrackFlusher = match &mut plane.ct {
            Some(c) => c,
            None => &mut noct,
        };
        let st = plane.syncer.sync(&mut plane.ipvs, &mut plane.links, ct, &vs, only.as_ref())?;
        // The set-matching program's inputs: the sets, and the cluster CIDR / masqueradeAll.
        let bound: BTreeSet<IpAddr> = vs
            .values()
            .filter(|v| v.bind)
            .filter_map(|v| match v.config.id {
                crate::dataplane::ipvs::client::ServiceId::Addr { addr, .. } => Some(addr),
                crate::dataplane::ipvs::client::ServiceId::Fwmark { .. } => None,
            })
            .collect();
        let want = crate::dataplane::ipvs::sets::compute(desired, node_addrs, &bound);
        let have = match (touched, plane.sets_mirror.take()) {
            (Some(_), Some(m)) => m,
            _ => crate::dataplane::ipvs::sets::SetMaps::read(&plane.sets)?,
        };
        let (set_writes, set_deletes) = crate::dataplane::ipvs::sets::sync_from(&mut plane.sets, &have, &want)?;
        plane.sets_mirror = Some(want);
        let dcfg = self.datapath_config(node_addrs)?;
        if self.maps.config().ok() != Some(dcfg) {
            self.maps.set_config(dcfg)?;
        }
        self.stats.lock().unwrap().ipvs_terminating = st.terminating as u64;
        Ok(crate::dataplane::ebpf::sync::SyncStats {
            frontends: st.services,
            backends: st.dests,
            writes: st.writes + st.addresses_bound + set_writes,
            deletes: st.deletes + st.addresses_unbound + set_deletes,
            errors: st.errors,
            removed: Default::default(),
        })
    }

    fn node_addresses(&self, node: Option<&k8s_openapi::api::core::v1::Node>) -> Vec<IpAddr> {
        if !self.cfg.nodeport_addresses.is_empty() {
            return self.cfg.nodeport_addresses.clone();
        }
        let from_uplinks: Vec<IpAddr> = self.cfg.uplinks.iter().flat_map(|u| netif::ipv4_addresses(u)).collect();
        if !from_uplinks.is_empty() {
            return from_uplinks;
        }
        // The Node's InternalIP/ExternalIP addresses, as the API reports them.
        node.and_then(|n| n.status.as_ref())
            .and_then(|s| s.addresses.as_ref())
            .map(|a| a.iter().filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP").filter_map(|a| a.address.parse().ok()).collect())
            .unwrap_or_default()
    }

    /// The fast path needs an SNAT address; IPVS mode (which masquerades in netfilter) does not.
    fn datapath_config(&self, node_addrs: &[IpAddr]) -> Result<DatapathConfig, AgentError> {
        let snat = self.cfg.snat_ip.or_else(|| node_addrs.first().copied());
        if snat.is_none() && self.mode != Mode::Ipvs {
            return Err(AgentError::NoNodeAddress);
        }
        let local_cidr = match self.cfg.detect_local {
            DetectLocal::ClusterCidr => self.cfg.cluster_cidr,
            DetectLocal::NodeCidr => self.node_pod_cidr,
            DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => None,
        };
        let (cidr, len) = match local_cidr {
            Some(net) => (addr_words(net.network()), u32::from(net.prefix_len())),
            None => ([0; 4], 0),
        };
        let by_iface = matches!(self.cfg.detect_local, DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_));
        let (snat_port_min, snat_port_max) = self.snat_ports;
        Ok(DatapathConfig {
            snat_addr: snat.map(addr_words).unwrap_or_default(),
            cluster_cidr: cidr,
            cluster_cidr_len: len,
            flags: if self.cfg.masquerade_all { CFG_F_MASQUERADE_ALL } else { 0 } | if by_iface { proxy_common::CFG_F_LOCAL_BY_IFACE } else { 0 },
            ct_tcp_timeout_s: self.cfg.ct_tcp_timeout_s,
            ct_udp_timeout_s: self.cfg.ct_udp_timeout_s,
            snat_port_min,
            snat_port_max,
            _pad: 0,
            host_netns_cookie: self.host_netns_cookie,
        })
    }

    /// The hooks each interface gets: eBPF mode runs the pipeline's ingress half (XDP on
    /// uplinks, TC on pod and tunnel interfaces) and its egress half (TC) on all of them; IPVS
    /// mode the set-matching program at TC ingress everywhere (XDP has no skb mark).
    fn wanted_hooks(&self, present: &[String]) -> Vec<(String, Hook)> {
        let mut wanted: Vec<(String, Hook)> = Vec::new();
        let ebpf = self.mode != Mode::Ipvs;
        for u in &self.cfg.uplinks {
            wanted.push((u.clone(), if ebpf { Hook::Xdp } else { Hook::TcIngress }));
            if ebpf {
                wanted.push((u.clone(), Hook::TcEgress));
            }
        }
        for i in present {
            if self.cfg.pod_ifaces.contains(i) || self.cfg.pod_iface_prefixes.iter().any(|p| i.starts_with(p.as_str())) {
                wanted.push((i.clone(), Hook::TcIngress));
                if ebpf {
                    wanted.push((i.clone(), Hook::TcEgress));
                }
            }
        }
        wanted
    }

    /// Attaches the programs to interfaces that do not have them yet, detaches them from
    /// interfaces that are gone, and keeps the masquerade address of each interface current.
    pub fn attach_interfaces(&mut self) {
        let present = netif::interfaces();
        let wanted = self.wanted_hooks(&present);
        let mut attached_any = false;
        for (iface, hook) in &wanted {
            if self.attached.contains(&(iface.clone(), *hook)) {
                continue;
            }
            match self.dp.attach(iface, *hook, self.cfg.xdp_mode) {
                Ok(()) => {
                    info!(iface = %iface, hook = hook.tag(), "attached");
                    self.attached.insert((iface.clone(), *hook));
                    attached_any = true;
                }
                Err(e) => error!(iface = %iface, hook = hook.tag(), error = %e, "attach failed"),
            }
        }
        // Links of interfaces that are gone.
        for (iface, hook) in kernel::attached_links(&self.cfg.pin_dir) {
            if hook != Hook::Cgroup && !present.contains(&iface) {
                let _ = kernel::detach(&self.cfg.pin_dir, &iface, hook);
                self.attached.retain(|(i, _)| i != &iface);
            }
        }
        // What the programs need to know of each interface they run on.
        let mut ifaces = std::collections::BTreeMap::new();
        let masters = match &self.cfg.detect_local {
            DetectLocal::BridgeInterface(_) => crate::netlink::rtnl::NetlinkLinks::connect().and_then(|mut l| l.masters()).unwrap_or_else(|e| {
                warn!(error = %e, "cannot read the interfaces' bridges: detectLocalMode BridgeInterface sees no local pods");
                Default::default()
            }),
            _ => Default::default(),
        };
        for (iface, _) in &wanted {
            let Some(index) = netif::index(iface) else {
                continue;
            };
            let mut info = proxy_common::IfaceInfo::default();
            // Masquerade uses the address of the interface a flow leaves by, as MASQUERADE
            // does (a tunnel device's own address, so the remote node routes replies back
            // through the tunnel); interfaces without one use the node's SNAT address.
            if self.mode != Mode::Ipvs {
                if let Some(IpAddr::V4(a)) = netif::ipv4_addresses(iface).first() {
                    info.snat_addr = u32::from_ne_bytes(a.octets());
                }
            }
            if self.cfg.detect_local.is_local(iface, masters.get(iface).map(String::as_str)) {
                info.flags |= proxy_common::IFACE_F_LOCAL;
            }
            if info != proxy_common::IfaceInfo::default() {
                ifaces.insert(index, info);
            }
        }
        if ifaces != self.ifaces {
            match self.maps.set_ifaces(&ifaces) {
                Ok(()) => self.ifaces = ifaces,
                Err(e) => warn!(error = %e, "interface information for the data path"),
            }
        }
        if attached_any && self.mode == Mode::Ebpf {
            set_sysctls(&FAST_PATH_SYSCTLS);
        }
    }

    /// One full sync from the manifest directory.
    pub fn sync_once(&mut self) -> Result<crate::dataplane::ebpf::sync::SyncStats, AgentError> {
        let Source::Dir(dir) = &self.cfg.source else {
            return Err(AgentError::Map(crate::dataplane::ebpf::maps::MapError::Other { map: "-", message: "sync_once reads a manifest directory".into() }));
        };
        let report = manifests::load_dir(dir).map_err(|e| crate::dataplane::ebpf::maps::MapError::Other { map: "-", message: e.to_string() })?;
        for e in &report.errors {
            warn!(error = %e, "object skipped");
        }
        let rejected = report.errors.len();
        self.sync_objects(&report.objects, None, rejected, &[])
    }

    fn node_info(&self, node: Option<&k8s_openapi::api::core::v1::Node>) -> NodeInfo {
        let zone = node.and_then(|n| n.metadata.labels.as_ref()).and_then(|l| l.get(model::ZONE_LABEL)).cloned().or_else(|| self.cfg.node_zone.clone());
        NodeInfo { name: self.cfg.node_name.clone(), nodeport_addresses: self.node_addresses(node), zone }
    }

    /// Computes the desired state of `objects` and syncs the maps to it (a full sync).
    pub fn sync_objects(
        &mut self,
        objects: &Objects,
        node: Option<&k8s_openapi::api::core::v1::Node>,
        rejected: usize,
        trigger_times: &[SystemTime],
    ) -> Result<crate::dataplane::ebpf::sync::SyncStats, AgentError> {
        let start = Instant::now();
        let info = self.node_info(node);
        let desired = model::compute(objects, &info, &ModelConfig { default_scheduler: self.cfg.scheduler });
        let r = self.program(&desired, &info.nodeport_addresses, None, rejected, trigger_times, start);
        self.last_desired = Some(desired);
        r
    }

    /// Writes `desired` to the maps: a full sync (`touched` None) lists the kernel first,
    /// repairing drift; an incremental one writes only the touched frontends' difference from
    /// what was last written.
    fn program(
        &mut self,
        desired: &model::DesiredState,
        node_addrs: &[IpAddr],
        touched: Option<&BTreeSet<model::FrontendKey>>,
        rejected: usize,
        trigger_times: &[SystemTime],
        start: Instant,
    ) -> Result<crate::dataplane::ebpf::sync::SyncStats, AgentError> {
        for e in &desired.errors {
            warn!(error = %e, "service field ignored");
        }
        if let Some(tx) = &self.events {
            // Each problem once while it lasts; again if it comes back after being fixed.
            let now: BTreeSet<String> = desired.errors.iter().map(|e| e.to_string()).collect();
            for e in desired.errors.iter().filter(|e| !self.reported.contains(&e.to_string())) {
                let _ = tx.send(e.clone());
            }
            if touched.is_none() {
                self.reported = now;
            } else {
                self.reported.extend(now);
            }
        }
        let result = if self.mode == Mode::Ipvs {
            self.program_ipvs(desired, node_addrs, touched)
        } else {
            self.datapath_config(node_addrs).and_then(|dcfg| {
                let r = match touched {
                    None => self.syncer.sync(&mut self.maps, desired, dcfg),
                    Some(t) => self.syncer.sync_subset(&mut self.maps, desired, dcfg, t),
                };
                r.map_err(|e| match e {
                    crate::dataplane::ebpf::sync::SyncError::Map(m) => AgentError::Map(m),
                })
            })
        };
        let elapsed = start.elapsed();
        let mut stats = self.stats.lock().unwrap();
        stats.syncs_total += 1;
        let st = match result {
            Ok(st) => st,
            Err(e) => {
                stats.sync_failures_total += 1;
                return Err(e);
            }
        };
        for e in &st.errors {
            warn!(error = %e, "frontend not programmed");
        }
        if let (Some(gc), false) = (&self.gc, st.removed.is_empty()) {
            let _ = gc.send(st.removed.clone());
        }
        if let Some(hc) = &mut self.health_checks {
            for e in hc.update(&desired.health_checks) {
                warn!(error = %e, "health check server");
            }
        }
        stats.sync_duration.observe(elapsed.as_secs_f64());
        let now = SystemTime::now();
        stats.last_sync = Some(now);
        stats.rejected_objects = (rejected + desired.errors.len()) as u64;
        for t in trigger_times {
            if let Ok(d) = now.duration_since(*t) {
                stats.network_programming.observe(d.as_secs_f64());
            }
        }
        info!(
            full = touched.is_none(),
            frontends = st.frontends,
            backends = st.backends,
            writes = st.writes,
            deletes = st.deletes,
            ms = elapsed.as_secs_f64() * 1e3,
            "synced"
        );
        Ok(st)
    }

    /// One sync from the Kubernetes caches: only the changed services are recomputed, unless a
    /// full sync is due (first sync, syncPeriod, a change of this node).
    fn sync_kube(&mut self, shared: &kube_source::Shared, periodic: bool) -> Result<u64, AgentError> {
        let start = Instant::now();
        let mut st = shared.state.lock().unwrap();
        let node_version = st.node.as_ref().and_then(|n| n.metadata.resource_version.clone());
        let full = periodic || self.last_desired.is_none() || node_version != self.last_node_version;
        let changed = st.take_changed_services();
        let info = self.node_info(st.node.as_ref());
        self.node_pod_cidr = st
            .node
            .as_ref()
            .and_then(|n| n.spec.as_ref())
            .and_then(|s| s.pod_cidrs.clone().or_else(|| s.pod_cidr.clone().map(|c| vec![c])))
            .and_then(|cidrs| cidrs.iter().filter_map(|c| c.parse::<IpNet>().ok()).find(|n| n.addr().is_ipv4()));
        let cfg = ModelConfig { default_scheduler: self.cfg.scheduler };
        let mut touched = None;
        let mut desired = match self.last_desired.take() {
            Some(mut d) if !full => {
                let partial = model::compute_filtered(&st.objects, &info, &cfg, Some(&changed));
                touched = Some(d.replace_services(&changed, partial));
                d
            }
            _ => model::compute(&st.objects, &info, &cfg),
        };
        let triggers = std::mem::take(&mut st.trigger_times);
        st.oldest_pending = None;
        let generation = st.generation;
        drop(st);
        let r = self.program(&desired, &info.nodeport_addresses, touched.as_ref(), 0, &triggers, start);
        desired.errors.clear();
        // The changes were taken from the trackers: after a failure only a full sync knows
        // what is still to be written.
        self.last_desired = r.is_ok().then_some(desired);
        self.last_node_version = node_version;
        r.map(|_| generation)
    }

    /// The conntrack collector's thread (eBPF mode): one bounded round every GC_INTERVAL, and at
    /// once the cleanup of UDP endpoints that left their service (sent by the syncs).
    fn start_gc(&self) -> Option<std::sync::mpsc::Sender<BTreeSet<RemovedBackend>>> {
        if self.mode == Mode::Ipvs {
            return None;
        }
        let (tx, rx) = std::sync::mpsc::channel::<BTreeSet<RemovedBackend>>();
        let pin_dir = self.cfg.pin_dir.clone();
        let timeouts = crate::dataplane::ebpf::conntrack::Timeouts {
            tcp: self.cfg.ct_tcp_timeout_s,
            udp: self.cfg.ct_udp_timeout_s,
            closing: self.cfg.ct_closing_timeout_s,
            ..Default::default()
        };
        let stats = self.stats.clone();
        let spawned = std::thread::Builder::new().name("kpr-gc".into()).spawn(move || {
            let (mut tables, balanced) = match (kernel::KernelConntrack::open(&pin_dir), kernel::KernelSockRev::open(&pin_dir)) {
                (Ok(t), Ok(b)) => (t, b),
                (Err(e), _) | (_, Err(e)) => return error!(error = %e, "conntrack collector cannot open its maps; idle flows are not collected"),
            };
            let mut kernel_ct = NetlinkConntrack::connect()
                .map_err(|e| warn!(error = %e, "no ctnetlink: kernel conntrack entries of removed UDP endpoints are left to time out"))
                .ok();
            let mut sockets = crate::netlink::sockdiag::NetlinkSockets::connect()
                .map_err(|e| warn!(error = %e, "no sock_diag: the node's UDP sockets connected to removed endpoints are not ended"))
                .ok();
            let mut affinity = crate::dataplane::ebpf::affinity_gc::AffinityGc::new(&pin_dir);
            let mut gc = crate::dataplane::ebpf::conntrack::Gc::new(timeouts, GC_BATCH);
            let mut last_affinity = Instant::now();
            while !STOP.load(Ordering::Relaxed) {
                match rx.recv_timeout(GC_INTERVAL) {
                    Ok(removed) => {
                        let handles = crate::dataplane::ebpf::endpoint_cleanup::Handles {
                            tables: &mut tables,
                            affinity: &mut affinity,
                            kernel_conntrack: kernel_ct.as_mut().map(|c| c as &mut dyn crate::netlink::ctnetlink::ConntrackFlusher),
                            sockets: sockets.as_mut().map(|s| s as &mut dyn crate::netlink::sockdiag::Sockets),
                            balanced: &balanced,
                        };
                        let r = crate::dataplane::ebpf::endpoint_cleanup::endpoints_removed(&removed, &mut gc, handles);
                        info!(
                            endpoints = removed.len(),
                            flows = r.flows,
                            kernel_entries = r.kernel_entries,
                            sockets = r.sockets,
                            affinity = r.affinity,
                            "cleared what held clients to endpoints that left their service"
                        );
                        for e in r.errors {
                            warn!(error = %e, "removed endpoint cleanup");
                        }
                        stats.lock().unwrap().gc_flows_total += r.flows as u64;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
                match gc.round(&mut tables, kernel::monotonic_ns()) {
                    Ok(st) => {
                        if st.flows > 0 {
                            tracing::debug!(read = st.read, flows = st.flows, entries = st.entries, kept = st.kept, "collected idle flows");
                        }
                        stats.lock().unwrap().gc_flows_total += st.flows as u64;
                    }
                    Err(e) => warn!(error = %e, "conntrack gc round failed"),
                }
                if last_affinity.elapsed() >= Duration::from_secs(5) {
                    if let Err(e) = affinity.collect(kernel::monotonic_ns()) {
                        warn!(error = %e, "affinity gc failed");
                    }
                    last_affinity = Instant::now();
                }
            }
        });
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                error!(error = %e, "cannot start the conntrack collector");
                None
            }
        }
    }

    pub fn run(&mut self) {
        let mut limiter = Limiter::new(self.cfg.min_sync_period, self.cfg.burst_syncs);
        let mut last_fp = None;
        let mut last_generation = u64::MAX;
        let mut last_full = Instant::now() - self.cfg.sync_period * 2;
        self.gc = self.start_gc();
        let mut last_attach = Instant::now() - Duration::from_secs(10);
        let mut dirty = true;
        let mut logged_waiting = false;
        let (mut retry_at, mut retry_backoff): (Option<Instant>, Duration) = (None, RETRY_MIN);
        while !STOP.load(Ordering::Relaxed) {
            if last_attach.elapsed() >= Duration::from_secs(1) {
                self.attach_interfaces();
                last_attach = Instant::now();
            }
            let source = self.cfg.source.clone();
            match &source {
                Source::Dir(dir) => {
                    let fp = manifests::fingerprint(dir).ok();
                    if fp != last_fp {
                        dirty = true;
                        last_fp = fp;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Source::Kube(shared) => {
                    let g = if dirty {
                        // Already have work; the limiter decides when (no busy loop meanwhile).
                        std::thread::sleep(Duration::from_millis(20));
                        shared.state.lock().unwrap().generation
                    } else {
                        shared.wait(last_generation, Duration::from_millis(100))
                    };
                    if g != last_generation {
                        dirty = true;
                    }
                    let st = shared.state.lock().unwrap();
                    let mut stats = self.stats.lock().unwrap();
                    stats.service_changes_pending = st.service_changes.pending() as u64;
                    stats.endpoint_changes_pending = st.slice_changes.pending() as u64;
                    stats.service_changes_total = st.service_changes.total;
                    stats.endpoint_changes_total = st.slice_changes.total;
                    stats.node_eligible = st.node.as_ref().is_none_or(|n| n.metadata.deletion_timestamp.is_none());
                    if !st.synced() {
                        // Nothing is programmed before every cache has listed: what the maps
                        // hold now keeps forwarding.
                        stats.pending_since.get_or_insert_with(Instant::now);
                        if !logged_waiting {
                            info!("waiting for the Service, EndpointSlice and Node caches to sync");
                            logged_waiting = true;
                        }
                        continue;
                    }
                }
            }
            if dirty {
                self.stats.lock().unwrap().pending_since.get_or_insert_with(Instant::now);
            }
            // Draining IPVS destinations are re-checked every few seconds, not every syncPeriod.
            let draining = self.stats.lock().unwrap().ipvs_terminating > 0 && last_full.elapsed() >= Duration::from_secs(2);
            let periodic = last_full.elapsed() >= self.cfg.sync_period || draining;
            let may_retry = retry_at.is_none_or(|t| Instant::now() >= t);
            if may_retry && ((dirty && limiter.try_take(Instant::now())) || periodic) {
                let ok = match &source {
                    Source::Dir(_) => self.sync_once().map(|_| ()),
                    Source::Kube(shared) => self.sync_kube(shared, periodic).map(|g| {
                        last_generation = g;
                    }),
                };
                match ok {
                    Ok(()) => {
                        dirty = false;
                        // Event-driven syncs of the Kubernetes source are incremental; only a
                        // full one restarts the syncPeriod clock (drift repair stays periodic).
                        if periodic || matches!(source, Source::Dir(_)) {
                            last_full = Instant::now();
                        }
                        retry_backoff = RETRY_MIN;
                        retry_at = None;
                        let mut stats = self.stats.lock().unwrap();
                        stats.pending_since = None;
                        stats.failing_since = None;
                    }
                    Err(e) => {
                        // Retried, with a back-off up to syncPeriod, not in a busy loop; a failed
                        // sync keeps the change pending (health says so after its timeout).
                        error!(error = %e, retry_in_s = retry_backoff.as_secs_f64(), "sync failed; retrying");
                        dirty = true;
                        retry_at = Some(Instant::now() + retry_backoff);
                        retry_backoff = (retry_backoff * 2).min(self.cfg.sync_period.max(RETRY_MIN));
                        self.stats.lock().unwrap().failing_since.get_or_insert_with(Instant::now);
                    }
                }
                if self.cfg.once {
                    return;
                }
            }
        }
        info!("stopping; programs and maps stay in place (run `kpr cleanup` to remove them)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_local_modes_parse_and_match_interfaces() {
        assert_eq!(DetectLocal::from_config("", None, None), Ok(DetectLocal::ClusterCidr));
        assert_eq!(DetectLocal::from_config("NodeCIDR", None, None), Ok(DetectLocal::NodeCidr));
        assert!(DetectLocal::from_config("BridgeInterface", None, None).unwrap_err().contains("detectLocal.bridgeInterface"));
        assert!(DetectLocal::from_config("Sideways", None, None).is_err());
        let br = DetectLocal::from_config("BridgeInterface", Some("cni0"), None).unwrap();
        assert!(br.is_local("veth1234", Some("cni0")) && !br.is_local("flannel.1", None) && !br.is_local("veth9", Some("docker0")));
        let pre = DetectLocal::from_config("InterfaceNamePrefix", None, Some("cali")).unwrap();
        assert!(pre.is_local("cali12ab", None) && !pre.is_local("eth0", None));
        assert!(!DetectLocal::ClusterCidr.is_local("cali12ab", None), "by address, not interface");
    }

    #[test]
    fn limiter_allows_a_burst_then_one_per_interval() {
        let mut l = Limiter::new(Duration::from_secs(1), 2);
        let t0 = Instant::now();
        assert!(l.try_take(t0));
        assert!(l.try_take(t0));
        assert!(!l.try_take(t0 + Duration::from_millis(100)));
        assert!(l.try_take(t0 + Duration::from_millis(1200)));
        assert!(!l.try_take(t0 + Duration::from_millis(1300)));
    }
}
