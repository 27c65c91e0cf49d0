//! kube-proxy's configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1),
//! read unchanged. Every field of the Go type is here, as an Option: unset and `null` are the
//! same. A value of the wrong type is an error naming its field path; a field this type does
//! not know is a warning. What each field means to kpr is decided in `settings::resolve`, which
//! takes the struct apart field by field, so no field can be forgotten.
use std::collections::BTreeMap;

use kube::core::Duration;
use serde::Deserialize;
use serde_yaml::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{file}: field {field}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub field: String,
    pub message: String,
}

/// Fields not in the type, by their path: warned about, never an error (newer kube-proxy
/// versions add fields).
type Unknown = BTreeMap<String, Value>;

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub feature_gates: Option<BTreeMap<String, bool>>,
    pub client_connection: Option<ClientConnection>,
    pub logging: Option<Logging>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub enable_profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub mode: Option<String>,
    pub iptables: Option<Iptables>,
    pub ipvs: Option<Ipvs>,
    pub nftables: Option<Nftables>,
    pub winkernel: Option<Value>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    pub conntrack: Option<Conntrack>,
    pub config_sync_period: Option<Duration>,
    pub port_range: Option<String>,
    pub windows_run_as_service: Option<bool>,
    /// The internal configuration's top-level copies, which some generated files carry.
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub masquerade_all: Option<bool>,
    pub masquerade_bit: Option<i32>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
    pub accept_content_types: Option<String>,
    pub content_type: Option<String>,
    pub qps: Option<f64>,
    pub burst: Option<i64>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Logging {
    pub format: Option<String>,
    pub verbosity: Option<u32>,
    pub flush_frequency: Option<Value>,
    pub vmodule: Option<Value>,
    pub options: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Iptables {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub localhost_node_ports: Option<bool>,
    #[serde(rename = "snatNodeInternalIP")]
    pub snat_node_internal_ip: Option<bool>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ipvs {
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    pub strict_arp: Option<bool>,
    pub tcp_timeout: Option<Duration>,
    pub tcp_fin_timeout: Option<Duration>,
    pub udp_timeout: Option<Duration>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Nftables {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocal {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Conntrack {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    pub tcp_established_timeout: Option<Duration>,
    pub tcp_close_wait_timeout: Option<Duration>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<Duration>,
    pub udp_stream_timeout: Option<Duration>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// Parses a configuration file; `file` names it in errors.
pub fn parse(file: &str, text: &str) -> Result<KubeProxyConfiguration, ConfigError> {
    let err = |field: String, message: String| ConfigError { file: file.into(), field, message };
    let de = serde_yaml::Deserializer::from_str(text);
    let c: KubeProxyConfiguration = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.inner().to_string();
        // serde_yaml appends " at line L column C": keep it, it helps.
        err(if path == "." { "-".into() } else { path }, msg)
    })?;
    if c.kind.as_deref() != Some(KIND) {
        return Err(err("kind".into(), format!("{:?}, expected {KIND}", c.kind.as_deref().unwrap_or(""))));
    }
    if c.api_version.as_deref() != Some(API_VERSION) {
        return Err(err("apiVersion".into(), format!("{:?}, expected {API_VERSION}", c.api_version.as_deref().unwrap_or(""))));
    }
    for (path, d) in c.durations() {
        if d.is_negative() {
            return Err(err(path.into(), format!("{d} is negative")));
        }
    }
    Ok(c)
}

impl KubeProxyConfiguration {
    /// Every duration field with its path (validated together: none may be negative).
    fn durations(&self) -> Vec<(&'static str, Duration)> {
        let ipt = self.iptables.clone().unwrap_or_default();
        let ipvs = self.ipvs.clone().unwrap_or_default();
        let nft = self.nftables.clone().unwrap_or_default();
        let ct = self.conntrack.clone().unwrap_or_default();
        [
            ("syncPeriod", self.sync_period),
            ("minSyncPeriod", self.min_sync_period),
            ("configSyncPeriod", self.config_sync_period),
            ("iptables.syncPeriod", ipt.sync_period),
            ("iptables.minSyncPeriod", ipt.min_sync_period),
            ("ipvs.syncPeriod", ipvs.sync_period),
            ("ipvs.minSyncPeriod", ipvs.min_sync_period),
            ("ipvs.tcpTimeout", ipvs.tcp_timeout),
            ("ipvs.tcpFinTimeout", ipvs.tcp_fin_timeout),
            ("ipvs.udpTimeout", ipvs.udp_timeout),
            ("nftables.syncPeriod", nft.sync_period),
            ("nftables.minSyncPeriod", nft.min_sync_period),
            ("conntrack.tcpEstablishedTimeout", ct.tcp_established_timeout),
            ("conntrack.tcpCloseWaitTimeout", ct.tcp_close_wait_timeout),
            ("conntrack.udpTimeout", ct.udp_timeout),
            ("conntrack.udpStreamTimeout", ct.udp_stream_timeout),
        ]
        .into_iter()
        .filter_map(|(p, d)| d.map(|d| (p, d)))
        .collect()
    }
}

/// The unknown fields of one section, as warnings naming their paths.
pub fn unknown_fields(file: &str, section: &str, unknown: &Unknown) -> Vec<String> {
    unknown.keys().map(|k| format!("{file}: unknown field {section}{k} (ignored)")).collect()
}

#[cfg(test)]
pub(crate) mod tests_support {
    /// The configuration kubeadm writes, unchanged.
    pub const KUBEADM: &str = r#"
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
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
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
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ipvs
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use tests_support::KUBEADM;

    #[test]
    fn reads_kubeadms_file_unchanged() {
        let c = parse("kube-proxy.yaml", KUBEADM).unwrap();
        assert_eq!(c.mode.as_deref(), Some("ipvs"));
        assert_eq!(c.cluster_cidr.as_deref(), Some("10.244.0.0/16,fd00:10:244::/56"));
        assert_eq!(c.ipvs.as_ref().unwrap().sync_period.map(std::time::Duration::from), Some(std::time::Duration::ZERO));
        assert_eq!(c.conntrack.as_ref().unwrap().max_per_core, None);
        assert!(c.unknown.is_empty(), "{:?}", c.unknown);
    }

    #[test]
    fn wrong_types_name_their_field() {
        let base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let bad = |extra: &str| parse("c.yaml", &format!("{base}{extra}")).unwrap_err().field;
        assert_eq!(bad("ipvs: {tcpTimeout: 5 minutes}\n"), "ipvs.tcpTimeout");
        assert_eq!(bad("conntrack: {maxPerCore: many}\n"), "conntrack.maxPerCore");
        assert_eq!(bad("iptables: {masqueradeAll: sometimes}\n"), "iptables.masqueradeAll");
        assert_eq!(bad("conntrack: {udpTimeout: -5s}\n"), "conntrack.udpTimeout");
        assert_eq!(parse("c.yaml", "kind: KubeProxyConfiguration\napiVersion: v1\n").unwrap_err().field, "apiVersion");
        let c = parse("c.yaml", &format!("{base}frobnicate: 1\nipvs: {{shiny: 1}}\n")).unwrap();
        assert!(c.unknown.contains_key("frobnicate"));
        assert!(c.ipvs.unwrap().unknown.contains_key("shiny"));
    }
}
