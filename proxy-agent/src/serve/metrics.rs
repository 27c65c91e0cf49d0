//! Health and metrics, with kube-proxy's semantics and metric names where they exist, plus the
//! data path's own figures read from the maps at scrape time.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::SocketAddr,
    path::PathBuf,
    time::{Instant, SystemTime},
};

use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use proxy_common::user::{port_host, v4_addr, words_addr};
use tracing::error;

use crate::{
    dataplane::ebpf::{kernel::KernelMaps, maps::DatapathMaps, view},
    stats::{SharedStats, Stats},
};

fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs() as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil from days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[derive(Clone)]
struct App {
    stats: SharedStats,
    pin_dir: PathBuf,
}

async fn healthz(State(app): State<App>, livez: bool) -> impl IntoResponse {
    let st = app.stats.lock().unwrap();
    let healthy = st.healthy(Instant::now()) && (livez || st.node_eligible);
    let body = serde_json::json!({
        "lastUpdated": st.last_sync.map(rfc3339).unwrap_or_default(),
        "mode": st.mode,
        "currentTime": rfc3339(SystemTime::now()),
        "nodeEligible": st.node_eligible,
    });
    let code = if healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, [("content-type", "application/json")], body.to_string())
}

/// Prometheus text for the agent's and the data path's figures.
pub fn render(stats: &Stats, maps: Option<&dyn DatapathMaps>) -> String {
    let mut o = String::new();
    stats.sync_duration.render(&mut o, "kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds");
    stats.network_programming.render(&mut o, "kubeproxy_network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds");
    let gauge = |o: &mut String, name: &str, help: &str, kind: &str, v: f64| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    };
    let last = stats.last_sync.map(|t| t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64()).unwrap_or(0.0);
    gauge(&mut o, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced", "gauge", last);
    gauge(&mut o, "kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes", "gauge", stats.service_changes_pending as f64);
    gauge(&mut o, "kubeproxy_sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes", "counter", stats.service_changes_total as f64);
    gauge(
        &mut o,
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "Pending proxy rules Endpoint changes",
        "gauge",
        stats.endpoint_changes_pending as f64,
    );
    gauge(
        &mut o,
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "Cumulative proxy rules Endpoint changes",
        "counter",
        stats.endpoint_changes_total as f64,
    );
    gauge(&mut o, "kpr_syncs_total", "Syncs of the data plane, successful or not", "counter", stats.syncs_total as f64);
    gauge(&mut o, "kpr_sync_failures_total", "Syncs that failed (retried on the next change or period)", "counter", stats.sync_failures_total as f64);
    gauge(
        &mut o,
        "kpr_ipvs_terminating_destinations",
        "IPVS destinations at weight 0 waiting for their connections to end",
        "gauge",
        stats.ipvs_terminating as f64,
    );
    gauge(&mut o, "kpr_conntrack_gc_flows_total", "Flows deleted by the conntrack collector", "counter", stats.gc_flows_total as f64);
    gauge(&mut o, "kpr_rejected_objects", "Service and EndpointSlice fields skipped as invalid in the last sync", "gauge", stats.rejected_objects as f64);
    let Some(maps) = maps else { return o };
    if let Ok(counters) = view::counters(maps) {
        let _ = writeln!(o, "# HELP kpr_datapath_packets_total Packets by what the data path did with them\n# TYPE kpr_datapath_packets_total counter");
        for (k, v) in counters {
            let _ = writeln!(o, "kpr_datapath_packets_total{{reason=\"{k}\"}} {v}");
        }
    }
    let backends = maps.backends();
    let sizes = [
        (proxy_common::map_names::SERVICES, maps.services().map(|v| v.len()).ok()),
        (proxy_common::map_names::SLOTS, maps.slots().map(|v| v.len()).ok()),
        (proxy_common::map_names::BACKENDS, backends.as_ref().map(|v| v.len()).ok()),
        (proxy_common::map_names::AFFINITY, maps.affinity().map(|v| v.len()).ok()),
    ];
    let _ = writeln!(o, "# HELP kpr_map_entries Entries in each BPF map\n# TYPE kpr_map_entries gauge");
    for (name, n) in sizes {
        if let Some(n) = n {
            let _ = writeln!(o, "kpr_map_entries{{map=\"{name}\"}} {n}");
        }
    }
    if let Ok(backends) = backends {
        let _ = writeln!(o, "# HELP kpr_backend_new_connections_total New connections sent to each backend\n# TYPE kpr_backend_new_connections_total counter");
        for (id, b) in backends {
            if let Ok(n) = maps.backend_new_connections(id) {
                let _ = writeln!(o, "kpr_backend_new_connections_total{{backend=\"{}:{}\"}} {n}", words_addr(b.addr), port_host(b.port));
            }
        }
    }
    let mut per_backend: BTreeMap<String, u64> = BTreeMap::new();
    let _ = writeln!(o, "# HELP kpr_conntrack_flows Tracked flows, by table (embryonic: TCP before its handshake completed)\n# TYPE kpr_conntrack_flows gauge");
    for table in crate::dataplane::ebpf::maps::Table::ALL {
        let Ok(entries) = maps.conntrack().entries(table) else {
            continue;
        };
        let _ = writeln!(o, "kpr_map_entries{{map=\"{}\"}} {}", table.map_name(), entries.len());
        let flows = crate::dataplane::ebpf::conntrack::assemble(&entries);
        let mut n = 0;
        for (_, v) in flows.iter().filter_map(|f| f.forward.as_ref()) {
            *per_backend.entry(format!("{}:{}", v4_addr(v.new_daddr), port_host(v.new_dport))).or_default() += 1;
            n += 1;
        }
        let _ = writeln!(o, "kpr_conntrack_flows{{table=\"{}\"}} {n}", table.name());
    }
    let _ = writeln!(o, "# HELP kpr_backend_flows Tracked flows per backend (active and idle until collected)\n# TYPE kpr_backend_flows gauge");
    for (b, n) in per_backend {
        let _ = writeln!(o, "kpr_backend_flows{{backend=\"{b}\"}} {n}");
    }
    o
}

type LevelHook = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;
static LOG_LEVEL: std::sync::OnceLock<LevelHook> = std::sync::OnceLock::new();

/// Installs how `PUT /debug/flags/v` changes the log level (the binary owns the subscriber).
pub fn set_log_level_hook(hook: LevelHook) {
    let _ = LOG_LEVEL.set(hook);
}

/// kube-proxy's `PUT /debug/flags/v` with a klog verbosity: up to 2 is info, 3 and 4 debug, 5
/// and more trace. A filter directive (e.g. `proxy_agent=debug`) is accepted too.
pub fn verbosity_to_filter(body: &str) -> String {
    match body.trim().parse::<u32>() {
        Ok(v) if v <= 2 => "info".into(),
        Ok(v) if v <= 4 => "debug".into(),
        Ok(_) => "trace".into(),
        Err(_) => body.trim().to_string(),
    }
}

async fn set_verbosity(body: String) -> impl IntoResponse {
    let filter = verbosity_to_filter(&body);
    match LOG_LEVEL.get().map(|h| h(&filter)) {
        Some(Ok(())) => (StatusCode::OK, format!("log filter set to {filter}\n")),
        Some(Err(e)) => (StatusCode::BAD_REQUEST, format!("{e}\n")),
        None => (StatusCode::SERVICE_UNAVAILABLE, "logging is not reloadable in this process\n".to_string()),
    }
}

async fn metrics(State(app): State<App>) -> impl IntoResponse {
    let maps = KernelMaps::open(&app.pin_dir).ok();
    let st = app.stats.lock().unwrap();
    let body = render(&st, maps.as_ref().map(|m| m as &dyn DatapathMaps));
    ([("content-type", "text/plain; version=0.0.4")], body)
}

#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} for {what}: {err} (is another kube-proxy or kpr running? set --{flag})")]
pub struct BindError {
    pub addr: SocketAddr,
    pub what: &'static str,
    pub flag: &'static str,
    pub err: std::io::Error,
}

/// Binds the health and metrics listeners now (so a port in use is a start-up error) and
/// serves them on the current runtime.
pub async fn serve(healthz_addr: Option<SocketAddr>, metrics_addr: Option<SocketAddr>, stats: SharedStats, pin_dir: PathBuf) -> Result<(), BindError> {
    let app = App { stats, pin_dir };
    if let Some(addr) = healthz_addr {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|err| BindError { addr, what: "/healthz", flag: "healthz-bind-address", err })?;
        let r = Router::new().route("/healthz", get(|s| healthz(s, false))).route("/livez", get(|s| healthz(s, true))).with_state(app.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, r).await {
                error!(error = %e, "health server stopped");
            }
        });
    }
    if let Some(addr) = metrics_addr {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|err| BindError { addr, what: "/metrics", flag: "metrics-bind-address", err })?;
        let r = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|s| healthz(s, false)))
            .route("/debug/flags/v", axum::routing::put(set_verbosity))
            .with_state(app);
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, r).await {
                error!(error = %e, "metrics server stopped");
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn verbosity_maps_like_klog() {
        assert_eq!(verbosity_to_filter("2"), "info");
        assert_eq!(verbosity_to_filter("4\n"), "debug");
        assert_eq!(verbosity_to_filter("9"), "trace");
        assert_eq!(verbosity_to_filter("proxy_agent=debug"), "proxy_agent=debug");
    }

    #[test]
    fn health_follows_pending_changes() {
        let mut s = Stats::new(Duration::from_secs(60));
        let now = Instant::now();
        assert!(s.healthy(now));
        s.pending_since = Some(now);
        assert!(s.healthy(now + Duration::from_secs(30)));
        assert!(!s.healthy(now + Duration::from_secs(61)));
        // Failing syncs with nothing pending: unhealthy after the same timeout.
        s.pending_since = None;
        s.failing_since = Some(now);
        assert!(s.healthy(now + Duration::from_secs(30)));
        assert!(!s.healthy(now + Duration::from_secs(61)));
    }

    #[test]
    fn renders_kube_proxy_names() {
        let mut s = Stats::new(Duration::from_secs(60));
        s.sync_duration.observe(0.003);
        s.last_sync = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        let text = render(&s, Some(&crate::dataplane::ebpf::maps::FakeMaps::default()));
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.002\"} 0"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds 1700000000"));
        assert!(text.contains("kpr_datapath_packets_total{reason=\"new_flow\"} 0"));
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(1_709_210_096)), "2024-02-29T12:34:56Z");
    }
}
