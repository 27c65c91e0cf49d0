//! A pinned map keeps its capacity across restarts: `capacity_mismatches` names the maps whose
//! new capacity a restart cannot apply, and leaves out a larger map that allocates per entry
//! (BPF_F_NO_PREALLOC: it costs nothing), such as the services map of earlier releases.
use kpr_lab::PinDir;
use proxy_agent::{
    dataplane::ebpf::kernel::{capacity_mismatches, Datapath},
    settings::Capacities,
};
use proxy_common::map_names;

fn caps(services: u32) -> Capacities {
    Capacities { services, backends: 64, slots: 64, conntrack: 64, conntrack_new: 64, affinity: 64 }
}

#[test]
fn a_larger_per_entry_map_is_no_mismatch_a_smaller_or_preallocated_one_is() {
    let pins = PinDir::new("mapcap");
    let dp = Datapath::load_object(pins.path(), caps(64)).expect("load the object");
    drop(dp);
    assert!(capacity_mismatches(pins.path(), &caps(64)).is_empty());
    // Fewer services asked: the services map (per entry) may stay larger; the round-robin
    // cursors (a preallocated array) keep memory the settings no longer want.
    let names = |c| capacity_mismatches(pins.path(), &c).into_iter().map(|(name, _, _)| name).collect::<Vec<_>>();
    assert_eq!(names(caps(32)), [map_names::RR_STATE]);
    // More asked: neither can grow in place.
    assert_eq!(names(caps(128)), [map_names::SERVICES, map_names::RR_STATE]);
}
