//! IPVS mode: the IPVS netlink client, its sync, kube-proxy's sets (as BPF maps) and fixed
//! netfilter rules, the `ipvsadm`-like view, and the drain of the fast path after a switch
//! from the eBPF mode.
pub mod client;
pub mod desired;
pub mod drain;
pub mod plane;
pub mod rules;
pub mod sets;
pub mod sync;
pub mod view;
