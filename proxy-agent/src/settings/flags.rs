//! `kpr run`'s flags. Every one that the configuration file can also set is an Option, so
//! `settings::resolve` can tell "given" from "left to the file or the default". Flags of kpr's
//! own (not in KubeProxyConfiguration) also read a `KPR_*` environment variable, which a
//! DaemonSet fills from a ConfigMap.
use std::{net::IpAddr, path::PathBuf};

use clap::{Args, ValueEnum};
use kube::core::Duration;

pub use crate::model::annotations::parse_duration;

/// How the uplinks' IPv4 ingress runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum XdpModeArg {
    /// Native XDP where the driver has it, except on a veth; TC ingress otherwise.
    Auto,
    /// Native XDP, or the attach fails.
    Native,
    /// Generic XDP (the kernel reallocates the head of most packets for it).
    Generic,
    /// No XDP: the same program at TC ingress.
    Off,
}

#[derive(Args, Debug, Clone, Default)]
pub struct Flags {
    /// kube-proxy's KubeProxyConfiguration file, read unchanged. Flags given explicitly win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory of Service and EndpointSlice manifests (YAML or JSON), watched for changes,
    /// instead of the Kubernetes API.
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    /// kubeconfig for the Kubernetes API [file: clientConnection.kubeconfig; default:
    /// $KUBECONFIG, ~/.kube/config, or in-cluster].
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's real address (https://host:port), for a node that must reach it before
    /// the `kubernetes` Service's ClusterIP is programmed (a cold start with empty maps).
    #[arg(long, env = "KPR_K8S_API_SERVER")]
    pub k8s_api_server: Option<String>,
    /// /healthz and /livez; a port alone or an address alone is completed with the default's
    /// [file: healthzBindAddress; default: 0.0.0.0:10256]; "" disables.
    #[arg(long)]
    pub healthz_bind_address: Option<String>,
    /// /metrics and /proxyMode [file: metricsBindAddress; default: 127.0.0.1:10249]; "" disables.
    #[arg(long)]
    pub metrics_bind_address: Option<String>,
    /// Exit when the health or metrics address cannot be bound [file: bindAddressHardFail].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub bind_address_hard_fail: Option<bool>,
    /// This node's primary IP (kube-proxy's bindAddress) [file: bindAddress; default: the Node's
    /// first InternalIP, else the first uplink address].
    #[arg(long)]
    pub bind_address: Option<IpAddr>,
    /// Least time between event-driven syncs, e.g. 1s, 250ms [file: minSyncPeriod of the mode's
    /// section; default: 1s].
    #[arg(long, value_parser = parse_duration)]
    pub min_sync_period: Option<Duration>,
    /// Full resync period, e.g. 30s [file: syncPeriod of the mode's section; default: 30s].
    #[arg(long, value_parser = parse_duration)]
    pub sync_period: Option<Duration>,
    /// Uplink interface(s): XDP for traffic from outside the node [default: the interfaces of
    /// the node's default routes].
    #[arg(long = "uplink", env = "KPR_UPLINKS", value_delimiter = ',')]
    pub uplinks: Vec<String>,
    /// Pod-facing interface(s) and tunnel devices: TC.
    #[arg(long = "pod-iface", env = "KPR_POD_IFACES", value_delimiter = ',')]
    pub pod_ifaces: Vec<String>,
    /// TC on every interface whose name starts with this (e.g. veth, cali, lxc) [default, with
    /// no --pod-iface either: cali, lxc, veth, eni, azv, gke, flannel., vxlan.calico].
    #[arg(long = "pod-iface-prefix", env = "KPR_POD_IFACE_PREFIXES", value_delimiter = ',')]
    pub pod_iface_prefixes: Vec<String>,
    /// cgroup v2 whose processes get connect-time balancing (the node's own traffic to
    /// services): "auto" = the cgroup2 root, "none" = off, or a path [default: auto].
    #[arg(long, env = "KPR_CGROUP")]
    pub cgroup: Option<String>,
    /// This node's name [file: hostnameOverride; default: the host name].
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// This node's zone for topology hints (the Node's topology.kubernetes.io/zone wins).
    #[arg(long)]
    pub node_zone: Option<String>,
    /// NodePort addresses, as addresses [file: nodePortAddresses, as CIDRs or "primary";
    /// default: every address of the uplinks].
    #[arg(long = "node-ip", value_delimiter = ',')]
    pub node_ips: Vec<IpAddr>,
    /// Source address for masqueraded traffic [default: the address of the interface the
    /// flow leaves by, else the primary IP].
    #[arg(long)]
    pub snat_ip: Option<IpAddr>,
    /// Masquerade with the node's primary IP, not the egress interface's address
    /// [file: iptables.snatNodeInternalIP].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub snat_node_internal_ip: Option<bool>,
    /// Pod CIDR(s), comma separated; traffic from outside them to a ClusterIP is masqueraded
    /// [file: clusterCIDR].
    #[arg(long, value_delimiter = ',')]
    pub cluster_cidr: Vec<ipnet::IpNet>,
    /// How a local client is told from one outside the cluster: ClusterCIDR, NodeCIDR,
    /// BridgeInterface, InterfaceNamePrefix [file: detectLocalMode; default: ClusterCIDR].
    #[arg(long)]
    pub detect_local_mode: Option<String>,
    /// detectLocalMode BridgeInterface: the pods' bridge [file: detectLocal.bridgeInterface].
    #[arg(long)]
    pub pod_bridge_interface: Option<String>,
    /// detectLocalMode InterfaceNamePrefix [file: detectLocal.interfaceNamePrefix].
    #[arg(long)]
    pub pod_interface_name_prefix: Option<String>,
    /// Serve the debug handlers on the metrics port (`PUT /debug/flags/v`: the log verbosity)
    /// [file: enableProfiling; default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub profiling: Option<bool>,
    /// Masquerade all traffic to ClusterIPs [file: masqueradeAll of the mode's section].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub masquerade_all: Option<bool>,
    /// The fast path's default scheduler: random, round-robin, maglev, least-connection, p2c (per
    /// Service: annotation kpr.io/scheduler) [file: ipvs.scheduler rr, mh or lc; default: random].
    #[arg(long)]
    pub scheduler: Option<String>,
    /// The uplinks' IPv4 ingress: XDP (auto: native where the driver has it, except on a
    /// veth, whose XDP copies every frame the stack sends through it), or TC (off) [default:
    /// auto].
    #[arg(long, value_enum, env = "KPR_XDP_MODE")]
    pub xdp_mode: Option<XdpModeArg>,
    /// After a switch from kube-proxy or between kpr's modes, the longest the previous one keeps
    /// serving its connections [default: 1h].
    #[arg(long, value_parser = parse_duration, env = "KPR_MODE_HANDOVER_LIMIT")]
    pub mode_handover_limit: Option<Duration>,
    /// Data plane: ebpf (the fast path), ipvs (IPVS + BPF set matching), auto (ebpf where the
    /// kernel loads it, else ipvs) [file: mode; default: ebpf].
    #[arg(long)]
    pub mode: Option<String>,
    /// IPVS mode's default scheduler (per Service: kpr.io/ipvs-scheduler) [file: ipvs.scheduler;
    /// default: rr].
    #[arg(long)]
    pub ipvs_scheduler: Option<String>,
    /// IPVS mode: arp_ignore=1/arp_announce=2 (MetalLB L2, DR) [file: ipvs.strictARP].
    #[arg(long = "ipvs-strict-arp", alias = "strict-arp", num_args = 0..=1, default_missing_value = "true")]
    pub ipvs_strict_arp: Option<bool>,
    /// IPVS mode: CIDRs whose virtual servers kpr leaves alone [file: ipvs.excludeCIDRs].
    #[arg(long, value_delimiter = ',')]
    pub ipvs_exclude_cidrs: Vec<ipnet::IpNet>,
    /// IPVS's idle TCP timeout; 0 keeps the kernel's [file: ipvs.tcpTimeout].
    #[arg(long, value_parser = parse_duration)]
    pub ipvs_tcp_timeout: Option<Duration>,
    /// IPVS's timeout after a FIN; 0 keeps the kernel's [file: ipvs.tcpFinTimeout].
    #[arg(long = "ipvs-tcpfin-timeout", value_parser = parse_duration)]
    pub ipvs_tcp_fin_timeout: Option<Duration>,
    /// IPVS's UDP timeout; 0 keeps the kernel's [file: ipvs.udpTimeout].
    #[arg(long, value_parser = parse_duration)]
    pub ipvs_udp_timeout: Option<Duration>,
    /// IPVS mode: bind IPv4 virtual IPs as addresses on kube-ipvs0 (kube-proxy's way) or as
    /// local routes (no O(N²) kernel cost at tens of thousands of Services)
    /// [default: address].
    #[arg(long, value_enum, env = "KPR_IPVS_VIP_BINDING")]
    pub ipvs_vip_binding: Option<super::VipBinding>,
    /// nf_conntrack_max per CPU; 0 leaves the kernel's [file: conntrack.maxPerCore; default: 32768].
    #[arg(long)]
    pub conntrack_max_per_core: Option<u32>,
    /// The least nf_conntrack_max [file: conntrack.min; default: 131072].
    #[arg(long)]
    pub conntrack_min: Option<u32>,
    /// Idle TCP flows end after this, in the fast path and the kernel's conntrack
    /// [file: conntrack.tcpEstablishedTimeout; default: 24h].
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_tcp_timeout_established: Option<Duration>,
    /// The kernel's CLOSE_WAIT timeout [file: conntrack.tcpCloseWaitTimeout; default: 1h].
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,
    /// The kernel's conntrack accepts out-of-window TCP packets [file: conntrack.tcpBeLiberal].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// Idle UDP flows that saw no reply [file: conntrack.udpTimeout; default: the kernel's].
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_udp_timeout: Option<Duration>,
    /// Idle UDP flows that saw replies: the fast path's UDP timeout too
    /// [file: conntrack.udpStreamTimeout; default: the kernel's, 120s in the fast path].
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_udp_timeout_stream: Option<Duration>,
    /// The fast path forgets idle flows that saw a FIN or RST after this [default: 10s].
    #[arg(long, env = "KPR_CONNTRACK_TCP_TIMEOUT_CLOSING", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_closing: Option<Duration>,
    /// The agent's writes to the API (its Events) a second, at most [file: clientConnection.qps;
    /// default: 5].
    #[arg(long)]
    pub kube_api_qps: Option<f64>,
    /// How many of those writes may go at once before `--kube-api-qps` paces them [file:
    /// clientConnection.burst; default: 10].
    #[arg(long)]
    pub kube_api_burst: Option<u32>,
    /// oom_score_adj of the agent [file: oomScoreAdj; default: -999].
    #[arg(long, allow_hyphen_values = true)]
    pub oom_score_adj: Option<i32>,
    /// Frontends the maps hold, each with a service id: a ClusterIP port takes two (internal
    /// and external traffic), a NodePort two per node address [default: 131072].
    #[arg(long, env = "KPR_MAX_SERVICES")]
    pub max_services: Option<u32>,
    /// Endpoints the maps hold, all services together [default: 262144].
    #[arg(long, env = "KPR_MAX_BACKENDS")]
    pub max_backends: Option<u32>,
    /// Flow entries of the fast path's conntrack (LRU; up to four a flow) [default: 524288].
    #[arg(long, env = "KPR_MAX_CONNTRACK")]
    pub max_conntrack: Option<u32>,
    /// Flow entries not yet assured (their own table): TCP before its handshake completes, UDP
    /// before its client sends after an answer [default: 131072].
    #[arg(long, env = "KPR_MAX_CONNTRACK_EMBRYONIC")]
    pub max_conntrack_embryonic: Option<u32>,
    /// IPv6 flow entries of the fast path's conntrack (LRU; up to four a flow) [default: 65536].
    #[arg(long, env = "KPR_MAX_CONNTRACK6")]
    pub max_conntrack6: Option<u32>,
    /// IPv6 flow entries not yet assured (their own LRU table) [default: 32768].
    #[arg(long, env = "KPR_MAX_CONNTRACK6_EMBRYONIC")]
    pub max_conntrack6_embryonic: Option<u32>,
    /// sessionAffinity ClientIP entries (LRU) [default: 131072].
    #[arg(long, env = "KPR_MAX_AFFINITY")]
    pub max_affinity: Option<u32>,
    /// Log verbosity as kube-proxy's -v: 0-2 info, 3-4 debug, 5+ trace (KPR_LOG, a tracing
    /// filter, wins) [file: logging.verbosity].
    #[arg(short = 'v', long = "v")]
    pub verbosity: Option<u32>,
    /// Sync once and exit (programs and maps stay).
    #[arg(long)]
    pub once: bool,
}
