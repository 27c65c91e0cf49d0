//! Header parsing: Ethernet -> IPv4 -> TCP/UDP (and SCTP's ports for IPVS mode's set
//! matching), and ICMP errors quoting a TCP/UDP packet. Anything else is "not ours" and passes.
use proxy_common::{PROTO_SCTP, PROTO_TCP, PROTO_UDP};

use crate::pkt::{L4Csum, Pkt};

pub const ETH_LEN: usize = 14;
pub const ETH_P_IP_BE: u16 = 0x0800u16.to_be();
/// Offsets of IPv4 fields from the start of the frame.
pub const IP_OFF: usize = ETH_LEN;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// A parsed IPv4 TCP/UDP packet. Addresses and ports in network order.
#[derive(Clone, Copy)]
pub struct Flow {
    pub l4_off: usize,
    pub ihl_bytes: usize,
    pub proto: u8,
    pub tcp_flags: u8,
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub csum: L4Csum,
}

impl Flow {
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
}

pub const PROTO_ICMP: u8 = 1;
/// ICMP errors are handled with option-less outer and quoted IPv4 headers (fixed offsets).
pub const ICMP_OFF: usize = IP_OFF + 20;
pub const INNER_IP_OFF: usize = ICMP_OFF + 8;
pub const INNER_L4_OFF: usize = INNER_IP_OFF + 20;

/// An ICMP error (destination unreachable, time exceeded, parameter problem) about an IPv4
/// TCP/UDP packet, which it quotes: the outer addresses and the quoted packet's 5-tuple, in
/// network order.
#[derive(Clone, Copy)]
pub struct IcmpError {
    pub saddr: u32,
    pub daddr: u32,
    pub inner_saddr: u32,
    pub inner_daddr: u32,
    pub inner_sport: u16,
    pub inner_dport: u16,
    pub inner_proto: u8,
    /// Destination unreachable, but for fragmentation needed: whoever sent it refuses the
    /// quoted packet (a port or host unreachable, an administrative prohibition).
    pub refusal: bool,
    /// The quoted L4 checksum, when the quote holds it (UDP's always; TCP's from 18 bytes on);
    /// offset 0 when it does not. (Not an Option: Rust's enum layout is not valid BTF, and the
    /// object's BTF must load.)
    pub inner_csum: L4Csum,
}

pub enum Parsed {
    /// Not IPv4 TCP/UDP: pass untouched.
    Other,
    /// An ICMP error about a TCP/UDP packet: translated as a reply to that packet.
    IcmpError(IcmpError),
    /// Truncated or inconsistent headers: pass untouched, never rewritten.
    Malformed,
    /// A fragment: no L4 ports to match on.
    Fragment,
    Flow(Flow),
}

#[inline(always)]
pub fn parse<P: Pkt>(p: &P) -> Parsed {
    parse_l4::<P, false>(p)
}

/// `parse`, and SCTP as a Flow too (its ports; `csum.off` 0: SCTP's CRC32c is not an internet
/// checksum to update). For IPVS mode's set matching, which never rewrites a packet.
#[inline(always)]
pub fn parse_with_sctp<P: Pkt>(p: &P) -> Parsed {
    parse_l4::<P, true>(p)
}

#[inline(always)]
fn parse_l4<P: Pkt, const SCTP: bool>(p: &P) -> Parsed {
    let Some(ethertype) = p.load::<u16>(12) else {
        return Parsed::Other;
    };
    if ethertype != ETH_P_IP_BE {
        return Parsed::Other;
    }
    // The fixed IPv4 header in one bounds check, so the verifier sees it before any
    // variable-offset access.
    let Some(w) = p.load::<[u16; 10]>(IP_OFF) else {
        return Parsed::Malformed;
    };
    let b = |i: usize| w[i / 2].to_ne_bytes()[i % 2];
    let vihl = b(0);
    if vihl >> 4 != 4 {
        return Parsed::Malformed;
    }
    let ihl_bytes = usize::from(vihl & 0x0f) * 4;
    if ihl_bytes < 20 {
        return Parsed::Malformed;
    }
    let proto = b(9);
    if proto == PROTO_ICMP {
        return parse_icmp_error(p, &w, ihl_bytes);
    }
    let sctp = SCTP && proto == PROTO_SCTP;
    if proto != PROTO_TCP && proto != PROTO_UDP && !sctp {
        return Parsed::Other;
    }
    let tot_len = usize::from(u16::from_be(w[1]));
    let frag = u16::from_be(w[3]);
    let saddr = u32::from(w[6]) | (u32::from(w[7]) << 16);
    let daddr = u32::from(w[8]) | (u32::from(w[9]) << 16);
    // The frame may carry Ethernet padding, never less than the IP header claims.
    if tot_len < ihl_bytes || ETH_LEN + tot_len > p.wire_len() {
        return Parsed::Malformed;
    }
    if frag & 0x3fff != 0 {
        return Parsed::Fragment;
    }
    let l4_off = IP_OFF + ihl_bytes;
    let (l4_min, csum_off, udp) = if proto == PROTO_TCP {
        (20, 16, false)
    } else if sctp {
        (12, 0, false)
    } else {
        (8, 6, true)
    };
    if tot_len < ihl_bytes + l4_min {
        return Parsed::Malformed;
    }
    // One bounds check per header: TCP up to its flags (and checksum), the whole UDP header,
    // SCTP's ports and verification tag.
    let (ports, tcp_flags) = if proto == PROTO_TCP {
        let Some(h) = p.ptr::<[u32; 5]>(l4_off) else {
            return Parsed::Malformed;
        };
        let (ports, word3) = unsafe { ((*h)[0], (*h)[3]) };
        (ports, (word3 >> 8) as u8)
    } else {
        let Some(h) = p.ptr::<[u32; 2]>(l4_off) else {
            return Parsed::Malformed;
        };
        (unsafe { (*h)[0] }, 0)
    };
    let ports: [u16; 2] = [ports as u16, (ports >> 16) as u16];
    Parsed::Flow(Flow {
        l4_off,
        ihl_bytes,
        proto,
        tcp_flags,
        saddr,
        daddr,
        sport: ports[0],
        dport: ports[1],
        csum: L4Csum { off: if sctp { 0 } else { l4_off + csum_off }, udp },
    })
}

/// ICMP types that quote the packet they are about (RFC 792).
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
/// Destination unreachable's "fragmentation needed" (path MTU discovery, not a refusal).
const ICMP_FRAG_NEEDED: u8 = 4;

#[inline(always)]
fn parse_icmp_error<P: Pkt>(p: &P, outer: &[u16; 10], ihl_bytes: usize) -> Parsed {
    let frag = u16::from_be(outer[3]);
    if ihl_bytes != 20 || frag & 0x3fff != 0 {
        return Parsed::Other;
    }
    let Some([icmp_type, icmp_code]) = p.load::<[u8; 2]>(ICMP_OFF) else {
        return Parsed::Other;
    };
    if icmp_type != ICMP_DEST_UNREACH && icmp_type != ICMP_TIME_EXCEEDED && icmp_type != ICMP_PARAMETERPROB {
        return Parsed::Other;
    }
    // The quoted IPv4 header and the first 8 bytes of its L4 header (ports, UDP checksum).
    let Some(inner) = p.load::<[u16; 14]>(INNER_IP_OFF) else {
        return Parsed::Other;
    };
    let b = |i: usize| inner[i / 2].to_ne_bytes()[i % 2];
    let proto = b(9);
    if b(0) != 0x45 || (proto != PROTO_TCP && proto != PROTO_UDP) || u16::from_be(inner[3]) & 0x1fff != 0 {
        return Parsed::Other;
    }
    let inner_csum = if proto == PROTO_UDP {
        L4Csum { off: INNER_L4_OFF + 6, udp: true }
    } else if p.load::<u16>(INNER_L4_OFF + 16).is_some() {
        L4Csum { off: INNER_L4_OFF + 16, udp: false }
    } else {
        L4Csum { off: 0, udp: false }
    };
    Parsed::IcmpError(IcmpError {
        saddr: u32::from(outer[6]) | (u32::from(outer[7]) << 16),
        daddr: u32::from(outer[8]) | (u32::from(outer[9]) << 16),
        inner_saddr: u32::from(inner[6]) | (u32::from(inner[7]) << 16),
        inner_daddr: u32::from(inner[8]) | (u32::from(inner[9]) << 16),
        inner_sport: inner[10],
        inner_dport: inner[11],
        inner_proto: proto,
        refusal: icmp_type == ICMP_DEST_UNREACH && icmp_code != ICMP_FRAG_NEEDED,
        inner_csum,
    })
}
