//! IPv6 header parsing: Ethernet -> IPv6 -> extension headers -> TCP/UDP/SCTP ports. Used by IPVS
//! mode's set matching and by the fast path's IPv6 packet path (pipeline6.rs).
use proxy_common::{PROTO_SCTP, PROTO_TCP, PROTO_UDP};

use crate::{
    parse::{IP_OFF, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    pkt::{L4Csum, Pkt},
};

pub const ETH_P_IPV6_BE: u16 = 0x86ddu16.to_be();
pub const IPV6_HDR_LEN: usize = 40;

/// Extension headers (RFC 8200 section 4) walked to reach L4.
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_AUTH: u8 = 51;
const NEXTHDR_DEST: u8 = 60;
/// More than this many extension headers: not parsed (passes untouched). A bounded walk, for the
/// verifier; real packets carry one or two.
const MAX_EXT_HEADERS: usize = 6;

/// A parsed IPv6 TCP/UDP/SCTP packet. Addresses and ports in network order.
#[derive(Clone, Copy)]
pub struct Flow6 {
    pub l4_off: usize,
    pub proto: u8,
    pub tcp_flags: u8,
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
}

impl Flow6 {
    #[inline(always)]
    pub fn is_new_tcp_syn(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }
    /// SYN, FIN or RST: packets that open or close a flow, which conntrack must see.
    #[inline(always)]
    pub fn is_tcp_control(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0
    }
    #[inline(always)]
    pub fn is_tcp_close(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_FIN | TCP_RST) != 0
    }
    /// Where the L4 checksum lives (TCP and UDP; IPv6 has no header checksum, and UDP's is
    /// mandatory, RFC 8200 section 8.1).
    #[inline(always)]
    pub fn csum(&self) -> L4Csum {
        let udp = self.proto == PROTO_UDP;
        L4Csum { off: self.l4_off + if udp { 6 } else { 16 }, udp }
    }
}

/// ICMPv6's next-header number.
pub const PROTO_ICMPV6: u8 = 58;

pub enum Parsed6 {
    /// Not IPv6, or not TCP/UDP/SCTP/ICMPv6: pass untouched.
    Other,
    /// An ICMPv6 message, its header at `off` (pipeline6 translates errors about its flows).
    Icmp { off: usize },
    /// Truncated headers, or more extension headers than are walked.
    Malformed,
    /// A fragment (first or later): no reliable L4 ports, as for IPv4.
    Fragment,
    Flow(Flow6),
}

/// Where a walk over extension headers ends.
pub enum L4At {
    /// The first header that is no extension header, and its offset.
    Header { next: u8, off: usize },
    /// A fragment header (first or later fragment).
    Fragment,
    /// Truncated, or more extension headers than are walked.
    Malformed,
}

/// Walks the extension headers from `next` at `off` (just past the fixed header); `load2` reads
/// a header's first two bytes (next header, length) at an offset. One walk for every reader of
/// IPv6: the TC set matching (direct packet access) and the KUBE-LOOP-BACK match (skb loads).
#[inline(always)]
pub fn walk_ext_headers(mut next: u8, mut off: usize, load2: impl Fn(usize) -> Option<[u8; 2]>) -> L4At {
    for _ in 0..MAX_EXT_HEADERS {
        let len = match next {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_AUTH => {
                let Some(e) = load2(off) else {
                    return L4At::Malformed;
                };
                // AH counts 4-byte units beyond the first two; the others 8-byte units beyond the first.
                let len = if next == NEXTHDR_AUTH { (usize::from(e[1]) + 2) * 4 } else { (usize::from(e[1]) + 1) * 8 };
                next = e[0];
                len
            }
            NEXTHDR_FRAGMENT => return L4At::Fragment,
            _ => return L4At::Header { next, off },
        };
        off += len;
    }
    match next {
        NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_AUTH | NEXTHDR_FRAGMENT => L4At::Malformed,
        _ => L4At::Header { next, off },
    }
}

#[inline(always)]
pub fn parse<P: Pkt>(p: &P) -> Parsed6 {
    let Some(ethertype) = p.load::<u16>(12) else {
        return Parsed6::Other;
    };
    if ethertype != ETH_P_IPV6_BE {
        return Parsed6::Other;
    }
    // The fixed header in one bounds check: version, payload length, next header, addresses.
    let Some(h) = p.load::<[u32; 10]>(IP_OFF) else {
        return Parsed6::Malformed;
    };
    if h[0].to_ne_bytes()[0] >> 4 != 6 {
        return Parsed6::Malformed;
    }
    let w1 = h[1].to_ne_bytes();
    let payload_len = usize::from(u16::from_be_bytes([w1[0], w1[1]]));
    if IP_OFF + IPV6_HDR_LEN + payload_len > p.wire_len() {
        return Parsed6::Malformed;
    }
    let (next, off) = match walk_ext_headers(w1[2], IP_OFF + IPV6_HDR_LEN, |off| p.load::<[u8; 2]>(off)) {
        L4At::Header { next, off } => (next, off),
        L4At::Fragment => return Parsed6::Fragment,
        L4At::Malformed => return Parsed6::Malformed,
    };
    if next == PROTO_ICMPV6 {
        return Parsed6::Icmp { off };
    }
    if next != PROTO_TCP && next != PROTO_UDP && next != PROTO_SCTP {
        return Parsed6::Other;
    }
    // Ports (and TCP's flags) in one load.
    let (ports, tcp_flags) = if next == PROTO_TCP {
        let Some(t) = p.load::<[u32; 4]>(off) else {
            return Parsed6::Malformed;
        };
        (t[0], (t[3] >> 8) as u8)
    } else {
        let Some(t) = p.load::<u32>(off) else {
            return Parsed6::Malformed;
        };
        (t, 0)
    };
    Parsed6::Flow(Flow6 {
        l4_off: off,
        proto: next,
        tcp_flags,
        saddr: [h[2], h[3], h[4], h[5]],
        daddr: [h[6], h[7], h[8], h[9]],
        sport: ports as u16,
        dport: (ports >> 16) as u16,
    })
}
