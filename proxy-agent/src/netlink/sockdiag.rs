//! Ends the node's connected UDP sockets that connect-time balancing pointed at a backend which
//! left its service, as `ss -K` does (sock_diag SOCK_DESTROY, CONFIG_INET_DIAG_DESTROY): the
//! application gets ECONNABORTED and reconnects, to a live backend. Without it a DNS forwarder or
//! a statsd client keeps sending into the removed pod (or to whoever gets its address next).
//! Only sockets kpr balanced are touched: their cookies are in KPR_SOCK_REV_V1. Both families: an
//! IPv6 socket balanced through an IPv4-mapped address is connected to ::ffff:a.b.c.d. Only
//! the agent's network namespace is seen (the node's sockets, not pods').
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use neli::consts::{nl::NlmF, socket::NlFamily};

use crate::netlink::socket::{NlError, RawSocket};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;

/// A UDP socket as sock_diag names it (its family is its addresses').
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpSocket {
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
    pub ifindex: u32,
    pub cookie: u64,
}

/// What the cleanup needs from the kernel's socket table (a fake records, for tests).
pub trait Sockets {
    /// UDP sockets of `dst`'s family connected to `dst:dport` (an IPv6 one for ::ffff:a.b.c.d).
    fn udp_connected_to(&mut self, dst: IpAddr, dport: u16) -> Result<Vec<UdpSocket>, SockDiagError>;
    /// Idempotent: a socket already gone is not an error.
    fn destroy(&mut self, s: &UdpSocket) -> Result<(), SockDiagError>;
}

/// Destroys the sockets connected to `dst:dport` whose cookie is one of `cookies`: for an IPv4
/// `dst`, IPv6 sockets connected to its IPv4-mapped form too.
pub fn end_balanced(sockets: &mut dyn Sockets, dst: IpAddr, dport: u16, cookies: &BTreeSet<u64>) -> Result<usize, SockDiagError> {
    let forms: &[IpAddr] = match dst {
        IpAddr::V4(a) => &[dst, IpAddr::V6(a.to_ipv6_mapped())],
        IpAddr::V6(_) => &[dst],
    };
    let mut n = 0;
    for form in forms {
        for s in sockets.udp_connected_to(*form, dport)?.iter().filter(|s| cookies.contains(&s.cookie)) {
            sockets.destroy(s)?;
            n += 1;
        }
    }
    Ok(n)
}

fn family(a: IpAddr) -> u8 {
    (if a.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 }) as u8
}

/// An address in inet_diag_sockid's 16 bytes (IPv4 in the first 4).
fn sockid_addr(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(a) => {
            let mut b = [0; 16];
            b[..4].copy_from_slice(&a.octets());
            b
        }
        IpAddr::V6(a) => a.octets(),
    }
}

pub struct NetlinkSockets {
    sock: RawSocket,
}

/// struct inet_diag_req_v2 for UDP of a family (`any`'s), every state, with the socket id given
/// (a dump when None).
fn request(any: IpAddr, s: Option<&UdpSocket>) -> Vec<u8> {
    let mut b = vec![family(any), libc::IPPROTO_UDP as u8, 0, 0];
    b.extend_from_slice(&u32::MAX.to_ne_bytes()); // idiag_states
                                                  // struct inet_diag_sockid: ports and addresses in network order, if, cookie.
    let unspecified = if any.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(Ipv6Addr::UNSPECIFIED) };
    let (sport, dport, src, dst, ifindex, cookie) =
        s.map(|s| (s.sport, s.dport, s.src, s.dst, s.ifindex, s.cookie)).unwrap_or((0, 0, unspecified, unspecified, 0, u64::MAX));
    b.extend_from_slice(&sport.to_be_bytes());
    b.extend_from_slice(&dport.to_be_bytes());
    b.extend_from_slice(&sockid_addr(src));
    b.extend_from_slice(&sockid_addr(dst));
    b.extend_from_slice(&ifindex.to_ne_bytes());
    b.extend_from_slice(&(cookie as u32).to_ne_bytes());
    b.extend_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    b
}

/// struct inet_diag_msg: the socket id starts at byte 4.
fn decode(msg: &[u8]) -> Option<UdpSocket> {
    let id = msg.get(4..52)?;
    let be16 = |o: usize| u16::from_be_bytes([id[o], id[o + 1]]);
    let v4 = msg[0] == libc::AF_INET as u8;
    if !v4 && msg[0] != libc::AF_INET6 as u8 {
        return None;
    }
    let addr = |o: usize| {
        if v4 {
            IpAddr::V4(Ipv4Addr::new(id[o], id[o + 1], id[o + 2], id[o + 3]))
        } else {
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&id[o..o + 16]).unwrap_or_default()))
        }
    };
    let ne32 = |o: usize| u32::from_ne_bytes([id[o], id[o + 1], id[o + 2], id[o + 3]]);
    Some(UdpSocket {
        sport: be16(0),
        dport: be16(2),
        src: addr(4),
        dst: addr(20),
        ifindex: ne32(36),
        cookie: u64::from(ne32(40)) | (u64::from(ne32(44)) << 32),
    })
}

impl NetlinkSockets {
    pub fn connect() -> Result<Self, SockDiagError> {
        Ok(Self { sock: RawSocket::connect(NlFamily::SockOrInetDiag)? })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    /// EOPNOTSUPP from SOCK_DESTROY.
    #[error("the kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY is off)")]
    NoDestroy,
    #[error("sock_diag: {0}")]
    Netlink(#[from] NlError),
}

fn destroy_error(e: NlError) -> SockDiagError {
    match e {
        NlError::Errno(libc::EOPNOTSUPP) => SockDiagError::NoDestroy,
        e => SockDiagError::Netlink(e),
    }
}

impl Sockets for NetlinkSockets {
    fn udp_connected_to(&mut self, dst: IpAddr, dport: u16) -> Result<Vec<UdpSocket>, SockDiagError> {
        let answers = self.sock.request(SOCK_DIAG_BY_FAMILY, NlmF::DUMP, request(dst, None))?;
        Ok(answers.iter().filter_map(|b| decode(b.as_ref())).filter(|s| s.dst == dst && s.dport == dport).collect())
    }
    fn destroy(&mut self, s: &UdpSocket) -> Result<(), SockDiagError> {
        match self.sock.request(SOCK_DESTROY, NlmF::ACK, request(s.dst, Some(s))) {
            Ok(_) | Err(NlError::Errno(libc::ENOENT)) => Ok(()),
            Err(e) => Err(destroy_error(e)),
        }
    }
}

#[derive(Debug, Default)]
pub struct FakeSockets {
    pub open: Vec<UdpSocket>,
    pub destroyed: Vec<UdpSocket>,
}

impl Sockets for FakeSockets {
    fn udp_connected_to(&mut self, dst: IpAddr, dport: u16) -> Result<Vec<UdpSocket>, SockDiagError> {
        Ok(self.open.iter().filter(|s| s.dst == dst && s.dport == dport).copied().collect())
    }
    fn destroy(&mut self, s: &UdpSocket) -> Result<(), SockDiagError> {
        self.open.retain(|o| o != s);
        self.destroyed.push(*s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sockets_kpr_balanced_to_the_backend_are_ended() {
        let b: IpAddr = "10.244.1.2".parse().unwrap();
        let b6: IpAddr = "::ffff:10.244.1.2".parse().unwrap();
        let s = |cookie, dst: IpAddr, dport| {
            let src = if dst.is_ipv4() { "198.18.0.1" } else { "::ffff:198.18.0.1" };
            UdpSocket { src: src.parse().unwrap(), sport: 40000 + cookie as u16, dst, dport, ifindex: 0, cookie }
        };
        let open = vec![s(1, b, 5353), s(2, b, 5353), s(3, b, 9999), s(4, "10.244.2.2".parse().unwrap(), 5353), s(5, b6, 5353)];
        let mut k = FakeSockets { open, ..Default::default() };
        // Socket 2 reached the backend directly, not through a service: not ours. Socket 5 is
        // an IPv6 socket balanced through the IPv4-mapped address.
        let n = end_balanced(&mut k, b, 5353, &[1, 3, 4, 5].into_iter().collect()).unwrap();
        assert_eq!(n, 2);
        assert_eq!(k.destroyed, vec![s(1, b, 5353), s(5, b6, 5353)]);
    }

    #[test]
    fn request_and_answer_layouts() {
        for (src, dst) in [("198.18.0.1", "10.244.1.2"), ("fd00:198::1", "fd00:10:244:1::2")] {
            let sock = UdpSocket { src: src.parse().unwrap(), sport: 40000, dst: dst.parse().unwrap(), dport: 5353, ifindex: 7, cookie: 0x1_0000_0002 };
            let req = request(sock.dst, Some(&sock));
            assert_eq!(req.len(), 56, "sizeof(struct inet_diag_req_v2)");
            assert_eq!(req[0], family(sock.dst));
            // An inet_diag_msg carries the same sockid at offset 4.
            let mut msg = vec![req[0], 7, 0, 0];
            msg.extend_from_slice(&req[8..56]);
            msg.extend_from_slice(&[0; 20]);
            assert_eq!(decode(&msg), Some(sock));
        }
    }
}
