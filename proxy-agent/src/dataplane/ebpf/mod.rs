//! eBPF mode: the fast path's object, its pinned maps and links, their sync, views and
//! collectors.
pub mod affinity_gc;
pub mod bpf_batch;
pub mod conntrack;
pub mod endpoint_cleanup;
pub mod kernel;
pub mod maglev;
pub mod maps;
pub mod sync;
pub mod view;
