//! The node's kernel interfaces other than netlink: interfaces, sysctls, netfilter.
pub mod netfilter;
pub mod netif;
pub mod sysctl;
