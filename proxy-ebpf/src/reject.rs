//! "No endpoints": answer as kube-proxy's REJECT rule does, with ICMP port unreachable, built in
//! place from the offending packet and sent back towards the client (see Pkt::reply_verdict).
//! Written field by field to keep the stack small (it is inlined into the caller's 512 bytes).
use crate::{
    csum,
    parse::{Flow, IP_OFF},
    pkt::{Pkt, Verdict},
};

const REPLY_LEN: usize = 14 + 20 + 8 + 28;
const ICMP_OFF: usize = IP_OFF + 20;

#[inline(always)]
fn halves(addr: u32) -> u64 {
    u64::from(addr as u16) + u64::from((addr >> 16) as u16)
}

/// Returns `None` when the packet cannot be turned into a reply (it is then dropped). A
/// subprogram: rare, and its frame stays off the new-flow path's.
#[inline(never)]
pub fn icmp_port_unreachable<P: Pkt>(p: &mut P, f: &Flow) -> Option<Verdict> {
    // The quote is the original IP header (no options) and the first 8 bytes of L4.
    if f.ihl_bytes != 20 {
        return None;
    }
    let (saddr, daddr) = (f.saddr, f.daddr);
    let dst_mac: [u16; 3] = p.load(0)?;
    let src_mac: [u16; 3] = p.load(6)?;
    let quote: [u16; 14] = p.load(IP_OFF)?;
    p.resize(REPLY_LEN)?;

    let verdict = p.reply_verdict();
    if verdict == Verdict::Bounce {
        p.store(0, src_mac)?;
        p.store(6, dst_mac)?;
    }
    let w0 = u16::from_ne_bytes([0x45, 0xc0]);
    let tot = (56u16).to_be();
    let ttl_proto = u16::from_ne_bytes([64, 1]);
    let ip_sum = u64::from(w0) + u64::from(tot) + u64::from(ttl_proto) + halves(daddr) + halves(saddr);
    p.store(IP_OFF, w0)?;
    p.store(IP_OFF + 2, tot)?;
    p.store(IP_OFF + 4, 0u32)?; // id, fragment offset
    p.store(IP_OFF + 8, ttl_proto)?;
    p.store(IP_OFF + 10, !csum::fold(ip_sum))?;
    p.store(IP_OFF + 12, daddr)?; // from the VIP
    p.store(IP_OFF + 16, saddr)?; // to the client

    let type_code = u16::from_ne_bytes([3, 3]);
    let mut sum = u64::from(type_code);
    let mut i = 0;
    while i < 14 {
        sum += u64::from(quote[i]);
        i += 1;
    }
    p.store(ICMP_OFF, type_code)?;
    p.store(ICMP_OFF + 2, !csum::fold(sum))?;
    p.store(ICMP_OFF + 4, 0u32)?;
    p.store(ICMP_OFF + 8, quote)?;
    Some(verdict)
}

/// The ICMPv6 reply: Ethernet, IPv6 header, ICMPv6 header, then the start of the offending
/// packet (RFC 4443 quotes as much as fits; its IPv6 header and 8 bytes after it are enough for
/// the client's stack to find the socket when no extension header sits in between).
const QUOTE6_LEN: usize = 48;
const ICMP6_OFF: usize = IP_OFF + 40;
const REPLY6_LEN: usize = ICMP6_OFF + 8 + QUOTE6_LEN;
const ICMPV6: u8 = 58;

#[inline(always)]
fn halves6(a: &[u32; 4]) -> u64 {
    halves(a[0]) + halves(a[1]) + halves(a[2]) + halves(a[3])
}

/// ICMPv6 destination unreachable, port unreachable (ip6tables' `REJECT --reject-with
/// icmp6-port-unreachable`), from `daddr` back to `saddr` (network order). `None` when the
/// packet cannot be turned into a reply (it is then dropped). A subprogram, as the IPv4 one.
#[inline(never)]
pub fn icmp6_port_unreachable<P: Pkt>(p: &mut P, saddr: [u32; 4], daddr: [u32; 4]) -> Option<Verdict> {
    let dst_mac: [u16; 3] = p.load(0)?;
    let src_mac: [u16; 3] = p.load(6)?;
    let quote: [u16; QUOTE6_LEN / 2] = p.load(IP_OFF)?;
    p.resize(REPLY6_LEN)?;

    let verdict = p.reply_verdict();
    if verdict == Verdict::Bounce {
        p.store(0, src_mac)?;
        p.store(6, dst_mac)?;
    }
    let payload_len = (8 + QUOTE6_LEN) as u16;
    p.store(IP_OFF, u32::from_ne_bytes([0x60, 0, 0, 0]))?;
    p.store(IP_OFF + 4, payload_len.to_be())?;
    p.store(IP_OFF + 6, u16::from_ne_bytes([ICMPV6, 64]))?;
    p.store(IP_OFF + 8, daddr)?; // from the VIP
    p.store(IP_OFF + 24, saddr)?; // to the client

    // The checksum covers the pseudo-header (addresses, upper-layer length, next header).
    let type_code = u16::from_ne_bytes([1, 4]);
    let mut sum = halves6(&saddr) + halves6(&daddr) + u64::from(payload_len.to_be()) + u64::from(u16::from_ne_bytes([0, ICMPV6])) + u64::from(type_code);
    let mut i = 0;
    while i < QUOTE6_LEN / 2 {
        sum += u64::from(quote[i]);
        i += 1;
    }
    p.store(ICMP6_OFF, type_code)?;
    p.store(ICMP6_OFF + 2, !csum::fold(sum))?;
    p.store(ICMP6_OFF + 4, 0u32)?;
    p.store(ICMP6_OFF + 8, quote)?;
    Some(verdict)
}
