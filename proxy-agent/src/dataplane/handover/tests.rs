use super::*;
use crate::{
    dataplane::{
        ebpf::maps::FakeMaps,
        ipvs::client::{DestConfig, FakeIpvs, FwdMethod, ServiceConfig, ServiceId},
    },
    host::netfilter::FakeNetfilter,
    netlink::rtnl::FakeLinks,
};

const VIP: &str = "10.96.0.10";

/// IPVS mode's state: kube-ipvs0 holding the VIP, its virtual server with one destination
/// carrying `active` established connections, and the fixed rules.
fn ipvs_mode(active: u32) -> (FakeIpvs, FakeLinks, FakeNetfilter) {
    let id = ServiceId::Addr { proto: 6, addr: VIP.parse().unwrap(), port: 80 };
    let mut ipvs = FakeIpvs::default();
    ipvs.add_service(&ServiceConfig { id, scheduler: "rr".into(), flags: 0, timeout_s: 0, netmask: u32::MAX, pe_name: None }).unwrap();
    ipvs.add_dest(&id, &DestConfig::new("10.244.1.2".parse().unwrap(), 8080, FwdMethod::Masq, 1)).unwrap();
    ipvs.set_conns(&id, "10.244.1.2".parse().unwrap(), 8080, active, 3);
    let mut links = FakeLinks::default();
    let i = links.ensure_dummy(IPVS_DUMMY).unwrap();
    links.add_address(i, VIP.parse().unwrap()).unwrap();
    let mut nf = FakeNetfilter::default();
    nf.saved.insert((rules::BACKEND.into(), "nat".into()), format!(":{} - [0:0]\n-A POSTROUTING -j {}\n", rules::NAT_CHAIN, rules::NAT_CHAIN));
    (ipvs, links, nf)
}

fn handover(ipvs: FakeIpvs, links: FakeLinks, nf: FakeNetfilter, pins: &Path) -> IpvsHandover {
    IpvsHandover {
        ipvs: Box::new(ipvs),
        links: Box::new(links),
        nf: Box::new(nf),
        kernel_programs: false,
        pin_dir: pins.into(),
        uplinks: vec![],
        clock: HandoverClock::new(Duration::from_secs(3600)),
    }
}

#[test]
fn no_ipvs_mode_here_means_no_handover_and_nothing_touched() {
    let pins = PathBuf::from("/nonexistent/kpr-handover-test");
    let mut maps = FakeMaps::default();
    // Someone else's virtual server, no kube-ipvs0: not kpr's.
    let (ipvs, _, nf) = ipvs_mode(5);
    let links = FakeLinks::default();
    let h = handover(ipvs, links, nf, &pins).begin(&mut maps);
    assert!(h.is_none());
    assert_eq!(maps.config.flags & CFG_F_HANDOVER, 0);
}

#[test]
fn ipvs_keeps_its_connections_until_they_end_then_its_state_goes() {
    let pins = PathBuf::from("/nonexistent/kpr-handover-test");
    let mut maps = FakeMaps::default();
    let (ipvs, links, nf) = ipvs_mode(2);
    let mut h = handover(ipvs, links, nf, &pins).begin(&mut maps).expect("IPVS serves connections: a handover");
    assert_ne!(maps.config.flags & CFG_F_HANDOVER, 0, "the fast path passes IPVS's connections on");
    // Read again only every IPVS_POLL.
    let none = BTreeSet::new();
    assert_eq!(h.poll(&mut maps, &none), Progress::Serving(u64::MAX));
    h.clock.last_count -= POLL;
    assert_eq!(h.poll(&mut maps, &none), Progress::Serving(2));
    // The connections end: here, with their destination.
    let id = ServiceId::Addr { proto: 6, addr: VIP.parse().unwrap(), port: 80 };
    h.ipvs.del_dest(&id, "10.244.1.2".parse().unwrap(), 8080).unwrap();
    h.clock.last_count -= POLL;
    assert_eq!(h.poll(&mut maps, &none), Progress::Done);
    assert_eq!(maps.config.flags & CFG_F_HANDOVER, 0, "flag cleared");
    assert!(h.ipvs.services().unwrap().is_empty(), "the virtual server went");
    assert_eq!(h.links.link_index(IPVS_DUMMY).unwrap(), None, "kube-ipvs0 went");
}

#[test]
fn without_connections_ipvs_modes_state_goes_at_once() {
    let pins = PathBuf::from("/nonexistent/kpr-handover-test");
    let mut maps = FakeMaps::default();
    maps.config.flags = CFG_F_HANDOVER;
    let (ipvs, links, nf) = ipvs_mode(0);
    assert!(handover(ipvs, links, nf, &pins).begin(&mut maps).is_none());
    assert_eq!(maps.config.flags & CFG_F_HANDOVER, 0, "a flag left by an earlier agent is cleared");
}

/// conntrack as a list the test edits.
struct Translated(std::rc::Rc<std::cell::RefCell<Vec<(IpAddr, u16)>>>);
impl TranslatedConnections for Translated {
    fn translated_tcp(&mut self) -> Result<Vec<(IpAddr, u16)>, crate::netlink::socket::NlError> {
        Ok(self.0.borrow().clone())
    }
}

#[test]
fn kube_proxys_translated_connections_to_services_hold_the_handover_until_they_end() {
    let vip: (IpAddr, u16) = (VIP.parse().unwrap(), 80);
    let host_port: (IpAddr, u16) = ("192.0.2.1".parse().unwrap(), 8443);
    let list = std::rc::Rc::new(std::cell::RefCell::new(vec![vip, host_port]));
    let mut maps = FakeMaps::default();
    let empty = Translated(std::rc::Rc::new(std::cell::RefCell::new(vec![])));
    assert!(ConntrackHandover::start(Box::new(empty), Box::new(FakeNetfilter::default()), &mut maps, Duration::from_secs(3600)).is_none());
    assert_eq!(maps.config.flags & CFG_F_HANDOVER, 0, "nothing translated: no handover");
    let restored = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let nf = Recording(restored.clone());
    let mut h = ConntrackHandover::start(Box::new(Translated(list.clone())), Box::new(nf), &mut maps, Duration::from_secs(3600))
        .expect("translated connections: a handover");
    assert_ne!(maps.config.flags & CFG_F_HANDOVER, 0);
    assert!(restored.borrow().iter().any(|r| r.contains(":KPR-HANDOVER - [0:0]\n-A KPR-HANDOVER -m conntrack")), "conntrack pinned: {restored:?}");
    // Before the first sync nothing is known of the Services: wait.
    h.clock.last_count -= POLL;
    assert_eq!(h.poll(&mut maps, &BTreeSet::new()), Progress::Serving(u64::MAX));
    let frontends: BTreeSet<(IpAddr, u16)> = [vip].into();
    assert_eq!(h.poll(&mut maps, &frontends), Progress::Serving(1), "only the connection to a Service counts");
    // The hostPort connection (not a Service's) does not hold the handover.
    list.borrow_mut().retain(|d| *d != vip);
    h.clock.last_count -= POLL;
    assert_eq!(h.poll(&mut maps, &frontends), Progress::Done);
    assert_eq!(maps.config.flags & CFG_F_HANDOVER, 0);
    assert!(restored.borrow().last().is_some_and(|r| r.contains("-X KPR-HANDOVER")), "conntrack unpinned: {restored:?}");
}

/// Netfilter whose filter table holds what was restored into it (enough for the pin).
struct Recording(std::rc::Rc<std::cell::RefCell<Vec<String>>>);
impl Netfilter for Recording {
    fn save(&self, _backend: &str, _table: &str) -> Result<String, NetfilterError> {
        let pinned = self.0.borrow().last().is_some_and(|r| r.contains("-A KPR-HANDOVER"));
        Ok(if pinned { ":KPR-HANDOVER - [0:0]\n".into() } else { String::new() })
    }
    fn restore(&mut self, _backend: &str, input: &str) -> Result<(), NetfilterError> {
        self.0.borrow_mut().push(input.into());
        Ok(())
    }
    fn ipsets(&self) -> Result<Vec<String>, NetfilterError> {
        Ok(vec![])
    }
    fn destroy_ipset(&mut self, _: &str) -> Result<(), NetfilterError> {
        Ok(())
    }
    fn nft_tables(&self) -> Result<Vec<(String, String)>, NetfilterError> {
        Ok(vec![])
    }
    fn delete_nft_table(&mut self, _: &str, _: &str) -> Result<(), NetfilterError> {
        Ok(())
    }
}
