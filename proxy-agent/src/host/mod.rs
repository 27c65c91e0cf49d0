//! The node's kernel interfaces other than netlink: interfaces, sysctls.
pub mod netif;
pub mod sysctl;
