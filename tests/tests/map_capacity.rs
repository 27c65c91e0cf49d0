//! Pinned maps across restarts and upgrades. A pinned map keeps its capacity: `capacity_mismatches`
//! names the maps whose new capacity a restart cannot apply, and leaves out a larger map that
//! allocates per entry (BPF_F_NO_PREALLOC: it costs nothing), such as the services map of earlier
//! releases. A map whose layout changed moves its entries into its successor where they must
//! keep their meaning (backend ids).
use kpr_lab::PinDir;
use proxy_agent::{
    dataplane::ebpf::{
        kernel::{backend_id_limit, capacity_mismatches, small_lru_maps, Datapath},
        kernel_maps::KernelMaps,
        maps::DatapathMaps,
    },
    settings::Capacities,
};
use proxy_common::{map_names, Backend};

fn caps(services: u32) -> Capacities {
    Capacities { services, backends: 64, slots: 64, conntrack: 64, conntrack_new: 64, conntrack6: 64, conntrack6_new: 64, affinity: 64 }
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

/// The warning for LRU maps too small for the CPUs reads the kernel's map types: the LRU tables
/// are named, the hashes and arrays are not, whatever their size.
#[test]
fn small_lru_maps_are_the_lru_tables_too_small_for_the_cpus() {
    let pins = PinDir::new("smalllru");
    drop(Datapath::load_object(pins.path(), caps(64)).expect("load the object"));
    let small = small_lru_maps(pins.path(), 2);
    assert_eq!(small, [(map_names::CONNTRACK, 64, 0), (map_names::CONNTRACK6, 64, 0), (map_names::AFFINITY, 64, 0)], "the LRU hashes among the sized maps");
    assert!(small_lru_maps(pins.path(), 0).is_empty(), "no CPU holds anything");
}

#[test]
fn the_ipv6_conntrack_tables_take_their_capacities_from_the_settings() {
    let pins = PinDir::new("ct6cap");
    let sized = Capacities { conntrack6: 256, conntrack6_new: 128, ..caps(64) };
    drop(Datapath::load_object(pins.path(), sized).expect("load the object"));
    // The embryonic table holds buckets of four.
    for (name, want) in [(map_names::CONNTRACK6, 256), (map_names::CONNTRACK6_NEW, proxy_common::ct_buckets(128))] {
        assert_eq!(aya::maps::MapInfo::from_pin(pins.path().join(name)).unwrap().max_entries(), want, "{name}");
    }
    // Preallocated (an LRU, a hash): a pinned table keeps its size, and says so.
    let names = capacity_mismatches(pins.path(), &Capacities { conntrack6: 512, ..sized }).into_iter().map(|(name, _, _)| name).collect::<Vec<_>>();
    assert_eq!(names, [map_names::CONNTRACK6]);
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
fn bpf(cmd: libc::c_long, attr: &[u64]) -> std::io::Result<i64> {
    let mut buf = [0u64; 16];
    buf[..attr.len()].copy_from_slice(attr);
    proxy_agent::dataplane::ebpf::bpf_batch::bpf(cmd, &mut buf)
}

/// Creates and pins a map as an earlier release did: `map_type`, `flags`, these entries.
fn pin_map<K: Copy, V: Copy>(path: &std::path::Path, map_type: u64, flags: u64, max_entries: u64, entries: &[(K, V)]) {
    const MAP_CREATE: libc::c_long = 0;
    const MAP_UPDATE_ELEM: libc::c_long = 2;
    const OBJ_PIN: libc::c_long = 6;
    let (k, v) = (std::mem::size_of::<K>() as u64, std::mem::size_of::<V>() as u64);
    // map_type, key_size | value_size << 32, max_entries | map_flags << 32.
    let fd = bpf(MAP_CREATE, &[map_type | (k << 32), v | (max_entries << 32), flags]).unwrap_or_else(|e| panic!("create a map of type {map_type}: {e}"));
    for (key, value) in entries {
        bpf(MAP_UPDATE_ELEM, &[fd as u64, key as *const K as u64, value as *const V as u64, 0]).unwrap_or_else(|e| panic!("insert into {path:?}: {e}"));
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    bpf(OBJ_PIN, &[c.as_ptr() as u64, fd as u64]).unwrap_or_else(|e| panic!("pin {path:?}: {e}"));
    unsafe { libc::close(fd as i32) };
}

/// Pins a hash map of backends by id, as releases before KPR_BE_V3 did (KPR_BE_V2): it
/// allocates per entry.
fn pin_backend_hash(path: &std::path::Path, entries: &[(u32, Backend)]) {
    const HASH: u64 = 1;
    const NO_PREALLOC: u64 = 1;
    pin_map(path, HASH, NO_PREALLOC, 64, entries);
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

#[test]
fn an_earlier_embryonic_lru_moves_into_the_new_table() {
    use proxy_agent::dataplane::ebpf::{
        kernel_maps::KernelConntrack,
        maps::{ConntrackTables, Table},
    };
    use proxy_common::{CtKey, CtValue, CT_DIR_EGRESS, CT_DIR_INGRESS, CT_F_REPLY, PROTO_TCP};
    const LRU_HASH: u64 = 9;
    let pins = PinDir::new("ct-new-v1");
    std::fs::create_dir_all(pins.path()).unwrap();
    // A handshake under way at the upgrade: its forward and reverse-DNAT entries.
    let (client, vip, backend) = ([10, 244, 0, 5], [10, 96, 0, 10], [10, 244, 1, 7]);
    let fwd = CtKey {
        saddr: u32::from_ne_bytes(client),
        daddr: u32::from_ne_bytes(vip),
        sport: 40000u16.to_be(),
        dport: 80u16.to_be(),
        proto: PROTO_TCP,
        dir: CT_DIR_INGRESS,
        _pad: 0,
    };
    let fwd_v = CtValue {
        new_saddr: fwd.saddr,
        new_daddr: u32::from_ne_bytes(backend),
        new_sport: fwd.sport,
        new_dport: 8080u16.to_be(),
        backend_id: 3,
        ..CtValue::default()
    };
    let reply = CtKey::reversed_of(&fwd_v, PROTO_TCP, CT_DIR_EGRESS);
    let reply_v = CtValue {
        new_saddr: fwd.daddr,
        new_daddr: fwd.saddr,
        new_sport: fwd.dport,
        new_dport: fwd.sport,
        backend_id: 3,
        flags: CT_F_REPLY,
        ..CtValue::default()
    };
    let v1 = pins.path().join(map_names::CONNTRACK_NEW_V1);
    pin_map(&v1, LRU_HASH, 0, 64, &[(fwd, fwd_v), (reply, reply_v)]);

    let dp = Datapath::load_object(pins.path(), caps(64)).expect("load the object");
    assert!(!v1.exists(), "the earlier table's pin is removed");
    let ct = KernelConntrack::open(pins.path()).unwrap();
    let (mut held, _) = ct.read_batch(Table::Embryonic, None, 1024).unwrap();
    held.sort_by_key(|(k, _)| *k);
    let mut want = vec![(fwd, fwd_v), (reply, reply_v)];
    want.sort_by_key(|(k, _)| *k);
    assert_eq!(held, want, "the handshake's entries are in the new embryonic table");
    // A restart finds no earlier table: nothing is carried again, and the entries stay.
    drop((dp, ct));
    let _dp = Datapath::load_object(pins.path(), caps(64)).expect("load again");
    assert_eq!(KernelConntrack::open(pins.path()).unwrap().read_batch(Table::Embryonic, None, 1024).unwrap().0.len(), 2);
}

/// The same for IPv6's embryonic tables (KPR_CT6_NEW_V1, an LRU, and V2, a hash), which became
/// buckets too.
#[test]
fn an_earlier_ipv6_embryonic_table_moves_into_the_new_one() {
    use proxy_agent::dataplane::ebpf::{conntrack6::Embryonic6, kernel_maps::KernelEmbryonic6};
    use proxy_common::{CtKey6, CtValue6, CT_DIR_EGRESS, CT_DIR_INGRESS, CT_F_REPLY, PROTO_TCP};
    const LRU_HASH: u64 = 9;
    const HASH: u64 = 1;
    let (client, frontend, backend) = ([0x0120_0db8, 0, 0, 5], [0x0120_0db8, 0, 0, 80], [0xfd00, 0, 0, 7]);
    let fwd = CtKey6 { saddr: client, daddr: frontend, sport: 40000u16.to_be(), dport: 80u16.to_be(), proto: PROTO_TCP, dir: CT_DIR_INGRESS, _pad: 0 };
    let fwd_v = CtValue6 { new_saddr: client, new_daddr: backend, new_sport: fwd.sport, new_dport: 8080u16.to_be(), backend_id: 3, ..CtValue6::default() };
    let reply = CtKey6::reversed_of(&fwd_v, PROTO_TCP, CT_DIR_EGRESS);
    let reply_v = CtValue6 {
        new_saddr: frontend,
        new_daddr: client,
        new_sport: fwd.dport,
        new_dport: fwd.sport,
        backend_id: 3,
        flags: CT_F_REPLY,
        ..CtValue6::default()
    };
    for (earlier, kind) in [(map_names::CONNTRACK6_NEW_V1, LRU_HASH), (map_names::CONNTRACK6_NEW_V2, HASH)] {
        let pins = PinDir::new(&format!("ct6-new-{kind}"));
        std::fs::create_dir_all(pins.path()).unwrap();
        let from = pins.path().join(earlier);
        pin_map(&from, kind, 0, 64, &[(fwd, fwd_v), (reply, reply_v)]);
        let dp = Datapath::load_object(pins.path(), caps(64)).expect("load the object");
        assert!(!from.exists(), "the earlier table's pin is removed ({earlier})");
        let (mut held, _) = KernelEmbryonic6::open(pins.path()).unwrap().read_batch(None, 1024).unwrap();
        held.sort_by_key(|(k, _)| *k);
        let mut want = vec![(fwd, fwd_v), (reply, reply_v)];
        want.sort_by_key(|(k, _)| *k);
        assert_eq!(held, want, "the handshake's entries are in the new embryonic table ({earlier})");
        drop(dp);
    }
}

#[test]
fn an_earlier_counters_map_adds_its_counts_into_the_new_one() {
    use aya::maps::{Map, MapData, PerCpuArray, PerCpuValues};
    use proxy_common::counter;
    const PERCPU_ARRAY: u64 = 6;
    let pins = PinDir::new("cnt-v6");
    std::fs::create_dir_all(pins.path()).unwrap();
    let cpus = aya::util::nr_cpus().unwrap();
    let v6 = pins.path().join(map_names::COUNTERS_V6);
    // KPR_CNT_V6 held exactly the counters of its day: those before the eviction counter.
    let pin_v6 = |counts: &[(u32, Vec<u64>)]| {
        pin_map::<u32, u64>(&v6, PERCPU_ARRAY, 0, u64::from(counter::CT_EMBRYONIC_EVICTED), &[]);
        let mut m = PerCpuArray::<MapData, u64>::try_from(Map::PerCpuArray(MapData::from_pin(&v6).unwrap())).unwrap();
        for (i, per_cpu) in counts {
            m.set(*i, PerCpuValues::try_from(per_cpu.clone()).unwrap(), 0).unwrap();
        }
    };
    let new_flows: Vec<u64> = (0..cpus as u64).map(|c| 10 + c).collect();
    pin_v6(&[(counter::NEW_FLOW, new_flows.clone()), (counter::HANDOVER_PASS, vec![7; cpus])]);

    let dp = Datapath::load_object(pins.path(), caps(64)).expect("load the object");
    assert!(!v6.exists(), "the earlier map's pin is removed");
    let info = aya::maps::MapInfo::from_pin(pins.path().join(map_names::COUNTERS)).unwrap();
    assert_eq!(info.max_entries(), counter::SLOTS, "room for counters to come");
    let counts = KernelMaps::open(pins.path()).unwrap().counters().unwrap();
    assert_eq!(counts.len(), counter::COUNT as usize);
    let before_rollback: u64 = new_flows.iter().sum();
    assert_eq!(counts[counter::NEW_FLOW as usize], before_rollback, "every CPU's count is carried");
    assert_eq!(counts[counter::HANDOVER_PASS as usize], 7 * cpus as u64);
    assert_eq!(counts.iter().sum::<u64>(), before_rollback + 7 * cpus as u64, "nothing else counted");

    // A rollback: the older release made KPR_CNT_V6 anew and counted from zero. The next
    // upgrade adds its counts to those kept from before the rollback.
    drop(dp);
    pin_v6(&[(counter::NEW_FLOW, vec![5; cpus])]);
    let _dp = Datapath::load_object(pins.path(), caps(64)).expect("load after a rollback");
    assert!(!v6.exists());
    let counts = KernelMaps::open(pins.path()).unwrap().counters().unwrap();
    assert_eq!(counts[counter::NEW_FLOW as usize], before_rollback + 5 * cpus as u64, "the counts from before and since the rollback");
}

/// The release before kept the assured tables' hints in arrays of their own (KPR_CT_HINT_V1,
/// KPR_CT6_HINT_V1); they are now in the embryonic buckets' lock lines, which that release
/// left zero. A load removes the old arrays' pins and sets every hint bit of the embryonic
/// tables it keeps: until the collector's rebuild, every new flow looks the assured table up.
#[test]
fn an_earlier_releases_hint_arrays_are_unpinned_and_the_kept_buckets_hint_is_filled() {
    use proxy_agent::dataplane::ebpf::kernel_maps::{rebuild_hints_now, Hint};
    use proxy_common::{CtBucket, CtBucket6, CtKey, CtKey6, PROTO_TCP};
    const ARRAY: u64 = 2;
    const MMAPABLE: u64 = 1 << 10;
    let pins = PinDir::new("hint-v1");
    drop(Datapath::load_object(pins.path(), caps(64)).expect("load the object"));
    // Rebuilt from empty assured tables: no bit set, as the earlier release's buckets are.
    rebuild_hints_now(pins.path()).unwrap();
    let keys: Vec<CtKey> = (1..=200u16)
        .map(|p| CtKey { saddr: 0x0a00_0001, daddr: 0x0a60_000a, sport: p.to_be(), dport: 80u16.to_be(), proto: PROTO_TCP, ..CtKey::default() })
        .collect();
    let keys6: Vec<CtKey6> = keys.iter().map(|k| CtKey6 { sport: k.sport, dport: k.dport, proto: PROTO_TCP, ..CtKey6::default() }).collect();
    let held = |pins: &PinDir| {
        let (h, h6) = (Hint::<CtBucket>::open(pins.path()).unwrap(), Hint::<CtBucket6>::open(pins.path()).unwrap());
        (keys.iter().filter(|k| h.may_hold(k)).count(), keys6.iter().filter(|k| h6.may_hold(k)).count())
    };
    assert_eq!(held(&pins), (0, 0), "rebuilt from empty tables");
    let old: Vec<std::path::PathBuf> = ["KPR_CT_HINT_V1", "KPR_CT6_HINT_V1"].iter().map(|n| pins.path().join(n)).collect();
    for path in &old {
        pin_map::<u32, u64>(path, ARRAY, MMAPABLE, 1024, &[]);
    }
    let _dp = Datapath::load_object(pins.path(), caps(64)).expect("load over the earlier release's pins");
    assert!(old.iter().all(|p| !p.exists()), "the hint arrays' pins are removed");
    assert_eq!(held(&pins), (200, 200), "every bit set at load");
}
