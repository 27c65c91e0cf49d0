//! The desired state computed from the objects: in full (on several threads at scale) or for
//! the changed Services alone (the incremental path), each Service into its own part of it.
use std::collections::BTreeSet;

use crate::model::{
    errors::err,
    objects::{self, Objects, ServiceObject},
    service,
    slice_object::SliceObject,
    DesiredState, FrontendKey, ModelConfig, NodeInfo, SERVICE_NAME_LABEL,
};

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
