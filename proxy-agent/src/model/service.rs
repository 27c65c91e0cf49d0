//! One Service and its EndpointSlices -> its frontends (every Service semantic kpr programs).
use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use proxy_common::limits::MAX_BACKENDS_PER_SERVICE;

use crate::model::{
    annotations::{
        ipvs_options, max_connection_age, outlier_ejection, scheduler, IpvsForward, IpvsOptions, IPVS_FORWARD_ANNOTATION, MAX_CONNECTION_AGE_ANNOTATION,
        OUTLIER_EJECTION_ANNOTATION, SCHEDULER_ANNOTATION,
    },
    endpoints::{port_endpoints, to_keys_of, topology_filtered, usable, Ep},
    errors::{err, unsupported, ObjectError},
    objects::{ServiceObject, ServiceSpec},
    slice_object::SliceObject,
    Backends, DesiredState, Frontend, FrontendKey, FrontendKind, Ipv6Reach, ModelConfig, NodeInfo, Protocol, Scheduler, Scope, DEFAULT_AFFINITY_TIMEOUT_S,
    NO_WIRE_FORM,
};

const NO_IPV6: &str = "this data plane serves no IPv6; the IPv4 parts of this Service are programmed";
/// eBPF mode without its IPv6 masquerade rule (Ipv6Reach::ClusterIps).
const IPV6_CLUSTER_IPS_ONLY: &str =
    "this node serves IPv6 clusterIPs only (at connect time): kpr could not install its ip6tables masquerade rule, which IPv6 NodePorts, externalIPs and load-balancer IPs need (see the agent's log); the rest of this Service is programmed";
const NO_CLUSTER_IP_OF_FAMILY: &str = "the Service has no clusterIP of this family (spec.ipFamilies): kube-proxy serves none of its addresses of it either";

/// How a frontend treats the client's address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    Plain,
    Masquerade,
    PreserveSource,
}

pub(super) fn service_frontends(
    ns: &str,
    name: &str,
    svc: &ServiceObject,
    slices: &[(&String, &SliceObject)],
    node: &NodeInfo,
    cfg: &ModelConfig,
    out: &mut DesiredState,
) {
    let object = format!("Service {ns}/{name}");
    let errors = &mut out.errors;
    if svc.other_proxy {
        return;
    }
    let Some(spec) = &svc.spec else { return };
    if spec.type_() == Some("ExternalName") {
        return;
    }
    let cluster_ip = spec.cluster_ip.as_deref().unwrap_or("");
    if cluster_ip == "None" {
        return; // headless
    }
    let Some(addrs) = addresses(svc, spec, cfg.ipv6, &object, errors) else { return };

    let svc_type = spec.type_().unwrap_or("ClusterIP");
    let etp_local = spec.external_traffic_policy() == Some("Local");
    let itp_local = spec.internal_traffic_policy() == Some("Local");
    let publish_not_ready = spec.publish_not_ready_addresses.unwrap_or(false);

    let scheduler = scheduler(svc.annotations.as_deref(), cfg.default_scheduler, &object, errors);
    let affinity_timeout_s = affinity_timeout(spec, &object, errors);
    let ipvs = ipvs_options(svc.annotations.as_deref(), &object, errors);
    let max_connection_age_s = max_connection_age(svc.annotations.as_deref(), cfg.max_connection_age, &object, errors);
    let outlier_ejection = outlier_ejection(svc.annotations.as_deref(), cfg.outlier_ejection, &object, errors);
    // IPv6 frontends in eBPF mode have no per-flow features: what works from them does not
    // apply there (the IPv4 frontends keep it).
    if cfg.ipv6.ebpf() && addrs.cluster.iter().any(IpAddr::is_ipv6) {
        let by_flows = [
            (max_connection_age_s != 0, MAX_CONNECTION_AGE_ANNOTATION),
            (outlier_ejection, OUTLIER_EJECTION_ANNOTATION),
            (
                matches!(scheduler, Scheduler::LeastConnection | Scheduler::PowerOfTwo)
                    && svc.annotations.as_deref().is_some_and(|a| a.contains_key(SCHEDULER_ANNOTATION)),
                SCHEDULER_ANNOTATION,
            ),
        ];
        for (_, annotation) in by_flows.iter().filter(|(set, _)| *set) {
            unsupported(
                errors,
                &object,
                format!("metadata.annotations[{annotation}]"),
                "not applied to the IPv6 frontends: eBPF mode balances IPv6 clusterIPs at connect time and the rest by a flow table without this feature (least-connection and P2C pick at random there); the IPv4 frontends have it",
            );
        }
    }

    if etp_local && matches!(svc_type, "LoadBalancer" | "NodePort") {
        if let Some(hc) = spec.health_check_node_port {
            match u16::try_from(hc).ok().filter(|p| *p != 0) {
                Some(port) => {
                    out.health_checks.insert(port, (ns.to_string(), name.to_string(), local_ready_endpoints(slices, node, publish_not_ready)));
                }
                None => err(errors, &object, "spec.healthCheckNodePort", format!("{hc} is not a port")),
            }
        }
    }
    let mut seen_ports = BTreeSet::new();
    for (i, port) in spec.ports.iter().enumerate() {
        let field = format!("spec.ports[{i}]");
        let proto = match Protocol::from_name(port.protocol.as_deref().unwrap_or("TCP")) {
            Some(p @ (Protocol::Tcp | Protocol::Udp)) => p,
            Some(Protocol::Sctp) if cfg.sctp => Protocol::Sctp,
            Some(Protocol::Sctp) => {
                unsupported(errors, &object, format!("{field}.protocol"), "SCTP is programmed in IPVS mode only, not by the eBPF fast path; port skipped");
                continue;
            }
            None => {
                err(errors, &object, format!("{field}.protocol"), format!("unknown protocol {:?}", port.protocol.as_deref().unwrap_or_default()));
                continue;
            }
        };
        let Ok(svc_port) = u16::try_from(port.port).map_err(|_| ()).and_then(|p| if p == 0 { Err(()) } else { Ok(p) }) else {
            err(errors, &object, format!("{field}.port"), format!("{} is not a port (1..65535)", port.port));
            continue;
        };
        if !seen_ports.insert((svc_port, proto)) {
            err(errors, &object, format!("{field}.port"), format!("duplicate port {svc_port}/{}", proto.name()));
            continue;
        }
        let port_name = port.name.as_deref().unwrap_or_default();
        let service: Arc<str> = format!("{ns}/{name}:{port_name}").into();

        let eps = port_endpoints(slices, ns, port_name, proto, node, cfg.ipv6, errors);
        if eps.len() > MAX_BACKENDS_PER_SERVICE as usize {
            err(
                errors,
                &object,
                field.clone(),
                format!("{} endpoints: more than the {MAX_BACKENDS_PER_SERVICE} a service port may have; port skipped", eps.len()),
            );
            continue;
        }
        // Each family's frontends take that family's endpoints (kube-proxy runs a proxier per family).
        let per_family = [true, false].map(|v4| {
            let all: Vec<&Ep> = eps.iter().filter(|e| e.ip.is_ipv4() == v4).collect();
            let cluster: Backends = to_keys_of(proto, topology_filtered(&all, node, publish_not_ready)).into();
            let local: Vec<&Ep> = all.iter().copied().filter(|e| e.local).collect();
            let local: Backends = to_keys_of(proto, usable(&local, publish_not_ready)).into();
            let internal = if itp_local { local.clone() } else { cluster.clone() };
            FamilyBackends { cluster, local, internal }
        });
        let of = |ip: &IpAddr| &per_family[usize::from(!ip.is_ipv4())];
        let served = addrs.cluster.iter().map(&of);
        if (itp_local || etp_local) && served.clone().any(|b| b.local.is_empty()) {
            let e = out.no_local_endpoints.entry((ns.to_string(), name.to_string())).or_default();
            e[0] |= itp_local;
            e[1] |= etp_local;
        }
        // DR and TUN cannot change the port: the real server sees the service port.
        let mut ipvs = ipvs.clone();
        if ipvs.forward != IpvsForward::Nat && eps.iter().any(|e| e.port != svc_port) {
            err(
                errors,
                &object,
                format!("metadata.annotations[{IPVS_FORWARD_ANNOTATION}]"),
                format!("{field}: port {svc_port} differs from its targetPort; dr/tun need them equal, using nat"),
            );
            ipvs.forward = IpvsForward::Nat;
        }
        let ipvs = shared_ipvs_options(ipvs);

        // kube-proxy's verdicts without endpoints: a service with none at all rejects; a traffic
        // policy Local frontend whose endpoints are all on other nodes drops.
        let mut add = |ip: IpAddr, p: u16, kind: FrontendKind, external: (Policy, Which), internal: (Policy, Which)| {
            let family = of(&ip);
            let backends_of = |which: Which| match which {
                Which::Internal => &family.internal,
                Which::Cluster => &family.cluster,
                Which::External if etp_local => &family.local,
                Which::External => &family.cluster,
            };
            let ranges: Vec<IpNet> = if kind == FrontendKind::LoadBalancer {
                let mut r: Vec<IpNet> = addrs.source_ranges.iter().filter(|n| n.addr().is_ipv4() == ip.is_ipv4()).copied().collect();
                // A load balancer that puts its IP on the node loops the node's own requests
                // back with that IP as the source: kube-proxy lets them in where a range admits
                // the node.
                if r.iter().any(|n| node.nodeport_addresses.iter().any(|a| n.contains(a))) {
                    r.push(IpNet::from(ip));
                }
                r
            } else {
                vec![]
            };
            // The two scopes' frontends are often one (every ClusterIP, and every other kind
            // under externalTrafficPolicy Cluster): it is then kept once, for both.
            let same = external.0 == internal.0 && Backends::ptr_eq(backends_of(external.1), backends_of(internal.1));
            let scopes: &[(Scope, (Policy, Which))] =
                if same { &[(Scope::Both, internal)] } else { &[(Scope::External, external), (Scope::Internal, internal)] };
            for (scope, (policy, which)) in scopes {
                let backends = backends_of(*which);
                let key = FrontendKey { ip, port: p, proto, scope: *scope };
                out.by_service.entry((ns.to_string(), name.to_string())).or_default().push(key);
                out.frontends.insert(
                    key,
                    Frontend {
                        service: service.clone(),
                        kind,
                        scheduler,
                        affinity_timeout_s,
                        masquerade: *policy == Policy::Masquerade,
                        preserve_source: *policy == Policy::PreserveSource,
                        no_local_endpoint: backends.is_empty() && !family.cluster.is_empty(),
                        source_ranges: ranges.clone(),
                        max_connection_age_s,
                        outlier_ejection,
                        backends: backends.clone(),
                        ipvs: ipvs.clone(),
                    },
                );
            }
        };
        // External frontends: externalTrafficPolicy decides masquerade and endpoint set for
        // traffic from outside; traffic from inside the cluster goes cluster-wide.
        let ext = (if etp_local { Policy::PreserveSource } else { Policy::Masquerade }, Which::External);
        let int_ext = (if etp_local { Policy::Plain } else { Policy::Masquerade }, Which::Cluster);
        // internalTrafficPolicy applies to all ClusterIP traffic, also what a router sends to the
        // node from outside (kube-proxy's KUBE-SVL chain has no source condition).
        let cluster_ip = (if cfg.masquerade_all { Policy::Masquerade } else { Policy::Plain }, Which::Internal);
        for ip in &addrs.cluster {
            add(*ip, svc_port, FrontendKind::ClusterIp, cluster_ip, cluster_ip);
        }
        if matches!(svc_type, "NodePort" | "LoadBalancer") {
            if let Some(np) = port.node_port {
                match u16::try_from(np).ok().filter(|p| *p != 0) {
                    Some(np) => {
                        // A family's node addresses serve the Services that have a clusterIP of it.
                        let of_family = |ip: &&IpAddr| addrs.cluster.iter().any(|c| c.is_ipv4() == ip.is_ipv4());
                        let mut skipped6 = false;
                        for ip in node.nodeport_addresses.iter().filter(of_family) {
                            if ip.is_ipv6() && !cfg.ipv6.serves_external() {
                                skipped6 = true;
                                continue;
                            }
                            add(*ip, np, FrontendKind::NodePort, ext, int_ext);
                        }
                        if skipped6 {
                            unsupported(errors, &object, format!("{field}.nodePort"), format!("{np} on the node's IPv6 addresses: {IPV6_CLUSTER_IPS_ONLY}"));
                        }
                    }
                    None => err(errors, &object, format!("{field}.nodePort"), format!("{np} is not a port")),
                }
            }
        }
        for ip in &addrs.external {
            add(*ip, svc_port, FrontendKind::ExternalIp, ext, int_ext);
        }
        for ip in &addrs.load_balancer {
            add(*ip, svc_port, FrontendKind::LoadBalancer, ext, int_ext);
        }
    }
}

/// One family's endpoint sets of a Service port.
struct FamilyBackends {
    /// Every usable endpoint (topology hints applied).
    cluster: Backends,
    /// This node's usable endpoints.
    local: Backends,
    /// What internalTrafficPolicy selects.
    internal: Backends,
}

/// Which endpoint set a frontend takes.
#[derive(Clone, Copy)]
enum Which {
    Internal,
    Cluster,
    /// externalTrafficPolicy's.
    External,
}

/// Where a Service is reached: each address of a family the data plane serves and the Service
/// has a clusterIP of; the others are reported.
struct Addresses {
    cluster: Vec<IpAddr>,
    external: Vec<IpAddr>,
    load_balancer: Vec<IpAddr>,
    /// loadBalancerSourceRanges, both families (each LB IP takes those of its own).
    source_ranges: Vec<IpNet>,
}

/// None: the clusterIP is not an address, and nothing of the Service can be programmed.
fn addresses(svc: &ServiceObject, spec: &ServiceSpec, ipv6: Ipv6Reach, object: &str, errors: &mut Vec<ObjectError>) -> Option<Addresses> {
    let cluster_ip = spec.cluster_ip.as_deref().unwrap_or("");
    let svc_type = spec.type_().unwrap_or("ClusterIP");
    let mut cluster_ips: Vec<IpAddr> = Vec::new();
    if !cluster_ip.is_empty() {
        match cluster_ip.parse::<IpAddr>() {
            Ok(ip) => cluster_ips.push(ip),
            Err(_) => {
                err(errors, object, "spec.clusterIP", format!("{cluster_ip:?} is not an IP address"));
                return None;
            }
        }
    }
    for (i, s) in spec.cluster_ips.iter().enumerate() {
        match s.parse::<IpAddr>() {
            Ok(ip) if !cluster_ips.contains(&ip) => cluster_ips.push(ip),
            Ok(_) => {}
            Err(_) => err(errors, object, format!("spec.clusterIPs[{i}]"), format!("{s:?} is not an IP address")),
        }
    }
    // The Service's families, whatever the plane serves of them.
    let families: Vec<bool> = cluster_ips.iter().map(IpAddr::is_ipv4).collect();
    match ipv6 {
        Ipv6Reach::None => {
            for ip in cluster_ips.iter().filter(|ip| ip.is_ipv6()) {
                unsupported(errors, object, "spec.clusterIPs", format!("{ip}: {NO_IPV6}"));
            }
            cluster_ips.retain(IpAddr::is_ipv4);
        }
        Ipv6Reach::ClusterIps | Ipv6Reach::AllWithoutFlowFeatures => cluster_ips.retain(|ip| {
            let ok = proxy_common::user::has_wire_form(*ip);
            if !ok {
                unsupported(errors, object, "spec.clusterIPs", format!("{ip}: {NO_WIRE_FORM}"));
            }
            ok
        }),
        Ipv6Reach::All => {}
    }
    // Another address of a family: served when the data plane and the Service both have it.
    let servable = |ip: IpAddr, field: String, errors: &mut Vec<ObjectError>| -> bool {
        if !families.contains(&ip.is_ipv4()) {
            err(errors, object, field, format!("{ip}: {NO_CLUSTER_IP_OF_FAMILY}"));
            false
        } else if ip.is_ipv6() && !ipv6.serves_external() {
            let why = if ipv6 == Ipv6Reach::None { NO_IPV6 } else { IPV6_CLUSTER_IPS_ONLY };
            unsupported(errors, object, field, format!("{ip}: {why}"));
            false
        } else if ipv6.ebpf() && !proxy_common::user::has_wire_form(ip) {
            unsupported(errors, object, field, format!("{ip}: {NO_WIRE_FORM}"));
            false
        } else {
            true
        }
    };

    let mut external_ips = Vec::new();
    for (i, s) in spec.external_ips.iter().enumerate() {
        match s.parse::<IpAddr>() {
            Ok(ip) => {
                if servable(ip, format!("spec.externalIPs[{i}]"), errors) {
                    external_ips.push(ip)
                }
            }
            Err(_) => err(errors, object, format!("spec.externalIPs[{i}]"), format!("{s:?} is not an IP address")),
        }
    }
    let mut lb_ips = Vec::new();
    if svc_type == "LoadBalancer" {
        for (i, ing) in svc.ingress.iter().enumerate() {
            // KEP-1860: the load balancer proxies this address itself; kube-proxy programs
            // nothing for it.
            if ing.ip_mode.as_deref() == Some("Proxy") {
                continue;
            }
            if let Some(s) = &ing.ip {
                let field = format!("status.loadBalancer.ingress[{i}].ip");
                match s.parse::<IpAddr>() {
                    Ok(ip) => {
                        if servable(ip, field, errors) {
                            lb_ips.push(ip)
                        }
                    }
                    Err(_) => err(errors, object, field, format!("{s:?} is not an IP address")),
                }
            }
        }
    }
    let mut source_ranges = Vec::new();
    for (i, s) in spec.load_balancer_source_ranges.iter().enumerate() {
        match s.trim().parse::<IpNet>() {
            Ok(net) => source_ranges.push(net.trunc()),
            Err(_) => err(errors, object, format!("spec.loadBalancerSourceRanges[{i}]"), format!("{s:?} is not a CIDR")),
        }
    }

    Some(Addresses { cluster: cluster_ips, external: external_ips, load_balancer: lb_ips, source_ranges })
}

/// sessionAffinity ClientIP's timeout (0: no affinity).
fn affinity_timeout(spec: &ServiceSpec, object: &str, errors: &mut Vec<ObjectError>) -> u32 {
    if spec.session_affinity() == Some("ClientIP") {
        match spec.affinity_timeout_seconds {
            None => DEFAULT_AFFINITY_TIMEOUT_S,
            Some(t) if (1..=86_400).contains(&t) => t as u32,
            Some(t) => {
                err(
                    errors,
                    object,
                    "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                    format!("{t} is outside 1..86400; using {DEFAULT_AFFINITY_TIMEOUT_S}"),
                );
                DEFAULT_AFFINITY_TIMEOUT_S
            }
        }
    } else {
        0
    }
}

/// The ready endpoints on this node (the answer of a healthCheckNodePort).
fn local_ready_endpoints(slices: &[(&String, &SliceObject)], node: &NodeInfo, publish_not_ready: bool) -> usize {
    let local: BTreeSet<IpAddr> = slices
        .iter()
        .flat_map(|(_, s)| s.endpoints.iter())
        .filter(|e| e.node_name() == Some(node.name.as_str()))
        .filter(|e| publish_not_ready || e.ready().unwrap_or(true))
        .flat_map(|e| e.addresses().filter_map(|a| a.ip()))
        .collect();
    local.len()
}

/// One allocation for every port with IPVS mode's defaults (nearly all: 80 bytes a port).
fn shared_ipvs_options(o: IpvsOptions) -> Arc<IpvsOptions> {
    static DEFAULT: std::sync::LazyLock<Arc<IpvsOptions>> = std::sync::LazyLock::new(Default::default);
    if o == IpvsOptions::default() {
        DEFAULT.clone()
    } else {
        Arc::new(o)
    }
}
