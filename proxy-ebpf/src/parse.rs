//! Header parsing: Ethernet -> IPv4 -> TCP/UDP. Anything else is "not ours" and passes.
use proxy_common::{PROTO_TCP, PROTO_UDP};

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

pub enum Parsed {
    /// Not IPv4 TCP/UDP: pass untouched.
    Other,
    /// Truncated or inconsistent headers: pass untouched, never rewritten.
    Malformed,
    /// A fragment: no L4 ports to match on.
    Fragment,
    Flow(Flow),
}

#[inline(always)]
pub fn parse<P: Pkt>(p: &P) -> Parsed {
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
    if proto != PROTO_TCP && proto != PROTO_UDP {
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
    let (l4_min, csum_off, udp) = if proto == PROTO_TCP { (20, 16, false) } else { (8, 6, true) };
    if tot_len < ihl_bytes + l4_min {
        return Parsed::Malformed;
    }
    // One bounds check per header: TCP up to its flags (and checksum), the whole UDP header.
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
        csum: L4Csum { off: l4_off + csum_off, udp },
    })
}
