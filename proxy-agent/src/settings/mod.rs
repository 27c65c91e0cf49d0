//! The agent's settings, resolved once at start from three layers by one rule: an explicit
//! flag, else the configuration file (kube-proxy's KubeProxyConfiguration, read unchanged),
//! else the default (`pick`). `resolve` takes the file apart field by field (no `..`), so each
//! of kube-proxy's fields is either used or warned about by name; a field added to the type
//! without a decision here does not compile.
pub mod flags;
pub mod kube_proxy;
pub mod values;

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

pub use flags::{Flags, XdpModeArg};
use ipnet::IpNet;
use kube_proxy::KubeProxyConfiguration;
pub use values::*;

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
    /// After a switch from kube-proxy or between kpr's modes, the longest the previous one
    /// keeps serving its connections.
    pub handover_limit: Duration,
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
    /// The agent's writes to the API (Events: its only ones; its reads are watches) a second,
    /// and how many may go at once (kube-proxy's clientConnection.qps and burst).
    pub api_qps: f64,
    pub api_burst: u32,
    pub healthz_bind_address: Option<SocketAddr>,
    /// kube-proxy's enableProfiling: the metrics port also serves the debug handlers
    /// (`PUT /debug/flags/v`, the log verbosity). Off, anyone who reaches the port could turn on
    /// trace logging.
    pub enable_profiling: bool,
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
        notes.push(format!("{name}: enableProfiling serves /debug/flags/v on the metrics port; kpr has no pprof handlers"));
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
    let is_rate = |q: &f64| q.is_finite() && *q > 0.0;
    if let Some(q) = f.kube_api_qps.filter(|q| !is_rate(q)) {
        return Err(flag_err("kube-api-qps", format!("{q} is not a rate: must be above zero")));
    }
    if f.kube_api_burst == Some(0) {
        return Err(flag_err("kube-api-burst", "must be above zero".into()));
    }
    // client-go's reading: zero or less is its default.
    let (file_qps, file_burst) = (cc.qps.filter(is_rate), cc.burst.filter(|b| *b > 0).map(|b| u32::try_from(b).unwrap_or(u32::MAX)));
    for (field, set) in [
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
    if matches!(detect, DetectLocal::ClusterCidr) && !cluster_cidrs.iter().any(|n| n.addr().is_ipv4()) {
        notes.push(
            "detectLocalMode ClusterCIDR without an IPv4 clusterCIDR: no local-traffic detector (as kube-proxy's): a pod's traffic counts as external \
             (externalTrafficPolicy Local NodePorts and load-balancer IPs take this node's endpoints only) and no client is masqueraded for being \
             outside the cluster; give clusterCIDR (--cluster-cidr)"
                .into(),
        );
    }

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
    file_scheduler.as_deref().map(check_ipvs_scheduler).transpose().map_err(|e| field_err("ipvs.scheduler", e))?;
    f.ipvs_scheduler.as_deref().map(check_ipvs_scheduler).transpose().map_err(|e| flag_err("ipvs-scheduler", e))?;
    // The fast path's counterpart of an IPVS scheduler: rr, mh and lc have one.
    let file_fast_scheduler = match file_scheduler.as_deref() {
        Some(ipvs) if Scheduler::of_ipvs(ipvs).is_some() => Scheduler::of_ipvs(ipvs),
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
        scheduler: pick(f.ipvs_scheduler.clone(), file_scheduler, proxy_common::IPVS_DEFAULT_SCHEDULER.into()),
        strict_arp: pick(f.ipvs_strict_arp, ipv.strict_arp, false),
        exclude_cidrs: pick((!f.ipvs_exclude_cidrs.is_empty()).then(|| f.ipvs_exclude_cidrs.clone()), (!exclude.is_empty()).then_some(exclude), vec![]),
        tcp_timeout: pick(f.ipvs_tcp_timeout.map(Duration::from), ipv.tcp_timeout.map(Duration::from), Duration::ZERO),
        tcp_fin_timeout: pick(f.ipvs_tcp_fin_timeout.map(Duration::from), ipv.tcp_fin_timeout.map(Duration::from), Duration::ZERO),
        udp_timeout: pick(f.ipvs_udp_timeout.map(Duration::from), ipv.udp_timeout.map(Duration::from), Duration::ZERO),
        vip_binding: pick(f.ipvs_vip_binding, None, VipBinding::Address),
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
        backends: pick(f.max_backends, None, dc.backends),
        slots: f.max_backends.map_or(dc.slots, |b| b.saturating_mul(4)),
        conntrack: pick(f.max_conntrack, None, dc.conntrack),
        conntrack_new: pick(f.max_conntrack_embryonic, None, dc.conntrack_new),
        conntrack6: pick(f.max_conntrack6, None, dc.conntrack6),
        conntrack6_new: pick(f.max_conntrack6_embryonic, None, dc.conntrack6_new),
        affinity: pick(f.max_affinity, None, dc.affinity),
    };
    for (flag, v) in [
        ("max-services", capacities.services),
        ("max-backends", capacities.backends),
        ("max-conntrack", capacities.conntrack),
        ("max-conntrack-embryonic", capacities.conntrack_new),
        ("max-conntrack6", capacities.conntrack6),
        ("max-conntrack6-embryonic", capacities.conntrack6_new),
        ("max-affinity", capacities.affinity),
    ] {
        if v == 0 {
            return Err(flag_err(flag, "must be above zero".into()));
        }
    }

    // A listener: the flag's address, else the file's (where set), else the default; each
    // completed by the default and checked, an error naming where it came from.
    let listener = |flag: &Option<String>, flag_name: &str, file: &Option<String>, field: &str, default: &str| match (flag, set_str(file)) {
        (Some(s), _) => bind_address(s, default).map_err(|e| flag_err(flag_name, e)),
        (None, Some(s)) => bind_address(&s, default).map_err(|e| field_err(field, e)),
        (None, None) => Ok(bind_address(default, default).expect("the default is an address")),
    };
    let healthz = listener(&f.healthz_bind_address, "healthz-bind-address", &healthz_bind_address, "healthzBindAddress", DEFAULT_HEALTHZ)?;
    let metrics = listener(&f.metrics_bind_address, "metrics-bind-address", &metrics_bind_address, "metricsBindAddress", DEFAULT_METRICS)?;
    oom_score_adj.map(check_oom_score_adj).transpose().map_err(|e| field_err("oomScoreAdj", e))?;
    f.oom_score_adj.map(check_oom_score_adj).transpose().map_err(|e| flag_err("oom-score-adj", e))?;

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
        handover_limit: pick(f.mode_handover_limit.map(Duration::from), None, Duration::from_secs(3600)),
        scheduler: pick(flag_scheduler, file_fast_scheduler, Scheduler::Random),
        ipvs: ipvs_settings,
        conntrack: conntrack_settings,
        capacities,
        sync_period: pick(f.sync_period.map(Duration::from).filter(|d| !d.is_zero()), file_sync, Duration::from_secs(30)),
        min_sync_period: pick(f.min_sync_period.map(Duration::from), file_min_sync, Duration::from_secs(1)),
        burst_syncs: 2,
        api_qps: pick(f.kube_api_qps, file_qps, 5.0),
        api_burst: pick(f.kube_api_burst, file_burst, 10),
        healthz_bind_address: healthz,
        enable_profiling: pick(f.profiling, enable_profiling, false),
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
