//! IPVS mode: the IPVS netlink client, its sync, kube-proxy's sets (as BPF maps) and fixed
//! netfilter rules, and the `ipvsadm`-like view.
pub mod client;
pub mod desired;
pub mod plane;
pub mod rules;
pub mod sets;
pub mod sync;
pub mod view;
