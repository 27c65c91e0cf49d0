//! A switch to IPVS mode on a kernel with TCX (6.6+; this host): the fast path's TC ingress link
//! is kept, renamed as the drain link, and IPVS mode's set matching is attached after it, in
//! that order on the interface; once drained, the fast path's links go and the set matching
//! stays. (The IPVS guest, 6.1, proves the same with netlink TC filters in `vm::mode_switch`;
//! this host has no IPVS, so the order is read back from the kernel, not shown by traffic.)
use aya::programs::{tc::TcAttachType, SchedClassifier, XdpMode};
use kpr_lab::{must, PinDir};
use proxy_agent::{
    dataplane::ebpf::kernel::{self, Datapath, Hook},
    settings::Capacities,
};
use proxy_common::prog_names;

fn tcx_ingress(iface: &str) -> Vec<String> {
    let (_, progs) = SchedClassifier::query_tcx(iface, TcAttachType::Ingress).expect("query TCX links");
    progs.iter().map(|p| p.name_as_str().unwrap_or("?").to_string()).collect()
}

/// Runs `check` in a network namespace of its own holding a veth pair d0/d1 (setns applies to
/// the calling thread: the check runs in one of its own), then deletes the namespace.
fn in_namespace(name: &str, check: impl FnOnce() + Send + 'static) {
    let ns = format!("kpr-{name}-{}", std::process::id());
    must(&format!("ip netns add {ns}"));
    must(&format!("ip -n {ns} link add d0 type veth peer name d1 && ip -n {ns} link set d0 up && ip -n {ns} link set d1 up"));
    let ns2 = ns.clone();
    let result = std::thread::spawn(move || {
        proxy_agent::host::netif::enter_netns(&ns2).expect("enter the test namespace");
        check();
    })
    .join();
    let _ = std::process::Command::new("ip").args(["netns", "del", &ns]).status();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// Capacities small enough for a namespace's worth of checks.
fn small() -> Capacities {
    Capacities { services: 16, backends: 16, slots: 16, conntrack: 16, conntrack_new: 16, conntrack6: 16, conntrack6_new: 16, affinity: 16 }
}

#[test]
fn drain_runs_the_fast_path_before_the_set_matching_then_detaches_it() {
    in_namespace("tcx", || {
        let pins = PinDir::new("tcxdrain");
        let mut dp = Datapath::load(pins.path(), small()).expect("load");
        // eBPF mode was here.
        dp.attach("d0", Hook::TcIngress, XdpMode::Skb).expect("fast path");
        dp.attach("d0", Hook::TcEgress, XdpMode::Skb).expect("fast path egress");
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_INGRESS]);
        // IPVS mode starts behind it.
        assert_eq!(kernel::keep_tc_ingress_for_drain(pins.path()).unwrap(), ["d0"]);
        assert!(kernel::attached_links(pins.path()).contains(&("d0".to_string(), Hook::TcDrain)));
        dp.load_ipset().expect("set matching");
        dp.set_after_fast_path(true);
        dp.attach("d0", Hook::TcIngress, XdpMode::Skb).expect("set matching after the fast path");
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_INGRESS, prog_names::TC_IPSET], "the fast path first, then the set matching");
        // A restart during the drain re-attaches the set matching in place.
        dp.attach("d0", Hook::TcIngress, XdpMode::Skb).expect("again");
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_INGRESS, prog_names::TC_IPSET]);
        // Drained.
        let removed = kernel::detach_fast_path(pins.path(), &prog_names::SOCK);
        assert!(removed.iter().any(|r| r == "tc_drain d0") && removed.iter().any(|r| r == "tc_egress d0"), "{removed:?}");
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_IPSET], "only the set matching stays");
        let (_, egress) = SchedClassifier::query_tcx("d0", TcAttachType::Egress).expect("query egress");
        assert!(egress.is_empty(), "the fast path's egress went");
        drop(pins);
    });
}

/// The same on an uplink whose IPv4 ingress runs at TC (`tc_uplink`, beside IPv6's): after a
/// switch from IPVS mode both go first on the hook, ahead of the set matching that IPVS mode
/// left there; on a switch back the uplink's link is kept as the drain link, ahead of the set
/// matching again, and goes with IPv6's once drained.
#[test]
fn an_uplinks_tc_ingress_goes_first_on_the_hook_both_ways() {
    in_namespace("tcxu", || {
        let pins = PinDir::new("tcxuplink");
        let mut dp = Datapath::load(pins.path(), small()).expect("load");
        // IPVS mode was here: its set matching on the uplink.
        dp.load_ipset().expect("set matching");
        dp.attach("d0", Hook::TcIngress, XdpMode::Skb).expect("set matching");
        // The fast path takes over while IPVS keeps its connections.
        dp.attach("d0", Hook::TcIngress6, XdpMode::Skb).expect("IPv6 ingress");
        dp.attach("d0", Hook::TcUplink, XdpMode::Skb).expect("uplink ingress");
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_UPLINK, prog_names::TC_INGRESS6, prog_names::TC_IPSET], "the fast path first");
        // IPVS's connections ended: the handover removes the set matching.
        kernel::detach(pins.path(), "d0", Hook::TcIngress).unwrap();
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_UPLINK, prog_names::TC_INGRESS6]);
        // Back to IPVS mode: the uplink's link drains in front of the set matching.
        assert_eq!(kernel::keep_tc_ingress_for_drain(pins.path()).unwrap(), ["d0"]);
        assert!(kernel::attached_links(pins.path()).contains(&("d0".to_string(), Hook::TcDrain)));
        dp.set_after_fast_path(true);
        dp.attach("d0", Hook::TcIngress, XdpMode::Skb).expect("set matching after the fast path");
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_UPLINK, prog_names::TC_INGRESS6, prog_names::TC_IPSET]);
        let removed = kernel::detach_fast_path(pins.path(), &prog_names::SOCK);
        assert!(removed.iter().any(|r| r == "tc_drain d0") && removed.iter().any(|r| r == "tc_ingress6 d0"), "{removed:?}");
        assert_eq!(tcx_ingress("d0"), [prog_names::TC_IPSET], "only the set matching stays");
        drop(pins);
    });
}
