//! Health and metrics, with kube-proxy's semantics and metric names where they exist, plus the
//! data path's own figures read from the maps at scrape time.
use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Instant, SystemTime},
};

use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use proxy_common::user::{port_host, v4_addr, words_addr};
use tracing::error;

use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::{
    dataplane::ebpf::{kernel, kernel_maps::KernelMaps, maps::DatapathMaps, view},
    stats::{SharedStats, Stats},
};

#[derive(Clone)]
struct App {
    stats: SharedStats,
    pin_dir: PathBuf,
}

async fn healthz(State(app): State<App>, livez: bool) -> impl IntoResponse {
    let st = app.stats.lock().unwrap();
    let healthy = st.healthy(Instant::now()) && (livez || st.node_eligible);
    let rfc3339 = |t: SystemTime| humantime::format_rfc3339_seconds(t).to_string();
    let mut body = serde_json::json!({
        "lastUpdated": st.last_sync.map(rfc3339).unwrap_or_default(),
        "currentTime": rfc3339(SystemTime::now()),
        "mode": st.mode,
    });
    if !livez {
        body["nodeEligible"] = serde_json::json!(st.node_eligible);
    }
    let code = if healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let counter = if livez { &st.m.livez_total } else { &st.m.healthz_total };
    counter.with_label_values(&[code.as_str()]).inc();
    (code, [("content-type", "application/json")], body.to_string())
}

/// What the last sync could not program (kpr's own): a JSON list of {object, field, reason,
/// message}, what `kpr services` shows as skipped.
pub const NOT_PROGRAMMED_PATH: &str = "/notProgrammed";

async fn not_programmed(State(app): State<App>) -> impl IntoResponse {
    let list: Vec<serde_json::Value> = app
        .stats
        .lock()
        .unwrap()
        .not_programmed
        .iter()
        .map(|e| serde_json::json!({"object": e.object, "field": e.field, "reason": e.reason, "message": e.message}))
        .collect();
    ([("content-type", "application/json")], serde_json::Value::from(list).to_string())
}

/// kube-proxy's /proxyMode: the mode's name, as text.
async fn proxy_mode(State(app): State<App>) -> impl IntoResponse {
    let mode = app.stats.lock().unwrap().mode;
    ([("content-type", "text/plain")], mode.to_string())
}

/// The data path's figures, read from the maps now: packets by what the programs did, map fill
/// and capacity, flows per table and backend, new connections per backend.
pub fn datapath_families(maps: &dyn DatapathMaps, capacities: &[(&'static str, u32)]) -> Vec<prometheus::proto::MetricFamily> {
    let r = Registry::new();
    let vec_counter = |name: &str, help: &str, label: &str| {
        let v = IntCounterVec::new(Opts::new(name, help), &[label]).unwrap();
        r.register(Box::new(v.clone())).unwrap();
        v
    };
    let vec_gauge = |name: &str, help: &str, label: &str| {
        let v = IntGaugeVec::new(Opts::new(name, help), &[label]).unwrap();
        r.register(Box::new(v.clone())).unwrap();
        v
    };
    let packets = vec_counter("kpr_datapath_packets_total", "Packets by what the data path did with them", "reason");
    if let Ok(counters) = view::counters(maps) {
        for (k, v) in counters {
            packets.with_label_values(&[k]).inc_by(v);
        }
    }
    let entries = vec_gauge("kpr_map_entries", "Entries in each BPF map", "map");
    let capacity = vec_gauge("kpr_map_capacity", "Entries each BPF map can hold (its max_entries)", "map");
    for (name, n) in capacities {
        capacity.with_label_values(&[name]).set(i64::from(*n));
    }
    let backends = maps.backends();
    for (name, n) in [
        (proxy_common::map_names::SERVICES, maps.services().map(|v| v.len()).ok()),
        (proxy_common::map_names::SLOTS, maps.slots().map(|v| v.len()).ok()),
        (proxy_common::map_names::BACKENDS, backends.as_ref().map(|v| v.len()).ok()),
        (proxy_common::map_names::AFFINITY, maps.affinity().map(|v| v.len()).ok()),
    ] {
        if let Some(n) = n {
            entries.with_label_values(&[name]).set(n as i64);
        }
    }
    let new_connections = vec_counter("kpr_backend_new_connections_total", "New connections sent to each backend", "backend");
    if let Ok(backends) = &backends {
        for (id, b) in backends {
            if let Ok(n) = maps.backend_new_connections(*id) {
                new_connections.with_label_values(&[&std::net::SocketAddr::new(words_addr(b.addr), port_host(b.port)).to_string()]).inc_by(n);
            }
        }
    }
    let flows = vec_gauge(
        "kpr_conntrack_flows",
        "Tracked flows, by table (embryonic: not yet assured, TCP before its handshake completed, UDP before its client sent after an answer)",
        "table",
    );
    let per_backend = vec_gauge("kpr_backend_flows", "Tracked flows per backend (active and idle until collected)", "backend");
    for table in crate::dataplane::ebpf::maps::Table::ALL {
        let Ok(list) = maps.conntrack().entries(table) else { continue };
        entries.with_label_values(&[table.map_name()]).set(list.len() as i64);
        let assembled = crate::dataplane::ebpf::conntrack::assemble(&list);
        let mut n = 0;
        for (_, v) in assembled.iter().filter_map(|f| f.forward.as_ref()) {
            per_backend.with_label_values(&[&format!("{}:{}", v4_addr(v.new_daddr), port_host(v.new_dport))]).inc();
            n += 1;
        }
        flows.with_label_values(&[table.name()]).set(n);
    }
    r.gather()
}

/// Prometheus text: the agent's registry (kube-proxy's metrics, kpr's, the process's) and the
/// data path's figures.
pub fn render(stats: &Stats, maps: Option<&dyn DatapathMaps>, capacities: &[(&'static str, u32)]) -> String {
    let mut families = stats.m.registry.gather();
    if let Some(maps) = maps {
        families.extend(datapath_families(maps, capacities));
    }
    let mut buf = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&families, &mut buf) {
        error!(error = %e, "encoding metrics");
    }
    String::from_utf8(buf).unwrap_or_default()
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
    let capacities = kernel::map_capacities(&app.pin_dir);
    let st = app.stats.lock().unwrap();
    let body = render(&st, maps.as_ref().map(|m| m as &dyn DatapathMaps), &capacities);
    ([("content-type", prometheus::TEXT_FORMAT)], body)
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
/// The debug handlers only where `debug` (kube-proxy's enableProfiling).
pub async fn serve(healthz_addr: Option<SocketAddr>, metrics_addr: Option<SocketAddr>, debug: bool, stats: SharedStats, pin_dir: PathBuf) -> Result<(), BindError> {
    let app = App { stats, pin_dir };
    if let Some(addr) = healthz_addr {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|err| BindError { addr, what: "/healthz", flag: "healthz-bind-address", err })?;
        let r = Router::new()
            .route("/healthz", get(|s| healthz(s, false)))
            .route("/livez", get(|s| healthz(s, true)))
            .route(NOT_PROGRAMMED_PATH, get(not_programmed))
            .with_state(app.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, r).await {
                error!(error = %e, "health server stopped");
            }
        });
    }
    if let Some(addr) = metrics_addr {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|err| BindError { addr, what: "/metrics", flag: "metrics-bind-address", err })?;
        let mut r = Router::new()
            .route("/metrics", get(metrics))
            .route("/proxyMode", get(proxy_mode))
            .route(NOT_PROGRAMMED_PATH, get(not_programmed))
            .route("/healthz", get(|s| healthz(s, false)));
        if debug {
            r = r.route("/debug/flags/v", axum::routing::put(set_verbosity));
        }
        let r = r.with_state(app);
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
    fn renders_kube_proxy_names_types_and_buckets() {
        let s = Stats::new(Duration::from_secs(60));
        s.m.sync_duration.observe(0.003);
        s.m.last_sync_timestamp.set(1_700_000_000.0);
        s.m.network_programming.observe(0.3);
        let text = render(&s, Some(&crate::dataplane::ebpf::maps::FakeMaps::default()), &[("KPR_SVC_V2", 42)]);
        for line in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.002\"} 0",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds 1700000000",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.5\"} 1",
            "# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter",
            "# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_sync_partial_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds gauge",
            "kpr_datapath_packets_total{reason=\"new_flow\"} 0",
            "kpr_map_capacity{map=\"KPR_SVC_V2\"} 42",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
        assert!(text.contains("process_cpu_seconds_total"), "process metrics");
    }
}
