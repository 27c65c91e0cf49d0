//! The agent's figures: health state and the Prometheus metrics the loop, the sources and the
//! data planes update. kube-proxy's metrics keep kube-proxy's names, types and buckets
//! (pkg/proxy/metrics), so its dashboards and alerts keep working; kpr's own start with `kpr_`.
//! `serve` renders them (with the process metrics and the data path's figures read at scrape
//! time) and judges health.
use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use prometheus::{GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// kube-proxy's network programming buckets: 0, 0.25 s, 0.5 s, 1..59 s, 60..115 s by 5,
/// 2..5 min by 30 s.
fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

/// The metrics, registered once in `registry`.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub sync_duration: Histogram,
    pub sync_full_duration: Histogram,
    pub sync_partial_duration: Histogram,
    pub network_programming: Histogram,
    pub last_sync_timestamp: prometheus::Gauge,
    pub last_queued_timestamp: prometheus::Gauge,
    pub service_changes_pending: IntGauge,
    pub service_changes_total: IntCounter,
    pub endpoint_changes_pending: IntGauge,
    pub endpoint_changes_total: IntCounter,
    /// Services with a Local traffic policy and no local endpoints, by policy (internal,
    /// external). A gauge despite the name, as in kube-proxy.
    pub no_local_endpoints: IntGaugeVec,
    pub healthz_total: IntCounterVec,
    pub livez_total: IntCounterVec,
    pub syncs_total: IntCounter,
    pub sync_failures_total: IntCounter,
    pub rejected_objects: IntGauge,
    /// The same by reason (FieldNotProgrammed: invalid; NotSupported: IPv6, SCTP; MapFull).
    pub not_programmed: IntGaugeVec,
    pub ipvs_terminating: IntGauge,
    /// After a mode switch: connections the previous mode still serves (0: none, or no switch).
    pub handover_connections: IntGauge,
    pub gc_flows_total: IntCounter,
    /// Flows marked as past their Service's maximum connection age.
    pub max_age_flows_total: IntCounter,
    /// Backends ejected by outlier detection.
    pub outlier_ejections_total: IntCounter,
    /// Passes of the assured tables' hint rebuild, by family.
    pub hint_passes_total: IntCounterVec,
    /// The share of a hint's bits set in the half its last pass rebuilt, by family.
    pub hint_bits_set: GaugeVec,
    /// Frontends that did not fit in a full map, by map.
    pub map_full_total: IntCounterVec,
    /// Kernel writes for one frontend that failed in a sync that went on (each also logged).
    pub write_errors_total: IntCounter,
    pub info: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone())).expect("metric names are unique");
            c
        }
        let hist = |name: &str, help: &str, buckets: Vec<f64>| reg(&registry, Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).unwrap());
        let sync_buckets = || prometheus::exponential_buckets(0.001, 2.0, 15).unwrap();
        let counter = |name: &str, help: &str| reg(&registry, IntCounter::new(name, help).unwrap());
        let gauge = |name: &str, help: &str| reg(&registry, IntGauge::new(name, help).unwrap());
        let counter_vec = |name: &str, help: &str, labels: &[&str]| reg(&registry, IntCounterVec::new(Opts::new(name, help), labels).unwrap());
        let m = Self {
            sync_duration: hist("kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", sync_buckets()),
            sync_full_duration: hist("kubeproxy_sync_full_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for full resyncs", sync_buckets()),
            sync_partial_duration: hist(
                "kubeproxy_sync_partial_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for partial resyncs",
                sync_buckets(),
            ),
            network_programming: hist(
                "kubeproxy_network_programming_duration_seconds",
                "In Cluster Network Programming Latency in seconds",
                network_programming_buckets(),
            ),
            last_sync_timestamp: reg(
                &registry,
                prometheus::Gauge::new("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced").unwrap(),
            ),
            last_queued_timestamp: reg(
                &registry,
                prometheus::Gauge::new("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", "The last time a sync of proxy rules was queued").unwrap(),
            ),
            service_changes_pending: gauge("kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes"),
            service_changes_total: counter("kubeproxy_sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes"),
            endpoint_changes_pending: gauge("kubeproxy_sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes"),
            endpoint_changes_total: counter("kubeproxy_sync_proxy_rules_endpoint_changes_total", "Cumulative proxy rules Endpoint changes"),
            no_local_endpoints: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new("kubeproxy_sync_proxy_rules_no_local_endpoints_total", "Number of services with a Local traffic policy and no endpoints"),
                    &["traffic_policy"],
                )
                .unwrap(),
            ),
            healthz_total: counter_vec("kubeproxy_proxy_healthz_total", "Cumulative proxy healthz HTTP status", &["code"]),
            livez_total: counter_vec("kubeproxy_proxy_livez_total", "Cumulative proxy livez HTTP status", &["code"]),
            syncs_total: counter("kpr_syncs_total", "Syncs of the data plane, successful or not"),
            sync_failures_total: counter("kpr_sync_failures_total", "Syncs that failed (retried with a back-off)"),
            rejected_objects: gauge("kpr_rejected_objects", "Service and EndpointSlice fields not programmed in the last sync (each also an Event)"),
            not_programmed: reg(
                &registry,
                IntGaugeVec::new(Opts::new("kpr_objects_not_programmed", "Object fields not programmed in the last sync, by the Event's reason"), &["reason"])
                    .unwrap(),
            ),
            ipvs_terminating: gauge("kpr_ipvs_terminating_destinations", "IPVS destinations at weight 0 waiting for their connections to end"),
            handover_connections: gauge(
                "kpr_mode_handover_connections",
                "After a switch between the eBPF and IPVS modes: connections (fast path flows, or IPVS established connections) the previous mode still serves",
            ),
            gc_flows_total: counter("kpr_conntrack_gc_flows_total", "Flows deleted by the conntrack collector"),
            hint_passes_total: counter_vec(
                "kpr_conntrack_hint_passes_total",
                "Passes of the collector over an assured table that rebuilt half of its hint (which tuples a new flow must look up there)",
                &["family"],
            ),
            hint_bits_set: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "kpr_conntrack_hint_bits_set_ratio",
                        "Share of an assured table's hint bits set, after its last rebuild pass: the share of new flows' tuples looked up in the assured table (1 until two passes after a load)",
                    ),
                    &["family"],
                )
                .unwrap(),
            ),
            outlier_ejections_total: counter(
                "kpr_outlier_ejections_total",
                "Backends left out of new connections for refusing or letting time out new connections in a row",
            ),
            max_age_flows_total: counter(
                "kpr_max_connection_age_flows_total",
                "Flows ended for outliving their Service's kpr.io/max-connection-age (TCP reset at the next packet, UDP re-balanced)",
            ),
            map_full_total: counter_vec("kpr_map_full_total", "Frontends or backends not programmed because a map was full, or programmed in a lesser way (a Maglev Service balanced at random)", &["map"]),
            write_errors_total: counter(
                "kpr_sync_write_errors_total",
                "Kernel writes for one frontend or endpoint (IPVS virtual servers and destinations, VIP bindings, a removed endpoint's flows, sockets and conntrack entries) that failed in a sync that went on; each is logged and retried",
            ),
            info: reg(&registry, IntGaugeVec::new(Opts::new("kpr_info", "The agent's version and data plane mode"), &["version", "mode"]).unwrap()),
            registry,
        };
        // The maps a sync writes, at zero from the start (a vector without children is not
        // exported, and alerts want the series).
        for map in [proxy_common::map_names::SERVICES, proxy_common::map_names::SLOTS, proxy_common::map_names::BACKENDS] {
            m.map_full_total.with_label_values(&[map]);
        }
        for policy in ["internal", "external"] {
            m.no_local_endpoints.with_label_values(&[policy]);
        }
        for reason in crate::model::errors::REASONS {
            m.not_programmed.with_label_values(&[reason]);
        }
        // Only Linux has /proc for the process collector.
        #[cfg(target_os = "linux")]
        let _ = m.registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()));
        m
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Moves a counter up to `total` (sources report cumulative counts).
pub fn counter_to(c: &IntCounter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}

pub struct Stats {
    pub m: Metrics,
    pub last_sync: Option<SystemTime>,
    /// Since when a change has been waiting for a sync (None: nothing pending).
    pub pending_since: Option<Instant>,
    /// Since when syncs have been failing (None: the last one succeeded).
    pub failing_since: Option<Instant>,
    /// Unhealthy when a change waits longer than this (kube-proxy: 2 × syncPeriod).
    pub health_timeout: Duration,
    /// False while the node is being deleted (kube-proxy's nodeEligible).
    pub node_eligible: bool,
    /// The data plane in force.
    pub mode: &'static str,
    /// What the last sync could not program, each with its object, field and reason (served
    /// at /notProgrammed for `kpr services`).
    pub not_programmed: Vec<crate::model::errors::ObjectError>,
}

impl Stats {
    pub fn new(health_timeout: Duration) -> Self {
        Self {
            m: Metrics::new(),
            last_sync: None,
            pending_since: None,
            failing_since: None,
            health_timeout,
            node_eligible: true,
            mode: "ebpf",
            not_programmed: Vec::new(),
        }
    }

    pub fn set_mode(&mut self, mode: &'static str) {
        self.mode = mode;
        self.m.info.reset();
        self.m.info.with_label_values(&[env!("CARGO_PKG_VERSION"), mode]).set(1);
    }

    /// kube-proxy's rule: healthy unless a change has waited longer than the timeout; and
    /// unhealthy when syncs have failed for longer than it, changes pending or not (a periodic
    /// sync that cannot repair the kernel state is a broken node too).
    pub fn healthy(&self, now: Instant) -> bool {
        let within = |since: Option<Instant>| since.is_none_or(|t| now.duration_since(t) < self.health_timeout);
        within(self.pending_since) && within(self.failing_since)
    }
}

pub type SharedStats = Arc<Mutex<Stats>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxys_buckets() {
        let b = network_programming_buckets();
        assert_eq!(&b[..4], &[0.0, 0.25, 0.5, 1.0]);
        assert_eq!(b.len(), 3 + 59 + 12 + 7);
        assert_eq!(*b.last().unwrap(), 300.0);
        assert!(b.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn cumulative_counts_move_counters_forward_only() {
        let m = Metrics::new();
        counter_to(&m.service_changes_total, 5);
        counter_to(&m.service_changes_total, 3);
        assert_eq!(m.service_changes_total.get(), 5);
    }
}
