//! kube-proxy's configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1),
//! read unchanged. Known fields are validated (an invalid value is an error naming the field);
//! unknown fields are warnings, as are fields that only matter to modes kpr does not run.
use std::{net::IpAddr, time::Duration};

use ipnet::IpNet;
use serde_yaml::Value;

use crate::model::Scheduler;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{file}: field {field}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub field: String,
    pub message: String,
}

/// What kpr takes from a KubeProxyConfiguration. `None`: not set in the file.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct KubeProxyConfig {
    pub mode: String,
    pub cluster_cidrs: Vec<IpNet>,
    /// CIDRs, or the keyword "primary" (kept as `NodePortAddress::Primary`).
    pub node_port_addresses: Vec<NodePortAddress>,
    pub masquerade_all: Option<bool>,
    pub masquerade_bit: Option<u8>,
    pub hostname_override: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    /// detectLocalMode, detectLocal.bridgeInterface, detectLocal.interfaceNamePrefix.
    pub detect_local_mode: Option<String>,
    pub detect_local_bridge: Option<String>,
    pub detect_local_prefix: Option<String>,
    pub ipvs: IpvsConfig,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum NodePortAddress {
    Cidr(IpNet),
    Primary,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct IpvsConfig {
    pub scheduler: Option<String>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub strict_arp: Option<bool>,
    pub tcp_timeout: Option<Duration>,
    pub tcp_fin_timeout: Option<Duration>,
    pub udp_timeout: Option<Duration>,
    pub exclude_cidrs: Vec<IpNet>,
}

/// Go's time.ParseDuration for the units kube-proxy files use ("30s", "1m0s", "1h2m3.5s", "250ms").
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() || s.starts_with('-') {
        return Err(format!("{s:?} is not a duration (e.g. 30s, 1m0s, 250ms)"));
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        if num_end == 0 {
            return Err(format!("{s:?} is not a duration (e.g. 30s, 1m0s, 250ms)"));
        }
        let n: f64 = rest[..num_end].parse().map_err(|_| format!("{s:?}: bad number"))?;
        rest = &rest[num_end..];
        let unit_end = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            u => return Err(format!("{s:?}: unknown unit {u:?}")),
        };
        total += n * scale;
        rest = &rest[unit_end..];
    }
    Ok(Duration::from_secs_f64(total))
}

const KNOWN_TOP: &[&str] = &[
    "apiVersion",
    "kind",
    "bindAddress",
    "bindAddressHardFail",
    "clientConnection",
    "clusterCIDR",
    "configSyncPeriod",
    "conntrack",
    "detectLocalMode",
    "detectLocal",
    "enableProfiling",
    "featureGates",
    "healthzBindAddress",
    "hostnameOverride",
    "iptables",
    "ipvs",
    "logging",
    "metricsBindAddress",
    "mode",
    "nftables",
    "nodePortAddresses",
    "oomScoreAdj",
    "portRange",
    "showHiddenMetricsForVersion",
    "winkernel",
    "masqueradeAll",
    "masqueradeBit",
    "syncPeriod",
    "minSyncPeriod",
];
const KNOWN_IPVS: &[&str] = &["scheduler", "syncPeriod", "minSyncPeriod", "strictARP", "tcpTimeout", "tcpFinTimeout", "udpTimeout", "excludeCIDRs"];
/// Fields kube-proxy uses that mean nothing to kpr's data plane: accepted, noted once.
const IGNORED: &[&str] = &[
    "bindAddress",
    "bindAddressHardFail",
    "clientConnection",
    "configSyncPeriod",
    "conntrack",
    "enableProfiling",
    "featureGates",
    "logging",
    "nftables",
    "oomScoreAdj",
    "portRange",
    "showHiddenMetricsForVersion",
    "winkernel",
];

pub fn parse(file: &str, text: &str) -> Result<KubeProxyConfig, ConfigError> {
    let err = |field: &str, message: String| ConfigError { file: file.into(), field: field.into(), message };
    let v: Value = serde_yaml::from_str(text).map_err(|e| err("-", format!("not YAML: {e}")))?;
    let Value::Mapping(top) = &v else {
        return Err(err("-", "not a mapping".into()));
    };
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
    if kind != "KubeProxyConfiguration" {
        return Err(err("kind", format!("{kind:?}, expected KubeProxyConfiguration")));
    }
    let api = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if api != "kubeproxy.config.k8s.io/v1alpha1" {
        return Err(err("apiVersion", format!("{api:?}, expected kubeproxy.config.k8s.io/v1alpha1")));
    }
    let mut c = KubeProxyConfig::default();
    for k in top.keys().filter_map(Value::as_str) {
        if !KNOWN_TOP.contains(&k) {
            c.warnings.push(format!("{file}: unknown field {k} (ignored)"));
        }
    }
    let string = |path: &str, val: Option<&Value>| -> Result<Option<String>, ConfigError> {
        match val {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(err(path, format!("{other:?} is not a string"))),
        }
    };
    let boolean = |path: &str, val: Option<&Value>| -> Result<Option<bool>, ConfigError> {
        match val {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(err(path, format!("{other:?} is not true or false"))),
        }
    };
    let duration = |path: &str, val: Option<&Value>| -> Result<Option<Duration>, ConfigError> {
        match string(path, val)? {
            None => Ok(None),
            Some(s) => parse_go_duration(&s).map(Some).map_err(|m| err(path, m)),
        }
    };
    let cidrs = |path: &str, val: Option<&Value>| -> Result<Vec<IpNet>, ConfigError> {
        match val {
            None | Some(Value::Null) => Ok(vec![]),
            Some(Value::Sequence(items)) => items
                .iter()
                .enumerate()
                .map(|(i, it)| {
                    let s = it.as_str().unwrap_or("");
                    s.parse::<IpNet>().map_err(|_| err(&format!("{path}[{i}]"), format!("{s:?} is not a CIDR")))
                })
                .collect(),
            Some(other) => Err(err(path, format!("{other:?} is not a list"))),
        }
    };
    let host_port = |path: &str, val: Option<&Value>| -> Result<Option<String>, ConfigError> {
        let Some(s) = string(path, val)? else {
            return Ok(None);
        };
        if s.is_empty() {
            return Ok(None);
        }
        let (host, port) = s.rsplit_once(':').ok_or_else(|| err(path, format!("{s:?} is not host:port")))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if !host.is_empty() && host.parse::<IpAddr>().is_err() {
            return Err(err(path, format!("{host:?} is not an IP address")));
        }
        port.parse::<u16>().map_err(|_| err(path, format!("{port:?} is not a port")))?;
        Ok(Some(s))
    };

    c.mode = string("mode", v.get("mode"))?.unwrap_or_default();
    match c.mode.as_str() {
        "" | "ebpf" | "ipvs" | "auto" => {}
        "iptables" | "nftables" | "kernelspace" => c.warnings.push(format!("{file}: mode {}: kpr replaces it with the eBPF fast path", c.mode)),
        other => return Err(err("mode", format!("unknown mode {other:?} (ebpf, ipvs, auto; iptables and nftables mean ebpf)"))),
    }
    if let Some(s) = string("clusterCIDR", v.get("clusterCIDR"))? {
        for (i, part) in s.split(',').map(str::trim).filter(|p| !p.is_empty()).enumerate() {
            c.cluster_cidrs.push(part.parse().map_err(|_| err("clusterCIDR", format!("entry {i}: {part:?} is not a CIDR")))?);
        }
    }
    match v.get("nodePortAddresses") {
        None | Some(Value::Null) => {}
        Some(Value::Sequence(items)) => {
            for (i, it) in items.iter().enumerate() {
                let s = it.as_str().unwrap_or("");
                c.node_port_addresses.push(if s == "primary" {
                    NodePortAddress::Primary
                } else {
                    NodePortAddress::Cidr(s.parse().map_err(|_| err(&format!("nodePortAddresses[{i}]"), format!("{s:?} is neither a CIDR nor \"primary\"")))?)
                });
            }
        }
        Some(other) => return Err(err("nodePortAddresses", format!("{other:?} is not a list"))),
    }
    let ipt = v.get("iptables");
    c.masquerade_all = match boolean("masqueradeAll", v.get("masqueradeAll"))? {
        Some(b) => Some(b),
        None => boolean("iptables.masqueradeAll", ipt.and_then(|i| i.get("masqueradeAll")))?,
    };
    let bit = v.get("masqueradeBit").map(|b| ("masqueradeBit", b)).or(ipt.and_then(|i| i.get("masqueradeBit")).map(|b| ("iptables.masqueradeBit", b)));
    if let Some((path, b)) = bit {
        if !b.is_null() {
            let n = b.as_u64().filter(|n| *n <= 31).ok_or_else(|| err(path, format!("{b:?} is not a bit number 0..31")))?;
            c.masquerade_bit = Some(n as u8);
        }
    }
    c.hostname_override = string("hostnameOverride", v.get("hostnameOverride"))?.filter(|s| !s.is_empty());
    c.detect_local_mode = string("detectLocalMode", v.get("detectLocalMode"))?.filter(|s| !s.is_empty());
    let dl = v.get("detectLocal");
    c.detect_local_bridge = string("detectLocal.bridgeInterface", dl.and_then(|d| d.get("bridgeInterface")))?.filter(|s| !s.is_empty());
    c.detect_local_prefix = string("detectLocal.interfaceNamePrefix", dl.and_then(|d| d.get("interfaceNamePrefix")))?.filter(|s| !s.is_empty());
    if let Some(m) = &c.detect_local_mode {
        crate::agent::DetectLocal::from_config(m, c.detect_local_bridge.as_deref(), c.detect_local_prefix.as_deref()).map_err(|e| err("detectLocalMode", e))?;
    }
    c.healthz_bind_address = host_port("healthzBindAddress", v.get("healthzBindAddress"))?;
    c.metrics_bind_address = host_port("metricsBindAddress", v.get("metricsBindAddress"))?;
    if let Some(ipvs) = v.get("ipvs") {
        if let Value::Mapping(m) = ipvs {
            for k in m.keys().filter_map(Value::as_str) {
                if !KNOWN_IPVS.contains(&k) {
                    c.warnings.push(format!("{file}: unknown field ipvs.{k} (ignored)"));
                }
            }
        }
        let f = |k: &str| ipvs.get(k);
        c.ipvs.scheduler = string("ipvs.scheduler", f("scheduler"))?.filter(|s| !s.is_empty());
        if let Some(s) = &c.ipvs.scheduler {
            if !proxy_common::IPVS_SCHEDULERS.contains(&s.as_str()) {
                return Err(err("ipvs.scheduler", format!("unknown scheduler {s:?} (one of {})", proxy_common::IPVS_SCHEDULERS.join(", "))));
            }
        }
        c.ipvs.sync_period = duration("ipvs.syncPeriod", f("syncPeriod"))?;
        c.ipvs.min_sync_period = duration("ipvs.minSyncPeriod", f("minSyncPeriod"))?;
        c.ipvs.strict_arp = boolean("ipvs.strictARP", f("strictARP"))?;
        c.ipvs.tcp_timeout = duration("ipvs.tcpTimeout", f("tcpTimeout"))?;
        c.ipvs.tcp_fin_timeout = duration("ipvs.tcpFinTimeout", f("tcpFinTimeout"))?;
        c.ipvs.udp_timeout = duration("ipvs.udpTimeout", f("udpTimeout"))?;
        c.ipvs.exclude_cidrs = cidrs("ipvs.excludeCIDRs", f("excludeCIDRs"))?;
    }
    for k in IGNORED {
        if top.get(*k).is_some_and(|v| !v.is_null()) {
            c.warnings.push(format!("{file}: {k} is kube-proxy's own and does not apply to kpr (ignored)"));
        }
    }
    Ok(c)
}

impl KubeProxyConfig {
    /// The fast path's default scheduler for an IPVS scheduler name: rr and mh have
    /// counterparts; the others only mean something to IPVS.
    pub fn fast_path_scheduler(&self) -> Option<Result<Scheduler, String>> {
        self.ipvs.scheduler.as_deref().map(|s| match s {
            "rr" => Ok(Scheduler::RoundRobin),
            "mh" => Ok(Scheduler::Maglev),
            other => Err(format!("ipvs.scheduler {other:?} applies to IPVS mode only; the eBPF fast path uses random")),
        })
    }

    /// NodePort addresses among `node_addresses`: those inside a configured CIDR, plus the
    /// first (primary) address when "primary" is listed. Empty config: all of them.
    pub fn select_node_port_addresses(&self, node_addresses: &[IpAddr]) -> Vec<IpAddr> {
        if self.node_port_addresses.is_empty() {
            return node_addresses.to_vec();
        }
        node_addresses
            .iter()
            .enumerate()
            .filter(|(i, a)| {
                self.node_port_addresses.iter().any(|n| match n {
                    NodePortAddress::Primary => *i == 0,
                    NodePortAddress::Cidr(net) => net.contains(*a),
                })
            })
            .map(|(_, a)| *a)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration kubeadm writes (trimmed of nothing: read unchanged).
    const KUBEADM: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ipvs
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

    #[test]
    fn reads_kubeadms_file_unchanged() {
        let c = parse("kube-proxy.yaml", KUBEADM).unwrap();
        assert_eq!(c.mode, "ipvs");
        assert_eq!(c.cluster_cidrs.len(), 2);
        assert_eq!(c.masquerade_all, Some(false));
        assert_eq!(c.ipvs.sync_period, Some(Duration::ZERO));
        assert_eq!(c.ipvs.strict_arp, Some(false));
        assert!(!c.warnings.iter().any(|w| w.contains("unknown field")), "{:?}", c.warnings);
    }

    #[test]
    fn values_are_validated_and_unknown_fields_warned() {
        let base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let bad = |extra: &str| parse("c.yaml", &format!("{base}{extra}")).unwrap_err().field;
        assert_eq!(bad("clusterCIDR: 10.244.0.0/33\n"), "clusterCIDR");
        assert_eq!(bad("nodePortAddresses: [10.0.0.0/8, nope]\n"), "nodePortAddresses[1]");
        assert_eq!(bad("ipvs: {scheduler: fastest}\n"), "ipvs.scheduler");
        assert_eq!(bad("ipvs: {tcpTimeout: 5 minutes}\n"), "ipvs.tcpTimeout");
        assert_eq!(bad("iptables: {masqueradeBit: 40}\n"), "iptables.masqueradeBit");
        assert_eq!(bad("healthzBindAddress: 0.0.0.0\n"), "healthzBindAddress");
        assert_eq!(bad("mode: userspace\n"), "mode");
        let c = parse(
            "c.yaml",
            &format!("{base}frobnicate: 1\nipvs: {{tcpTimeout: 1h30m, udpTimeout: 250ms, shiny: 1}}\nnodePortAddresses: [primary, 192.0.2.0/24]\n"),
        )
        .unwrap();
        assert_eq!(c.ipvs.tcp_timeout, Some(Duration::from_secs(5400)));
        assert_eq!(c.ipvs.udp_timeout, Some(Duration::from_millis(250)));
        assert!(c.warnings.iter().any(|w| w.contains("unknown field frobnicate")));
        assert!(c.warnings.iter().any(|w| w.contains("unknown field ipvs.shiny")));
        let addrs: Vec<IpAddr> = ["198.51.100.1", "192.0.2.9", "203.0.113.1"].iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(c.select_node_port_addresses(&addrs), addrs[..2].to_vec());
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("1m0s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_go_duration("1h2m3.5s").unwrap(), Duration::from_secs_f64(3723.5));
        assert_eq!(parse_go_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_go_duration("5").is_err());
        assert!(parse_go_duration("-1s").is_err());
    }
}
