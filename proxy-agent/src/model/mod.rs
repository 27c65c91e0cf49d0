//! The desired state: a pure function of Services, EndpointSlices, the node and the
//! configuration. All Service semantics live here; no I/O.
pub mod annotations;
mod backends;
mod compute;
mod endpoints;
pub mod errors;
mod intern;
pub mod objects;
mod service;
pub mod slice_object;
pub mod slice_wire;

use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr, str::FromStr, sync::Arc};

use ipnet::IpNet;

pub use crate::model::annotations::{
    IpvsForward, IpvsOptions, IPVS_FORWARD_ANNOTATION, IPVS_SCHEDULER_ANNOTATION, IPVS_WEIGHTS_ANNOTATION, MAX_CONNECTION_AGE_ANNOTATION,
    OUTLIER_EJECTION_ANNOTATION, SCHEDULER_ANNOTATION,
};
pub use crate::model::compute::compute;
use crate::model::errors::ObjectError;

pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
pub(crate) const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

pub use backends::Backends;
pub use proxy_common::Protocol;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Scheduler {
    #[default]
    Random,
    RoundRobin,
    Maglev,
    /// The backend with the fewest open flows (exact up to 8 backends, two random choices above).
    LeastConnection,
    /// The less loaded of two random backends.
    PowerOfTwo,
}

/// Each scheduler once: its name, the other names it answers to, and the IPVS scheduler it is the
/// fast path's counterpart of.
const SCHEDULERS: [(Scheduler, &str, &[&str], Option<&str>); 5] = [
    (Scheduler::Random, "random", &[], None),
    (Scheduler::RoundRobin, "round-robin", &["rr"], Some("rr")),
    (Scheduler::Maglev, "maglev", &["mh"], Some("mh")),
    (Scheduler::LeastConnection, "least-connection", &["lc"], Some("lc")),
    (Scheduler::PowerOfTwo, "p2c", &["power-of-two"], None),
];

impl Scheduler {
    pub const ALL: [Scheduler; 5] = [SCHEDULERS[0].0, SCHEDULERS[1].0, SCHEDULERS[2].0, SCHEDULERS[3].0, SCHEDULERS[4].0];

    pub fn name(self) -> &'static str {
        SCHEDULERS.iter().find(|s| s.0 == self).map(|s| s.1).expect("every scheduler is in the table")
    }

    /// The fast path's counterpart of an IPVS scheduler (rr, mh, lc), if it has one.
    pub fn of_ipvs(ipvs: &str) -> Option<Scheduler> {
        SCHEDULERS.iter().find(|s| s.3 == Some(ipvs)).map(|s| s.0)
    }
}

impl FromStr for Scheduler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        SCHEDULERS.iter().find(|(_, name, aliases, _)| *name == s || aliases.contains(&s)).map(|e| e.0).ok_or_else(|| {
            let names: Vec<&str> = SCHEDULERS.iter().map(|e| e.1).collect();
            format!("unknown scheduler {s:?} (expected {})", names.join(", "))
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FrontendKind {
    ClusterIp,
    NodePort,
    ExternalIp,
    LoadBalancer,
}

impl FrontendKind {
    pub fn name(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "clusterip",
            FrontendKind::NodePort => "nodeport",
            FrontendKind::ExternalIp => "externalip",
            FrontendKind::LoadBalancer => "loadbalancer",
        }
    }
}

/// (address, port, protocol, scope): one entry of KPR_SVC_V1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub ip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
    pub scope: Scope,
}

/// Which traffic a frontend answers: from pods and the node's own processes (internal), or
/// from outside the node (external). The same address and port can have different backends
/// for each: that is how the traffic policies differ. Where they do not, one frontend answers
/// both (`Both`), and an address and port has either it or the other two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    Internal,
    External,
    Both,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Scope::Internal => "internal",
            Scope::External => "external",
            Scope::Both => "both",
        }
    }

    /// Whether a frontend of this scope answers `traffic`'s.
    pub fn answers(self, traffic: Scope) -> bool {
        self == traffic || self == Scope::Both
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendKey {
    pub ip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    /// "namespace/name:port-name" (shared by the port's frontends).
    pub service: Arc<str>,
    pub kind: FrontendKind,
    pub scheduler: Scheduler,
    pub affinity_timeout_s: u32,
    /// Masquerade its connections (hairpin always; externalTrafficPolicy Cluster).
    pub masquerade: bool,
    /// Keep the client's address (externalTrafficPolicy Local).
    pub preserve_source: bool,
    /// No backend here but some elsewhere (a traffic policy Local frontend): drop, as
    /// kube-proxy does, instead of rejecting.
    pub no_local_endpoint: bool,
    /// loadBalancerSourceRanges (empty: every source).
    pub source_ranges: Vec<IpNet>,
    /// Connections older than this many seconds are ended (kpr.io/max-connection-age; 0: never).
    pub max_connection_age_s: u32,
    /// Backends that refuse new connections are left out for a while (kpr.io/outlier-ejection).
    pub outlier_ejection: bool,
    /// Sorted, deduplicated. Shared: a port's frontends (two scopes, each node address and
    /// load-balancer IP) mostly take the same set.
    pub backends: Backends,
    /// Shared by the port's frontends, like `backends`.
    pub ipvs: Arc<IpvsOptions>,
}

impl Frontend {
    /// A frontend with every option off (random scheduling, no affinity, no masquerade, no
    /// source ranges): what the benchmarks and tests start from.
    pub fn plain(service: &str, kind: FrontendKind, backends: Vec<BackendKey>) -> Self {
        Frontend {
            service: service.into(),
            kind,
            scheduler: Scheduler::Random,
            affinity_timeout_s: 0,
            masquerade: false,
            preserve_source: false,
            no_local_endpoint: false,
            source_ranges: vec![],
            max_connection_age_s: 0,
            outlier_ejection: false,
            backends: backends.into(),
            ipvs: Default::default(),
        }
    }

    /// `plain` "ns/web:http" with these backends, for tests (each sets what it checks with
    /// `..Frontend::for_test(..)`).
    #[cfg(test)]
    pub(crate) fn for_test(kind: FrontendKind, backends: &[(&str, u16)], proto: Protocol) -> Self {
        Self::plain("ns/web:http", kind, backends.iter().map(|(ip, port)| BackendKey { ip: ip.parse().unwrap(), port: *port, proto }).collect())
    }
}

#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    pub name: String,
    /// Addresses NodePorts listen on, both families.
    pub nodeport_addresses: Vec<IpAddr>,
    /// topology.kubernetes.io/zone of this node, for topology hints.
    pub zone: Option<String>,
}

/// Why an IPv6 address is not programmed where the plane serves IPv6 clusterIPs only (eBPF mode,
/// whose maps keep an address as four words, IPv4 in word 0).
pub(crate) const NO_WIRE_FORM: &str =
    "an IPv6 address whose last 96 bits are zero (a Subnet-Router anycast address) has an IPv4 address's form in the eBPF maps; not programmed";

/// Which IPv6 parts of Services a data plane serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ipv6Reach {
    /// None.
    #[default]
    None,
    /// clusterIPs only, at connect time (eBPF mode where its IPv6 masquerade rule could not be
    /// installed: the packet path for outside clients needs it).
    ClusterIps,
    /// Every address, without the per-flow features (eBPF mode: clusterIPs at connect time, for
    /// every socket of the node; NodePorts, externalIPs and load-balancer IPs also per packet
    /// from outside, by a flow table without maximum connection age, outlier ejection and
    /// active-flow counts).
    AllWithoutFlowFeatures,
    /// Every address (IPVS mode).
    All,
}

impl Ipv6Reach {
    /// IPv6 NodePorts, externalIPs and load-balancer IPs are served.
    pub fn serves_external(self) -> bool {
        matches!(self, Ipv6Reach::AllWithoutFlowFeatures | Ipv6Reach::All)
    }
    /// eBPF mode's levels: addresses in the maps' form (see NO_WIRE_FORM), and none of the
    /// per-flow features for IPv6 frontends.
    pub fn ebpf(self) -> bool {
        matches!(self, Ipv6Reach::ClusterIps | Ipv6Reach::AllWithoutFlowFeatures)
    }
}

#[derive(Clone, Debug, Default)]
pub struct ModelConfig {
    pub default_scheduler: Scheduler,
    /// The data plane forwards SCTP (`Dataplane::programs_sctp`); otherwise SCTP ports are
    /// reported as not supported.
    pub sctp: bool,
    /// Which IPv6 parts of a Service the data plane serves (`Dataplane::programs_ipv6`); the
    /// others are reported as not supported, and the rest of the Service is programmed.
    pub ipv6: Ipv6Reach,
    /// The data plane ends connections past a maximum age (`Dataplane::ends_old_connections`);
    /// otherwise the annotation is reported as not supported.
    pub max_connection_age: bool,
    /// The data plane ejects outliers (`Dataplane::ejects_outliers`); otherwise the annotation
    /// is reported as not supported.
    pub outlier_ejection: bool,
    /// kube-proxy's masqueradeAll: every connection to a ClusterIP is masqueraded (and only to a
    /// ClusterIP: a NodePort's, an externalIP's or a load-balancer IP's traffic keeps its
    /// externalTrafficPolicy's).
    pub masquerade_all: bool,
}

#[derive(Clone, Debug, Default)]
pub struct DesiredState {
    pub frontends: BTreeMap<FrontendKey, Frontend>,
    /// Each Service's frontend keys, by (namespace, name): what an incremental sync replaces.
    /// Inline: most Services have one (a Vec grown to four took 120 bytes).
    pub by_service: BTreeMap<(String, String), smallvec::SmallVec<[FrontendKey; 1]>>,
    /// healthCheckNodePort -> (namespace/name, local ready endpoints): what the health check
    /// servers of externalTrafficPolicy Local services answer.
    pub health_checks: BTreeMap<u16, (String, String, usize)>,
    /// Services with a Local traffic policy and no local endpoint, by (namespace, name): which
    /// policies ([internal, external]) are so (kube-proxy's no_local_endpoints metric).
    pub no_local_endpoints: BTreeMap<(String, String), [bool; 2]>,
    /// What kpr cannot program of each Service (its fields, its EndpointSlices), by (namespace,
    /// name): kept per Service so an incremental sync replaces only the changed ones'.
    pub service_errors: BTreeMap<(String, String), Vec<ObjectError>>,
    /// Problems of no one Service (an EndpointSlice that names none); complete at every compute.
    pub errors: Vec<ObjectError>,
}

impl DesiredState {
    /// Everything kpr cannot program of the objects, each once.
    pub fn problems(&self) -> impl Iterator<Item = &ObjectError> {
        self.errors.iter().chain(self.service_errors.values().flatten())
    }

    /// Golden text: one line per frontend, one per backend.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for (k, f) in &self.frontends {
            let scope = k.scope.name();
            let mut flags = Vec::new();
            for (set, name) in [
                (f.masquerade, "masq"),
                (f.preserve_source, "preserve-source"),
                (!f.source_ranges.is_empty(), "source-ranges"),
                (f.no_local_endpoint, "no-local-endpoint"),
                (f.max_connection_age_s > 0, "max-age"),
                (f.outlier_ejection, "outlier-ejection"),
            ] {
                if set {
                    flags.push(name);
                }
            }
            let flags = if flags.is_empty() { "-".to_string() } else { flags.join(",") };
            let _ = writeln!(
                s,
                "frontend {}/{} {scope} {} {} sched={} affinity={} flags={flags} ranges={}",
                std::net::SocketAddr::new(k.ip, k.port),
                k.proto.name(),
                f.kind.name(),
                f.service,
                f.scheduler.name(),
                f.affinity_timeout_s,
                f.source_ranges.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(","),
            );
            for b in f.backends.iter() {
                let _ = writeln!(s, "  backend {}", std::net::SocketAddr::new(b.ip, b.port));
            }
        }
        s
    }
}
