//! Ends the node's connected UDP sockets that connect-time balancing pointed at a backend which
//! left its service, as `ss -K` does (sock_diag SOCK_DESTROY, CONFIG_INET_DIAG_DESTROY): the
//! application gets ECONNABORTED and reconnects, to a live backend. Without it a DNS forwarder or
//! a statsd client keeps sending into the removed pod (or to whoever gets its address next).
//! Only sockets kpr balanced are touched: their cookies are in KPR_SOCK_REV_V1.
use std::{collections::BTreeSet, net::Ipv4Addr};

use neli::consts::{nl::NlmF, socket::NlFamily};

use crate::netlink::socket::{NlError, RawSocket};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;

/// A UDP socket as sock_diag names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpSocket {
    pub src: Ipv4Addr,
    pub sport: u16,
    pub dst: Ipv4Addr,
    pub dport: u16,
    pub ifindex: u32,
    pub cookie: u64,
}

/// What the cleanup needs from the kernel's socket table (a fake records, for tests).
pub trait Sockets {
    /// IPv4 UDP sockets connected to `dst:dport`.
    fn udp_connected_to(&mut self, dst: Ipv4Addr, dport: u16) -> Result<Vec<UdpSocket>, String>;
    /// Idempotent: a socket already gone is not an error.
    fn destroy(&mut self, s: &UdpSocket) -> Result<(), String>;
}

/// Destroys the sockets connected to `dst:dport` whose cookie is one of `cookies`.
pub fn end_balanced(sockets: &mut dyn Sockets, dst: Ipv4Addr, dport: u16, cookies: &BTreeSet<u64>) -> Result<usize, String> {
    let mut n = 0;
    for s in sockets.udp_connected_to(dst, dport)?.iter().filter(|s| cookies.contains(&s.cookie)) {
        sockets.destroy(s)?;
        n += 1;
    }
    Ok(n)
}

pub struct NetlinkSockets {
    sock: RawSocket,
}

/// struct inet_diag_req_v2 for IPv4 UDP, every state, with the socket id given.
fn request(s: Option<&UdpSocket>) -> Vec<u8> {
    let mut b = vec![libc::AF_INET as u8, libc::IPPROTO_UDP as u8, 0, 0];
    b.extend_from_slice(&u32::MAX.to_ne_bytes()); // idiag_states
                                                  // struct inet_diag_sockid: ports and addresses in network order, if, cookie.
    let (sport, dport, src, dst, ifindex, cookie) =
        s.map(|s| (s.sport, s.dport, s.src, s.dst, s.ifindex, s.cookie)).unwrap_or((0, 0, Ipv4Addr::UNSPECIFIED, Ipv4Addr::UNSPECIFIED, 0, u64::MAX));
    b.extend_from_slice(&sport.to_be_bytes());
    b.extend_from_slice(&dport.to_be_bytes());
    b.extend_from_slice(&src.octets());
    b.extend_from_slice(&[0; 12]);
    b.extend_from_slice(&dst.octets());
    b.extend_from_slice(&[0; 12]);
    b.extend_from_slice(&ifindex.to_ne_bytes());
    b.extend_from_slice(&(cookie as u32).to_ne_bytes());
    b.extend_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    b
}

/// struct inet_diag_msg: the socket id starts at byte 4.
fn decode(msg: &[u8]) -> Option<UdpSocket> {
    let id = msg.get(4..52)?;
    let be16 = |o: usize| u16::from_be_bytes([id[o], id[o + 1]]);
    let v4 = |o: usize| Ipv4Addr::new(id[o], id[o + 1], id[o + 2], id[o + 3]);
    let ne32 = |o: usize| u32::from_ne_bytes([id[o], id[o + 1], id[o + 2], id[o + 3]]);
    (msg[0] == libc::AF_INET as u8).then(|| UdpSocket {
        sport: be16(0),
        dport: be16(2),
        src: v4(4),
        dst: v4(20),
        ifindex: ne32(36),
        cookie: u64::from(ne32(40)) | (u64::from(ne32(44)) << 32),
    })
}

impl NetlinkSockets {
    pub fn connect() -> Result<Self, String> {
        Ok(Self { sock: RawSocket::connect(NlFamily::SockOrInetDiag)? })
    }
}

fn describe(e: NlError) -> String {
    match e {
        NlError::Errno(libc::EOPNOTSUPP) => "the kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY is off)".into(),
        NlError::Errno(errno) => std::io::Error::from_raw_os_error(errno).to_string(),
        NlError::Socket(s) => s,
    }
}

impl Sockets for NetlinkSockets {
    fn udp_connected_to(&mut self, dst: Ipv4Addr, dport: u16) -> Result<Vec<UdpSocket>, String> {
        let answers = self.sock.request(SOCK_DIAG_BY_FAMILY, NlmF::DUMP, request(None)).map_err(describe)?;
        Ok(answers.iter().filter_map(|b| decode(b.as_ref())).filter(|s| s.dst == dst && s.dport == dport).collect())
    }
    fn destroy(&mut self, s: &UdpSocket) -> Result<(), String> {
        match self.sock.request(SOCK_DESTROY, NlmF::ACK, request(Some(s))) {
            Ok(_) | Err(NlError::Errno(libc::ENOENT)) => Ok(()),
            Err(e) => Err(describe(e)),
        }
    }
}

#[derive(Debug, Default)]
pub struct FakeSockets {
    pub open: Vec<UdpSocket>,
    pub destroyed: Vec<UdpSocket>,
}

impl Sockets for FakeSockets {
    fn udp_connected_to(&mut self, dst: Ipv4Addr, dport: u16) -> Result<Vec<UdpSocket>, String> {
        Ok(self.open.iter().filter(|s| s.dst == dst && s.dport == dport).copied().collect())
    }
    fn destroy(&mut self, s: &UdpSocket) -> Result<(), String> {
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
        let b: Ipv4Addr = "10.244.1.2".parse().unwrap();
        let s = |cookie, dst: Ipv4Addr, dport| UdpSocket { src: "198.18.0.1".parse().unwrap(), sport: 40000 + cookie as u16, dst, dport, ifindex: 0, cookie };
        let mut k = FakeSockets { open: vec![s(1, b, 5353), s(2, b, 5353), s(3, b, 9999), s(4, "10.244.2.2".parse().unwrap(), 5353)], ..Default::default() };
        // Socket 2 reached the backend directly, not through a service: not ours.
        let n = end_balanced(&mut k, b, 5353, &[1, 3, 4].into_iter().collect()).unwrap();
        assert_eq!(n, 1);
        assert_eq!(k.destroyed, vec![s(1, b, 5353)]);
    }

    #[test]
    fn request_and_answer_layouts() {
        let sock =
            UdpSocket { src: "198.18.0.1".parse().unwrap(), sport: 40000, dst: "10.244.1.2".parse().unwrap(), dport: 5353, ifindex: 7, cookie: 0x1_0000_0002 };
        let req = request(Some(&sock));
        assert_eq!(req.len(), 56, "sizeof(struct inet_diag_req_v2)");
        // An inet_diag_msg carries the same sockid at offset 4.
        let mut msg = vec![libc::AF_INET as u8, 7, 0, 0];
        msg.extend_from_slice(&req[8..56]);
        msg.extend_from_slice(&[0; 20]);
        assert_eq!(decode(&msg), Some(sock));
    }
}
