//! Pinned maps across restarts and upgrades. A pinned map keeps its capacity: `capacity_mismatches`
//! names the maps whose new capacity a restart cannot apply, and leaves out a larger map that
//! allocates per entry (BPF_F_NO_PREALLOC: it costs nothing), such as the services map of earlier
//! releases. A map whose layout changed moves its entries into its successor where they must
//! keep their meaning (backend ids).
use kpr_lab::PinDir;
use proxy_agent::{
    dataplane::ebpf::{
        kernel::{backend_id_limit, capacity_mismatches, Datapath},
        kernel_maps::KernelMaps,
        maps::DatapathMaps,
    },
    settings::Capacities,
};
use proxy_common::{map_names, Backend};

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

#[test]
fn backend_ids_stay_below_the_smallest_map_indexed_by_them() {
    let pins = PinDir::new("beidlim");
    let with_backends = |backends| Capacities { backends, ..caps(64) };
    drop(Datapath::load_object(pins.path(), with_backends(64)).expect("load the object"));
    assert_eq!(backend_id_limit(pins.path(), 32), 32, "fewer asked than pinned");
    assert_eq!(backend_id_limit(pins.path(), 128), 64, "more asked than pinned");
    // As an upgrade that brings a new backend map leaves it: the array made at the new size,
    // the per-backend counters pinned at the old one.
    std::fs::remove_file(pins.path().join(map_names::BACKENDS)).unwrap();
    drop(Datapath::load_object(pins.path(), with_backends(128)).expect("load the object again"));
    let info = aya::maps::MapInfo::from_pin(pins.path().join(map_names::BACKENDS)).unwrap();
    assert_eq!(info.max_entries(), 128);
    assert_eq!(backend_id_limit(pins.path(), 128), 64, "the counters' 64 ids bound the ids");
}

/// One bpf(2) call with a zero-padded attribute.
fn bpf(cmd: libc::c_long, attr: &[u64]) -> i64 {
    let mut buf = [0u64; 16];
    buf[..attr.len()].copy_from_slice(attr);
    unsafe { libc::syscall(libc::SYS_bpf, cmd, buf.as_mut_ptr(), std::mem::size_of_val(&buf)) }
}

/// Pins a hash map of backends by id, as releases before KPR_BE_V3 did (KPR_BE_V2).
fn pin_backend_hash(path: &std::path::Path, entries: &[(u32, Backend)]) {
    const MAP_CREATE: libc::c_long = 0;
    const MAP_UPDATE_ELEM: libc::c_long = 2;
    const OBJ_PIN: libc::c_long = 6;
    const HASH: u64 = 1;
    const NO_PREALLOC: u64 = 1;
    // map_type, key_size | value_size << 32, max_entries | map_flags << 32.
    let fd = bpf(MAP_CREATE, &[HASH | (4 << 32), 20 | (64 << 32), NO_PREALLOC]);
    assert!(fd >= 0, "create a hash map: {}", std::io::Error::last_os_error());
    for (id, b) in entries {
        let r = bpf(MAP_UPDATE_ELEM, &[fd as u64, id as *const u32 as u64, b as *const Backend as u64, 0]);
        assert_eq!(r, 0, "insert backend {id}: {}", std::io::Error::last_os_error());
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(bpf(OBJ_PIN, &[c.as_ptr() as u64, fd as u64]), 0, "pin {path:?}: {}", std::io::Error::last_os_error());
    unsafe { libc::close(fd as i32) };
}

#[test]
fn an_earlier_backend_hash_map_moves_into_the_array_with_its_ids() {
    let pins = PinDir::new("be-v2");
    std::fs::create_dir_all(pins.path()).unwrap();
    let web = Backend::new("10.244.1.7".parse().unwrap(), 8080, proxy_common::PROTO_TCP);
    let dns = Backend::new("fd00:244::53".parse().unwrap(), 53, proxy_common::PROTO_UDP);
    let past_capacity = Backend::new("10.244.1.9".parse().unwrap(), 80, proxy_common::PROTO_TCP);
    let v2 = pins.path().join(map_names::BACKENDS_V2);
    pin_backend_hash(&v2, &[(7, web), (63, dns), (64, past_capacity)]);

    let dp = Datapath::load_object(pins.path(), caps(64)).expect("load the object");
    assert!(!v2.exists(), "the earlier map's pin is removed");
    let maps = KernelMaps::open(pins.path()).unwrap();
    let mut held = maps.backends().unwrap();
    held.sort();
    assert_eq!(held, vec![(7, web), (63, dns)], "the backends keep their ids; an id past the array's capacity stays behind");

    // Deletes are idempotent, past the array too; a put past it is a full map.
    let mut maps = maps;
    maps.del_backend(7).unwrap();
    maps.del_backend(7).unwrap();
    maps.del_backend(1_000).unwrap();
    assert_eq!(maps.put_backend(1_000, web).unwrap_err().full_map(), Some(map_names::BACKENDS));
    // A restart finds the array pinned and no earlier map: nothing is carried over again.
    drop((dp, maps));
    let dp = Datapath::load_object(pins.path(), caps(64)).expect("load again");
    assert_eq!(KernelMaps::open(pins.path()).unwrap().backends().unwrap(), vec![(63, dns)]);

    // A rollback: an older release made its own KPR_BE_V2 and gave the backends new ids. The
    // next upgrade takes those, not what the first one left in KPR_BE_V3.
    drop(dp);
    pin_backend_hash(&v2, &[(5, web)]);
    let _dp = Datapath::load_object(pins.path(), caps(64)).expect("load after a rollback");
    assert!(!v2.exists());
    assert_eq!(KernelMaps::open(pins.path()).unwrap().backends().unwrap(), vec![(5, web)], "the rollback's ids, none of the stale array's");
}
