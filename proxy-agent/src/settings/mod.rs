//! The agent's settings: flags, kube-proxy's configuration file, defaults.
pub mod kube_proxy;
