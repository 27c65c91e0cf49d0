//! healthCheckNodePort servers for externalTrafficPolicy Local services, answering as
//! kube-proxy's do: 200 with the local endpoint count when there are local endpoints and the
//! agent is healthy (its syncs keep up), 503 otherwise, so external load balancers only send to
//! nodes that have the pods and a working proxy.
use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
};

use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use tokio::{runtime::Handle, task::JoinHandle};

type Table = Arc<Mutex<BTreeMap<u16, (String, String, usize)>>>;
/// Whether the agent is healthy now (metrics::Stats::healthy).
pub type Healthy = Arc<dyn Fn() -> bool + Send + Sync>;

pub struct HealthChecks {
    handle: Handle,
    table: Table,
    healthy: Healthy,
    servers: HashMap<u16, JoinHandle<()>>,
}

async fn answer(State((table, healthy, port)): State<(Table, Healthy, u16)>) -> impl IntoResponse {
    let entry = table.lock().unwrap().get(&port).cloned();
    let (ns, name, n) = entry.unwrap_or_default();
    let proxy_healthy = healthy();
    let body = serde_json::json!({
        "service": {"namespace": ns, "name": name},
        "localEndpoints": n,
        "serviceProxyHealthy": proxy_healthy,
    });
    let code = if n > 0 && proxy_healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, [("content-type", "application/json"), ("x-content-type-options", "nosniff")], body.to_string())
}

impl HealthChecks {
    pub fn new(handle: Handle, healthy: Healthy) -> Self {
        Self { handle, table: Arc::default(), healthy, servers: HashMap::new() }
    }

    pub fn ports(&self) -> Vec<u16> {
        let mut p: Vec<u16> = self.servers.keys().copied().collect();
        p.sort();
        p
    }

    /// Serves exactly `wanted`; returns one message per port that could not be bound.
    pub fn update(&mut self, wanted: &BTreeMap<u16, (String, String, usize)>) -> Vec<String> {
        *self.table.lock().unwrap() = wanted.clone();
        let mut errors = Vec::new();
        self.servers.retain(|port, task| {
            let keep = wanted.contains_key(port);
            if !keep {
                task.abort();
            }
            keep
        });
        for (port, (ns, name, _)) in wanted {
            if self.servers.contains_key(port) {
                continue;
            }
            let listener = match std::net::TcpListener::bind(("0.0.0.0", *port)).and_then(|l| l.set_nonblocking(true).map(|_| l)) {
                Ok(l) => l,
                Err(e) => {
                    errors.push(format!("Service {ns}/{name}: spec.healthCheckNodePort {port}: cannot listen: {e} (port in use?)"));
                    continue;
                }
            };
            let app = Router::new().fallback(get(answer)).with_state((self.table.clone(), self.healthy.clone(), *port));
            let _guard = self.handle.enter();
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    errors.push(format!("Service {ns}/{name}: spec.healthCheckNodePort {port}: cannot serve: {e}"));
                    continue;
                }
            };
            let port = *port;
            self.servers.insert(
                port,
                self.handle.spawn(async move {
                    if let Err(e) = axum::serve(listener, app).await {
                        tracing::warn!(port, error = %e, "health check server stopped");
                    }
                }),
            );
        }
        errors
    }
}
