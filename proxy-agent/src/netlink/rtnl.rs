//! Links, addresses and local routes over rtnetlink (neli): the dummy interface `kube-ipvs0`
//! and the virtual IPs IPVS answers for, bound on it as addresses (kube-proxy's way) or as
//! local routes. Behind the `Links` trait; `FakeLinks` keeps maps.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use neli::{
    consts::{
        nl::NlmF,
        rtnl::{Ifa, IfaF, Ifla, IflaInfo, RtAddrFamily, RtScope, RtTable, Rta, Rtm, Rtn, Rtprot},
        socket::NlFamily,
    },
    nl::{NlPayload, Nlmsghdr, NlmsghdrBuilder},
    rtnl::{Ifaddrmsg, IfaddrmsgBuilder, IfinfomsgBuilder, RtattrBuilder, Rtmsg, RtmsgBuilder},
    socket::synchronous::NlSocketHandle,
    types::{Buffer, RtBuffer},
    utils::Groups,
    FromBytesWithInput, Size, ToBytes,
};

use crate::netlink::socket::{Acks, NlError};

/// kube-proxy's name, so operators' habits (`ip addr show kube-ipvs0`) carry over.
pub const IPVS_DUMMY: &str = "kube-ipvs0";

/// The `rtm_protocol` of the local routes kpr adds (`ip route show table local proto 107`): what
/// tells them from the kernel's own local routes, which every address brings.
pub const RTPROT_KPR: u8 = 107;

/// The loopback link's index in every network namespace (the kernel's LOOPBACK_IFINDEX).
const LOOPBACK_IFINDEX: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("rtnetlink socket: {0}")]
    Socket(String),
    #[error("{op} {object}: {err}")]
    Kernel { op: &'static str, object: String, err: std::io::Error },
    #[error("link {0} not found")]
    NoLink(String),
}

impl LinkError {
    pub fn errno(&self) -> Option<i32> {
        match self {
            LinkError::Kernel { err, .. } => err.raw_os_error(),
            _ => None,
        }
    }
}

/// Send: a sync binds on a thread of its own while it writes IPVS.
pub trait Links: Send {
    /// Creates the dummy link if missing (left down, like kube-proxy's); returns its index.
    fn ensure_dummy(&mut self, name: &str) -> Result<u32, LinkError>;
    fn link_index(&mut self, name: &str) -> Result<Option<u32>, LinkError>;
    fn delete_link(&mut self, name: &str) -> Result<(), LinkError>;
    fn addresses(&mut self, ifindex: u32) -> Result<BTreeSet<IpAddr>, LinkError>;
    /// Idempotent (an address already there is success).
    fn add_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError>;
    /// Idempotent.
    fn del_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError>;
    /// Adds (`add`) or deletes each of `addrs`, each with its own outcome. The kernel's
    /// implementation pipelines them (many per sendmsg): kube-ipvs0 holds an address per
    /// Service.
    fn change_addresses(&mut self, ifindex: u32, add: bool, addrs: &[IpAddr]) -> Vec<Result<(), LinkError>> {
        addrs.iter().map(|a| if add { self.add_address(ifindex, *a) } else { self.del_address(ifindex, *a) }).collect()
    }
    /// The IPv4 local routes kpr added (table local, protocol `RTPROT_KPR`, through `lo`).
    fn local_routes(&mut self) -> Result<BTreeSet<IpAddr>, LinkError>;
    /// Adds (`add`) or deletes a host-scope local route to each of `addrs` (IPv4), each with its
    /// own outcome: it makes the address local as an address would (source: the address
    /// itself), but costs O(log n) in the kernel where an IPv4 address costs a walk of the
    /// link's address list. Through `lo`, never kube-ipvs0: the kernel deletes every route
    /// through a link whose last IPv4 address goes, as kube-ipvs0's do when route binding takes
    /// over from addresses. Idempotent both ways.
    fn change_local_routes(&mut self, add: bool, addrs: &[IpAddr]) -> Vec<Result<(), LinkError>>;
}

pub struct NetlinkLinks {
    sock: NlSocketHandle,
    seq: u32,
    /// Requests in flight per sendmsg (1: one at a time).
    depth: usize,
    /// Which of them ask for an ACK.
    acks: Acks,
}

fn sock_err(e: impl std::fmt::Display) -> LinkError {
    LinkError::Socket(e.to_string())
}

impl NetlinkLinks {
    pub fn connect() -> Result<Self, LinkError> {
        let sock = NlSocketHandle::connect(NlFamily::Route, None, Groups::empty()).map_err(sock_err)?;
        Ok(NetlinkLinks { sock, seq: 0, depth: crate::netlink::socket::PIPELINE_DEPTH, acks: Acks::Last })
    }

    /// Changes addresses one request at a time, each waiting for its answer (the benchmark's
    /// baseline).
    pub fn one_at_a_time(mut self) -> Self {
        self.depth = 1;
        self
    }

    /// Asks for an ACK to every pipelined request (the previous release's way: the benchmark's
    /// baseline).
    pub fn ack_every_request(mut self) -> Self {
        self.acks = Acks::Every;
        self
    }

    /// The next request of type `ty` (`flags` besides REQUEST), numbered.
    fn message<P: Size>(&mut self, ty: Rtm, flags: NlmF, payload: P) -> Result<Nlmsghdr<Rtm, P>, LinkError> {
        self.seq = self.seq.wrapping_add(1);
        NlmsghdrBuilder::default()
            .nl_type(ty)
            .nl_flags(NlmF::REQUEST | flags)
            .nl_seq(self.seq)
            .nl_payload(NlPayload::Payload(payload))
            .build()
            .map_err(sock_err)
    }

    /// One request; the typed replies of a dump, or none after an ACK (`flags` ask for one).
    fn request<P>(&mut self, ty: Rtm, flags: NlmF, payload: P, op: &'static str, object: &str) -> Result<Vec<P>, LinkError>
    where
        P: Size + ToBytes + FromBytesWithInput<Input = usize> + std::fmt::Debug + Clone,
    {
        let msg = self.message(ty, flags, payload)?;
        crate::netlink::socket::exchange(&self.sock, &msg).map_err(|e| match e {
            NlError::Errno(errno) => LinkError::Kernel { op, object: object.into(), err: std::io::Error::from_raw_os_error(errno) },
            NlError::Socket(e) => LinkError::Socket(e),
        })
    }

    fn addr_msg(ifindex: u32, addr: IpAddr) -> Result<Ifaddrmsg, LinkError> {
        let (family, bytes, prefix) = match addr {
            IpAddr::V4(a) => (RtAddrFamily::Inet, a.octets().to_vec(), 32),
            IpAddr::V6(a) => (RtAddrFamily::Inet6, a.octets().to_vec(), 128),
        };
        let mut attrs = RtBuffer::<Ifa, Buffer>::new();
        for ty in [Ifa::Local, Ifa::Address] {
            attrs.push(RtattrBuilder::default().rta_type(ty).rta_payload(bytes.clone()).build().map_err(sock_err)?);
        }
        // IPv6: no duplicate address detection, which would hold a VIP tentative (unusable)
        // for a second or more; the address is the node's alone.
        let flags = if addr.is_ipv6() { IfaF::NODAD } else { IfaF::empty() };
        IfaddrmsgBuilder::default()
            .ifa_flags(flags)
            .ifa_family(family)
            .ifa_prefixlen(prefix)
            .ifa_scope(RtScope::Universe)
            .ifa_index(ifindex)
            .rtattrs(attrs)
            .build()
            .map_err(sock_err)
    }

    /// A host-scope local route to `addr` through `lo`, in table local, as the kernel makes for
    /// an address: the address is its own preferred source.
    fn local_route_msg(addr: IpAddr) -> Result<Rtmsg, LinkError> {
        let IpAddr::V4(v4) = addr else {
            return Err(LinkError::Socket(format!("{addr}: local routes are for IPv4 addresses")));
        };
        let mut attrs = RtBuffer::<Rta, Buffer>::new();
        for ty in [Rta::Dst, Rta::Prefsrc] {
            attrs.push(RtattrBuilder::default().rta_type(ty).rta_payload(v4.octets().to_vec()).build().map_err(sock_err)?);
        }
        attrs.push(RtattrBuilder::default().rta_type(Rta::Oif).rta_payload(LOOPBACK_IFINDEX).build().map_err(sock_err)?);
        RtmsgBuilder::default()
            .rtm_family(RtAddrFamily::Inet)
            .rtm_dst_len(32)
            .rtm_src_len(0)
            .rtm_tos(0)
            .rtm_table(RtTable::Local)
            .rtm_protocol(Rtprot::UnrecognizedConst(RTPROT_KPR))
            .rtm_scope(RtScope::Host)
            .rtm_type(Rtn::Local)
            .rtattrs(attrs)
            .build()
            .map_err(sock_err)
    }

    /// One request per address (`payload` builds each), pipelined: each address's outcome.
    fn pipelined<P: Size + ToBytes + std::fmt::Debug>(
        &mut self,
        c: Change,
        addrs: &[IpAddr],
        payload: impl Fn(IpAddr) -> Result<P, LinkError>,
    ) -> Vec<Result<(), LinkError>> {
        let mut msgs = Vec::with_capacity(addrs.len());
        for addr in addrs {
            match payload(*addr).and_then(|m| self.message(c.ty, NlmF::ACK | c.flags, m)) {
                Ok(m) => msgs.push(m),
                Err(e) => return addrs.iter().map(|_| Err(LinkError::Socket(e.to_string()))).collect(),
            }
        }
        match crate::netlink::socket::pipeline(&self.sock, &msgs, self.depth, self.acks) {
            Ok(answers) => addrs
                .iter()
                .zip(answers)
                .map(|(addr, a)| match a {
                    Err(errno) if !c.harmless.contains(&errno) => {
                        Err(LinkError::Kernel { op: c.op, object: addr.to_string(), err: std::io::Error::from_raw_os_error(errno) })
                    }
                    _ => Ok(()),
                })
                .collect(),
            Err(e) => {
                let e = match e {
                    NlError::Errno(errno) => std::io::Error::from_raw_os_error(errno).to_string(),
                    NlError::Socket(s) => s,
                };
                addrs.iter().map(|_| Err(LinkError::Socket(e.clone()))).collect()
            }
        }
    }
}

/// A kind of pipelined change: the request, and the errnos that mean it is already so
/// (idempotent adds and deletes).
struct Change {
    ty: Rtm,
    flags: NlmF,
    op: &'static str,
    harmless: &'static [i32],
}

fn addr_from(family: RtAddrFamily, p: &[u8]) -> Option<IpAddr> {
    match family {
        RtAddrFamily::Inet => <[u8; 4]>::try_from(p).ok().map(IpAddr::from),
        RtAddrFamily::Inet6 => <[u8; 16]>::try_from(p).ok().map(IpAddr::from),
        _ => None,
    }
}

impl NetlinkLinks {
    /// Interface name -> the name of the bridge (or other master) it is enslaved to.
    pub fn masters(&mut self) -> Result<BTreeMap<String, String>, LinkError> {
        let links = self.links()?;
        let names: BTreeMap<i32, String> = links.iter().filter_map(|l| Some((*l.ifi_index(), name_of(l)?))).collect();
        Ok(links
            .iter()
            .filter_map(|l| {
                let master = l.rtattrs().get_attr_handle().get_attr_payload_as::<u32>(Ifla::Master).ok()?;
                Some((name_of(l)?, names.get(&(master as i32))?.clone()))
            })
            .collect())
    }

    /// Interface name -> its kind ("veth", "bond", "vxlan", ...); a NIC has none.
    pub fn kinds(&mut self) -> Result<BTreeMap<String, String>, LinkError> {
        Ok(self
            .links()?
            .iter()
            .filter_map(|l| {
                let attrs = l.rtattrs().get_attr_handle();
                let info = attrs.get_nested_attributes::<IflaInfo>(Ifla::Linkinfo).ok()?;
                let kind = info.get_attr_payload_as_with_len::<String>(IflaInfo::Kind).ok()?;
                Some((name_of(l)?, kind.trim_end_matches('\0').to_string()))
            })
            .collect())
    }

    fn links(&mut self) -> Result<Vec<neli::rtnl::Ifinfomsg>, LinkError> {
        let msg = IfinfomsgBuilder::default().ifi_family(RtAddrFamily::Unspecified).build().map_err(sock_err)?;
        self.request(Rtm::Getlink, NlmF::DUMP, msg, "list links", "")
    }
}

fn name_of(l: &neli::rtnl::Ifinfomsg) -> Option<String> {
    l.rtattrs().get_attr_handle().get_attr_payload_as_with_len::<String>(Ifla::Ifname).ok().map(|n| n.trim_end_matches('\0').to_string())
}

impl Links for NetlinkLinks {
    fn ensure_dummy(&mut self, name: &str) -> Result<u32, LinkError> {
        if let Some(i) = self.link_index(name)? {
            return Ok(i);
        }
        let mut info = RtBuffer::<IflaInfo, Buffer>::new();
        info.push(RtattrBuilder::default().rta_type(IflaInfo::Kind).rta_payload("dummy\0").build().map_err(sock_err)?);
        let mut attrs = RtBuffer::<Ifla, Buffer>::new();
        attrs.push(RtattrBuilder::default().rta_type(Ifla::Ifname).rta_payload(format!("{name}\0")).build().map_err(sock_err)?);
        attrs.push(RtattrBuilder::default().rta_type(Ifla::Linkinfo).rta_payload(info).build().map_err(sock_err)?);
        let msg = IfinfomsgBuilder::default().ifi_family(RtAddrFamily::Unspecified).rtattrs(attrs).build().map_err(sock_err)?;
        match self.request(Rtm::Newlink, NlmF::CREATE | NlmF::EXCL | NlmF::ACK, msg, "create link", name) {
            Err(e) if e.errno() == Some(libc::EEXIST) => {}
            r => {
                r?;
            }
        }
        self.link_index(name)?.ok_or_else(|| LinkError::NoLink(name.into()))
    }

    fn link_index(&mut self, name: &str) -> Result<Option<u32>, LinkError> {
        let msg = IfinfomsgBuilder::default().ifi_family(RtAddrFamily::Unspecified).build().map_err(sock_err)?;
        let links = self.request(Rtm::Getlink, NlmF::DUMP, msg, "list links", "")?;
        Ok(links.iter().find_map(|l| {
            let n = l.rtattrs().get_attr_handle().get_attr_payload_as_with_len::<String>(Ifla::Ifname).ok()?;
            (n.trim_end_matches('\0') == name).then_some(*l.ifi_index() as u32)
        }))
    }

    fn delete_link(&mut self, name: &str) -> Result<(), LinkError> {
        let Some(index) = self.link_index(name)? else {
            return Ok(());
        };
        let msg = IfinfomsgBuilder::default().ifi_family(RtAddrFamily::Unspecified).ifi_index(index as i32).build().map_err(sock_err)?;
        match self.request(Rtm::Dellink, NlmF::ACK, msg, "delete link", name) {
            Err(e) if e.errno() == Some(libc::ENODEV) => Ok(()),
            r => r.map(drop),
        }
    }

    fn addresses(&mut self, ifindex: u32) -> Result<BTreeSet<IpAddr>, LinkError> {
        let msg = IfaddrmsgBuilder::default()
            .ifa_family(RtAddrFamily::Unspecified)
            .ifa_prefixlen(0)
            .ifa_scope(RtScope::Universe)
            .ifa_index(0)
            .build()
            .map_err(sock_err)?;
        let all = self.request(Rtm::Getaddr, NlmF::DUMP, msg, "list addresses", "")?;
        Ok(all
            .iter()
            .filter(|a| *a.ifa_index() == ifindex)
            .filter_map(|a| {
                let pick = |ty| a.rtattrs().iter().find(|r| *r.rta_type() == ty);
                let attr = pick(Ifa::Local).or_else(|| pick(Ifa::Address))?;
                addr_from(*a.ifa_family(), attr.rta_payload().as_ref())
            })
            .collect())
    }

    fn add_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError> {
        self.change_addresses(ifindex, true, &[addr]).pop().unwrap_or(Ok(()))
    }

    fn del_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError> {
        self.change_addresses(ifindex, false, &[addr]).pop().unwrap_or(Ok(()))
    }

    fn change_addresses(&mut self, ifindex: u32, add: bool, addrs: &[IpAddr]) -> Vec<Result<(), LinkError>> {
        let change = if add {
            Change { ty: Rtm::Newaddr, flags: NlmF::CREATE | NlmF::EXCL, op: "add address", harmless: &[libc::EEXIST] }
        } else {
            Change { ty: Rtm::Deladdr, flags: NlmF::empty(), op: "delete address", harmless: &[libc::EADDRNOTAVAIL, libc::ENODEV] }
        };
        self.pipelined(change, addrs, |a| Self::addr_msg(ifindex, a))
    }

    fn local_routes(&mut self) -> Result<BTreeSet<IpAddr>, LinkError> {
        let msg = RtmsgBuilder::default()
            .rtm_family(RtAddrFamily::Inet)
            .rtm_dst_len(0)
            .rtm_src_len(0)
            .rtm_tos(0)
            .rtm_table(RtTable::Unspec)
            .rtm_protocol(Rtprot::Unspec)
            .rtm_scope(RtScope::Universe)
            .rtm_type(Rtn::Unspec)
            .build()
            .map_err(sock_err)?;
        let all: Vec<Rtmsg> = self.request(Rtm::Getroute, NlmF::DUMP, msg, "list routes", "")?;
        Ok(all
            .iter()
            .filter(|r| *r.rtm_table() == RtTable::Local && *r.rtm_type() == Rtn::Local && u8::from(*r.rtm_protocol()) == RTPROT_KPR)
            .filter_map(|r| {
                let dst = r.rtattrs().iter().find(|a| *a.rta_type() == Rta::Dst)?;
                addr_from(*r.rtm_family(), dst.rta_payload().as_ref())
            })
            .collect())
    }

    fn change_local_routes(&mut self, add: bool, addrs: &[IpAddr]) -> Vec<Result<(), LinkError>> {
        // CREATE without EXCL: an address's own local route to the same destination (protocol
        // kernel) is another route, so ours is added beside it; only ours again is EEXIST.
        let change = if add {
            Change { ty: Rtm::Newroute, flags: NlmF::CREATE, op: "add local route", harmless: &[libc::EEXIST] }
        } else {
            Change { ty: Rtm::Delroute, flags: NlmF::empty(), op: "delete local route", harmless: &[libc::ESRCH, libc::ENODEV] }
        };
        self.pipelined(change, addrs, Self::local_route_msg)
    }
}

#[derive(Default, Debug)]
pub struct FakeLinks {
    /// name -> (index, addresses)
    pub links: BTreeMap<String, (u32, BTreeSet<IpAddr>)>,
    /// kpr's local routes.
    pub local_routes: BTreeSet<IpAddr>,
}

impl Links for FakeLinks {
    fn ensure_dummy(&mut self, name: &str) -> Result<u32, LinkError> {
        let next = self.links.len() as u32 + 10;
        Ok(self.links.entry(name.into()).or_insert((next, BTreeSet::new())).0)
    }
    fn link_index(&mut self, name: &str) -> Result<Option<u32>, LinkError> {
        Ok(self.links.get(name).map(|l| l.0))
    }
    fn delete_link(&mut self, name: &str) -> Result<(), LinkError> {
        self.links.remove(name);
        Ok(())
    }
    fn addresses(&mut self, ifindex: u32) -> Result<BTreeSet<IpAddr>, LinkError> {
        Ok(self.links.values().find(|l| l.0 == ifindex).map(|l| l.1.clone()).unwrap_or_default())
    }
    fn add_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError> {
        let l = self.links.values_mut().find(|l| l.0 == ifindex).ok_or_else(|| LinkError::NoLink(ifindex.to_string()))?;
        l.1.insert(addr);
        Ok(())
    }
    fn del_address(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), LinkError> {
        if let Some(l) = self.links.values_mut().find(|l| l.0 == ifindex) {
            l.1.remove(&addr);
        }
        Ok(())
    }
    fn local_routes(&mut self) -> Result<BTreeSet<IpAddr>, LinkError> {
        Ok(self.local_routes.clone())
    }
    fn change_local_routes(&mut self, add: bool, addrs: &[IpAddr]) -> Vec<Result<(), LinkError>> {
        addrs
            .iter()
            .map(|a| {
                if !a.is_ipv4() {
                    return Err(LinkError::Socket(format!("{a}: local routes are for IPv4 addresses")));
                }
                if add {
                    self.local_routes.insert(*a);
                } else {
                    self.local_routes.remove(a);
                }
                Ok(())
            })
            .collect()
    }
}
