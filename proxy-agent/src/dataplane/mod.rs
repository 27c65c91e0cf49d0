//! The data planes: one folder per mode.
pub mod ebpf;
pub mod ipvs;
