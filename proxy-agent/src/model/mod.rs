//! The desired state: a pure function of Services, EndpointSlices, the node and the
//! configuration. All Service semantics live here; no I/O.
pub mod annotations;
mod endpoints;
mod intern;
pub mod objects;
mod service;
pub mod slice_wire;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
    str::FromStr,
    sync::Arc,
};

use ipnet::IpNet;

pub use crate::model::annotations::{
    IpvsForward, IpvsOptions, IPVS_FORWARD_ANNOTATION, IPVS_SCHEDULER_ANNOTATION, IPVS_WEIGHTS_ANNOTATION, MAX_CONNECTION_AGE_ANNOTATION,
    OUTLIER_EJECTION_ANNOTATION, SCHEDULER_ANNOTATION,
};
use crate::model::objects::{err, ObjectError, Objects, ServiceObject, SliceObject};

pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
pub(crate) const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

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

impl Scheduler {
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Random => "random",
            Scheduler::RoundRobin => "round-robin",
            Scheduler::Maglev => "maglev",
            Scheduler::LeastConnection => "least-connection",
            Scheduler::PowerOfTwo => "p2c",
        }
    }
}

impl FromStr for Scheduler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "random" => Ok(Scheduler::Random),
            "round-robin" | "rr" => Ok(Scheduler::RoundRobin),
            "maglev" | "mh" => Ok(Scheduler::Maglev),
            "least-connection" | "lc" => Ok(Scheduler::LeastConnection),
            "p2c" | "power-of-two" => Ok(Scheduler::PowerOfTwo),
            other => Err(format!("unknown scheduler {other:?} (expected random, round-robin, maglev, least-connection or p2c)")),
        }
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
    pub backends: Arc<[BackendKey]>,
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

pub fn compute(objects: &Objects, node: &NodeInfo, cfg: &ModelConfig) -> DesiredState {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    compute_on(objects, node, cfg, if objects.services.len() < PARALLEL_FROM { 1 } else { threads })
}

/// Below this many Services a full compute stays on one thread.
const PARALLEL_FROM: usize = 4_096;

/// The full compute on `threads` threads, each over a consecutive part of the Services. They
/// are independent of one another but for a frontend key two of them claim, which the later
/// one takes: the parts appended in order keep that. At 100,000 Services the compute took a
/// second of one core while the others idled.
fn compute_on(objects: &Objects, node: &NodeInfo, cfg: &ModelConfig, threads: usize) -> DesiredState {
    let mut out = unowned_slices(objects);
    let services: Vec<(&(String, String), &ServiceObject)> = objects.services.iter().collect();
    let compute = |part: &[(&(String, String), &ServiceObject)]| {
        let mut out = DesiredState::default();
        add_services(objects, part.iter().copied(), node, cfg, &mut out);
        out
    };
    // The last part is computed here, not on a thread of its own (with one part, no thread
    // starts); a part whose thread cannot start (a pids limit) is computed here too, in its turn.
    let chunks: Vec<_> = services.chunks(services.len().div_ceil(threads.max(1)).max(1)).collect();
    let parts: Vec<DesiredState> = std::thread::scope(|s| {
        let compute = &compute;
        let (last, rest) = chunks.split_last().map_or((&[][..], &[][..]), |(l, r)| (*l, r));
        let started: Vec<_> =
            rest.iter().map(|part| (*part, std::thread::Builder::new().name("kpr-model".into()).spawn_scoped(s, move || compute(part)).ok())).collect();
        let last = compute(last);
        let mut parts: Vec<DesiredState> =
            started.into_iter().map(|(part, t)| t.map_or_else(|| compute(part), |t| t.join().expect("the model's compute does not panic"))).collect();
        parts.push(last);
        parts
    });
    for part in parts {
        out.append(part);
    }
    out.frontends = objects::packed(std::mem::take(&mut out.frontends));
    out.by_service = objects::packed(std::mem::take(&mut out.by_service));
    out
}

/// The desired state of the `names` services alone: the incremental path.
fn compute_only(objects: &Objects, node: &NodeInfo, cfg: &ModelConfig, names: &BTreeSet<(String, String)>) -> DesiredState {
    let mut out = unowned_slices(objects);
    add_services(objects, names.iter().filter_map(|n| objects.services.get_key_value(n)), node, cfg, &mut out);
    out
}

/// A state holding only the problems of no one Service: slices that name none.
fn unowned_slices(objects: &Objects) -> DesiredState {
    let mut out = DesiredState::default();
    for (ns, name) in objects.slices.unowned() {
        err(
            &mut out.errors,
            &format!("EndpointSlice {ns}/{name}"),
            format!("metadata.labels[{SERVICE_NAME_LABEL}]"),
            "missing: the slice belongs to no Service",
        );
    }
    out
}

/// Each Service's frontends, health check and problems, into `out`, in order.
fn add_services<'a>(
    objects: &Objects,
    services: impl Iterator<Item = (&'a (String, String), &'a ServiceObject)>,
    node: &NodeInfo,
    cfg: &ModelConfig,
    out: &mut DesiredState,
) {
    for (name, svc) in services {
        add_service(objects, name, svc, node, cfg, out);
    }
}

/// One Service's frontends, health check and problems, into `out`.
fn add_service(objects: &Objects, (ns, name): &(String, String), svc: &ServiceObject, node: &NodeInfo, cfg: &ModelConfig, out: &mut DesiredState) {
    let slices: Vec<(&String, &SliceObject)> = objects.slices.of_service(ns, name).collect();
    let before = out.errors.len();
    service::service_frontends(ns, name, svc, &slices, node, cfg, out);
    let own = out.errors.split_off(before);
    if !own.is_empty() {
        out.service_errors.insert((ns.clone(), name.clone()), own);
    }
}

impl DesiredState {
    /// Adds `later`, computed for Services that come after this state's: a frontend key both
    /// hold is `later`'s, as if computed in one pass.
    fn append(&mut self, later: DesiredState) {
        let DesiredState { mut frontends, mut by_service, mut health_checks, mut no_local_endpoints, mut service_errors, mut errors } = later;
        self.frontends.append(&mut frontends);
        self.by_service.append(&mut by_service);
        self.health_checks.append(&mut health_checks);
        self.no_local_endpoints.append(&mut no_local_endpoints);
        self.service_errors.append(&mut service_errors);
        self.errors.append(&mut errors);
    }

    /// The incremental path: recomputes the `names` services from `objects` and puts them in
    /// place of what this state held of them. Returns every frontend key that may differ: those
    /// removed and those (re)added.
    pub fn recompute_services(&mut self, objects: &Objects, node: &NodeInfo, cfg: &ModelConfig, names: &BTreeSet<(String, String)>) -> BTreeSet<FrontendKey> {
        let partial = compute_only(objects, node, cfg, names);
        self.replace_services(names, partial)
    }

    /// Replaces everything of the `names` services with `partial` (computed for them alone).
    fn replace_services(&mut self, names: &BTreeSet<(String, String)>, partial: DesiredState) -> BTreeSet<FrontendKey> {
        let mut touched = BTreeSet::new();
        if names.is_empty() {
            return touched;
        }
        for name in names {
            // A key another Service took over since (the same address and port) stays its own.
            let prefix = format!("{}/{}:", name.0, name.1);
            for k in self.by_service.remove(name).unwrap_or_default() {
                if self.frontends.get(&k).is_some_and(|f| f.service.starts_with(&prefix)) {
                    self.frontends.remove(&k);
                    touched.insert(k);
                }
            }
        }
        touched.extend(partial.frontends.keys().copied());
        self.by_service.extend(partial.by_service);
        self.health_checks.retain(|_, (ns, n, _)| !names.contains(&(ns.clone(), n.clone())));
        self.no_local_endpoints.retain(|k, _| !names.contains(k));
        self.no_local_endpoints.extend(partial.no_local_endpoints);
        self.frontends.extend(partial.frontends);
        self.health_checks.extend(partial.health_checks);
        self.service_errors.retain(|k, _| !names.contains(k));
        self.service_errors.extend(partial.service_errors);
        self.errors = partial.errors;
        touched
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::manifests::{load_text, LoadReport};

    /// The full compute split between threads gives what one thread gives: the same frontends
    /// (a key two Services claim is the later one's, also across the parts), health checks,
    /// Local policies without local endpoints, and problems.
    #[test]
    fn a_compute_split_between_threads_equals_one_on_a_single_thread() {
        let mut y = String::new();
        for i in 0..12 {
            // s03 and s10 claim one address, s05 and s06 another; s07 is invalid.
            let ip = match i {
                10 => "10.96.3.3".to_string(),
                6 => "10.96.3.5".to_string(),
                7 => "10.96.3.999".to_string(),
                _ => format!("10.96.3.{i}"),
            };
            let local = if i % 4 == 1 { "type: NodePort, externalTrafficPolicy: Local, healthCheckNodePort: 3200" } else { "type: ClusterIP" };
            y += &format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: s{i:02}, namespace: p}}\nspec: {{{local}, clusterIP: {ip}, ports: [{{name: http, port: 80, nodePort: 3100{i:02}}}]}}\n---\n"
            )
            .replace("3200", &format!("32{i:03}"));
            y += &format!(
                "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{i:02}-1, namespace: p, labels: {{kubernetes.io/service-name: s{i:02}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{{addresses: [10.244.0.{i}], nodeName: elsewhere}}]\n---\n"
            );
        }
        let mut r = LoadReport::default();
        load_text("p.yaml", &y, &mut r);
        let node = NodeInfo::default();
        let cfg = ModelConfig::default();
        let one = compute_on(&r.objects, &node, &cfg, 1);
        assert!(one.dump().contains("10.96.3.3:80/TCP both clusterip p/s10:http"), "{}", one.dump());
        assert!(one.dump().contains("10.96.3.5:80/TCP both clusterip p/s06:http"), "{}", one.dump());
        assert!(one.problems().any(|e| e.object.contains("p/s07")));
        assert!(!one.health_checks.is_empty() && !one.no_local_endpoints.is_empty());
        for threads in [2, 4, 5, 12, 16] {
            let split = compute_on(&r.objects, &node, &cfg, threads);
            assert_eq!(split.dump(), one.dump(), "{threads} threads");
            assert_eq!(split.by_service, one.by_service);
            assert_eq!(split.health_checks, one.health_checks);
            assert_eq!(split.no_local_endpoints, one.no_local_endpoints);
            assert_eq!(split.problems().map(|e| e.to_string()).collect::<Vec<_>>(), one.problems().map(|e| e.to_string()).collect::<Vec<_>>());
        }
    }
}
