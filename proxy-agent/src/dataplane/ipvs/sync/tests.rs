use super::*;
use crate::{
    dataplane::ipvs::{client::FakeIpvs, desired::desired_virtual_servers},
    model::{DesiredState, Frontend, FrontendKey, FrontendKind, IpvsForward, IpvsOptions, Protocol, Scope},
    netlink::ctnetlink::FakeConntrack,
    netlink::rtnl::FakeLinks,
};

fn fe(kind: FrontendKind, backends: &[(&str, u16)], proto: Protocol) -> Frontend {
    Frontend::for_test(kind, backends, proto)
}

fn state(frontends: Vec<(&str, u16, Protocol, Frontend)>) -> DesiredState {
    let mut d = DesiredState::default();
    for (ip, port, proto, f) in frontends {
        for scope in [Scope::Internal, Scope::External] {
            d.frontends.insert(FrontendKey { ip: ip.parse().unwrap(), port, proto, scope }, f.clone());
        }
    }
    d
}

struct World {
    ipvs: FakeIpvs,
    links: FakeLinks,
    ct: FakeConntrack,
    syncer: IpvsSyncer,
}

impl World {
    fn new() -> Self {
        let settings = SyncSettings { node_addresses: vec!["198.18.0.1".parse().unwrap()], ..Default::default() };
        World { ipvs: FakeIpvs::default(), links: FakeLinks::default(), ct: FakeConntrack::default(), syncer: IpvsSyncer::new(settings) }
    }
    fn sync(&mut self, d: &DesiredState) -> IpvsSyncStats {
        let vs = desired_virtual_servers(d, &self.syncer.settings);
        let st = self.syncer.sync(&mut self.ipvs, &mut self.links, &mut self.ct, &vs, None).unwrap();
        assert!(st.errors.is_empty(), "{:?}", st.errors);
        st
    }
    fn bound(&self) -> Vec<String> {
        self.links.links.get(IPVS_DUMMY).map(|l| l.1.iter().map(|a| a.to_string()).collect()).unwrap_or_default()
    }
    fn routed(&self) -> Vec<String> {
        self.links.local_routes.iter().map(|a| a.to_string()).collect()
    }
}

fn tcp(ip: &str, port: u16) -> ServiceId {
    ServiceId::Addr { proto: 6, addr: ip.parse().unwrap(), port }
}

#[test]
fn programs_binds_and_is_idempotent() {
    let mut w = World::new();
    let d = state(vec![
        ("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 8080), ("10.244.2.2", 8080)], Protocol::Tcp)),
        ("198.18.0.1", 30080, Protocol::Tcp, fe(FrontendKind::NodePort, &[("10.244.1.2", 8080)], Protocol::Tcp)),
    ]);
    let st = w.sync(&d);
    assert_eq!((st.services, st.dests, st.addresses_bound), (2, 3, 1));
    assert_eq!(w.bound(), vec!["10.96.0.1"]); // never the node address
    assert_eq!(w.ipvs.services[&tcp("10.96.0.1", 80)].1.len(), 2);
    w.ipvs.writes.clear();
    let st = w.sync(&d);
    assert_eq!((st.writes, st.deletes), (0, 0));
    assert!(w.ipvs.writes.is_empty(), "a second sync wrote {:?}", w.ipvs.writes);
}

#[test]
fn removed_tcp_backend_drains_then_goes_and_comes_back_with_its_weight() {
    let mut w = World::new();
    let both = state(vec![("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 80), ("10.244.2.2", 80)], Protocol::Tcp))]);
    let one = state(vec![("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 80)], Protocol::Tcp))]);
    w.sync(&both);
    let id = tcp("10.96.0.1", 80);
    let gone: IpAddr = "10.244.2.2".parse().unwrap();
    w.ipvs.set_conns(&id, gone, 80, 1, 0);
    let st = w.sync(&one);
    assert_eq!(st.terminating, 1);
    assert_eq!(w.ipvs.services[&id].1[&(gone, 80)].config.weight, 0);
    w.sync(&one); // still a connection: stays at weight 0
    assert!(w.ipvs.services[&id].1.contains_key(&(gone, 80)));
    // Comes back while draining: weight restored, not re-created.
    w.ipvs.writes.clear();
    w.sync(&both);
    assert_eq!(w.ipvs.writes, vec!["update-dest TCP 10.96.0.1:80 10.244.2.2:80 w1"]);
    w.sync(&one);
    w.ipvs.set_conns(&id, gone, 80, 0, 0);
    w.sync(&one);
    assert!(!w.ipvs.services[&id].1.contains_key(&(gone, 80)));
}

#[test]
fn removed_udp_backend_goes_at_once_with_its_conntrack() {
    let mut w = World::new();
    let both = state(vec![("10.96.0.10", 53, Protocol::Udp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 53), ("10.244.2.2", 53)], Protocol::Udp))]);
    let one = state(vec![("10.96.0.10", 53, Protocol::Udp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 53)], Protocol::Udp))]);
    w.sync(&both);
    let id = ServiceId::Addr { proto: 17, addr: "10.96.0.10".parse().unwrap(), port: 53 };
    w.ipvs.set_conns(&id, "10.244.2.2".parse().unwrap(), 53, 0, 5);
    w.sync(&one);
    assert_eq!(w.ipvs.services[&id].1.len(), 1);
    assert_eq!(w.ct.flushed, vec![(17, "10.96.0.10".parse().unwrap(), 53, "10.244.2.2".parse().unwrap(), 53)]);
}

#[test]
fn incremental_syncs_touch_only_their_services_and_bind_new_vips() {
    let mut w = World::new();
    let mut d = state(vec![("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 80)], Protocol::Tcp))]);
    w.sync(&d);
    d.frontends.extend(state(vec![("10.96.0.2", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.2.2", 80)], Protocol::Tcp))]).frontends);
    let vs = desired_virtual_servers(&d, &w.syncer.settings);
    let only: BTreeSet<ServiceId> = [tcp("10.96.0.2", 80)].into();
    w.ipvs.writes.clear();
    let st = w.syncer.sync(&mut w.ipvs, &mut w.links, &mut w.ct, &vs, Some(&only)).unwrap();
    assert_eq!((st.addresses_bound, st.errors.len()), (1, 0));
    assert_eq!(w.ipvs.writes, vec!["add-service TCP 10.96.0.2:80", "add-dest TCP 10.96.0.2:80 10.244.2.2:80 w1"]);
    assert_eq!(w.bound(), vec!["10.96.0.1", "10.96.0.2"]);
    // Removed by an incremental sync: service and address go.
    d.frontends.retain(|k, _| k.ip != "10.96.0.2".parse::<IpAddr>().unwrap());
    let vs = desired_virtual_servers(&d, &w.syncer.settings);
    w.syncer.sync(&mut w.ipvs, &mut w.links, &mut w.ct, &vs, Some(&only)).unwrap();
    assert!(!w.ipvs.services.contains_key(&tcp("10.96.0.2", 80)));
    assert_eq!(w.bound(), vec!["10.96.0.1"]);
}

#[test]
fn route_binding_routes_ipv4_vips_and_takes_over_addresses_both_ways() {
    route_binding_switches(usize::MAX);
}

#[test]
fn route_binding_switches_alike_with_every_bind_on_the_binding_thread() {
    route_binding_switches(1);
}

fn route_binding_switches(concurrent_binds: usize) {
    let mut w = World::new();
    w.syncer.settings.concurrent_binds = concurrent_binds;
    let d = state(vec![
        ("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 80)], Protocol::Tcp)),
        ("fd00:96::1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("fd00:244::2", 80)], Protocol::Tcp)),
        ("192.0.2.50", 80, Protocol::Tcp, fe(FrontendKind::LoadBalancer, &[("10.244.1.2", 80)], Protocol::Tcp)),
    ]);
    // A node bound as kube-proxy does, then switched to routes: IPv4 moves, IPv6 stays.
    w.sync(&d);
    assert_eq!((w.bound(), w.routed()), (vec!["10.96.0.1".to_string(), "192.0.2.50".into(), "fd00:96::1".into()], vec![]));
    w.syncer.settings.vip_binding = VipBinding::Route;
    let st = w.sync(&d);
    assert_eq!((st.addresses_bound, st.addresses_unbound), (2, 2));
    assert_eq!((w.bound(), w.routed()), (vec!["fd00:96::1".to_string()], vec!["10.96.0.1".to_string(), "192.0.2.50".into()]));
    w.ipvs.writes.clear();
    assert_eq!(w.sync(&d).addresses_bound, 0, "settled");
    assert!(w.ipvs.writes.is_empty());
    // A Service removed incrementally takes its route with it.
    let mut less = d.clone();
    less.frontends.retain(|k, _| k.ip != "192.0.2.50".parse::<IpAddr>().unwrap());
    let vs = desired_virtual_servers(&less, &w.syncer.settings);
    let only: BTreeSet<ServiceId> = [tcp("192.0.2.50", 80)].into();
    w.syncer.sync(&mut w.ipvs, &mut w.links, &mut w.ct, &vs, Some(&only)).unwrap();
    assert_eq!(w.routed(), vec!["10.96.0.1"]);
    assert!(!w.ipvs.services.contains_key(&tcp("192.0.2.50", 80)));
    // A virtual server on a routed VIP is ours after a switch back: it goes with its Service.
    w.syncer.settings.vip_binding = VipBinding::Address;
    w.sync(&DesiredState::default());
    assert!(w.ipvs.services.is_empty(), "{:?}", w.ipvs.services.keys().collect::<Vec<_>>());
    assert_eq!((w.bound(), w.routed()), (vec![], vec![]));
}

#[test]
fn cleanup_owns_routed_vips() {
    let mut w = World::new();
    w.syncer.settings.vip_binding = VipBinding::Route;
    w.sync(&state(vec![("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 80)], Protocol::Tcp))]));
    let foreign = ServiceConfig { id: tcp("192.0.2.10", 80), scheduler: "wlc".into(), flags: 0, timeout_s: 0, netmask: u32::MAX, pe_name: None };
    w.ipvs.add_service(&foreign).unwrap();
    cleanup(&mut w.ipvs, &mut w.links, &[]).unwrap();
    assert_eq!(w.ipvs.services.keys().copied().collect::<Vec<_>>(), vec![foreign.id]);
    assert!(w.links.local_routes.is_empty() && w.links.links.is_empty());
}

#[test]
fn stale_services_go_foreign_ones_stay() {
    let mut w = World::new();
    let d = state(vec![
        ("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 80)], Protocol::Tcp)),
        ("198.18.0.1", 30080, Protocol::Tcp, fe(FrontendKind::NodePort, &[("10.244.1.2", 80)], Protocol::Tcp)),
    ]);
    w.sync(&d);
    // Someone else's virtual server, on an address we never bound.
    let foreign = ServiceConfig { id: tcp("192.0.2.10", 80), scheduler: "wlc".into(), flags: 0, timeout_s: 0, netmask: u32::MAX, pe_name: None };
    w.ipvs.add_service(&foreign).unwrap();
    w.sync(&DesiredState::default());
    assert_eq!(w.ipvs.services.keys().copied().collect::<Vec<_>>(), vec![foreign.id]);
    assert!(w.bound().is_empty());
}

#[test]
fn external_ips_on_node_addresses_are_not_bound_but_are_ours() {
    let mut w = World::new();
    w.syncer.settings.node_addresses = vec!["198.18.0.1".parse().unwrap()];
    let d = state(vec![
        ("198.18.0.1", 80, Protocol::Tcp, fe(FrontendKind::ExternalIp, &[("10.244.1.2", 80)], Protocol::Tcp)),
        ("192.0.2.50", 80, Protocol::Tcp, fe(FrontendKind::LoadBalancer, &[("10.244.1.2", 80)], Protocol::Tcp)),
    ]);
    w.sync(&d);
    assert_eq!(w.bound(), vec!["192.0.2.50"], "a node address is not bound on kube-ipvs0");
    assert!(w.ipvs.services.contains_key(&tcp("198.18.0.1", 80)));
    // The service goes: its virtual server on the node address goes too.
    w.sync(&DesiredState::default());
    assert!(w.ipvs.services.is_empty(), "{:?}", w.ipvs.services.keys().collect::<Vec<_>>());
}

#[test]
fn annotations_and_affinity_reach_the_kernel() {
    let mut w = World::new();
    let mut f = fe(FrontendKind::LoadBalancer, &[("10.244.1.2", 80), ("10.244.2.2", 80)], Protocol::Tcp);
    f.affinity_timeout_s = 600;
    f.ipvs =
        IpvsOptions { scheduler: Some("wrr".into()), forward: IpvsForward::DirectRouting, weights: [("10.244.2.2".parse().unwrap(), 3)].into_iter().collect() }
            .into();
    w.sync(&state(vec![("192.0.2.50", 80, Protocol::Tcp, f.clone())]));
    let (cfg, dests) = &w.ipvs.services[&tcp("192.0.2.50", 80)];
    assert_eq!((cfg.scheduler.as_str(), cfg.flags, cfg.timeout_s), ("wrr", flags::PERSISTENT, 600));
    let weights: Vec<_> = dests.values().map(|d| (d.config.weight, d.config.fwd)).collect();
    assert_eq!(weights, vec![(1, FwdMethod::Route), (3, FwdMethod::Route)]);
    // A scheduler change is an update, not a re-creation (connections survive).
    std::sync::Arc::make_mut(&mut f.ipvs).scheduler = Some("sh".into());
    w.ipvs.writes.clear();
    w.sync(&state(vec![("192.0.2.50", 80, Protocol::Tcp, f)]));
    assert_eq!(w.ipvs.writes, vec!["update-service TCP 192.0.2.50:80"]);
}

/// FakeLinks that notes which thread bound each VIP, refuses some, and at its first address
/// may wait to meet an IPVS write.
#[derive(Default)]
struct WatchedLinks {
    inner: FakeLinks,
    binders: BTreeSet<String>,
    refuse: BTreeSet<IpAddr>,
    meeting: Option<Meeting>,
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("unnamed").to_string()
}

/// Each side says it has started and waits (a while) for the other to have started: both
/// meet only if they run at the same time.
struct Meeting {
    tell: std::sync::mpsc::Sender<()>,
    hear: std::sync::mpsc::Receiver<()>,
    met: Option<bool>,
}

impl Meeting {
    fn pair() -> (Meeting, Meeting) {
        let ((a_tell, b_hear), (b_tell, a_hear)) = (std::sync::mpsc::channel(), std::sync::mpsc::channel());
        (Meeting { tell: a_tell, hear: a_hear, met: None }, Meeting { tell: b_tell, hear: b_hear, met: None })
    }
    fn meet(&mut self) {
        if self.met.is_none() {
            let _ = self.tell.send(());
            self.met = Some(self.hear.recv_timeout(std::time::Duration::from_secs(5)).is_ok());
        }
    }
}

/// FakeIpvs whose first read of the virtual servers waits to meet the binding.
struct MeetingIpvs {
    inner: FakeIpvs,
    meeting: Meeting,
}

impl Ipvs for MeetingIpvs {
    fn info(&mut self) -> Result<crate::dataplane::ipvs::client::Info, IpvsError> {
        self.inner.info()
    }
    fn services(&mut self) -> Result<Vec<crate::dataplane::ipvs::client::Service>, IpvsError> {
        self.meeting.meet();
        self.inner.services()
    }
    fn service(&mut self, id: &ServiceId) -> Result<Option<crate::dataplane::ipvs::client::Service>, IpvsError> {
        self.inner.service(id)
    }
    fn add_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError> {
        self.inner.add_service(s)
    }
    fn update_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError> {
        self.inner.update_service(s)
    }
    fn del_service(&mut self, id: &ServiceId) -> Result<(), IpvsError> {
        self.inner.del_service(id)
    }
    fn dests(&mut self, id: &ServiceId) -> Result<Vec<crate::dataplane::ipvs::client::Dest>, IpvsError> {
        self.inner.dests(id)
    }
    fn add_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError> {
        self.inner.add_dest(id, d)
    }
    fn update_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError> {
        self.inner.update_dest(id, d)
    }
    fn del_dest(&mut self, id: &ServiceId, addr: IpAddr, port: u16) -> Result<(), IpvsError> {
        self.inner.del_dest(id, addr, port)
    }
    fn flush(&mut self) -> Result<(), IpvsError> {
        self.inner.flush()
    }
    fn zero(&mut self, id: Option<&ServiceId>) -> Result<(), IpvsError> {
        self.inner.zero(id)
    }
    fn timeouts(&mut self) -> Result<crate::dataplane::ipvs::client::Timeouts, IpvsError> {
        self.inner.timeouts()
    }
    fn set_timeouts(&mut self, t: &crate::dataplane::ipvs::client::Timeouts) -> Result<(), IpvsError> {
        self.inner.set_timeouts(t)
    }
}

impl Links for WatchedLinks {
    fn ensure_dummy(&mut self, name: &str) -> Result<u32, LinkError> {
        self.inner.ensure_dummy(name)
    }
    fn link_index(&mut self, name: &str) -> Result<Option<u32>, LinkError> {
        self.inner.link_index(name)
    }
    fn delete_link(&mut self, name: &str) -> Result<(), LinkError> {
        self.inner.delete_link(name)
    }
    fn addresses(&mut self, ifindex: u32) -> Result<BTreeSet<IpAddr>, LinkError> {
        self.inner.addresses(ifindex)
    }
    fn add_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError> {
        self.binders.insert(thread_name());
        if let Some(m) = &mut self.meeting {
            m.meet();
        }
        if self.refuse.contains(&addr) {
            return Err(LinkError::Kernel { op: "add address", object: addr.to_string(), err: std::io::Error::from_raw_os_error(libc::ENOSPC) });
        }
        self.inner.add_address(ifindex, addr)
    }
    fn del_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError> {
        self.inner.del_address(ifindex, addr)
    }
    fn local_routes(&mut self) -> Result<BTreeSet<IpAddr>, LinkError> {
        self.inner.local_routes()
    }
    fn change_local_routes(&mut self, add: bool, addrs: &[IpAddr]) -> Vec<Result<(), LinkError>> {
        self.binders.insert(thread_name());
        self.inner.change_local_routes(add, addrs)
    }
}

fn many(n: u32) -> DesiredState {
    let mut d = DesiredState::default();
    for i in 0..n {
        let ip = format!("10.96.{}.{}", i / 250, 1 + i % 250);
        d.frontends.extend(state(vec![(ip.as_str(), 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 80)], Protocol::Tcp))]).frontends);
    }
    d
}

#[test]
fn a_large_bind_runs_beside_the_ipvs_writes_and_each_failure_is_reported_and_retried() {
    let settings = SyncSettings::default();
    let mut syncer = IpvsSyncer::new(settings.clone());
    let (mut ipvs, mut ct) = (FakeIpvs::default(), FakeConntrack::default());
    let refused: IpAddr = "10.96.0.7".parse().unwrap();
    let mut links = WatchedLinks { refuse: [refused].into(), ..Default::default() };
    let vs = desired_virtual_servers(&many(300), &settings);

    let st = syncer.sync(&mut ipvs, &mut links, &mut ct, &vs, None).unwrap();
    assert_eq!(links.binders, ["kpr-bind".to_string()].into(), "300 binds go on the binding thread");
    assert_eq!(st.addresses_bound, 299);
    assert_eq!(st.errors.len(), 1, "{:?}", st.errors);
    assert!(st.errors[0].contains("10.96.0.7") && st.errors[0].starts_with("bind "), "{}", st.errors[0]);
    assert_eq!(ipvs.services.len(), 300, "every virtual server is written, its VIP bound or not");
    assert_eq!(links.inner.links[IPVS_DUMMY].1.len(), 299);

    // The next sync, even an incremental one that trusts the cached bindings, binds only what
    // is missing: on the caller's thread, as so few are.
    links.refuse.clear();
    links.binders.clear();
    let only: BTreeSet<ServiceId> = [tcp("10.96.0.1", 80)].into();
    let st = syncer.sync(&mut ipvs, &mut links, &mut ct, &vs, Some(&only)).unwrap();
    assert_eq!((st.addresses_bound, st.errors.len()), (1, 0), "{:?}", st.errors);
    assert!(!links.binders.contains("kpr-bind"), "{:?}", links.binders);
    assert!(links.inner.links[IPVS_DUMMY].1.contains(&refused));
    let st = syncer.sync(&mut ipvs, &mut links, &mut ct, &vs, None).unwrap();
    assert_eq!((st.addresses_bound, st.writes, st.errors.len()), (0, 0, 0));
}

#[test]
fn the_binding_and_the_ipvs_writes_run_at_the_same_time() {
    let settings = SyncSettings::default();
    let vs = desired_virtual_servers(&many(settings.concurrent_binds as u32), &settings);
    let (for_links, for_ipvs) = Meeting::pair();
    let mut links = WatchedLinks { meeting: Some(for_links), ..Default::default() };
    let mut ipvs = MeetingIpvs { inner: FakeIpvs::default(), meeting: for_ipvs };
    let st = IpvsSyncer::new(settings.clone()).sync(&mut ipvs, &mut links, &mut FakeConntrack::default(), &vs, None).unwrap();
    assert!(st.errors.is_empty(), "{:?}", st.errors);
    assert_eq!((links.meeting.unwrap().met, ipvs.meeting.met), (Some(true), Some(true)), "each side waited for the other while it ran");
    assert_eq!((st.addresses_bound, ipvs.inner.services.len()), (vs.len(), vs.len()));
}

#[test]
fn below_the_threshold_the_vips_are_bound_first_on_the_syncs_thread() {
    let settings = SyncSettings { concurrent_binds: 4, ..SyncSettings::default() };
    for (n, binder) in [(3, thread_name()), (4, "kpr-bind".to_string())] {
        let mut links = WatchedLinks::default();
        let vs = desired_virtual_servers(&many(n), &settings);
        let st = IpvsSyncer::new(settings.clone()).sync(&mut FakeIpvs::default(), &mut links, &mut FakeConntrack::default(), &vs, None).unwrap();
        assert_eq!(st.addresses_bound, n as usize);
        assert_eq!(links.binders, [binder].into(), "{n} binds");
    }
}

#[test]
fn a_failed_write_names_its_service_and_the_others_are_programmed() {
    let mut w = World::new();
    let d = state(vec![
        ("10.96.0.1", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.2", 8080)], Protocol::Tcp)),
        ("10.96.0.2", 80, Protocol::Tcp, fe(FrontendKind::ClusterIp, &[("10.244.1.3", 8080)], Protocol::Tcp)),
    ]);
    let mut vs = desired_virtual_servers(&d, &w.syncer.settings);
    // A scheduler the kernel does not have: the kernel refuses the virtual server.
    let bad = vs.get_mut(&tcp("10.96.0.2", 80)).unwrap();
    bad.config.scheduler = "no-such-scheduler".into();
    let service = bad.service.clone();
    let st = w.syncer.sync(&mut w.ipvs, &mut w.links, &mut w.ct, &vs, None).unwrap();
    assert!(w.ipvs.services.contains_key(&tcp("10.96.0.1", 80)) && !w.ipvs.services.contains_key(&tcp("10.96.0.2", 80)));
    // The virtual server's add and its destination's: each counted, each an Event on the Service.
    assert_eq!((st.errors.len(), st.failed.len()), (2, 2), "{:?}", st.errors);
    let object = format!("Service {}", service.rsplit_once(':').unwrap().0);
    for e in &st.failed {
        assert_eq!((e.reason, &e.object), (WRITE_FAILED, &object), "{e}");
    }
    assert!(st.failed[0].message.contains("add service"), "{}", st.failed[0]);
}
