//! Building and checking IPv4 TCP/UDP/ICMP and IPv6 TCP/UDP/ICMPv6 frames for the packet
//! fixtures.
use std::net::{Ipv4Addr, Ipv6Addr};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;

pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const FIN: u8 = 0x01;
pub const RST: u8 = 0x04;

fn sum16(data: &[u8]) -> u32 {
    let mut s = 0u32;
    for c in data.chunks(2) {
        let w = if c.len() == 2 { u16::from_be_bytes([c[0], c[1]]) } else { u16::from_be_bytes([c[0], 0]) };
        s += u32::from(w);
    }
    s
}

fn fold(mut s: u32) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

pub fn checksum(data: &[u8]) -> u16 {
    !fold(sum16(data))
}

fn l4_checksum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(12 + l4.len());
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.push(0);
    pseudo.push(proto);
    pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
    pseudo.extend_from_slice(l4);
    checksum(&pseudo)
}

#[derive(Clone, Debug)]
pub struct Frame {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    pub tcp_flags: u8,
    pub payload: Vec<u8>,
    /// UDP: send a zero (absent) checksum.
    pub udp_no_checksum: bool,
}

impl Frame {
    pub fn tcp(src: &str, sport: u16, dst: &str, dport: u16, flags: u8) -> Self {
        Self { src: src.parse().unwrap(), dst: dst.parse().unwrap(), proto: TCP, sport, dport, tcp_flags: flags, payload: Vec::new(), udp_no_checksum: false }
    }
    pub fn udp(src: &str, sport: u16, dst: &str, dport: u16, payload: &[u8]) -> Self {
        Self { proto: UDP, tcp_flags: 0, payload: payload.to_vec(), ..Self::tcp(src, sport, dst, dport, 0) }
    }

    /// The IPv4 packet (no Ethernet header).
    pub fn ip_bytes(&self) -> Vec<u8> {
        self.bytes()[14..].to_vec()
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend_from_slice(&self.sport.to_be_bytes());
        l4.extend_from_slice(&self.dport.to_be_bytes());
        if self.proto == TCP {
            l4.extend_from_slice(&1000u32.to_be_bytes()); // seq
            l4.extend_from_slice(&0u32.to_be_bytes()); // ack
            l4.push(5 << 4);
            l4.push(self.tcp_flags);
            l4.extend_from_slice(&64240u16.to_be_bytes());
            l4.extend_from_slice(&[0, 0, 0, 0]); // csum, urg
        } else {
            l4.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
        }
        l4.extend_from_slice(&self.payload);
        let csum_off = if self.proto == TCP { 16 } else { 6 };
        if !(self.proto == UDP && self.udp_no_checksum) {
            let mut c = l4_checksum(self.src, self.dst, self.proto, &l4);
            if self.proto == UDP && c == 0 {
                c = 0xffff;
            }
            l4[csum_off..csum_off + 2].copy_from_slice(&c.to_be_bytes());
        }
        let mut ip = vec![0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, self.proto, 0, 0];
        let tot = (20 + l4.len()) as u16;
        ip[2..4].copy_from_slice(&tot.to_be_bytes());
        ip.extend_from_slice(&self.src.octets());
        ip.extend_from_slice(&self.dst.octets());
        let c = checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb, 0x08, 0x00];
        f.extend_from_slice(&ip);
        f.extend_from_slice(&l4);
        f
    }
}

/// An ICMP error from `src` to `dst` quoting `quoted` (its IPv4 header and `quote_len` bytes of
/// its L4 header), as a router or host sends it.
pub fn icmp_error(src: &str, dst: &str, icmp_type: u8, code: u8, quoted: &Frame, quote_len: usize) -> Vec<u8> {
    let q = quoted.ip_bytes();
    let q = &q[..(20 + quote_len).min(q.len())];
    let mut icmp = vec![icmp_type, code, 0, 0, 0, 0, 0x05, 0xaa]; // "next-hop MTU" 1450 for code 4
    icmp.extend_from_slice(q);
    let c = checksum(&icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let (src, dst): (Ipv4Addr, Ipv4Addr) = (src.parse().unwrap(), dst.parse().unwrap());
    let mut ip = vec![0x45, 0xc0, 0, 0, 0, 0, 0, 0, 64, ICMP, 0, 0];
    ip[2..4].copy_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb, 0x08, 0x00];
    f.extend_from_slice(&ip);
    f.extend_from_slice(&icmp);
    f
}

/// A parsed output frame, with its checksums verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    pub ip_csum_ok: bool,
    pub l4_csum_ok: bool,
    pub l4_csum_zero: bool,
    /// ICMP: type, code, and the quoted (src, dst, sport, dport).
    pub icmp: Option<(u8, u8, Ipv4Addr, Ipv4Addr, u16, u16)>,
    /// ICMP: the quoted IPv4 header's checksum is valid.
    pub quote_ip_csum_ok: bool,
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
}

pub fn parse(f: &[u8]) -> Parsed {
    assert!(f.len() >= 34, "frame too short: {}", f.len());
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let proto = ip[9];
    let ip_csum_ok = checksum(&ip[..ihl]) == 0;
    let l4 = &ip[ihl..tot];
    let mut p = Parsed {
        src,
        dst,
        proto,
        sport: 0,
        dport: 0,
        ip_csum_ok,
        l4_csum_ok: false,
        l4_csum_zero: false,
        icmp: None,
        quote_ip_csum_ok: false,
        src_mac: f[6..12].try_into().unwrap(),
        dst_mac: f[0..6].try_into().unwrap(),
    };
    match proto {
        ICMP => {
            p.l4_csum_ok = checksum(l4) == 0;
            let q = &l4[8..];
            let qsrc = Ipv4Addr::new(q[12], q[13], q[14], q[15]);
            let qdst = Ipv4Addr::new(q[16], q[17], q[18], q[19]);
            let qs = u16::from_be_bytes([q[20], q[21]]);
            let qd = u16::from_be_bytes([q[22], q[23]]);
            p.icmp = Some((l4[0], l4[1], qsrc, qdst, qs, qd));
            p.quote_ip_csum_ok = checksum(&q[..20]) == 0;
        }
        _ => {
            p.sport = u16::from_be_bytes([l4[0], l4[1]]);
            p.dport = u16::from_be_bytes([l4[2], l4[3]]);
            if proto == UDP && l4[6] == 0 && l4[7] == 0 {
                p.l4_csum_zero = true;
                p.l4_csum_ok = true;
            } else {
                p.l4_csum_ok = l4_checksum(src, dst, proto, l4) == 0;
            }
        }
    }
    p
}

/// The TCP/UDP checksum over IPv6's pseudo-header (RFC 8200 section 8.1).
fn l4_checksum6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, l4: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(40 + l4.len());
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, proto]);
    pseudo.extend_from_slice(l4);
    checksum(&pseudo)
}

/// An Ethernet + IPv6 frame: `ext` is a chain of (header type, length in 8-byte units beyond
/// the first) extension headers before the L4 header; TCP gets `flags`. The L4 checksum is
/// valid.
pub fn frame6(src: &str, dst: &str, proto: u8, sport: u16, dport: u16, flags: u8, ext: &[(u8, u8)]) -> Vec<u8> {
    let (s, d): (Ipv6Addr, Ipv6Addr) = (src.parse().unwrap(), dst.parse().unwrap());
    let mut l4 = Vec::new();
    l4.extend_from_slice(&sport.to_be_bytes());
    l4.extend_from_slice(&dport.to_be_bytes());
    let csum_at = if proto == TCP {
        l4.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
        16
    } else {
        l4.extend_from_slice(&[0, 12, 0, 0, b'h', b'i', b'!', b'\n']);
        6
    };
    let c = l4_checksum6(s, d, proto, &l4);
    let c = if proto == UDP && c == 0 { 0xffff } else { c };
    l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
    // The extension headers, each naming the next.
    let mut chain = Vec::new();
    let types: Vec<u8> = ext.iter().map(|e| e.0).chain([proto]).collect();
    for (i, (_, len)) in ext.iter().enumerate() {
        let mut h = vec![0u8; (usize::from(*len) + 1) * 8];
        h[0] = types[i + 1];
        h[1] = *len;
        if types[i] == 44 {
            // A fragment header: offset 0 with more fragments to come (a first fragment).
            h[1] = 0;
            h[3] = 1;
        }
        chain.extend(h);
    }
    let payload = chain.len() + l4.len();
    let mut f = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x86, 0xdd];
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(payload as u16).to_be_bytes());
    f.push(types[0]);
    f.push(64);
    f.extend_from_slice(&s.octets());
    f.extend_from_slice(&d.octets());
    f.extend(chain);
    f.extend(l4);
    f
}

/// A parsed IPv6 output frame (no extension headers), its L4 checksum verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed6 {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    pub l4_csum_ok: bool,
}

pub fn parse6(f: &[u8]) -> Parsed6 {
    assert!(f.len() >= 54 && f[12..14] == [0x86, 0xdd], "not an IPv6 frame: {f:02x?}");
    let ip = &f[14..];
    let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap());
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap());
    let l4 = &ip[40..40 + len];
    Parsed6 {
        src,
        dst,
        proto: ip[6],
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        l4_csum_ok: l4_checksum6(src, dst, ip[6], l4) == 0,
    }
}

/// Checks an ICMPv6 port unreachable answering `orig`: MACs and addresses swapped, the first 48
/// bytes of the offending IPv6 packet quoted, a valid checksum over the pseudo-header.
pub fn check_icmp6_port_unreachable(reply: &[u8], orig: &[u8]) {
    assert_eq!(reply.len(), 14 + 40 + 8 + 48, "{reply:02x?}");
    assert_eq!((&reply[0..6], &reply[6..12]), (&orig[6..12], &orig[0..6]), "MACs swapped");
    assert_eq!(&reply[12..14], &[0x86, 0xdd]);
    assert_eq!(reply[14] >> 4, 6);
    assert_eq!(u16::from_be_bytes([reply[18], reply[19]]), 56, "payload length");
    assert_eq!((reply[20], reply[21]), (58, 64), "next header ICMPv6, hop limit");
    assert_eq!(&reply[22..38], &orig[38..54], "from the VIP");
    assert_eq!(&reply[38..54], &orig[22..38], "to the client");
    assert_eq!((reply[54], reply[55]), (1, 4), "destination unreachable, port unreachable");
    assert_eq!(&reply[62..], &orig[14..62], "the quote");
    // The checksum over the pseudo-header and the ICMPv6 message sums to 0xffff.
    let mut sum: u64 = 0;
    let words = |b: &[u8]| b.chunks(2).map(|c| u64::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum::<u64>();
    sum += words(&reply[22..54]) + 56 + 58 + words(&reply[54..]);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    assert_eq!(sum, 0xffff, "ICMPv6 checksum");
}

/// An ICMPv6 error (`icmp_type`, `code`, `word`: the MTU of a packet too big) from `src` to
/// `dst`, quoting the first `quote_len` bytes of the IPv6 packet in `quoted` (an Ethernet frame),
/// with a valid checksum.
pub fn icmp6_error(src: &str, dst: &str, icmp_type: u8, code: u8, word: u32, quoted: &[u8], quote_len: usize) -> Vec<u8> {
    let (s, d): (Ipv6Addr, Ipv6Addr) = (src.parse().unwrap(), dst.parse().unwrap());
    let quote = &quoted[14..(14 + quote_len).min(quoted.len())];
    let mut msg = vec![icmp_type, code, 0, 0];
    msg.extend_from_slice(&word.to_be_bytes());
    msg.extend_from_slice(quote);
    let c = l4_checksum6(s, d, 58, &msg);
    msg[2..4].copy_from_slice(&c.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x86, 0xdd, 0x60, 0, 0, 0];
    f.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    f.extend_from_slice(&[58, 64]);
    f.extend_from_slice(&s.octets());
    f.extend_from_slice(&d.octets());
    f.extend(msg);
    f
}

/// An ICMPv6 error frame as read back: its addresses, type, whether its checksum holds, and the
/// quoted packet's (src, sport, dst, dport) and, where the whole quoted L4 header is there,
/// whether its checksum holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Icmp6Error {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub icmp_type: u8,
    pub csum_ok: bool,
    pub quoted: (Ipv6Addr, u16, Ipv6Addr, u16),
    pub quoted_l4_csum_ok: Option<bool>,
}

pub fn parse_icmp6_error(f: &[u8]) -> Icmp6Error {
    assert!(f.len() >= 14 + 40 + 8 + 44 && f[20] == 58, "not an ICMPv6 error: {f:02x?}");
    let ip = &f[14..];
    let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap());
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap());
    let msg = &ip[40..40 + len];
    let q = &msg[8..];
    let (qs, qd) = (Ipv6Addr::from(<[u8; 16]>::try_from(&q[8..24]).unwrap()), Ipv6Addr::from(<[u8; 16]>::try_from(&q[24..40]).unwrap()));
    let ql4 = &q[40..];
    let qlen = usize::from(u16::from_be_bytes([q[4], q[5]]));
    let quoted_l4_csum_ok = (ql4.len() >= qlen).then(|| l4_checksum6(qs, qd, q[6], &ql4[..qlen]) == 0);
    Icmp6Error {
        src,
        dst,
        icmp_type: msg[0],
        csum_ok: l4_checksum6(src, dst, 58, msg) == 0,
        quoted: (qs, u16::from_be_bytes([ql4[0], ql4[1]]), qd, u16::from_be_bytes([ql4[2], ql4[3]])),
        quoted_l4_csum_ok,
    }
}
