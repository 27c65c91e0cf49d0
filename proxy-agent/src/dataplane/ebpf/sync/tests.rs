use super::*;
use crate::{
    dataplane::ebpf::maps::FakeMaps,
    model::{Frontend, FrontendKey, FrontendKind, Protocol, Scheduler},
};
use proxy_common::limits::MAX_BACKENDS_PER_SERVICE;

fn frontend(backends: &[(&str, u16)], sched: Scheduler) -> Frontend {
    Frontend { scheduler: sched, source_ranges: vec!["198.18.0.0/24".parse().unwrap()], ..Frontend::for_test(FrontendKind::ClusterIp, backends, Protocol::Tcp) }
}

fn key(ip: &str) -> FrontendKey {
    FrontendKey { ip: ip.parse().unwrap(), port: 80, proto: Protocol::Tcp, scope: crate::model::Scope::Internal }
}

fn state(frontends: &[(&str, &[(&str, u16)])]) -> DesiredState {
    let mut d = DesiredState::default();
    for (vip, backends) in frontends {
        let mut f = frontend(backends, Scheduler::Random);
        f.service = format!("ns/{vip}:http").into();
        f.source_ranges.clear();
        d.frontends.insert(key(vip), f);
    }
    d
}

/// One list shared by the two scopes' frontends of 10.96.0.3, and 10.96.0.2's own (synced
/// first: keys sort by address).
fn shared_state() -> DesiredState {
    let mut d = DesiredState::default();
    let shared = frontend(&[("10.244.1.1", 80), ("10.244.1.2", 80)], Scheduler::Random);
    for scope in [crate::model::Scope::Internal, crate::model::Scope::External] {
        d.frontends.insert(FrontendKey { scope, ..key("10.96.0.3") }, shared.clone());
    }
    d.frontends.insert(key("10.96.0.2"), frontend(&[("10.244.2.1", 80)], Scheduler::Random));
    d
}

#[test]
fn frontends_that_share_a_backend_list_each_get_it_whole() {
    let d = shared_state();
    let mut maps = FakeMaps::default();
    let st = Syncer::default().sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!((st.frontends, st.backends, maps.backends.len()), (3, 3, 3));
    let addrs = |ips: &[&str]| -> Vec<[u32; 4]> { ips.iter().map(|ip| proxy_common::user::addr_words(ip.parse().unwrap())).collect() };
    let got: Vec<Vec<[u32; 4]>> = view(&maps).into_values().collect();
    assert_eq!(got.iter().filter(|b| **b == addrs(&["10.244.1.1", "10.244.1.2"])).count(), 2, "{got:?}");
    assert_eq!(got.iter().filter(|b| **b == addrs(&["10.244.2.1"])).count(), 1, "{got:?}");
}

#[test]
fn a_shared_list_that_did_not_fit_is_not_taken_as_written() {
    let mut maps = FakeMaps::default();
    maps.capacity.insert(proxy_common::map_names::BACKENDS, 2);
    let st = Syncer::default().sync(&mut maps, &shared_state(), DatapathConfig::default()).unwrap();
    // 10.96.0.2's backend and one of the shared list's fit: the first scope of 10.96.0.3
    // fails on the second, and the other scope must fail too, not take the list as written.
    assert_eq!(st.full.len(), 2, "{st:?}");
    assert_eq!(view(&maps).len(), 1);
    assert!(maps.slots.values().all(|id| maps.backends.contains_key(id)));
}

#[test]
fn a_full_backend_map_makes_room_before_it_inserts() {
    let mut maps = FakeMaps::default();
    maps.capacity.insert(proxy_common::map_names::BACKENDS, 4);
    let mut s = Syncer::default();
    let before = state(&[("10.96.0.1", &[("10.244.1.1", 80), ("10.244.1.2", 80)]), ("10.96.0.2", &[("10.244.2.1", 80), ("10.244.2.2", 80)])]);
    s.sync(&mut maps, &before, DatapathConfig::default()).unwrap();
    assert_eq!(maps.backends.len(), 4);
    assert_eq!(maps.bulks, 1, "into empty maps, everything fits: the puts may be held");
    // One service shrinks, the other grows: the total fits, but only once the shrinking
    // one's backend is gone; the growing one (written first) meets a full map.
    let after = state(&[("10.96.0.1", &[("10.244.1.1", 80)]), ("10.96.0.2", &[("10.244.2.1", 80), ("10.244.2.2", 80), ("10.244.2.3", 80)])]);
    for incremental in [false, true] {
        let (from, to) = if incremental { (&after, &before) } else { (&before, &after) };
        let st = if incremental {
            s.sync_subset(&mut maps, to, DatapathConfig::default(), &[key("10.96.0.1"), key("10.96.0.2")].into()).unwrap()
        } else {
            s.sync(&mut maps, to, DatapathConfig::default()).unwrap()
        };
        assert!(st.errors.is_empty() && st.full.is_empty(), "{:?}", st.errors);
        let mut fresh = FakeMaps::default();
        Syncer::default().sync(&mut fresh, to, DatapathConfig::default()).unwrap();
        assert_eq!(maps.backends.len(), fresh.backends.len(), "{from:?} -> {to:?}");
        assert_eq!(maps.services.len(), 2);
    }
    // Past the capacity unless the deletes go first: no held puts (a held put cannot say
    // "full" for its frontend).
    assert_eq!(maps.bulks, 1);
}

#[test]
fn a_backend_that_a_frontend_left_as_it_was_points_to_keeps_its_id() {
    // Two ids (1..3). Both services use A; then s1 wants two more backends than there are
    // ids, so it stays as it was (pointing to A), and s2 leaves: A's id must not be freed
    // and given to another backend while s1's slot names it.
    let mut maps = FakeMaps::default();
    let mut s = Syncer::new(16, 3, 2);
    s.ids.reuse_backend_ids_at_once();
    let a = ("10.244.1.1", 80);
    s.sync(&mut maps, &state(&[("10.96.0.1", &[a]), ("10.96.0.2", &[a])]), DatapathConfig::default()).unwrap();
    let grown = state(&[("10.96.0.1", &[a, ("10.244.1.2", 80), ("10.244.1.3", 80)]), ("10.96.0.2", &[a])]);
    let st = s.sync(&mut maps, &grown, DatapathConfig::default()).unwrap();
    assert_eq!(st.full.len(), 1, "{:?}", st.errors);
    let left = state(&[("10.96.0.1", &[a, ("10.244.1.2", 80), ("10.244.1.3", 80)])]);
    s.sync_subset(&mut maps, &left, DatapathConfig::default(), &[key("10.96.0.2")].into()).unwrap();
    let then = state(&[("10.96.0.1", &[a, ("10.244.1.2", 80), ("10.244.1.3", 80)]), ("10.96.0.3", &[("10.244.9.9", 80)])]);
    s.sync_subset(&mut maps, &then, DatapathConfig::default(), &[key("10.96.0.3")].into()).unwrap();
    let a_addr = proxy_common::user::addr_words(a.0.parse().unwrap());
    let s1 = programmed(&maps)[&proxy_common::user::addr_words("10.96.0.1".parse().unwrap())].clone();
    assert_eq!(s1, vec![a_addr], "s1 still reaches A, not the newcomer");
}

#[test]
fn slots_written_by_hand_past_any_service_are_deleted() {
    let d = state(&[("10.96.0.1", &[("10.244.1.1", 80)])]);
    let mut maps = FakeMaps::default();
    let mut s = Syncer::default();
    s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    let sid = maps.services.values().next().unwrap().service_id;
    let id = *maps.slots.values().next().unwrap();
    for slot in [0, MAX_BACKENDS_PER_SERVICE + 1, u32::MAX] {
        maps.slots.insert(SlotKey { service_id: sid, slot }, id);
    }
    maps.slots.insert(SlotKey { service_id: sid, slot: 2 }, 0);
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!((st.deletes, maps.slots.len()), (4, 1), "{:?}", maps.slots);
    assert_eq!(programmed(&maps).values().next().unwrap().len(), 1);
}

#[test]
fn backend_ids_stay_below_the_limit_through_churn() {
    // Ids 1..8 (the per-backend arrays' size), and 60 backends that come and go: pods
    // rescheduled with new addresses, as on a node that runs for months.
    let mut maps = FakeMaps::default();
    let mut s = Syncer::new(16, 8, 2);
    s.ids.reuse_backend_ids_at_once();
    for round in 0..20u8 {
        let (a, b) = (format!("10.244.{round}.1"), format!("10.244.{round}.2"));
        let (c, keep) = (format!("10.244.{round}.3"), "10.244.200.1".to_string());
        let d = state(&[("10.96.0.1", &[(&a, 80), (&b, 80), (&keep, 80)]), ("10.96.0.2", &[(&c, 80)])]);
        let st = if round % 3 == 0 {
            s.sync(&mut maps, &d, DatapathConfig::default()).unwrap()
        } else {
            s.sync_subset(&mut maps, &d, DatapathConfig::default(), &[key("10.96.0.1"), key("10.96.0.2")].into()).unwrap()
        };
        assert!(st.errors.is_empty() && st.full.is_empty(), "round {round}: {:?} {:?}", st.errors, st.full);
        assert!(maps.backends.keys().all(|id| (1..8).contains(id)), "round {round}: {:?}", maps.backends.keys());
        let mut fresh = FakeMaps::default();
        Syncer::default().sync(&mut fresh, &d, DatapathConfig::default()).unwrap();
        assert_eq!(programmed(&maps), programmed(&fresh), "round {round}");
        assert_eq!(maps.backends.len(), 4, "round {round}: the old backends are deleted");
    }
}

/// Each service (by VIP) -> the backend addresses its slots point to, sorted.
fn programmed(maps: &FakeMaps) -> BTreeMap<[u32; 4], Vec<[u32; 4]>> {
    maps.services
        .iter()
        .map(|(k, v)| {
            let mut bes: Vec<[u32; 4]> =
                (1..=v.backend_count).map(|slot| maps.backends[&maps.slots[&SlotKey { service_id: v.service_id, slot }]].addr).collect();
            bes.sort();
            (k.addr, bes)
        })
        .collect()
}

#[test]
fn overridden_frontends_are_programmed_as_overridden_in_full_and_incremental_syncs() {
    let d = state(&[("10.96.0.1", &[("10.244.1.1", 80), ("10.244.1.2", 80)]), ("10.96.0.2", &[("10.244.1.2", 80), ("10.244.2.2", 80)])]);
    // Outlier ejection leaves 10.244.1.2 out of the first frontend only.
    let mut left = d.clone();
    let first = left.frontends.get_mut(&key("10.96.0.1")).unwrap();
    first.backends = first.backends.iter().filter(|b| b.ip != "10.244.1.2".parse::<std::net::IpAddr>().unwrap()).collect();
    let overrides: HashMap<FrontendKey, Frontend> = [(key("10.96.0.1"), left.frontends[&key("10.96.0.1")].clone())].into();
    let mut want = FakeMaps::default();
    Syncer::default().sync(&mut want, &left, DatapathConfig::default()).unwrap();
    let mut plain = FakeMaps::default();
    Syncer::default().sync(&mut plain, &d, DatapathConfig::default()).unwrap();
    assert_ne!(programmed(&want), programmed(&plain));
    for incremental in [false, true] {
        let (mut maps, mut s) = (FakeMaps::default(), Syncer::default());
        s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        s.set_overrides(overrides.clone());
        let touched: BTreeSet<FrontendKey> = [key("10.96.0.1")].into();
        if incremental {
            s.sync_subset(&mut maps, &d, DatapathConfig::default(), &touched).unwrap();
        } else {
            s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        }
        assert_eq!(programmed(&maps), programmed(&want), "incremental: {incremental}");
        // The ejection ends: the desired state's own frontend again.
        s.set_overrides(HashMap::new());
        if incremental {
            s.sync_subset(&mut maps, &d, DatapathConfig::default(), &touched).unwrap();
        } else {
            s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
        }
        assert_eq!(programmed(&maps), programmed(&plain), "incremental: {incremental}");
    }
}

#[test]
fn the_service_ids_are_the_configured_capacity_and_running_out_is_a_full_services_map() {
    let mut maps = FakeMaps::default();
    // Ids 1..=2 (id 0 is never given out).
    let mut s = Syncer::new(3, MAX_BACKENDS, 2);
    let d = state(&[("10.96.0.1", &[("10.244.1.1", 80)]), ("10.96.0.2", &[("10.244.1.1", 80)]), ("10.96.0.3", &[("10.244.1.1", 80)])]);
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!(st.full, vec![(proxy_common::map_names::SERVICES, "ns/10.96.0.3:http".to_string())]);
    assert_eq!(maps.services.len(), 2);
    // One leaves: its id goes to the one that did not fit.
    let d = state(&[("10.96.0.2", &[("10.244.1.1", 80)]), ("10.96.0.3", &[("10.244.1.1", 80)])]);
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert!(st.full.is_empty(), "{:?}", st.full);
    assert_eq!(maps.services.len(), 2);
}

#[test]
fn what_does_not_fit_is_reported_per_frontend_and_the_rest_is_programmed() {
    let mut maps = FakeMaps::default();
    maps.capacity.insert(proxy_common::map_names::BACKENDS, 3);
    let mut s = Syncer::default();
    let d = state(&[("10.96.0.1", &[("10.244.1.1", 80), ("10.244.1.2", 80)]), ("10.96.0.2", &[("10.244.2.1", 80), ("10.244.2.2", 80)])]);
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!(st.full, vec![(proxy_common::map_names::BACKENDS, "ns/10.96.0.2:http".to_string())]);
    assert_eq!(maps.services.len(), 1, "the first service is programmed");
    // Room appears (the capacity is raised): the next sync programs the rest.
    maps.capacity.insert(proxy_common::map_names::BACKENDS, 4);
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert!(st.full.is_empty());
    assert_eq!(maps.services.len(), 2);
}

#[test]
fn stable_ids_minimal_writes_and_cleanup() {
    let mut maps = FakeMaps::default();
    let mut s = Syncer::default();
    let mut d = DesiredState::default();
    d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 8080), ("10.0.0.2", 8080)], Scheduler::Random));
    s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!(maps.services.len(), 1);
    assert_eq!(maps.slots.len(), 2);
    assert_eq!(maps.backends.len(), 2);
    assert_eq!(maps.source_ranges.len(), 1);
    let id_of = |m: &FakeMaps, ip: &str| {
        let w = proxy_common::user::addr_words(ip.parse().unwrap());
        *m.backends.iter().find(|(_, b)| b.addr == w).unwrap().0
    };
    let id2 = id_of(&maps, "10.0.0.2");

    // Same state again: nothing to write.
    let before = maps.writes;
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0));
    assert_eq!(maps.writes, before);

    // Replace backend 1: backend 2 keeps its id.
    d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.2", 8080), ("10.0.0.3", 8080)], Scheduler::Random));
    s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!(id_of(&maps, "10.0.0.2"), id2);
    assert_eq!(maps.backends.len(), 2);

    // A restarted agent (fresh Syncer) writes nothing for an unchanged state.
    let mut s2 = Syncer::default();
    let st = s2.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");

    // Everything removed: nothing left.
    s2.sync(&mut maps, &DesiredState::default(), DatapathConfig::default()).unwrap();
    assert!(maps.services.is_empty() && maps.slots.is_empty() && maps.backends.is_empty());
    assert!(maps.source_ranges.is_empty());
}

#[test]
fn subset_sync_trusts_its_mirror_and_full_sync_repairs_drift() {
    let mut maps = FakeMaps::default();
    let mut s = Syncer::default();
    let mut d = DesiredState::default();
    d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random));
    s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    d.frontends.insert(key("10.96.0.2"), frontend(&[("10.0.0.3", 80)], Scheduler::Random));
    d.frontends.remove(&key("10.96.0.1"));
    let all: BTreeSet<FrontendKey> = [key("10.96.0.1"), key("10.96.0.2")].into_iter().collect();
    let st = s.sync_subset(&mut maps, &d, DatapathConfig::default(), &all).unwrap();
    assert!(st.writes > 0 && st.deletes > 0);
    let mut reference = FakeMaps::default();
    Syncer::default().sync(&mut reference, &d, DatapathConfig::default()).unwrap();
    assert_eq!(maps.services.len(), reference.services.len());
    assert_eq!(maps.slots.len(), reference.slots.len());
    assert_eq!(maps.backends.len(), reference.backends.len());
    // Drift: an entry deleted by hand. The cached sync trusts its mirror; the full one repairs.
    maps.slots.clear();
    assert_eq!(s.sync_subset(&mut maps, &d, DatapathConfig::default(), &all).unwrap().writes, 0);
    assert!(maps.slots.is_empty());
    s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!(maps.slots.len(), 1);
}

#[test]
fn the_first_full_sync_takes_the_maps_read_ahead_and_later_ones_read_them() {
    // What a previous agent left.
    let mut maps = FakeMaps::default();
    let mut d = DesiredState::default();
    d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random));
    Syncer::default().sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    let kept = programmed(&maps);

    // A restart reads ahead: the sync takes over the ids from that read and writes nothing.
    let mut s = Syncer::default();
    s.set_read_ahead(MapsRead::read(&maps).unwrap());
    // Proof that it is that read the sync uses: a slot deleted after it is not seen.
    let slot = *maps.slots.keys().next().unwrap();
    let slot_id = maps.slots.remove(&slot).unwrap();
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");
    // The next full sync reads the maps and repairs the slot, with its backend id.
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!(st.writes, 1);
    assert_eq!(maps.slots.get(&slot), Some(&slot_id));
    assert_eq!(programmed(&maps), kept);

    // Once a sync has a mirror, a read ahead is not taken: it may be older than the mirror.
    s.set_read_ahead(MapsRead::read(&FakeMaps::default()).unwrap());
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");
}

/// Frontend -> backend addresses, as the maps say.
fn view(m: &FakeMaps) -> BTreeMap<ServiceKey, Vec<[u32; 4]>> {
    m.services
        .iter()
        .map(|(k, v)| {
            let bes = (1..=v.backend_count).map(|slot| m.backends[&m.slots[&SlotKey { service_id: v.service_id, slot }]].addr).collect();
            (*k, bes)
        })
        .collect()
}

#[test]
fn subset_sync_equals_a_full_sync() {
    let mut maps = FakeMaps::default();
    let mut s = Syncer::default();
    let mut d = DesiredState::default();
    d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random));
    d.frontends.insert(key("10.96.0.2"), frontend(&[("10.0.0.2", 80), ("10.0.0.3", 80)], Scheduler::Random));
    d.frontends.insert(key("10.96.0.3"), frontend(&[("10.0.0.9", 80)], Scheduler::Maglev));
    s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    // Change one, remove one (its backend 10.0.0.9 must go), add one sharing a backend.
    let mut d2 = d.clone();
    d2.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.4", 80)], Scheduler::Random));
    d2.frontends.remove(&key("10.96.0.3"));
    let mut f4 = frontend(&[("10.0.0.3", 80)], Scheduler::Random);
    f4.source_ranges = vec!["203.0.113.0/24".parse().unwrap()];
    d2.frontends.insert(key("10.96.0.4"), f4);
    let touched: BTreeSet<FrontendKey> = [key("10.96.0.1"), key("10.96.0.3"), key("10.96.0.4")].into_iter().collect();
    s.sync_subset(&mut maps, &d2, DatapathConfig::default(), &touched).unwrap();
    let mut reference = FakeMaps::default();
    Syncer::default().sync(&mut reference, &d2, DatapathConfig::default()).unwrap();
    assert_eq!(view(&maps), view(&reference));
    assert_eq!(maps.backends.len(), reference.backends.len(), "unused backends deleted: {:?}", maps.backends);
    assert_eq!(maps.slots.len(), reference.slots.len());
    assert_eq!(maps.source_ranges.len(), reference.source_ranges.len());
    // And a full sync afterwards finds nothing to do.
    let st = s.sync(&mut maps, &d2, DatapathConfig::default()).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0), "{st:?}");
}

/// A port whose two scopes become different (externalTrafficPolicy set to Local) and then
/// the same again: its frontend for both and its internal one are one map entry, and each
/// subset sync leaves what a full sync writes.
#[test]
fn a_port_whose_scopes_split_and_join_again_keeps_its_entry() {
    use crate::model::Scope;
    let at = |scope| FrontendKey { scope, ..key("10.96.0.1") };
    let both = frontend(&[("10.0.0.1", 80), ("10.0.0.2", 80)], Scheduler::Random);
    let mut joined = DesiredState::default();
    joined.frontends.insert(at(Scope::Both), both.clone());
    let mut split = DesiredState::default();
    split.frontends.insert(at(Scope::Internal), both.clone());
    split.frontends.insert(at(Scope::External), Frontend { preserve_source: true, ..frontend(&[("10.0.0.2", 80)], Scheduler::Random) });
    let touched: BTreeSet<FrontendKey> = [at(Scope::Internal), at(Scope::External), at(Scope::Both)].into();
    let mut maps = FakeMaps::default();
    let mut s = Syncer::default();
    s.sync(&mut maps, &joined, DatapathConfig::default()).unwrap();
    let id = s.service_id(&at(Scope::Both)).unwrap();
    for d in [&split, &joined, &split] {
        s.sync_subset(&mut maps, d, DatapathConfig::default(), &touched).unwrap();
        let mut reference = FakeMaps::default();
        Syncer::default().sync(&mut reference, d, DatapathConfig::default()).unwrap();
        assert_eq!(view(&maps), view(&reference));
        assert_eq!(maps.services.len(), d.frontends.len());
        assert_eq!(s.service_id(&at(Scope::Internal)), Some(id), "the entry (and its flows' service id) stays");
        let st = s.sync(&mut maps, d, DatapathConfig::default()).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "a full sync after it finds nothing to do: {st:?}");
    }
}

#[test]
fn maglev_row_is_written_once_and_freed() {
    let mut maps = FakeMaps::default();
    let mut s = Syncer::new(16, MAX_BACKENDS, 2);
    let mut d = DesiredState::default();
    d.frontends.insert(key("10.96.0.1"), frontend(&[("10.0.0.1", 80)], Scheduler::Maglev));
    d.frontends.insert(key("10.96.0.2"), frontend(&[("10.0.0.1", 80)], Scheduler::Maglev));
    d.frontends.insert(key("10.96.0.3"), frontend(&[("10.0.0.1", 80)], Scheduler::Maglev));
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    // Two rows only: the third frontend falls back to random and says so.
    assert_eq!(maps.maglev.len(), 2);
    assert_eq!(st.errors.len(), 1);
    assert_eq!((st.failed.len(), st.failed[0].reason), (1, crate::model::errors::MAP_FULL), "an Event on the Service: {:?}", st.failed);
    assert!(st.failed[0].message.contains("Maglev rows"), "{}", st.failed[0]);
    assert_eq!(st.fallback, [(proxy_common::map_names::MAGLEV, "ns/web:http".to_string())], "counted in kpr_map_full_total");
    let v = maps.services.values().filter(|v| v.scheduler == SCHED_RANDOM).count();
    assert_eq!(v, 1);
    let st = s.sync(&mut maps, &d, DatapathConfig::default()).unwrap();
    assert_eq!(st.writes, 0);
}
