//! What the benchmarks share: ClusterIP desired states and manifests, medians, the kernel's
//! figure for BPF map memory.
pub mod call_cost;
pub mod chart;

use std::{fmt::Write as _, net::IpAddr};

use proxy_agent::model::{BackendKey, DesiredState, Frontend, FrontendKey, FrontendKind, Protocol, Scope};

use kpr_lab::lab::backend_ip;

/// Sets (or replaces) service `i`'s ClusterIP frontend `vip:80` on `backends`: one frontend
/// for both scopes, as the model makes it.
pub fn set_clusterip(d: &mut DesiredState, i: u32, vip: IpAddr, backends: Vec<BackendKey>) {
    let fe = Frontend::plain(&format!("bench/s{i}:http"), FrontendKind::ClusterIp, backends);
    d.frontends.insert(FrontendKey { ip: vip, port: 80, proto: Protocol::Tcp, scope: Scope::Both }, fe);
}

/// N ClusterIP services (`vip(i):80`) with `eps` TCP endpoints each on port 8080, taken in turn
/// from `first_backend` (a host-order IPv4 address) onwards, wrapping after `span` addresses.
pub fn clusterips(n: u32, eps: u32, vip: impl Fn(u32) -> IpAddr, first_backend: u32, span: u32) -> DesiredState {
    let mut d = DesiredState::default();
    for i in 0..n {
        let backends =
            (0..eps).map(|j| BackendKey { ip: IpAddr::from((first_backend + (i * eps + j) % span).to_be_bytes()), port: 8080, proto: Protocol::Tcp }).collect();
        set_clusterip(&mut d, i, vip(i), backends);
    }
    d
}

/// N Services with their EndpointSlices in `namespace`, each `vip(i):80` -> port 8080 of the
/// lab's three backends.
pub fn clusterip_manifests(n: u32, namespace: &str, vip: impl Fn(u32) -> String) -> String {
    let mut y = String::new();
    for i in 0..n {
        let _ = write!(
            y,
            "apiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: {namespace}}}\nspec: {{clusterIP: {}, ports: [{{name: http, port: 80, targetPort: 8080}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{i}-1, namespace: {namespace}, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{{addresses: [{}]}}, {{addresses: [{}]}}, {{addresses: [{}]}}]\n---\n",
            vip(i),
            backend_ip(1),
            backend_ip(2),
            backend_ip(3)
        );
    }
    y
}

/// The Services of `clusterip_manifests` as kube-proxy's iptables renderer takes them.
pub fn clusterip_rules(n: u32, namespace: &str, vip: impl Fn(u32) -> String) -> Vec<kpr_lab::iptables::Svc> {
    (0..n)
        .map(|i| kpr_lab::iptables::Svc {
            name: format!("{namespace}/s{i}:http"),
            vip: vip(i),
            port: 80,
            proto: "tcp",
            node_port: None,
            backends: (1..=3).map(|b| (backend_ip(b), 8080)).collect(),
        })
        .collect()
}

/// A goal against this run's figure, printed beside the figures it reads. A benchmark reports a
/// goal; it never fails on one.
pub fn print_goal(goal: &str, figure: &str, met: bool) {
    println!("goal: {goal}: {figure}: {}", if met { "met" } else { "NOT met" });
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A sample's mean and percentiles (nearest rank): what one new flow costs varies with where
/// its table entries fall (a cold cache line or a warm one), so the mean alone hides the spread.
#[derive(Clone, Copy, Debug)]
pub struct Spread {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    /// The mean of the first `Spread::FIRST` samples, in the order taken.
    pub first: f64,
    /// The mean of the last half, in the order taken.
    pub last_half: f64,
}

impl Spread {
    /// How many samples `first` is the mean of.
    pub const FIRST: usize = 50;

    /// Of a sample that is not empty, in the order taken.
    pub fn of(mut v: Vec<f64>) -> Self {
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
        let (first, last_half) = (mean(&v[..v.len().min(Self::FIRST)]), mean(&v[v.len() / 2..]));
        v.sort_by(f64::total_cmp);
        let rank = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
        Spread { mean: mean(&v), p50: rank(0.5), p90: rank(0.9), p99: rank(0.99), first, last_half }
    }

    /// "p50 871 p90 1192 p99 1602" (ns).
    pub fn percentiles(&self) -> String {
        format!("p50 {:.0} p90 {:.0} p99 {:.0}", self.p50, self.p90, self.p99)
    }

    /// "first 50 1254, last half 594" (ns).
    pub fn in_order(&self) -> String {
        format!("first {} {:.0}, last half {:.0}", Self::FIRST, self.first, self.last_half)
    }
}

/// The kernel's figure for the BPF maps a process holds (`pid`, or "self"): the `memlock` of
/// each map descriptor in its fdinfo.
pub fn bpf_map_memlock(pid: &str) -> u64 {
    // A map the process holds through several fds (the object, the map handles, the
    // collector's) counts once: by its id.
    let mut by_id: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo")).into_iter().flatten().flatten() {
        let Ok(info) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<u64>().ok());
        if let (Some(id), Some(memlock)) = (field("map_id:"), field("memlock:")) {
            by_id.insert(id, memlock);
        }
    }
    by_id.values().sum()
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn spread_is_the_mean_and_nearest_rank_percentiles() {
        let s = Spread::of((1..=100).rev().map(f64::from).collect());
        assert_eq!((s.mean, s.p50, s.p90, s.p99), (50.5, 50.0, 90.0, 99.0));
        let one = Spread::of(vec![7.0]);
        assert_eq!((one.mean, one.p50, one.p99, one.first, one.last_half), (7.0, 7.0, 7.0, 7.0, 7.0));
        assert_eq!(s.percentiles(), "p50 50 p90 90 p99 99");
        // In the order taken: 100 down to 1.
        assert_eq!((s.first, s.last_half), (75.5, 25.5));
        assert_eq!(s.in_order(), "first 50 76, last half 26");
    }
}
