//! When an endpoint leaves its service, its sessionAffinity entries for that service go (the
//! data path only ignores affinity to a backend that no longer exists anywhere).
//!
//! A UDP endpoint's clients must also move at once: UDP has no handshake that would bring them
//! to a live backend, so a DNS forwarder or a statsd client would keep sending into a removed
//! pod (or, once its address is reused, to a stranger). Three places hold them there, and each
//! is cleared:
//! - the data path's conntrack: its flows to that (service, backend) are deleted, so the next
//!   datagram is balanced again;
//! - the kernel's conntrack: NAT entries for the service address answered by that endpoint
//!   (kube-proxy's own cleanup; in eBPF mode these are what kube-proxy's rules left in a
//!   migration as kubeproxy_cleanup, the data path's own flows are not NATed there);
//! - the node's sockets that connect-time balancing connected to it: destroyed (sock_diag), so
//!   the application reconnects to a live backend.
//!
//! TCP flows are left to finish, as kube-proxy leaves them: their backend may still answer
//! (a graceful termination), and a dead one resets them.
use std::{collections::BTreeSet, net::IpAddr};

use proxy_common::{
    user::{port_host, words_addr},
    PROTO_UDP,
};

use crate::{
    dataplane::ebpf::maps::MapError,
    dataplane::ebpf::sync::RemovedBackend,
    dataplane::ebpf::{conntrack::Gc, maps::ConntrackTables},
    netlink::ctnetlink::{ConntrackFlusher, NatTuple},
    netlink::sockdiag::{self, Sockets},
};

/// Which sockets connect-time balancing sent to a backend (KPR_SOCK_REV_V1's cookies).
pub trait BalancedSockets {
    /// (An IPv6 socket balanced through an IPv4-mapped address is listed under the IPv4 one.)
    fn cookies_to(&self, addr: IpAddr, port: u16) -> Result<BTreeSet<u64>, MapError>;
}

/// The sessionAffinity map (KPR_AFF_V1).
pub trait Affinity {
    /// Deletes the entries of these (service id, backend id) pairs; returns how many.
    fn purge(&mut self, pairs: &BTreeSet<(u32, u32)>) -> Result<usize, MapError>;
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Data-path flows deleted.
    pub flows: usize,
    /// Kernel conntrack entries deleted.
    pub kernel_entries: usize,
    /// Node sockets destroyed.
    pub sockets: usize,
    /// sessionAffinity entries deleted.
    pub affinity: usize,
    /// What could not be done (the rest was).
    pub errors: Vec<String>,
}

/// The kernel handles the cleanup may use; a missing one is skipped (and said once at start).
pub struct Handles<'a> {
    pub tables: &'a mut dyn ConntrackTables,
    pub affinity: &'a mut dyn Affinity,
    pub kernel_conntrack: Option<&'a mut dyn ConntrackFlusher>,
    pub sockets: Option<&'a mut dyn Sockets>,
    pub balanced: &'a dyn BalancedSockets,
}

pub fn endpoints_removed(removed: &BTreeSet<RemovedBackend>, gc: &mut Gc, h: Handles<'_>) -> Report {
    let mut r = Report::default();
    let all: BTreeSet<(u32, u32)> = removed.iter().map(|x| (x.service_id, x.backend_id)).collect();
    match h.affinity.purge(&all) {
        Ok(n) => r.affinity = n,
        Err(e) => r.errors.push(format!("sessionAffinity entries: {e}")),
    }
    let removed: BTreeSet<RemovedBackend> = removed.iter().filter(|x| x.frontend.proto == PROTO_UDP).copied().collect();
    if removed.is_empty() {
        return r;
    }
    let pairs: BTreeSet<(u32, u32)> = removed.iter().map(|x| (x.service_id, x.backend_id)).collect();
    match gc.purge(h.tables, &pairs) {
        Ok(st) => r.flows = st.flows,
        Err(e) => r.errors.push(format!("data-path flows: {e}")),
    }
    if let Some(ct) = h.kernel_conntrack {
        let tuples: Vec<NatTuple> = removed
            .iter()
            .map(|x| (x.frontend.proto, words_addr(x.frontend.addr), port_host(x.frontend.port), words_addr(x.backend.addr), port_host(x.backend.port)))
            .collect();
        match ct.flush_all(&tuples) {
            Ok(n) => r.kernel_entries = n,
            Err(e) => r.errors.push(format!("kernel conntrack: {e}")),
        }
    }
    if let Some(sockets) = h.sockets {
        let backends: BTreeSet<(IpAddr, u16)> = removed.iter().map(|x| (words_addr(x.backend.addr), port_host(x.backend.port))).collect();
        for (addr, port) in backends {
            let cookies = match h.balanced.cookies_to(addr, port) {
                Ok(c) if c.is_empty() => continue,
                Ok(c) => c,
                Err(e) => {
                    r.errors.push(format!("balanced sockets: {e}"));
                    continue;
                }
            };
            match sockdiag::end_balanced(sockets, addr, port, &cookies) {
                Ok(n) => r.sockets += n,
                Err(e) => r.errors.push(format!("sockets connected to {addr}:{port}: {e}")),
            }
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::ebpf::{
            conntrack::Timeouts,
            maps::{FakeTables, Table},
        },
        netlink::ctnetlink::FakeConntrack,
        netlink::sockdiag::{FakeSockets, UdpSocket},
    };
    use proxy_common::{Backend, CtKey, CtValue, ServiceKey, CT_DIR_EGRESS, CT_DIR_INGRESS, CT_F_REPLY, PROTO_UDP, SCOPE_INTERNAL};

    #[derive(Default)]
    struct Aff(Vec<BTreeSet<(u32, u32)>>);
    impl Affinity for Aff {
        fn purge(&mut self, pairs: &BTreeSet<(u32, u32)>) -> Result<usize, MapError> {
            self.0.push(pairs.clone());
            Ok(pairs.len())
        }
    }

    struct Balanced(BTreeSet<u64>);
    impl BalancedSockets for Balanced {
        fn cookies_to(&self, addr: IpAddr, port: u16) -> Result<BTreeSet<u64>, MapError> {
            Ok(if (addr, port) == ("10.244.1.2".parse().unwrap(), 5353) { self.0.clone() } else { BTreeSet::new() })
        }
    }

    #[test]
    fn a_removed_udp_endpoint_loses_its_flows_kernel_entries_and_sockets() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let w = |s: &str| proxy_common::user::addr_words(ip(s))[0];
        let frontend = ServiceKey::new(ip("10.96.0.53"), 53, PROTO_UDP, SCOPE_INTERNAL);
        let backend = Backend::new(ip("10.244.1.2"), 5353, PROTO_UDP);
        let gone = RemovedBackend { service_id: 4, backend_id: 9, frontend, backend };
        // One data-path flow to it: forward and reverse-DNAT entries.
        let mut tables = FakeTables::default();
        let base = CtValue { last_seen_ns: 1, service_id: 4, backend_id: 9, ..CtValue::default() };
        tables.assured.insert(
            CtKey {
                saddr: w("10.244.9.2"),
                daddr: w("10.96.0.53"),
                sport: 6000u16.to_be(),
                dport: 53u16.to_be(),
                proto: PROTO_UDP,
                dir: CT_DIR_INGRESS,
                _pad: 0,
            },
            CtValue { new_saddr: w("10.244.9.2"), new_daddr: w("10.244.1.2"), new_sport: 6000u16.to_be(), new_dport: 5353u16.to_be(), ..base },
        );
        tables.assured.insert(
            CtKey {
                saddr: w("10.244.1.2"),
                daddr: w("10.244.9.2"),
                sport: 5353u16.to_be(),
                dport: 6000u16.to_be(),
                proto: PROTO_UDP,
                dir: CT_DIR_EGRESS,
                _pad: 0,
            },
            CtValue { new_saddr: w("10.96.0.53"), new_daddr: w("10.244.9.2"), new_sport: 53u16.to_be(), new_dport: 6000u16.to_be(), flags: CT_F_REPLY, ..base },
        );
        let mut kernel = FakeConntrack::default();
        let sock = |cookie| UdpSocket { src: "198.18.0.1".parse().unwrap(), sport: 40000, dst: "10.244.1.2".parse().unwrap(), dport: 5353, ifindex: 0, cookie };
        let mut sockets = FakeSockets { open: vec![sock(7), sock(8)], ..Default::default() };
        let mut gc = Gc::new(Timeouts::default(), 64);
        let mut aff = Aff::default();
        // A TCP backend leaving too: its affinity goes, its flows stay.
        let tcp = RemovedBackend { frontend: ServiceKey::new(ip("10.96.0.12"), 80, proxy_common::PROTO_TCP, SCOPE_INTERNAL), service_id: 5, ..gone };
        let r = endpoints_removed(
            &[gone, tcp].into_iter().collect(),
            &mut gc,
            Handles {
                tables: &mut tables,
                affinity: &mut aff,
                kernel_conntrack: Some(&mut kernel),
                sockets: Some(&mut sockets),
                balanced: &Balanced([7].into_iter().collect()),
            },
        );
        assert_eq!(r, Report { flows: 1, kernel_entries: 0, sockets: 1, affinity: 2, errors: vec![] });
        assert_eq!(aff.0, vec![[(4, 9), (5, 9)].into_iter().collect()]);
        assert!(tables.table(Table::Assured).is_empty());
        assert_eq!(kernel.flushed, vec![(PROTO_UDP, ip("10.96.0.53"), 53, ip("10.244.1.2"), 5353)]);
        assert_eq!(sockets.destroyed, vec![sock(7)], "only the socket kpr balanced there");
    }
}
