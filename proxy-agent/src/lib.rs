//! kpr, a kube-proxy replacement: the node agent's library (the `kpr` binary is a thin CLI).
//!
//! Where a change goes:
//! - `source/`: where Services, EndpointSlices and the Node come from (the Kubernetes API, a
//!   manifest directory);
//! - `model/`: what they mean, as data-plane-neutral frontends and backends;
//! - `dataplane/`: one folder per mode (`ebpf/`, `ipvs/`) behind the `Dataplane` trait;
//! - `netlink/`: the kernel's netlink families the modes share (rtnetlink, ctnetlink, sock_diag);
//! - `host/`: the node's other kernel interfaces (interfaces, sysctls, netfilter);
//! - `serve/`: what the agent serves (metrics, health, healthCheckNodePorts);
//! - `settings/`: flags, kube-proxy's configuration file and their precedence;
//! - `stats.rs`: the figures the loop and the data planes keep for metrics and health;
//! - `agent.rs`: the loop that ties a source to a data plane;
//! - `limiter.rs`: the token bucket that paces its syncs and its writes to the API.
pub mod agent;
pub mod dataplane;
pub mod host;
pub mod limiter;
pub mod migration;
pub mod model;
pub mod netlink;
pub mod serve;
pub mod settings;
pub mod source;
pub mod stats;

/// Set by SIGTERM/SIGINT: the loop and the collector stop; programs and maps stay.
pub static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
