//! The settings' value types, each with its parsing and the checks a value must pass.
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use ipnet::IpNet;

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
    /// The name in flags, files, /proxyMode and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Ipvs => "ipvs",
            Mode::Auto => "auto",
        }
    }

    /// A KubeProxyConfiguration's mode: kube-proxy's own modes become the fast path, which
    /// replaces them (a note says so).
    pub(super) fn from_file(s: &str) -> Result<(Self, Option<String>), String> {
        match s {
            "iptables" | "nftables" | "kernelspace" => Ok((Mode::Ebpf, Some(format!("mode {s}: kpr replaces it with the eBPF fast path")))),
            other => other.parse().map(|m| (m, None)),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [Mode::Ebpf, Mode::Ipvs, Mode::Auto]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown mode {s:?} (ebpf, ipvs, auto; kube-proxy's iptables and nftables mean ebpf)"))
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

    /// Whether the fast path tells local clients by their interface (not their address).
    pub fn by_interface(&self) -> bool {
        matches!(self, DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_))
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

/// Which node addresses NodePorts answer on.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum NodePortAddresses {
    /// Every address of the uplinks (kube-proxy's default in iptables and IPVS mode).
    #[default]
    All,
    /// These addresses (--node-ip).
    Addresses(Vec<IpAddr>),
    /// The node's addresses these select (nodePortAddresses).
    Select(Vec<NodePortFilter>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortFilter {
    Cidr(IpNet),
    /// The primary IP of each family (bindAddress, else the Node's first InternalIP of it).
    Primary,
}

impl NodePortAddresses {
    /// The NodePort addresses among `node_addresses`, whose first of each family is that
    /// family's primary IP.
    pub fn select(&self, node_addresses: &[IpAddr]) -> Vec<IpAddr> {
        match self {
            NodePortAddresses::All => node_addresses.to_vec(),
            NodePortAddresses::Addresses(a) => a.clone(),
            NodePortAddresses::Select(filters) => node_addresses
                .iter()
                .enumerate()
                .filter(|(i, a)| {
                    filters.iter().any(|f| match f {
                        NodePortFilter::Primary => node_addresses.iter().position(|b| b.is_ipv4() == a.is_ipv4()) == Some(*i),
                        NodePortFilter::Cidr(net) => net.contains(*a),
                    })
                })
                .map(|(_, a)| *a)
                .collect(),
        }
    }
}

/// The kernel's conntrack (as kube-proxy sets it, since netfilter still tracks every flow
/// kpr balances) and the fast path's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackSettings {
    /// nf_conntrack_max = max(max_per_core × CPUs, min); max_per_core 0 leaves it.
    pub max_per_core: u32,
    pub min: u32,
    /// Idle established TCP flows: the kernel's and the fast path's.
    pub tcp_established: Duration,
    pub tcp_close_wait: Duration,
    pub tcp_be_liberal: bool,
    /// The kernel's UDP timeouts; None leaves them.
    pub udp: Option<Duration>,
    pub udp_stream: Option<Duration>,
    /// The fast path: idle TCP flows after a FIN or RST.
    pub tcp_closing: Duration,
}

impl Default for ConntrackSettings {
    fn default() -> Self {
        Self {
            max_per_core: 32_768,
            min: 131_072,
            tcp_established: Duration::from_secs(24 * 3600),
            tcp_close_wait: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp: None,
            udp_stream: None,
            tcp_closing: Duration::from_secs(10),
        }
    }
}

impl ConntrackSettings {
    /// The fast path's timeout for an assured UDP flow (the client sent after a reply): the
    /// kernel's "stream" timeout, 120 s where that is left to the kernel (its default).
    pub fn fast_path_udp(&self) -> Duration {
        self.udp_stream.unwrap_or(Duration::from_secs(120))
    }
    /// The fast path's timeout for a UDP flow not assured (no reply yet, or none answered since,
    /// as a DNS query's): the kernel's plain UDP timeout, 30 s where that is left to the kernel
    /// (its default).
    pub fn fast_path_udp_unassured(&self) -> Duration {
        self.udp.unwrap_or(Duration::from_secs(30))
    }
}

/// IPVS mode's settings (kube-proxy's ipvs.*).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsSettings {
    /// Default scheduler; per Service: annotation kpr.io/ipvs-scheduler.
    pub scheduler: String,
    pub strict_arp: bool,
    pub exclude_cidrs: Vec<IpNet>,
    /// IPVS's own timeouts; zero keeps the kernel's.
    pub tcp_timeout: Duration,
    pub tcp_fin_timeout: Duration,
    pub udp_timeout: Duration,
    pub vip_binding: VipBinding,
}

/// How IPVS mode makes its IPv4 virtual IPs local (IPVS sees only packets to local addresses).
/// IPv6 ones are always addresses: the kernel adds those in constant time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum VipBinding {
    /// An address on kube-ipvs0 each, as kube-proxy (`ip addr show kube-ipvs0`). The kernel
    /// walks the link's address list on every add, so binding N costs O(N²): seconds at tens of
    /// thousands of Services, once per node start from an empty kube-ipvs0.
    #[default]
    Address,
    /// A local route each, through `lo` (`ip route show table local proto 107`):
    /// the same delivery, O(log N) each.
    Route,
}

impl Default for IpvsSettings {
    fn default() -> Self {
        Self {
            scheduler: proxy_common::IPVS_DEFAULT_SCHEDULER.into(),
            strict_arp: false,
            exclude_cidrs: vec![],
            tcp_timeout: Duration::ZERO,
            tcp_fin_timeout: Duration::ZERO,
            udp_timeout: Duration::ZERO,
            vip_binding: VipBinding::Address,
        }
    }
}

/// What the fast path's maps hold; the kernel allocates (or, with BPF_F_NO_PREALLOC, allows)
/// this much. See docs/configuration.md for the memory each costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    /// Frontends (address, port, protocol, scope), each with its own service id: a ClusterIP
    /// port takes two (internal and external traffic), a NodePort two more per node address.
    pub services: u32,
    pub backends: u32,
    /// Backend slots: endpoints counted once per service port they serve.
    pub slots: u32,
    pub conntrack: u32,
    pub conntrack_new: u32,
    /// IPv6 flow entries (LRU), and IPv6 TCP flows before their handshake completes.
    pub conntrack6: u32,
    pub conntrack6_new: u32,
    pub affinity: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        use proxy_common::limits::*;
        Self {
            services: MAX_SERVICES,
            backends: MAX_BACKENDS,
            slots: MAX_SLOTS,
            conntrack: MAX_CONNTRACK,
            conntrack_new: MAX_CONNTRACK_NEW,
            conntrack6: MAX_CONNTRACK6,
            conntrack6_new: MAX_CONNTRACK6_NEW,
            affinity: MAX_AFFINITY,
        }
    }
}

/// Where connect-time balancing attaches.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Cgroup {
    /// The cgroup2 root.
    #[default]
    Auto,
    None,
    Path(PathBuf),
}

pub const DEFAULT_HEALTHZ: &str = "0.0.0.0:10256";
pub const DEFAULT_METRICS: &str = "127.0.0.1:10249";

/// kube-proxy's bind addresses: "IP:port", an IP alone (the default's port), ":port" (the
/// default's address); "" disables.
pub fn bind_address(s: &str, default: &str) -> Result<Option<SocketAddr>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    let default: SocketAddr = default.parse().expect("a default address");
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(Some(a));
    }
    if let Ok(ip) = s.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, default.port())));
    }
    if let Some(port) = s.strip_prefix(':') {
        return port.parse::<u16>().map(|p| Some(SocketAddr::new(default.ip(), p))).map_err(|_| format!("{s:?}: {port:?} is not a port"));
    }
    Err(format!("{s:?} is not IP:port, an IP, or :port"))
}

/// An IPVS scheduler name kube-proxy accepts.
pub fn check_ipvs_scheduler(s: &str) -> Result<(), String> {
    if proxy_common::IPVS_SCHEDULERS.contains(&s) {
        Ok(())
    } else {
        Err(format!("unknown scheduler {s:?} (one of {})", proxy_common::IPVS_SCHEDULERS.join(", ")))
    }
}

/// An oom_score_adj value.
pub fn check_oom_score_adj(o: i32) -> Result<(), String> {
    if (-1000..=1000).contains(&o) {
        Ok(())
    } else {
        Err(format!("{o} is outside -1000..1000"))
    }
}
