//! Deletes netfilter conntrack entries over ctnetlink (neli), as kube-proxy does when a UDP
//! endpoint goes: entries whose original destination is the service address and whose reply
//! comes from the endpoint, so no client is kept on a dead backend by a stale NAT entry (IPVS
//! mode; in eBPF mode the entries kube-proxy's rules left during a migration).
use std::net::IpAddr;

use neli::{
    consts::{nl::NlmF, socket::NlFamily},
    types::Buffer,
};

use crate::{
    netlink::attrs::attrs,
    netlink::socket::{NlError, RawSocket},
};

/// (protocol, service address, service port, endpoint address, endpoint port).
pub type NatTuple = (u8, IpAddr, u16, IpAddr, u16);

pub trait ConntrackFlusher {
    /// Entries whose original destination is `vip:port` and whose reply source is
    /// `backend:backend_port`; returns how many went.
    fn flush(&mut self, proto: u8, vip: IpAddr, port: u16, backend: IpAddr, backend_port: u16) -> Result<usize, NlError>;
    /// The same for several; implementations may read the table once.
    fn flush_all(&mut self, tuples: &[NatTuple]) -> Result<usize, NlError> {
        let mut n = 0;
        for (proto, vip, port, backend, backend_port) in tuples {
            n += self.flush(*proto, *vip, *port, *backend, *backend_port)?;
        }
        Ok(n)
    }
}

#[derive(Default, Debug)]
pub struct FakeConntrack {
    pub flushed: Vec<NatTuple>,
}

impl ConntrackFlusher for FakeConntrack {
    fn flush(&mut self, proto: u8, vip: IpAddr, port: u16, backend: IpAddr, backend_port: u16) -> Result<usize, NlError> {
        self.flushed.push((proto, vip, port, backend, backend_port));
        Ok(0)
    }
}

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
/// TCP_CONNTRACK_ESTABLISHED (linux/netfilter/nf_conntrack_tcp.h).
pub const TCP_ESTABLISHED: u8 = 3;

/// (proto, src, sport, dst, dport) of a conntrack tuple.
#[derive(Debug, Default, PartialEq, Eq, Clone, Copy)]
pub struct Tuple {
    pub proto: u8,
    pub src: Option<IpAddr>,
    pub sport: u16,
    pub dst: Option<IpAddr>,
    pub dport: u16,
}

fn v4(p: &[u8]) -> Option<IpAddr> {
    <[u8; 4]>::try_from(p).ok().map(IpAddr::from)
}

fn v6(p: &[u8]) -> Option<IpAddr> {
    <[u8; 16]>::try_from(p).ok().map(IpAddr::from)
}

/// A CTA_PROTOINFO payload's TCP state, if it is TCP's.
fn decode_tcp_state(p: &[u8]) -> Option<u8> {
    let (_, tcp) = attrs("conntrack protoinfo", p).filter_map(Result::ok).find(|(ty, _)| *ty == CTA_PROTOINFO_TCP)?;
    attrs("conntrack tcp", tcp).filter_map(Result::ok).find_map(|(ty, v)| match (ty, v) {
        (CTA_PROTOINFO_TCP_STATE, [state]) => Some(*state),
        _ => None,
    })
}

/// Decodes a CTA_TUPLE_* payload; malformed input gives None.
pub fn decode_tuple(p: &[u8]) -> Option<Tuple> {
    let mut t = Tuple::default();
    for a in attrs("conntrack tuple", p) {
        let (ty, v) = a.ok()?;
        match ty {
            CTA_TUPLE_IP => {
                for b in attrs("conntrack ip", v) {
                    let (ty, v) = b.ok()?;
                    match ty {
                        CTA_IP_V4_SRC => t.src = v4(v),
                        CTA_IP_V4_DST => t.dst = v4(v),
                        CTA_IP_V6_SRC => t.src = v6(v),
                        CTA_IP_V6_DST => t.dst = v6(v),
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for b in attrs("conntrack proto", v) {
                    let (ty, v) = b.ok()?;
                    match (ty, v) {
                        (CTA_PROTO_NUM, [n]) => t.proto = *n,
                        (CTA_PROTO_SRC_PORT, [a, b]) => t.sport = u16::from_be_bytes([*a, *b]),
                        (CTA_PROTO_DST_PORT, [a, b]) => t.dport = u16::from_be_bytes([*a, *b]),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(t)
}

pub struct NetlinkConntrack {
    sock: RawSocket,
}

impl NetlinkConntrack {
    pub fn connect() -> Result<Self, NlError> {
        Ok(NetlinkConntrack { sock: RawSocket::connect(NlFamily::Netfilter)? })
    }

    /// One ctnetlink request; the bodies of its answers (after their nfgenmsg header).
    fn request(&mut self, msg_type: u16, flags: NlmF, body: Vec<u8>) -> Result<Vec<Buffer>, NlError> {
        self.sock.request((NFNL_SUBSYS_CTNETLINK << 8) | msg_type, flags, body)
    }

    /// Every entry of either family: its family and original-direction attribute (raw, for a
    /// delete), both tuples, and a TCP entry's state.
    fn dump(&mut self) -> Result<Vec<Dumped>, NlError> {
        let mut out = Vec::new();
        // AF_UNSPEC: the kernel filters a dump by family only when one is given.
        for b in self.request(IPCTNL_MSG_CT_GET, NlmF::DUMP, nfgenmsg(libc::AF_UNSPEC as u8))? {
            let family = b.as_ref().first().copied().unwrap_or(libc::AF_INET as u8);
            let body = b.as_ref().get(4..).unwrap_or(&[]);
            let (mut orig_raw, mut orig, mut reply, mut tcp_state) = (None, None, None, None);
            let mut off = 0;
            for a in attrs("conntrack", body) {
                let Ok((ty, v)) = a else { break };
                let len = v.len() + 4;
                match ty {
                    CTA_TUPLE_ORIG => {
                        orig_raw = body.get(off..off + len).map(<[u8]>::to_vec);
                        orig = decode_tuple(v);
                    }
                    CTA_TUPLE_REPLY => reply = decode_tuple(v),
                    CTA_PROTOINFO => tcp_state = decode_tcp_state(v),
                    _ => {}
                }
                off += (len + 3) & !3;
            }
            if let (Some(raw), Some(o), Some(r)) = (orig_raw, orig, reply) {
                out.push(((family, raw), o, r, tcp_state));
            }
        }
        Ok(out)
    }

    fn delete(&mut self, (family, orig_raw): &Raw) -> Result<(), NlError> {
        let mut body = nfgenmsg(*family);
        body.extend_from_slice(orig_raw);
        match self.request(IPCTNL_MSG_CT_DELETE, NlmF::ACK, body) {
            // Gone meanwhile (expired): what we wanted.
            Ok(_) | Err(NlError::Errno(libc::ENOENT)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// An entry as a delete names it: its family and raw original tuple.
type Raw = (u8, Vec<u8>);

/// One dumped entry: its raw original tuple, both tuples, a TCP entry's state.
type Dumped = (Raw, Tuple, Tuple, Option<u8>);

/// struct nfgenmsg: family, version 0, resource id 0.
fn nfgenmsg(family: u8) -> Vec<u8> {
    vec![family, 0, 0, 0]
}

impl NetlinkConntrack {
    /// Entries from a client to `vip:port` that `backend:backend_port` answers.
    pub fn count(&mut self, proto: u8, vip: IpAddr, port: u16, backend: IpAddr, backend_port: u16) -> Result<usize, NlError> {
        Ok(self.matching(&[(proto, vip, port, backend, backend_port)])?.len())
    }

    /// The raw original tuples of the entries any of `tuples` names.
    fn matching(&mut self, tuples: &[NatTuple]) -> Result<Vec<Raw>, NlError> {
        let named = |o: &Tuple, r: &Tuple| {
            tuples.iter().any(|(proto, vip, port, be, be_port)| {
                o.proto == *proto && o.dst == Some(*vip) && o.dport == *port && r.src == Some(*be) && r.sport == *be_port
            })
        };
        Ok(self.dump()?.into_iter().filter(|(_, o, r, _)| named(o, r)).map(|(raw, ..)| raw).collect())
    }

    /// The original destinations (address, port) of established TCP connections that netfilter
    /// translated to another destination: connections a proxy before kpr (kube-proxy's DNAT,
    /// IPVS with conntrack) carries. The fast path's own flows are never among them: netfilter
    /// sees those already translated.
    pub fn translated_tcp(&mut self) -> Result<Vec<(IpAddr, u16)>, NlError> {
        Ok(self
            .dump()?
            .into_iter()
            .filter(|(_, o, r, state)| o.proto == proxy_common::PROTO_TCP && *state == Some(TCP_ESTABLISHED) && (r.src != o.dst || r.sport != o.dport))
            .filter_map(|(_, o, ..)| Some((o.dst?, o.dport)))
            .collect())
    }
}

impl ConntrackFlusher for NetlinkConntrack {
    fn flush(&mut self, proto: u8, vip: IpAddr, port: u16, backend: IpAddr, backend_port: u16) -> Result<usize, NlError> {
        self.flush_all(&[(proto, vip, port, backend, backend_port)])
    }
    fn flush_all(&mut self, tuples: &[NatTuple]) -> Result<usize, NlError> {
        if tuples.is_empty() {
            return Ok(0);
        }
        let doomed = self.matching(tuples)?;
        for raw in &doomed {
            self.delete(raw)?;
        }
        Ok(doomed.len())
    }
}
