//! Netlink families shared by the modes.
pub mod attrs;
pub mod ctnetlink;
pub mod rtnl;
pub mod sockdiag;
pub mod socket;
