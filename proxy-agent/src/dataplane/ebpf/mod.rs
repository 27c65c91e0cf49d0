//! eBPF mode: the fast path's object (`kernel`: loader, pins, links), its maps behind one
//! seam (`maps`, with a fake; `bulk` writes a large sync's puts in batches), their sync by difference, the `Dataplane` (`plane`), the
//! views of `kpr services`/`conntrack`, and the collectors (conntrack, with what its passes observe; IPv6's embryonic table; affinity; endpoints).
pub mod affinity_gc;
pub mod bpf_batch;
mod bulk;
mod collector;
pub mod conntrack;
pub mod conntrack6;
pub mod endpoint_cleanup;
pub mod hint;
pub mod ids;
pub mod interfaces;
pub mod kernel;
pub mod kernel_maps;
pub mod maglev;
pub mod maps;
pub mod masquerade6;
pub mod observations;
pub mod outlier;
pub mod plane;
pub mod sync;
pub mod view;
pub mod wire;
