//! The agent loop, generic over where the objects come from (`Source`) and which mode programs
//! them (`Dataplane`): wait for changes, compute the desired state (incrementally for changed
//! services, in full at start, every syncPeriod, on a change of the Node, and after a failure),
//! hand it to the data plane, and keep interfaces attached. kube-proxy's bounded-frequency
//! runner decides when. A failed sync is logged, counted and retried with a back-off; the loop
//! goes on.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::atomic::Ordering,
    time::{Duration, Instant, SystemTime},
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use tracing::{error, info, warn};

use crate::{
    dataplane::{Dataplane, DataplaneError, NodeContext, SyncStats},
    host::netif,
    model::{self, errors::ObjectError, DesiredState, FrontendKey, ModelConfig, NodeInfo},
    serve::healthcheck::HealthChecks,
    settings::{NodePortAddresses, Settings},
    source::{Poll, Source, SyncInput},
    stats::SharedStats,
    STOP,
};

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("source: {0}")]
    Source(String),
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
}

/// A failed sync is retried after this, doubling up to syncPeriod.
const RETRY_MIN: Duration = Duration::from_secs(1);
/// Interfaces are re-checked this often.
const RECONCILE_EVERY: Duration = Duration::from_secs(1);

pub use crate::limiter::Limiter;

/// What the loop needs of the settings.
#[derive(Clone, Debug)]
pub struct LoopSettings {
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub burst_syncs: u32,
    pub once: bool,
    pub node_name: String,
    pub node_zone: Option<String>,
    pub primary_ip: Option<IpAddr>,
    pub node_port_addresses: NodePortAddresses,
    pub uplinks: Vec<String>,
    pub model: ModelConfig,
}

impl LoopSettings {
    pub fn new(s: &Settings, node_name: String) -> Self {
        Self {
            sync_period: s.sync_period,
            min_sync_period: s.min_sync_period,
            burst_syncs: s.burst_syncs,
            once: s.once,
            node_name,
            node_zone: s.node_zone.clone(),
            primary_ip: s.primary_ip,
            node_port_addresses: s.node_port_addresses.clone(),
            uplinks: s.uplinks.clone(),
            model: ModelConfig { default_scheduler: s.scheduler, masquerade_all: s.masquerade_all, ..ModelConfig::default() },
        }
    }
}

/// The loop's clock-driven state, advanced by `step` with the time passed in (tests drive it).
#[derive(Debug)]
struct Timing {
    limiter: Limiter,
    last_full: Option<Instant>,
    last_reconcile: Option<Instant>,
    dirty: bool,
    retry_at: Option<Instant>,
    retry_backoff: Duration,
    logged_waiting: bool,
}

/// What one step did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Waiting,
    Idle,
    Synced { full: bool },
    Failed,
}

pub struct Agent<S: Source, D: Dataplane> {
    pub source: S,
    pub dataplane: D,
    cfg: LoopSettings,
    pub stats: SharedStats,
    /// healthCheckNodePort servers (need a tokio runtime; None in tools and tests without one).
    pub health_checks: Option<HealthChecks>,
    /// Where objects that cannot be programmed are sent as Kubernetes Events (kube source).
    pub events: Option<tokio::sync::mpsc::UnboundedSender<ObjectError>>,
    reported: BTreeSet<String>,
    /// The same for frontends that did not fit in a full map.
    reported_full: BTreeSet<String>,
    /// The Service ports that met a full map or a failed write, by object, field and reason:
    /// an incremental sync tries only what changed, so what it does not touch is still failing
    /// until the next full sync tries it again.
    failing: BTreeMap<(String, String, &'static str), ObjectError>,
    /// The desired state last programmed, updated per changed service between full syncs.
    last_desired: Option<DesiredState>,
    last_node_version: Option<String>,
    /// The data path's SNAT drops at the last sync (None before the first: the count outlives
    /// a restart, so the first sync only reads it).
    snat_no_port_seen: Option<u64>,
    timing: Timing,
}

impl<S: Source, D: Dataplane> Agent<S, D> {
    pub fn new(mut cfg: LoopSettings, source: S, dataplane: D, stats: SharedStats) -> Self {
        stats.lock().unwrap().set_mode(dataplane.mode().name());
        cfg.model.sctp = dataplane.programs_sctp();
        cfg.model.ipv6 = dataplane.programs_ipv6();
        cfg.model.max_connection_age = dataplane.ends_old_connections();
        cfg.model.outlier_ejection = dataplane.ejects_outliers();
        let timing = Timing {
            limiter: Limiter::new(cfg.min_sync_period, cfg.burst_syncs, Instant::now()),
            last_full: None,
            last_reconcile: None,
            dirty: true,
            retry_at: None,
            retry_backoff: RETRY_MIN,
            logged_waiting: false,
        };
        Self {
            source,
            dataplane,
            cfg,
            stats,
            health_checks: None,
            events: None,
            reported: BTreeSet::new(),
            reported_full: BTreeSet::new(),
            failing: BTreeMap::new(),
            last_desired: None,
            last_node_version: None,
            snat_no_port_seen: None,
            timing,
        }
    }

    /// Runs until SIGTERM (or after one sync with `once`).
    pub fn run(&mut self) {
        while !STOP.load(Ordering::Relaxed) {
            let wait = if self.timing.dirty { Duration::from_millis(20) } else { Duration::from_millis(100) };
            let step = self.step(Instant::now(), wait);
            if self.cfg.once && matches!(step, Step::Synced { .. } | Step::Failed) {
                return;
            }
        }
        info!("stopping; programs and maps stay in place (run `kpr cleanup` to remove them)");
    }

    /// One turn of the loop at time `now`; `wait` bounds the wait for the source.
    pub fn step(&mut self, now: Instant, wait: Duration) -> Step {
        if self.timing.last_reconcile.is_none_or(|t| now.saturating_duration_since(t) >= RECONCILE_EVERY) {
            self.dataplane.reconcile_interfaces();
            self.timing.last_reconcile = Some(now);
        }
        let poll = self.source.poll(wait);
        {
            let mut stats = self.stats.lock().unwrap();
            self.source.observe(&mut stats);
            if poll == Poll::NotReady {
                // Nothing is programmed before every cache has listed: what the kernel holds
                // keeps forwarding.
                stats.pending_since.get_or_insert(now);
                if !self.timing.logged_waiting {
                    info!("waiting for the Service, EndpointSlice and Node caches to sync");
                    self.timing.logged_waiting = true;
                }
                return Step::Waiting;
            }
            if poll == Poll::Changed {
                self.timing.dirty = true;
                stats.m.last_queued_timestamp.set(unix_seconds(SystemTime::now()));
            }
            if self.timing.dirty {
                stats.pending_since.get_or_insert(now);
            }
        }
        let since_full = self.timing.last_full.map(|t| now.saturating_duration_since(t));
        let periodic = since_full.is_none_or(|d| d >= self.cfg.sync_period || self.dataplane.full_sync_within().is_some_and(|w| d >= w));
        let may_retry = self.timing.retry_at.is_none_or(|t| now >= t);
        if !(may_retry && ((self.timing.dirty && self.timing.limiter.try_take(now)) || periodic)) {
            return Step::Idle;
        }
        match self.sync(periodic, now) {
            Ok(full) => {
                self.timing.dirty = false;
                if full {
                    self.timing.last_full = Some(now);
                }
                self.timing.retry_backoff = RETRY_MIN;
                self.timing.retry_at = None;
                let mut stats = self.stats.lock().unwrap();
                stats.pending_since = None;
                stats.failing_since = None;
                Step::Synced { full }
            }
            Err(e) => {
                // Retried with a back-off up to syncPeriod, not in a busy loop; the change stays
                // pending (health says so after its timeout).
                error!(error = %e, retry_in_s = self.timing.retry_backoff.as_secs_f64(), "sync failed; retrying");
                self.timing.dirty = true;
                self.timing.retry_at = Some(now + self.timing.retry_backoff);
                self.timing.retry_backoff = (self.timing.retry_backoff * 2).min(self.cfg.sync_period.max(RETRY_MIN));
                self.stats.lock().unwrap().failing_since.get_or_insert(now);
                Step::Failed
            }
        }
    }

    /// One sync: incremental for the changed services unless a full one is due (`periodic`,
    /// the first, a change of the Node, or after a failure). Returns whether it was full.
    fn sync(&mut self, periodic: bool, now: Instant) -> Result<bool, SyncError> {
        let start = Instant::now();
        let cfg = &self.cfg;
        let last = self.last_desired.take();
        let last_node_version = self.last_node_version.clone();
        let taken = self.source.with_input(|input: SyncInput<'_>| {
            if let Some(why) = input.unavailable {
                return Err(why);
            }
            let node_version = input.node.and_then(|n| n.metadata.resource_version.clone());
            // The uplinks' addresses are read once a sync.
            let addresses = node_addresses(cfg, input.node);
            let info = node_info(cfg, input.node, &addresses);
            let node = NodeContext {
                nodeport_addresses: info.nodeport_addresses.clone(),
                addresses: addresses.clone(),
                primary_ip: addresses.iter().find(|a| a.is_ipv4()).copied(),
                pod_cidrs: pod_cidrs(input.node),
            };
            let full = periodic || last.is_none() || node_version != last_node_version || input.changed.is_none();
            let (desired, touched) = match (last, input.changed) {
                (Some(mut d), Some(changed)) if !full => {
                    let touched = d.recompute_services(input.objects, &info, &cfg.model, &changed);
                    (d, Some(touched))
                }
                _ => (model::compute(input.objects, &info, &cfg.model), None),
            };
            tracing::debug!(full, ms = start.elapsed().as_secs_f64() * 1e3, "desired state computed");
            Ok((desired, touched, node, node_version, input.errors, input.trigger_times))
        });
        let (desired, touched, node, node_version, source_errors, triggers) = match taken {
            Ok(t) => t,
            Err(why) => {
                self.stats.lock().unwrap().m.sync_failures_total.inc();
                return Err(SyncError::Source(why));
            }
        };
        let full = touched.is_none();
        let r = self.program(&desired, &node, touched.as_ref(), &source_errors, &triggers, start, now);
        // The changes were taken from the source: after a failure only a full sync knows what
        // is still to be written.
        self.last_desired = r.is_ok().then_some(desired);
        self.last_node_version = node_version;
        r.map(|_| full).map_err(SyncError::from)
    }

    /// Hands `desired` to the data plane and accounts for it: problems logged and sent as
    /// Events, health check servers, metrics.
    #[allow(clippy::too_many_arguments)]
    fn program(
        &mut self,
        desired: &DesiredState,
        node: &NodeContext,
        touched: Option<&BTreeSet<FrontendKey>>,
        source_errors: &[ObjectError],
        triggers: &[SystemTime],
        start: Instant,
        _now: Instant,
    ) -> Result<SyncStats, DataplaneError> {
        let problems: Vec<&ObjectError> = source_errors.iter().chain(desired.problems()).collect();
        for e in &problems {
            warn!(error = %e, "object or field not programmed");
        }
        if let Some(tx) = &self.events {
            // Each problem once while it lasts; again if it comes back after being fixed (the
            // desired state holds every Service's problems, also after an incremental sync).
            let now: BTreeSet<String> = problems.iter().map(|e| e.to_string()).collect();
            for e in problems.iter().filter(|e| !self.reported.contains(&e.to_string())) {
                let _ = tx.send((*e).clone());
            }
            self.reported = now;
        }
        let result = self.dataplane.sync(desired, node, touched);
        let elapsed = start.elapsed();
        let mut stats = self.stats.lock().unwrap();
        stats.m.syncs_total.inc();
        let st = match result {
            Ok(st) => st,
            Err(e) => {
                stats.m.sync_failures_total.inc();
                return Err(e);
            }
        };
        for e in &st.errors {
            warn!(error = %e, "frontend not programmed");
        }
        stats.m.write_errors_total.inc_by(st.errors.len() as u64);
        // A full map: an Event on the Service port (once while it lasts, however many of its
        // frontends met it) and a metric per frontend. A Service port's failed writes: the
        // same, with their own reason. Each backend left out for now (outlier ejection): an
        // Event of its own.
        if touched.is_none() {
            self.failing.clear();
        }
        let failing = model::errors::one_per_field(st.full.iter().map(|(map, service)| map_full_error(map, service)).chain(st.failed.iter().cloned()));
        self.failing.extend(failing.into_iter().map(|e| ((e.object.clone(), e.field.clone(), e.reason), e)));
        let full: Vec<ObjectError> = self.failing.values().cloned().chain(st.ejected.iter().cloned()).collect();
        for (map, _) in st.full.iter().chain(&st.fallback) {
            stats.m.map_full_total.with_label_values(&[map]).inc();
        }
        if let Some(tx) = &self.events {
            for e in full.iter().filter(|e| !self.reported_full.contains(&e.to_string())) {
                let _ = tx.send(e.clone());
            }
        }
        let now_full = full.iter().map(|e| e.to_string());
        if touched.is_none() {
            self.reported_full = now_full.collect();
        } else {
            self.reported_full.extend(now_full);
        }
        if let Some(seen) = self.snat_no_port_seen.replace(st.snat_no_port) {
            if st.snat_no_port > seen {
                let e = model::errors::snat_ports_exhausted(&self.cfg.node_name, st.snat_no_port - seen);
                warn!(error = %e, "masqueraded connections dropped");
                if let Some(tx) = &self.events {
                    let _ = tx.send(e);
                }
            }
        }
        if let Some(hc) = &mut self.health_checks {
            let failed = hc.update(&desired.health_checks);
            for e in &failed {
                warn!(error = %e, "health check server");
            }
            stats.m.write_errors_total.inc_by(failed.len() as u64);
        }
        let secs = elapsed.as_secs_f64();
        stats.m.sync_duration.observe(secs);
        if touched.is_none() { &stats.m.sync_full_duration } else { &stats.m.sync_partial_duration }.observe(secs);
        let now = SystemTime::now();
        stats.last_sync = Some(now);
        stats.m.last_sync_timestamp.set(unix_seconds(now));
        stats.m.rejected_objects.set(problems.len() as i64);
        let full_by_reason: Vec<&'static str> = full.iter().map(|e| e.reason).collect();
        stats.not_programmed = problems.iter().map(|e| (*e).clone()).chain(full).collect();
        for reason in crate::model::errors::REASONS {
            let n = problems.iter().filter(|p| p.reason == reason).count() + full_by_reason.iter().filter(|r| **r == reason).count();
            stats.m.not_programmed.with_label_values(&[reason]).set(n as i64);
        }
        for (i, policy) in ["internal", "external"].into_iter().enumerate() {
            stats.m.no_local_endpoints.with_label_values(&[policy]).set(desired.no_local_endpoints.values().filter(|p| p[i]).count() as i64);
        }
        for t in triggers {
            if let Ok(d) = now.duration_since(*t) {
                stats.m.network_programming.observe(d.as_secs_f64());
            }
        }
        info!(
            full = touched.is_none(),
            frontends = st.frontends,
            backends = st.backends,
            writes = st.writes,
            deletes = st.deletes,
            ms = elapsed.as_secs_f64() * 1e3,
            "synced"
        );
        Ok(st)
    }
}

/// A frontend ("namespace/name:port") that did not fit in `map`, as an Event's content.
fn map_full_error(map: &'static str, service: &str) -> ObjectError {
    model::errors::service_port_error(
        service,
        format!("not programmed on this node: map {map} is full (raise its capacity: docs/configuration.md); every other service is"),
        model::errors::MAP_FULL,
    )
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// The node's addresses, primary first: the given primary IP, the Node's InternalIPs then
/// ExternalIPs, the uplinks' addresses.
fn node_addresses(cfg: &LoopSettings, node: Option<&Node>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    let from_node = node.and_then(|n| n.status.as_ref()).and_then(|s| s.addresses.as_ref());
    let typed = |ty: &'static str| -> Vec<IpAddr> {
        from_node.into_iter().flatten().filter(|a| a.type_ == ty).filter_map(|a| node_field(&a.address, "status.addresses", "left out")).collect()
    };
    let uplinks: Vec<IpAddr> = cfg.uplinks.iter().flat_map(|u| netif::addresses(u)).collect();
    for a in cfg.primary_ip.into_iter().chain(typed("InternalIP")).chain(typed("ExternalIP")).chain(uplinks) {
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

fn node_info(cfg: &LoopSettings, node: Option<&Node>, addresses: &[IpAddr]) -> NodeInfo {
    let zone = node.and_then(|n| n.metadata.labels.as_ref()).and_then(|l| l.get(model::ZONE_LABEL)).cloned().or_else(|| cfg.node_zone.clone());
    let nodeport_addresses = cfg.node_port_addresses.select(addresses);
    NodeInfo { name: cfg.node_name.clone(), nodeport_addresses, zone }
}

/// The Node's pod CIDRs, one per family (detectLocalMode NodeCIDR).
fn pod_cidrs(node: Option<&Node>) -> Vec<IpNet> {
    node.and_then(|n| n.spec.as_ref())
        .and_then(|s| s.pod_cidrs.clone().or_else(|| s.pod_cidr.clone().map(|c| vec![c])))
        .map(|cidrs| cidrs.iter().filter_map(|c| node_field(c, "spec.podCIDRs", "left out (detectLocalMode NodeCIDR)")).collect())
        .unwrap_or_default()
}

/// A value of the Node's `field`, parsed; one that does not parse is logged with what
/// becomes of it, and left out.
fn node_field<T: std::str::FromStr>(text: &str, field: &'static str, consequence: &str) -> Option<T>
where
    T::Err: std::fmt::Display,
{
    text.parse().inspect_err(|e| warn!(field, value = %text, error = %e, "a Node field does not parse: {consequence}")).ok()
}

#[cfg(test)]
mod tests;
