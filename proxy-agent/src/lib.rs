//! kpr, a kube-proxy replacement: the node agent's library (the `kpr` binary is a thin CLI).
pub mod agent;
pub mod config;
pub mod healthcheck;
pub mod kernel;
pub mod kube_source;
pub mod kubeproxy_cleanup;
pub mod maglev;
pub mod manifests;
pub mod maps;
pub mod metrics;
pub mod model;
pub mod netif;
pub mod sync;
pub mod sysctl;
pub mod view;
