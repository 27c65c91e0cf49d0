//! Answers built in place from the offending packet and sent back towards its sender (see
//! Pkt::reply_verdict): "no endpoints" as kube-proxy's REJECT rule answers it (ICMP or ICMPv6 port
//! unreachable), and the TCP reset that ends a flow past its maximum connection age. Written
//! field by field to keep the stack small (inlined into the caller's 512 bytes).
use proxy_common::PROTO_TCP;

use crate::{
    csum,
    parse::{Flow, IP_OFF, PROTO_ICMP, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    pkt::{Pkt, Verdict},
};

const REPLY_LEN: usize = 14 + 20 + 8 + 28;
const ICMP_OFF: usize = IP_OFF + 20;

#[inline(always)]
fn halves(addr: u32) -> u64 {
    u64::from(addr as u16) + u64::from((addr >> 16) as u16)
}

/// Resizes the frame to the reply's `len` and, where the reply goes straight back out
/// (`Verdict::Bounce`), swaps its MAC addresses. Whatever the reply quotes must be read before.
#[inline(always)]
fn turn_around<P: Pkt>(p: &mut P, len: usize) -> Option<Verdict> {
    let dst_mac: [u16; 3] = p.load(0)?;
    let src_mac: [u16; 3] = p.load(6)?;
    p.resize(len)?;
    let verdict = p.reply_verdict();
    if verdict == Verdict::Bounce {
        p.store(0, src_mac)?;
        p.store(6, dst_mac)?;
    }
    Some(verdict)
}

/// An option-less IPv4 header with its checksum: `tos_word` is the first 16 bits (version, IHL,
/// TOS) as they lie in memory; addresses in network order.
#[inline(always)]
fn write_ipv4_header<P: Pkt>(p: &mut P, tos_word: u16, tot_len: u16, proto: u8, saddr: u32, daddr: u32) -> Option<()> {
    let tot = tot_len.to_be();
    let ttl_proto = u16::from_ne_bytes([64, proto]);
    let ip_sum = u64::from(tos_word) + u64::from(tot) + u64::from(ttl_proto) + halves(saddr) + halves(daddr);
    p.store(IP_OFF, tos_word)?;
    p.store(IP_OFF + 2, tot)?;
    p.store(IP_OFF + 4, 0u32)?; // id, fragment offset
    p.store(IP_OFF + 8, ttl_proto)?;
    p.store(IP_OFF + 10, !csum::fold(ip_sum))?;
    p.store(IP_OFF + 12, saddr)?;
    p.store(IP_OFF + 16, daddr)
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
    let quote: [u16; 14] = p.load(IP_OFF)?;
    let verdict = turn_around(p, REPLY_LEN)?;
    // From the VIP to the client.
    write_ipv4_header(p, u16::from_ne_bytes([0x45, 0xc0]), 56, PROTO_ICMP, daddr, saddr)?;

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
    let quote: [u16; QUOTE6_LEN / 2] = p.load(IP_OFF)?;
    let verdict = turn_around(p, REPLY6_LEN)?;
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

const RST_LEN: usize = IP_OFF + 20 + 20;

/// A TCP reset answering the packet `f` (RFC 9293 section 3.10.7.1: to a segment with ACK, a
/// reset whose sequence number is that acknowledgement; else one that acknowledges the segment),
/// from its destination back to its source. Ends a flow past its Service's maximum connection
/// age: at ingress the destination is still the service address, which the client knows. `None`
/// when the packet cannot be turned into one (then dropped).
///
/// The packet's fields by value (addresses and ports in network order, `ports` = sport | dport
/// << 16): a Flow pointer would put the Flow on the established path's stack.
#[inline(never)]
pub fn tcp_reset<P: Pkt>(p: &mut P, saddr: u32, daddr: u32, ports: u32, l4_off: usize) -> Option<Verdict> {
    if l4_off != IP_OFF + 20 {
        return None;
    }
    let tot_len = u16::from_be(p.load::<u16>(IP_OFF + 2)?);
    // Ports, sequence, acknowledgement, data offset and flags.
    let th: [u32; 4] = p.load(l4_off)?;
    let (seq, ack) = (u32::from_be(th[1]), u32::from_be(th[2]));
    let w3 = th[3].to_ne_bytes();
    let (doff, flags) = (u32::from(w3[0] >> 4) * 4, w3[1]);
    let payload = u32::from(tot_len).saturating_sub(20 + doff);
    let (rseq, rack, rflags) = if flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        let len = payload + u32::from(flags & TCP_SYN != 0) + u32::from(flags & TCP_FIN != 0);
        (0, seq.wrapping_add(len), TCP_RST | TCP_ACK)
    };
    let verdict = turn_around(p, RST_LEN)?;
    let (sport, dport) = (ports as u16, (ports >> 16) as u16);
    let (saddr, daddr) = (daddr, saddr);
    write_ipv4_header(p, u16::from_ne_bytes([0x45, 0]), 40, PROTO_TCP, saddr, daddr)?;

    let l4 = IP_OFF + 20;
    let ports = u32::from(dport) | (u32::from(sport) << 16);
    let (seq_be, ack_be) = (rseq.to_be(), rack.to_be());
    let off_flags = u16::from_ne_bytes([0x50, rflags]);
    // Pseudo-header (addresses, protocol, length), then the header with a zero checksum.
    let sum = halves(saddr)
        + halves(daddr)
        + u64::from(u16::from_ne_bytes([0, PROTO_TCP]))
        + u64::from((20u16).to_be())
        + halves(ports)
        + halves(seq_be)
        + halves(ack_be)
        + u64::from(off_flags);
    p.store(l4, ports)?;
    p.store(l4 + 4, seq_be)?;
    p.store(l4 + 8, ack_be)?;
    p.store(l4 + 12, off_flags)?;
    p.store(l4 + 14, 0u16)?; // window
    p.store(l4 + 16, !csum::fold(sum))?;
    p.store(l4 + 18, 0u16)?; // urgent pointer
    Some(verdict)
}
