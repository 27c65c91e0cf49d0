//! What the agent serves: /metrics, /healthz, /livez, and the healthCheckNodePorts.
pub mod healthcheck;
pub mod metrics;
