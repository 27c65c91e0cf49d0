//! The agent's settings, resolved once at start from three layers by one rule: an explicit
//! flag, else the configuration file (kube-proxy's KubeProxyConfiguration, read unchanged),
//! else the default (`pick`). `resolve` takes the file apart field by field (no `..`), so each
//! of kube-proxy's fields is either used or warned about by name; a field added to the type
//! without a decision here does not compile.
pub mod flags;
pub mod kube_proxy;

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

pub use flags::{Flags, XdpModeArg};
use ipnet::IpNet;
use kube_proxy::KubeProxyConfiguration;

use crate::model::Scheduler;

/// The one precedence rule: an explicit flag, else the file, else the default.
fn pick<T>(flag: Option<T>, file: Option<T>, default: T) -> T {
    flag.or(file).unwrap_or(default)
}

/// A file's value counts only when set: kube-proxy's files write "" and 0s for "unset".
fn set_str(v: &Option<String>) -> Option<String> {
    v.as_ref().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

fn set_duration(v: Option<kube::core::Duration>) -> Option<Duration> {
    v.map(Duration::from).filter(|d| !d.is_zero())
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{origin}: {message}")]
pub struct SettingsError {
    /// "--flag", or "FILE: field path".
    pub origin: String,
    pub message: String,
}

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
    fn from_file(s: &str) -> Result<(Self, Option<String>), String> {
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
    /// The primary IP (bindAddress, else the Node's first InternalIP).
    Primary,
}

impl NodePortAddresses {
    /// The NodePort addresses among `node_addresses`, whose first is the primary IP.
    pub fn select(&self, node_addresses: &[IpAddr]) -> Vec<IpAddr> {
        match self {
            NodePortAddresses::All => node_addresses.to_vec(),
            NodePortAddresses::Addresses(a) => a.clone(),
            NodePortAddresses::Select(filters) => node_addresses
                .iter()
                .enumerate()
                .filter(|(i, a)| {
                    filters.iter().any(|f| match f {
                        NodePortFilter::Primary => *i == 0,
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
    /// The fast path's UDP timeout: a flow it balances saw replies (the kernel's "stream"
    /// timeout), 120 s where that is left to the kernel (its default).
    pub fn fast_path_udp(&self) -> Duration {
        self.udp_stream.unwrap_or(Duration::from_secs(120))
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
}

impl Default for IpvsSettings {
    fn default() -> Self {
        Self {
            scheduler: "rr".into(),
            strict_arp: false,
            exclude_cidrs: vec![],
            tcp_timeout: Duration::ZERO,
            tcp_fin_timeout: Duration::ZERO,
            udp_timeout: Duration::ZERO,
        }
    }
}

/// What the fast path's maps hold; the kernel allocates (or, with BPF_F_NO_PREALLOC, allows)
/// this much. See docs/configuration.md for the memory each costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    /// Service ports (ids): ClusterIP, NodePort, external and LB addresses share one.
    pub services: u32,
    /// Frontends: (address, port, protocol, scope).
    pub frontends: u32,
    pub backends: u32,
    /// Backend slots: endpoints counted once per service port they serve.
    pub slots: u32,
    pub conntrack: u32,
    pub conntrack_new: u32,
    pub affinity: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        use proxy_common::limits::*;
        Self {
            services: MAX_SERVICES,
            frontends: MAX_FRONTENDS,
            backends: MAX_BACKENDS,
            slots: MAX_SLOTS,
            conntrack: MAX_CONNTRACK,
            conntrack_new: MAX_CONNTRACK_NEW,
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

#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub mode: Mode,
    /// Manifests instead of the Kubernetes API.
    pub manifests: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    /// The API server's real address, which replaces the in-cluster Service address.
    pub k8s_api_server: Option<String>,
    /// None: the host name.
    pub node_name: Option<String>,
    pub node_zone: Option<String>,
    /// kube-proxy's bindAddress: the node's primary IP when given.
    pub primary_ip: Option<IpAddr>,
    pub node_port_addresses: NodePortAddresses,
    pub snat_ip: Option<IpAddr>,
    /// Masquerade with the primary IP rather than the egress interface's address.
    pub snat_node_internal_ip: bool,
    pub cluster_cidrs: Vec<IpNet>,
    pub detect_local: DetectLocal,
    pub masquerade_all: bool,
    pub uplinks: Vec<String>,
    pub pod_ifaces: Vec<String>,
    pub pod_iface_prefixes: Vec<String>,
    pub cgroup: Cgroup,
    pub xdp_mode: XdpModeArg,
    /// The fast path's default scheduler.
    pub scheduler: Scheduler,
    pub ipvs: IpvsSettings,
    pub conntrack: ConntrackSettings,
    pub capacities: Capacities,
    /// Full resync period (kube-proxy's syncPeriod).
    pub sync_period: Duration,
    /// Least time between two event-driven syncs (minSyncPeriod), and how many may come in a
    /// burst before that applies.
    pub min_sync_period: Duration,
    pub burst_syncs: u32,
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    pub bind_address_hard_fail: bool,
    pub oom_score_adj: i32,
    pub verbosity: u32,
    /// Stop after the first sync (tests, benchmarks).
    pub once: bool,
}

impl Default for Settings {
    fn default() -> Self {
        resolve(&Flags::default(), None).expect("the defaults resolve").0
    }
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

/// Resolves the flags over the file (named `file.0`, for messages) over the defaults. Returns
/// the settings and the notes to log (fields ignored, replaced or not applicable).
pub fn resolve(f: &Flags, file: Option<(&str, KubeProxyConfiguration)>) -> Result<(Settings, Vec<String>), SettingsError> {
    let (name, kp) = match file {
        Some((n, kp)) => (n.to_string(), kp),
        None => (String::new(), KubeProxyConfiguration::default()),
    };
    let mut notes: Vec<String> = Vec::new();
    let field_err = |field: &str, message: String| SettingsError { origin: format!("{name}: {field}"), message };
    let flag_err = |flag: &str, message: String| SettingsError { origin: format!("--{flag}"), message };

    let KubeProxyConfiguration {
        api_version: _,
        kind: _,
        feature_gates,
        client_connection,
        logging,
        hostname_override,
        bind_address: file_bind_address,
        healthz_bind_address,
        metrics_bind_address,
        bind_address_hard_fail,
        enable_profiling,
        show_hidden_metrics_for_version,
        mode,
        iptables,
        ipvs,
        nftables,
        winkernel,
        detect_local_mode,
        detect_local,
        cluster_cidr,
        node_port_addresses,
        oom_score_adj,
        conntrack,
        config_sync_period,
        port_range,
        windows_run_as_service,
        sync_period,
        min_sync_period,
        masquerade_all,
        masquerade_bit,
        unknown,
    } = kp;
    notes.extend(kube_proxy::unknown_fields(&name, "", &unknown));
    let note_ignored = |notes: &mut Vec<String>, field: &str, why: &str| notes.push(format!("{name}: {field} {why} (ignored)"));

    // Fields that mean nothing to kpr: named when set to anything but their zero value.
    if feature_gates.as_ref().is_some_and(|g| !g.is_empty()) {
        note_ignored(&mut notes, "featureGates", "names kube-proxy's feature gates; kpr has none");
    }
    if enable_profiling == Some(true) {
        note_ignored(&mut notes, "enableProfiling", "is kube-proxy's pprof; kpr serves none");
    }
    if set_str(&show_hidden_metrics_for_version).is_some() {
        note_ignored(&mut notes, "showHiddenMetricsForVersion", "applies to kube-proxy's metrics registry");
    }
    if winkernel.as_ref().is_some_and(|w| !is_zero_value(w)) {
        note_ignored(&mut notes, "winkernel", "is for Windows nodes");
    }
    if windows_run_as_service == Some(true) {
        note_ignored(&mut notes, "windowsRunAsService", "is for Windows nodes");
    }
    if set_str(&port_range).is_some() {
        note_ignored(&mut notes, "portRange", "was the userspace proxy's, unused by kube-proxy too");
    }
    if set_duration(config_sync_period).is_some() {
        note_ignored(&mut notes, "configSyncPeriod", "is an informer resync; kpr's watches need none");
    }

    // The mode first: which section's sync periods and masquerade settings apply depends on it.
    let file_mode = match set_str(&mode) {
        Some(m) => {
            let (m, note) = Mode::from_file(&m).map_err(|e| field_err("mode", e))?;
            notes.extend(note.map(|n| format!("{name}: {n}")));
            Some(m)
        }
        None => None,
    };
    let flag_mode = f.mode.as_deref().map(|m| m.parse::<Mode>().map_err(|e| flag_err("mode", e))).transpose()?;
    let the_mode = pick(flag_mode, file_mode, Mode::Ebpf);
    let file_mode_name = set_str(&mode).unwrap_or_default();

    let cc = client_connection.unwrap_or_default();
    notes.extend(kube_proxy::unknown_fields(&name, "clientConnection.", &cc.unknown));
    for (field, set) in [
        ("clientConnection.qps", cc.qps.is_some_and(|q| q != 0.0)),
        ("clientConnection.burst", cc.burst.is_some_and(|b| b != 0)),
        ("clientConnection.contentType", set_str(&cc.content_type).is_some()),
        ("clientConnection.acceptContentTypes", set_str(&cc.accept_content_types).is_some()),
    ] {
        if set {
            note_ignored(&mut notes, field, "tunes client-go; kpr's client (kube-rs) watches with its own settings");
        }
    }
    let log = logging.unwrap_or_default();
    notes.extend(kube_proxy::unknown_fields(&name, "logging.", &log.unknown));
    if set_str(&log.format).is_some_and(|fm| fm != "text") {
        note_ignored(&mut notes, "logging.format", "is --log-format for kpr (human or json)");
    }
    for (field, v) in [("logging.flushFrequency", &log.flush_frequency), ("logging.vmodule", &log.vmodule), ("logging.options", &log.options)] {
        if v.as_ref().is_some_and(|v| !is_zero_value(v)) {
            note_ignored(&mut notes, field, "is klog's");
        }
    }

    let ipt = iptables.unwrap_or_default();
    let ipv = ipvs.unwrap_or_default();
    let nft = nftables.unwrap_or_default();
    notes.extend(kube_proxy::unknown_fields(&name, "iptables.", &ipt.unknown));
    notes.extend(kube_proxy::unknown_fields(&name, "ipvs.", &ipv.unknown));
    notes.extend(kube_proxy::unknown_fields(&name, "nftables.", &nft.unknown));
    if ipt.localhost_node_ports == Some(true) {
        note_ignored(&mut notes, "iptables.localhostNodePorts", "(NodePorts on 127.0.0.1) has no eBPF or IPVS counterpart, as in kube-proxy's IPVS mode");
    }
    // The mode's section: ipvs.* in IPVS mode, nftables.* for a file written for nftables,
    // iptables.* otherwise; the top-level copies win over all of them.
    let (section, sync, min_sync, masq_all, masq_bit) = match (the_mode, file_mode_name.as_str()) {
        (Mode::Ipvs, _) => ("ipvs", ipv.sync_period, ipv.min_sync_period, ipt.masquerade_all, ipt.masquerade_bit),
        (_, "nftables") => ("nftables", nft.sync_period, nft.min_sync_period, nft.masquerade_all, nft.masquerade_bit),
        _ => ("iptables", ipt.sync_period, ipt.min_sync_period, ipt.masquerade_all, ipt.masquerade_bit),
    };
    let file_sync = set_duration(sync_period).or(set_duration(sync));
    let file_min_sync = set_duration(min_sync_period).or(set_duration(min_sync));
    let masq_all = masquerade_all.or(masq_all);
    let masq_bit = masquerade_bit.or(masq_bit);
    for (s, d, m) in [
        ("iptables", &ipt.sync_period, &ipt.min_sync_period),
        ("ipvs", &ipv.sync_period, &ipv.min_sync_period),
        ("nftables", &nft.sync_period, &nft.min_sync_period),
    ] {
        // Another section's periods are fine (a file ready for another mode) unless they
        // differ from the ones in force: then the reader should know which apply.
        let differs = |v: &Option<kube::core::Duration>, inforce: Option<Duration>| set_duration(*v).is_some_and(|v| Some(v) != inforce);
        if s != section && (differs(d, file_sync) || differs(m, file_min_sync)) {
            notes.push(format!("{name}: {s}.syncPeriod/minSyncPeriod do not apply in mode {the_mode} ({section}.* do)"));
        }
    }
    if let Some(b) = masq_bit {
        if !(0..=31).contains(&b) {
            return Err(field_err(&format!("{section}.masqueradeBit"), format!("{b} is not a bit number 0..31")));
        }
        if b != 14 {
            notes.push(format!(
                "{name}: {section}.masqueradeBit {b}: kpr marks with bit 14 (0x4000) in IPVS mode, and the eBPF fast path masquerades without a mark"
            ));
        }
    }

    let dl = detect_local.unwrap_or_default();
    notes.extend(kube_proxy::unknown_fields(&name, "detectLocal.", &dl.unknown));
    let dl_mode = pick(f.detect_local_mode.clone(), set_str(&detect_local_mode), String::new());
    let dl_bridge = f.pod_bridge_interface.clone().or(set_str(&dl.bridge_interface));
    let dl_prefix = f.pod_interface_name_prefix.clone().or(set_str(&dl.interface_name_prefix));
    let detect = DetectLocal::from_config(&dl_mode, dl_bridge.as_deref(), dl_prefix.as_deref()).map_err(|e| match f.detect_local_mode {
        Some(_) => flag_err("detect-local-mode", e),
        None => field_err("detectLocalMode", e),
    })?;

    let mut file_cidrs = Vec::new();
    if let Some(s) = set_str(&cluster_cidr) {
        for (i, part) in s.split(',').map(str::trim).filter(|p| !p.is_empty()).enumerate() {
            file_cidrs.push(part.parse::<IpNet>().map_err(|_| field_err("clusterCIDR", format!("entry {i}: {part:?} is not a CIDR")))?);
        }
    }
    let cluster_cidrs = pick((!f.cluster_cidr.is_empty()).then(|| f.cluster_cidr.clone()), (!file_cidrs.is_empty()).then_some(file_cidrs), vec![]);

    let mut filters = Vec::new();
    for (i, s) in node_port_addresses.iter().flatten().enumerate() {
        let field = format!("nodePortAddresses[{i}]");
        match s.as_str() {
            "primary" => filters.push(NodePortFilter::Primary),
            "all" => filters.extend(["0.0.0.0/0", "::/0"].map(|n| NodePortFilter::Cidr(n.parse().expect("CIDR")))),
            "localhost" => notes.push(format!("{name}: {field} localhost: NodePorts on loopback exist in kube-proxy's iptables mode only (ignored)")),
            cidr => filters
                .push(NodePortFilter::Cidr(cidr.parse().map_err(|_| field_err(&field, format!("{cidr:?} is neither a CIDR nor primary, all or localhost")))?)),
        }
    }
    let node_port_addresses = pick(
        (!f.node_ips.is_empty()).then(|| NodePortAddresses::Addresses(f.node_ips.clone())),
        (!filters.is_empty()).then_some(NodePortAddresses::Select(filters)),
        NodePortAddresses::All,
    );

    let file_primary = match set_str(&file_bind_address) {
        Some(s) => {
            let ip: IpAddr = s.parse().map_err(|_| field_err("bindAddress", format!("{s:?} is not an IP address")))?;
            (!ip.is_unspecified()).then_some(ip)
        }
        None => None,
    };

    let file_scheduler = set_str(&ipv.scheduler);
    if let Some(s) = &file_scheduler {
        if !proxy_common::IPVS_SCHEDULERS.contains(&s.as_str()) {
            return Err(field_err("ipvs.scheduler", format!("unknown scheduler {s:?} (one of {})", proxy_common::IPVS_SCHEDULERS.join(", "))));
        }
    }
    if let Some(s) = &f.ipvs_scheduler {
        if !proxy_common::IPVS_SCHEDULERS.contains(&s.as_str()) {
            return Err(flag_err("ipvs-scheduler", format!("unknown scheduler {s:?} (one of {})", proxy_common::IPVS_SCHEDULERS.join(", "))));
        }
    }
    // The fast path's counterpart of an IPVS scheduler: rr and mh have one.
    let file_fast_scheduler = match file_scheduler.as_deref() {
        Some("rr") => Some(Scheduler::RoundRobin),
        Some("mh") => Some(Scheduler::Maglev),
        Some(other) => {
            if the_mode != Mode::Ipvs {
                notes.push(format!("{name}: ipvs.scheduler {other:?} applies to IPVS mode only; the eBPF fast path uses random"));
            }
            None
        }
        None => None,
    };
    let flag_scheduler = f.scheduler.as_deref().map(|s| s.parse::<Scheduler>().map_err(|e| flag_err("scheduler", e))).transpose()?;

    let mut exclude = Vec::new();
    for (i, s) in ipv.exclude_cidrs.iter().flatten().enumerate() {
        exclude.push(s.parse::<IpNet>().map_err(|_| field_err(&format!("ipvs.excludeCIDRs[{i}]"), format!("{s:?} is not a CIDR")))?);
    }
    let ipvs_settings = IpvsSettings {
        scheduler: pick(f.ipvs_scheduler.clone(), file_scheduler, "rr".into()),
        strict_arp: pick(f.ipvs_strict_arp, ipv.strict_arp, false),
        exclude_cidrs: pick((!f.ipvs_exclude_cidrs.is_empty()).then(|| f.ipvs_exclude_cidrs.clone()), (!exclude.is_empty()).then_some(exclude), vec![]),
        tcp_timeout: pick(f.ipvs_tcp_timeout.map(Duration::from), ipv.tcp_timeout.map(Duration::from), Duration::ZERO),
        tcp_fin_timeout: pick(f.ipvs_tcp_fin_timeout.map(Duration::from), ipv.tcp_fin_timeout.map(Duration::from), Duration::ZERO),
        udp_timeout: pick(f.ipvs_udp_timeout.map(Duration::from), ipv.udp_timeout.map(Duration::from), Duration::ZERO),
    };

    let ct = conntrack.unwrap_or_default();
    notes.extend(kube_proxy::unknown_fields(&name, "conntrack.", &ct.unknown));
    let nonneg = |field: &str, v: Option<i32>| -> Result<Option<u32>, SettingsError> {
        v.map(|n| u32::try_from(n).map_err(|_| field_err(field, format!("{n} is negative")))).transpose()
    };
    let d = ConntrackSettings::default();
    let conntrack_settings = ConntrackSettings {
        max_per_core: pick(f.conntrack_max_per_core, nonneg("conntrack.maxPerCore", ct.max_per_core)?, d.max_per_core),
        min: pick(f.conntrack_min, nonneg("conntrack.min", ct.min)?, d.min),
        tcp_established: pick(f.conntrack_tcp_timeout_established.map(Duration::from), set_duration(ct.tcp_established_timeout), d.tcp_established),
        tcp_close_wait: pick(f.conntrack_tcp_timeout_close_wait.map(Duration::from), set_duration(ct.tcp_close_wait_timeout), d.tcp_close_wait),
        tcp_be_liberal: pick(f.conntrack_tcp_be_liberal, ct.tcp_be_liberal, d.tcp_be_liberal),
        udp: f.conntrack_udp_timeout.map(Duration::from).or(set_duration(ct.udp_timeout)).filter(|d| !d.is_zero()),
        udp_stream: f.conntrack_udp_timeout_stream.map(Duration::from).or(set_duration(ct.udp_stream_timeout)).filter(|d| !d.is_zero()),
        tcp_closing: pick(f.conntrack_tcp_timeout_closing.map(Duration::from), None, d.tcp_closing),
    };
    if conntrack_settings.tcp_established.is_zero() || conntrack_settings.tcp_closing.is_zero() {
        return Err(flag_err("conntrack-tcp-timeout-established", "the fast path's TCP timeouts must be above zero".into()));
    }

    let dc = Capacities::default();
    let capacities = Capacities {
        services: pick(f.max_services, None, dc.services),
        frontends: f.max_services.map_or(dc.frontends, |s| s.saturating_mul(2)),
        backends: pick(f.max_backends, None, dc.backends),
        slots: f.max_backends.map_or(dc.slots, |b| b.saturating_mul(4)),
        conntrack: pick(f.max_conntrack, None, dc.conntrack),
        conntrack_new: pick(f.max_conntrack_embryonic, None, dc.conntrack_new),
        affinity: pick(f.max_affinity, None, dc.affinity),
    };
    for (flag, v) in [
        ("max-services", capacities.services),
        ("max-backends", capacities.backends),
        ("max-conntrack", capacities.conntrack),
        ("max-conntrack-embryonic", capacities.conntrack_new),
        ("max-affinity", capacities.affinity),
    ] {
        if v == 0 {
            return Err(flag_err(flag, "must be above zero".into()));
        }
    }

    let healthz = match &f.healthz_bind_address {
        Some(s) => bind_address(s, DEFAULT_HEALTHZ).map_err(|e| flag_err("healthz-bind-address", e))?,
        None => match set_str(&healthz_bind_address) {
            Some(s) => bind_address(&s, DEFAULT_HEALTHZ).map_err(|e| field_err("healthzBindAddress", e))?,
            None => bind_address(DEFAULT_HEALTHZ, DEFAULT_HEALTHZ).expect("default"),
        },
    };
    let metrics = match &f.metrics_bind_address {
        Some(s) => bind_address(s, DEFAULT_METRICS).map_err(|e| flag_err("metrics-bind-address", e))?,
        None => match set_str(&metrics_bind_address) {
            Some(s) => bind_address(&s, DEFAULT_METRICS).map_err(|e| field_err("metricsBindAddress", e))?,
            None => bind_address(DEFAULT_METRICS, DEFAULT_METRICS).expect("default"),
        },
    };
    if let Some(o) = oom_score_adj {
        if !(-1000..=1000).contains(&o) {
            return Err(field_err("oomScoreAdj", format!("{o} is outside -1000..1000")));
        }
    }
    if let Some(o) = f.oom_score_adj {
        if !(-1000..=1000).contains(&o) {
            return Err(flag_err("oom-score-adj", format!("{o} is outside -1000..1000")));
        }
    }

    let settings = Settings {
        mode: the_mode,
        manifests: f.manifests.clone(),
        kubeconfig: pick(f.kubeconfig.clone().map(Some), set_str(&cc.kubeconfig).map(|k| Some(PathBuf::from(k))), None),
        k8s_api_server: f.k8s_api_server.clone().filter(|s| !s.is_empty()),
        node_name: pick(f.node_name.clone().filter(|n| !n.is_empty()).map(Some), set_str(&hostname_override).map(Some), None),
        node_zone: f.node_zone.clone(),
        primary_ip: pick(f.bind_address.map(Some), file_primary.map(Some), None),
        node_port_addresses,
        snat_ip: f.snat_ip,
        snat_node_internal_ip: pick(f.snat_node_internal_ip, ipt.snat_node_internal_ip, false),
        cluster_cidrs,
        detect_local: detect,
        masquerade_all: pick(f.masquerade_all, masq_all, false),
        uplinks: f.uplinks.clone(),
        pod_ifaces: f.pod_ifaces.clone(),
        pod_iface_prefixes: f.pod_iface_prefixes.clone(),
        cgroup: match f.cgroup.as_deref() {
            None | Some("auto") => Cgroup::Auto,
            Some("none") => Cgroup::None,
            Some(p) => Cgroup::Path(p.into()),
        },
        xdp_mode: pick(f.xdp_mode, None, XdpModeArg::Auto),
        scheduler: pick(flag_scheduler, file_fast_scheduler, Scheduler::Random),
        ipvs: ipvs_settings,
        conntrack: conntrack_settings,
        capacities,
        sync_period: pick(f.sync_period.map(Duration::from).filter(|d| !d.is_zero()), file_sync, Duration::from_secs(30)),
        min_sync_period: pick(f.min_sync_period.map(Duration::from), file_min_sync, Duration::from_secs(1)),
        burst_syncs: 2,
        healthz_bind_address: healthz,
        metrics_bind_address: metrics,
        bind_address_hard_fail: pick(f.bind_address_hard_fail, bind_address_hard_fail, false),
        oom_score_adj: pick(f.oom_score_adj, oom_score_adj, -999),
        verbosity: pick(f.verbosity, log.verbosity, 0),
        once: f.once,
    };
    Ok((settings, notes))
}

/// Whether a YAML value is its type's zero (what kube-proxy's own files write for "unset").
fn is_zero_value(v: &serde_yaml::Value) -> bool {
    use serde_yaml::Value;
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || s == "0" || s == "0s",
        Value::Sequence(s) => s.iter().all(is_zero_value),
        Value::Mapping(m) => m.values().all(is_zero_value),
        Value::Tagged(t) => is_zero_value(&t.value),
    }
}

#[cfg(test)]
mod tests;
