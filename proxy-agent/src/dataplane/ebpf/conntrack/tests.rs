use super::*;
use crate::dataplane::ebpf::maps::FakeTables;
use proxy_common::{CT_F_MAX_AGE, CT_F_REFUSED, CT_F_SEEN_REPLY};
use proxy_common::{CT_F_REPLY, CT_F_SNAT, PROTO_UDP};

fn a(s: &str) -> u32 {
    u32::from_ne_bytes(s.parse::<std::net::Ipv4Addr>().unwrap().octets())
}
fn p(n: u16) -> u16 {
    n.to_be()
}

/// The entries the data path writes for client C:c -> V:v balanced to B:b via port p, with
/// masquerade to S:s when given (see proxy_common::CtKey).
fn flow(proto: u8, c: (&str, u16), v: (&str, u16), b: (&str, u16), port: u16, snat: Option<(&str, u16)>, seen: u64) -> Vec<(CtKey, CtValue)> {
    let (c_a, c_p, v_a, v_p, b_a, b_p) = (a(c.0), p(c.1), a(v.0), p(v.1), a(b.0), p(b.1));
    let port = p(port);
    let masq = if snat.is_some() { CT_F_SNAT } else { 0 };
    let base = CtValue { last_seen_ns: seen, backend_id: 7, service_id: 3, ..CtValue::default() };
    let k = |s, d, sp, dp, dir| CtKey { saddr: s, daddr: d, sport: sp, dport: dp, proto, dir, _pad: 0 };
    let val = |s, d, sp, dp, flags| CtValue { new_saddr: s, new_daddr: d, new_sport: sp, new_dport: dp, flags, ..base };
    let mut out = vec![
        (k(c_a, v_a, c_p, v_p, CT_DIR_INGRESS), val(c_a, b_a, port, b_p, masq)),
        (k(b_a, c_a, b_p, port, CT_DIR_EGRESS), val(v_a, c_a, v_p, c_p, masq | CT_F_REPLY)),
    ];
    if let Some((s, sp)) = snat {
        let (s_a, s_p) = (a(s), p(sp));
        out.push((k(c_a, b_a, port, b_p, CT_DIR_EGRESS), val(s_a, b_a, s_p, b_p, CT_F_SNAT)));
        out.push((k(b_a, s_a, b_p, s_p, CT_DIR_INGRESS), val(b_a, c_a, b_p, port, CT_F_SNAT | CT_F_REPLY)));
    }
    out
}

#[test]
fn assemble_groups_the_four_entries_of_a_masqueraded_flow() {
    let mut e = flow(PROTO_TCP, ("198.18.0.2", 5000), ("198.18.0.1", 30080), ("10.244.1.2", 8080), 5000, Some(("198.18.0.1", 40000)), 1);
    e.extend(flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 1));
    let flows = assemble(&e);
    assert_eq!(flows.len(), 2, "{flows:?}");
    let tcp = flows.iter().find(|f| f.proto() == PROTO_TCP).unwrap();
    assert!(tcp.forward.is_some() && tcp.reverse_dnat.is_some() && tcp.snat.is_some() && tcp.reverse_snat.is_some(), "{tcp:?}");
    let udp = flows.iter().find(|f| f.proto() == PROTO_UDP).unwrap();
    assert!(udp.forward.is_some() && udp.reverse_dnat.is_some() && udp.snat.is_none());
}

#[test]
fn gc_deletes_a_flow_only_when_every_direction_is_idle_and_in_bounded_rounds() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    // A UDP flow whose replies are still flowing (reverse DNAT stamped late), an idle one.
    let mut busy = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
    busy[1].1.last_seen_ns = 200 * s;
    let idle = flow(PROTO_UDP, ("10.244.9.2", 6001), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6001, None, 0);
    for (k, v) in busy.iter().chain(&idle) {
        t.assured.insert(*k, *v);
    }
    let mut gc = Gc::new(Timeouts::default(), 2);
    let mut total = GcStats::default();
    for _ in 0..3 {
        let st = gc.round(&mut t, 250 * s).unwrap();
        assert!(st.read <= 2 * 2, "a round reads one batch per table: {st:?}");
        total.flows += st.flows;
        total.entries += st.entries;
    }
    assert_eq!((total.flows, total.entries), (1, 2));
    assert_eq!(t.assured.len(), 2, "the busy flow stays whole");
    assert!(t.assured.contains_key(&busy[0].0));
    assert!(t.flow_cache_generation > 0, "deleting flows invalidates the flow cache");
}

#[test]
fn a_tuple_reused_between_read_and_delete_keeps_its_new_entry() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    let old = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
    for (k, v) in &old {
        t.assured.insert(*k, *v);
    }
    // The data path gives the forward tuple a new flow (another backend) after the read.
    let mut new_fwd = old[0].1;
    new_fwd.backend_id = 8;
    new_fwd.last_seen_ns = 300 * s;
    t.reused.insert(old[0].0, new_fwd);
    let st = Gc::new(Timeouts::default(), 16).round(&mut t, 300 * s).unwrap();
    assert_eq!(st.flows, 0);
    assert_eq!(t.assured.get(&old[0].0), Some(&new_fwd), "the new flow's entry was lost");
}

#[test]
fn orphans_and_embryonic_flows_time_out() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    let f = flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, None, 0);
    // An embryonic flow past 60 s, and a reverse-DNAT entry whose forward entry is gone.
    for (k, v) in &f {
        t.embryonic.insert(*k, *v);
    }
    let orphan = flow(PROTO_TCP, ("10.244.9.3", 7001), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7001, None, 0);
    t.assured.insert(orphan[1].0, orphan[1].1);
    let st = Gc::new(Timeouts::default(), 16).round(&mut t, 61 * s).unwrap();
    assert_eq!(st.entries, 2, "{st:?}");
    assert!(t.embryonic.is_empty());
    assert_eq!(t.assured.len(), 1, "the orphan is TCP: it waits for the established timeout");
    let st = Gc::new(Timeouts::default(), 16).round(&mut t, 86_401 * s).unwrap();
    assert_eq!(st.entries, 1);
}

/// A collector round at `secs`, every entry of `table` stamped then (busy flows).
fn busy_round(t: &mut FakeTables, gc: &mut Gc, table: Table, secs: u64) -> GcStats {
    let now = secs * 1_000_000_000;
    for v in t.table_mut(table).values_mut() {
        v.last_seen_ns = now;
    }
    gc.round(t, now).unwrap()
}

/// A UDP flow not assured (no answer, or no datagram from its client after one) ages at the
/// kernel's plain UDP timeout (30 s by default), an assured one at the stream timeout (120 s).
#[test]
fn udp_flows_not_assured_time_out_at_the_plain_udp_timeout() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    let unassured = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
    let assured = flow(PROTO_UDP, ("10.244.9.2", 6001), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6001, None, 0);
    t.embryonic.extend(unassured.iter().copied());
    t.assured.extend(assured.iter().copied());
    let timeouts = Timeouts::from_settings(&crate::settings::ConntrackSettings::default());
    assert_eq!((timeouts.udp_unassured, timeouts.udp), (30, 120));
    let mut gc = Gc::new(timeouts, 16);
    assert_eq!(gc.round(&mut t, 29 * s).unwrap().flows, 0);
    assert_eq!(gc.round(&mut t, 31 * s).unwrap().flows, 1);
    assert!(t.embryonic.is_empty());
    assert_eq!(t.assured.len(), 2, "the assured flow waits for the stream timeout");
    assert_eq!(gc.round(&mut t, 121 * s).unwrap().flows, 1);
    // conntrack.udpTimeout sets it.
    let set = crate::settings::ConntrackSettings { udp: Some(std::time::Duration::from_secs(5)), ..Default::default() };
    assert_eq!(Timeouts::from_settings(&set).udp_unassured, 5);
}

/// A UDP flow may stay embryonic all its life (never answered, as a syslog stream): its
/// Service's maximum age reaches it there too. An embryonic TCP flow is the SYN timeout's.
#[test]
fn a_udp_flow_never_assured_is_marked_past_its_maximum_age() {
    let mut t = FakeTables::default();
    let udp = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
    let tcp = flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, None, 0);
    t.embryonic.extend(udp.iter().chain(&tcp).copied());
    let mut gc = Gc::new(Timeouts::default(), 16);
    gc.set_max_ages([(3, 10)].into_iter().collect());
    let at = |t: &mut FakeTables, gc: &mut Gc, secs: u64| busy_round(t, gc, Table::Embryonic, secs);
    assert_eq!(at(&mut t, &mut gc, 100).aged, 0, "first seen at 100 s");
    assert_eq!(at(&mut t, &mut gc, 111).aged, 1);
    assert!(t.embryonic[&udp[0].0].flags & CT_F_MAX_AGE != 0, "the UDP flow's forward entry carries the mark");
    assert!(t.embryonic[&tcp[0].0].flags & CT_F_MAX_AGE == 0, "not the embryonic TCP flow");
}

#[test]
fn flows_past_their_services_maximum_age_are_marked_once_counted_from_first_sight() {
    let mut t = FakeTables::default();
    let aged = flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, None, 0);
    let mut other = flow(PROTO_TCP, ("10.244.9.2", 7001), ("10.96.0.11", 80), ("10.244.1.2", 8080), 7001, None, 0);
    for e in other.iter_mut() {
        e.1.service_id = 4;
    }
    for (k, v) in aged.iter().chain(&other) {
        t.assured.insert(*k, *v);
    }
    let mut gc = Gc::new(Timeouts::default(), 16);
    gc.set_max_ages([(3, 10)].into_iter().collect());
    // Busy flows (stamped every round): only the age can end them.
    let at = |t: &mut FakeTables, gc: &mut Gc, secs: u64| busy_round(t, gc, Table::Assured, secs);
    assert_eq!(at(&mut t, &mut gc, 100).aged, 0, "first seen at 100 s");
    assert_eq!(at(&mut t, &mut gc, 105).aged, 0);
    let generation = t.flow_cache_generation;
    let st = at(&mut t, &mut gc, 111);
    assert_eq!((st.aged, st.flows), (1, 0), "marked, not deleted: {st:?}");
    assert!(t.assured[&aged[0].0].flags & CT_F_MAX_AGE != 0, "the forward entry carries the mark");
    assert!(t.assured[&aged[1].0].flags & CT_F_MAX_AGE == 0, "only the forward entry");
    assert!(t.assured[&other[0].0].flags & CT_F_MAX_AGE == 0, "a Service without a maximum age is left alone");
    assert!(t.flow_cache_generation > generation, "no CPU may answer the marked flow from its cache");
    assert_eq!(at(&mut t, &mut gc, 130).aged, 0, "once");
    // The tuple carrying a new flow (another backend) counts from its own first sight.
    t.assured.get_mut(&aged[0].0).unwrap().flags = 0;
    t.assured.get_mut(&aged[0].0).unwrap().backend_id = 8;
    assert_eq!(at(&mut t, &mut gc, 131).aged, 0);
    assert_eq!(at(&mut t, &mut gc, 142).aged, 1);
    // A Service that no longer asks: nothing more is marked.
    t.assured.get_mut(&aged[0].0).unwrap().flags = 0;
    t.assured.get_mut(&aged[0].0).unwrap().backend_id = 9;
    gc.set_max_ages(HashMap::new());
    assert_eq!(at(&mut t, &mut gc, 200).aged, 0);
}

#[test]
fn open_flows_are_counted_per_backend_at_the_end_of_each_pass() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    let mut n = 0;
    for (port, backend, closing) in [(7000, 7, false), (7001, 7, false), (7002, 8, false), (7003, 8, true)] {
        for (k, mut v) in flow(PROTO_TCP, ("10.244.9.2", port), ("10.96.0.10", 80), ("10.244.1.2", 8080), port, None, 100 * s) {
            v.backend_id = backend;
            if closing {
                v.flags |= CT_F_CLOSING;
            }
            t.assured.insert(k, v);
            n += 1;
        }
    }
    assert_eq!(n, 8);
    // Batches of 3: the pass over the 8 entries takes three rounds.
    let mut gc = Gc::new(Timeouts::default(), 3);
    gc.round(&mut t, 101 * s).unwrap();
    gc.round(&mut t, 101 * s).unwrap();
    assert!(gc.active_flows().is_empty(), "nothing before a whole pass over the assured table");
    assert!(gc.round(&mut t, 101 * s).unwrap().pass_done);
    assert_eq!(gc.active_flows(), [(7, 2), (8, 1)].into_iter().collect(), "closing flows are not counted");
}

#[test]
fn busy_flows_are_kept_and_counted_without_a_lookup_of_their_other_entries() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    let masqueraded = flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, Some(("10.244.0.1", 7000)), 100 * s);
    let plain = flow(PROTO_UDP, ("10.244.9.2", 7001), ("10.96.0.53", 53), ("10.244.2.2", 5353), 7001, None, 100 * s);
    assert_eq!(masqueraded.len() + plain.len(), 6);
    for (k, v) in masqueraded.iter().chain(&plain) {
        t.assured.insert(*k, *v);
    }
    let mut gc = Gc::new(Timeouts::default(), 16);
    // Stamped 5 s ago: within every timeout (the shortest, a closing TCP flow's, is 10 s).
    let st = gc.round(&mut t, 105 * s).unwrap();
    assert!(st.pass_done && st.read == 6 && st.entries == 0, "{st:?}");
    assert_eq!(t.gets.get(), 0, "no entry was looked up");
    assert_eq!((gc.active_flows(), gc.live_flows()), ([(7, 2)].into_iter().collect(), Some(2)), "each flow counted once");
    // Quiet for 20 s: a closing TCP flow would be idle, so the TCP flow's entries are read
    // whole; the UDP flow (120 s) is still within its shortest timeout.
    let st = gc.round(&mut t, 120 * s).unwrap();
    assert!(t.gets.get() > 0 && st.entries == 0 && t.assured.len() == 6, "{st:?}");
    assert_eq!(gc.live_flows(), Some(2));
}

#[test]
fn unanswered_syns_are_reported_once_after_the_timeout() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    for (k, v) in flow(PROTO_TCP, ("10.244.9.2", 7000), ("10.96.0.10", 80), ("10.244.1.2", 8080), 7000, None, 100 * s) {
        t.embryonic.insert(k, v);
    }
    // Answered, or refused (counted by the data path): never reported.
    for (port, flag) in [(7001, CT_F_SEEN_REPLY), (7002, CT_F_REFUSED)] {
        for (k, mut v) in flow(PROTO_TCP, ("10.244.9.2", port), ("10.96.0.10", 80), ("10.244.1.2", 8080), port, None, 100 * s) {
            v.flags |= flag;
            t.embryonic.insert(k, v);
        }
    }
    let mut gc = Gc::new(Timeouts::default(), 16);
    assert!(gc.round(&mut t, 100 * s).unwrap().syn_timeouts.is_empty());
    assert!(gc.round(&mut t, 102 * s).unwrap().syn_timeouts.is_empty());
    assert_eq!(gc.round(&mut t, 103 * s).unwrap().syn_timeouts, vec![7]);
    assert!(gc.round(&mut t, 104 * s).unwrap().syn_timeouts.is_empty(), "once per flow");
}

#[test]
fn purge_deletes_a_busy_flow_that_a_round_keeps() {
    let s = 1_000_000_000u64;
    let old = flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 0);
    // A datagram after the read stamps the forward entry: same flow, newer stamp.
    let mut stamped = old[0].1;
    stamped.last_seen_ns = 5 * s;
    let fill = || {
        let mut t = FakeTables::default();
        t.assured.extend(old.iter().copied());
        t.reused.insert(old[0].0, stamped);
        t
    };
    let mut t = fill();
    let st = Gc::new(Timeouts::default(), 16).purge(&mut t, &[(old[0].1.service_id, old[0].1.backend_id)].into_iter().collect()).unwrap();
    assert_eq!((st.flows, st.kept), (1, 0), "the removed backend's flow went, busy or not");
    assert!(t.assured.is_empty(), "{:?}", t.assured);
    // Its own expiry (a round) keeps it: the stamp says it is alive.
    let mut t = fill();
    let st = Gc::new(Timeouts::default(), 16).round(&mut t, 1_000 * s).unwrap();
    assert_eq!((st.flows, st.kept), (0, 1));
    assert_eq!(t.assured.get(&old[0].0), Some(&stamped));
}

#[test]
fn purge_deletes_the_flows_of_removed_backends_at_once() {
    let mut t = FakeTables::default();
    let mut other = flow(PROTO_UDP, ("10.244.9.2", 6001), ("10.96.0.53", 53), ("10.244.3.2", 5353), 6001, None, 5);
    for e in other.iter_mut() {
        e.1.backend_id = 9;
    }
    for (k, v) in flow(PROTO_UDP, ("10.244.9.2", 6000), ("10.96.0.53", 53), ("10.244.2.2", 5353), 6000, None, 5).iter().chain(&other) {
        t.assured.insert(*k, *v);
    }
    let st = Gc::new(Timeouts::default(), 16).purge(&mut t, &[(3, 7)].into_iter().collect()).unwrap();
    assert_eq!((st.flows, st.entries), (1, 2));
    assert_eq!(t.assured.len(), 2);
    assert!(t.assured.values().all(|v| v.backend_id == 9));
}

/// The assured batches' keys reach the hint's rebuild only once it follows the passes, each
/// batch with where it falls in its pass.
#[test]
fn assured_keys_are_handed_over_only_once_asked_with_their_place_in_the_pass() {
    let mut t = FakeTables::default();
    for port in 6000..6002 {
        t.assured.extend(flow(PROTO_UDP, ("10.244.9.2", port), ("10.96.0.53", 53), ("10.244.2.2", 5353), port, None, 250_000_000_000));
    }
    let mut gc = Gc::new(Timeouts::default(), 2);
    let st = gc.round(&mut t, 250_000_000_000).unwrap();
    assert_eq!((st.read, st.assured.keys.len()), (2, 0), "not asked: no copy");
    gc.hand_over_assured_keys = true;
    let passes: Vec<(usize, bool, bool)> = (0..3)
        .map(|_| {
            let a = gc.round(&mut t, 250_000_000_000).unwrap().assured;
            (a.keys.len(), a.first, a.last)
        })
        .collect();
    // Two batches of two: the pass begun before, its last batch, then a whole pass.
    assert_eq!(passes, [(2, false, true), (2, true, false), (2, false, true)]);
}

/// With `pass_every_ns`, a table whose pass ended starts the next one only that long after the
/// last one started; a pass under way goes on every round, and the rounds between read nothing
/// of that table.
#[test]
fn a_pass_starts_at_most_every_pass_every_ns() {
    let s = 1_000_000_000u64;
    let mut t = FakeTables::default();
    for port in 6000..6002 {
        t.assured.extend(flow(PROTO_UDP, ("10.244.9.2", port), ("10.96.0.53", 53), ("10.244.2.2", 5353), port, None, 100 * s));
    }
    // Batches of 2 over 4 entries: a pass is two rounds.
    let mut gc = Gc::new(Timeouts::default(), 2);
    gc.pass_every_ns = 2 * s;
    let reads: Vec<usize> =
        [100.0, 100.25, 100.5, 101.75, 102.0, 102.25, 102.5].iter().map(|&at| gc.round(&mut t, (at * s as f64) as u64).unwrap().read).collect();
    assert_eq!(reads, [2, 2, 0, 0, 2, 2, 0], "a pass at 100 s (two rounds), none until 102 s, the next at 102 s");
    // Without it (0), every round reads.
    let mut gc = Gc::new(Timeouts::default(), 2);
    assert!((0..4).all(|_| gc.round(&mut t, 100 * s).unwrap().read == 2));
}

#[test]
fn a_masqueraded_flow_whose_backend_closed_first_keeps_its_snat_tuple_through_time_wait() {
    let s = 1_000_000_000u64;
    let closed = |port: u16, backend_first: bool, reset: bool| {
        let mut e = flow(PROTO_TCP, ("198.18.0.2", port), ("10.96.0.10", 80), ("10.244.1.2", 8080), port, Some(("198.18.0.1", port)), 0);
        for (_, v) in e.iter_mut() {
            v.flags |= proxy_common::CT_F_CLOSING;
        }
        if backend_first {
            e[3].1.flags |= proxy_common::CT_F_TIME_WAIT;
        }
        if reset {
            e[2].1.flags |= proxy_common::CT_F_RESET;
        }
        e
    };
    let mut t = FakeTables::default();
    let (client_first, backend_first, reset_after) = (closed(7000, false, false), closed(7001, true, false), closed(7002, true, true));
    for (k, v) in client_first.iter().chain(&backend_first).chain(&reset_after) {
        t.assured.insert(*k, *v);
    }
    let mut gc = Gc::new(Timeouts::default(), 64);
    // Quiet past the closing timeout: the client-first flow and the one a reset ended go.
    gc.round(&mut t, 30 * s).unwrap();
    assert_eq!(t.assured.len(), 4, "{:?}", t.assured.keys());
    assert!(t.assured.contains_key(&backend_first[3].0), "the backend's TIME_WAIT holds the tuple");
    // Quiet past the backend's TIME_WAIT: gone too.
    gc.round(&mut t, 61 * s).unwrap();
    assert!(t.assured.is_empty());
}
