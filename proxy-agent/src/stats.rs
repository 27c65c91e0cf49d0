//! The agent's figures: sync counts and durations, pending changes, health state, and what the
//! data planes report. The loop and the data planes write them; `serve` renders and judges them.
use std::{
    fmt::Write as _,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

/// A Prometheus histogram with fixed buckets.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// kube-proxy's buckets for sync durations: 1 ms doubling 15 times.
    pub fn exponential(start: f64, factor: f64, n: usize) -> Self {
        let bounds: Vec<f64> = (0..n).map(|i| start * factor.powi(i as i32)).collect();
        Self { counts: vec![0; bounds.len()], bounds, sum: 0.0, count: 0 }
    }
    pub fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", self.count, self.sum, self.count);
    }
}

#[derive(Debug)]
pub struct Stats {
    pub sync_duration: Histogram,
    pub network_programming: Histogram,
    pub last_sync: Option<SystemTime>,
    pub syncs_total: u64,
    pub sync_failures_total: u64,
    pub service_changes_pending: u64,
    pub service_changes_total: u64,
    pub endpoint_changes_pending: u64,
    pub endpoint_changes_total: u64,
    /// Since when a change has been waiting for a sync (None: nothing pending).
    pub pending_since: Option<Instant>,
    /// Since when syncs have been failing (None: the last one succeeded).
    pub failing_since: Option<Instant>,
    /// Unhealthy when a change waits longer than this (kube-proxy: 2 × syncPeriod).
    pub health_timeout: Duration,
    /// False while the node is being deleted (kube-proxy's nodeEligible).
    pub node_eligible: bool,
    /// Objects that could not be programmed, with the reason (also logged, and Events).
    pub rejected_objects: u64,
    /// "ebpf" or "ipvs": the data plane in force.
    pub mode: &'static str,
    /// IPVS mode: destinations at weight 0 waiting for their connections to end.
    pub ipvs_terminating: u64,
    /// Flows the conntrack collector deleted (idle, closed, or of removed UDP backends).
    pub gc_flows_total: u64,
}

impl Stats {
    pub fn new(health_timeout: Duration) -> Self {
        Self {
            sync_duration: Histogram::exponential(0.001, 2.0, 15),
            network_programming: Histogram::exponential(0.001, 2.0, 20),
            last_sync: None,
            syncs_total: 0,
            sync_failures_total: 0,
            service_changes_pending: 0,
            service_changes_total: 0,
            endpoint_changes_pending: 0,
            endpoint_changes_total: 0,
            pending_since: None,
            failing_since: None,
            health_timeout,
            node_eligible: true,
            rejected_objects: 0,
            mode: "ebpf",
            ipvs_terminating: 0,
            gc_flows_total: 0,
        }
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
