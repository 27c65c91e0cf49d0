//! ICMPv6 errors about the IPv6 packet path's flows (destination unreachable, packet too big,
//! time exceeded, parameter problem), translated as netfilter's NAT does (see icmp.rs): the
//! error is a reply to the packet it quotes, so the entry of that packet's reply at this hook
//! rewrites the quote (addresses and ports, and its L4 checksum where quoted) and the outer
//! addresses that are the quote's. Without it a client never learns the path MTU towards an
//! IPv6 frontend (IPv6 routers do not fragment), and a backend never hears of an unreachable
//! client.
//!
//! - At the uplink's ingress: an error about a reply the node sent (frontend -> client) goes
//!   to the backend, quoting backend -> client; netfilter then undoes its masquerade in it.
//! - At egress: an error about a forward packet (client -> backend), netfilter's masquerade
//!   already undone, goes to the client quoting client -> frontend.
//!
//! Every byte is written by hand: the ICMPv6 checksum takes every change (the outer addresses
//! through its pseudo-header), so a CHECKSUM_COMPLETE sum over the packet stays right.
use proxy_common::{counter, CtKey6, PROTO_TCP, PROTO_UDP};

use crate::{
    conntrack6,
    counters::bump,
    csum,
    maps::CONNTRACK6,
    parse::IP_OFF,
    pkt::{Pkt, Verdict},
};

const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PARAM_PROBLEM: u8 = 4;

/// Whether the packet holds `a` at `at`, word by word (no copy on the stack).
#[inline(always)]
fn holds<P: Pkt>(p: &P, at: usize, a: &[u32; 4]) -> bool {
    (0..4).all(|i| p.load::<u32>(at + 4 * i) == Some(a[i]))
}

/// Writes `a` at `at`, word by word.
#[inline(always)]
fn put<P: Pkt>(p: &mut P, at: usize, a: &[u32; 4]) -> Option<()> {
    for (i, w) in a.iter().enumerate() {
        p.store(at + 4 * i, *w)?;
    }
    Some(())
}

/// Translates the ICMPv6 message at `off` if it is an error about a flow this hook knows (`dir`:
/// CT_DIR_INGRESS or CT_DIR_EGRESS); anything else goes on untouched (`Verdict::Next`, see
/// pipeline6). A subprogram (rare packets): its frame stays off the hot path's.
#[inline(never)]
pub fn translate<P: Pkt>(p: &mut P, off: usize, dir: u8) -> Verdict {
    match rewrite(p, off, dir) {
        Some(true) => {
            bump(counter::ICMP_ERROR_NAT);
            Verdict::Pass
        }
        Some(false) => Verdict::Next,
        None => Verdict::Drop,
    }
}

/// Some(true): translated; Some(false): not an error about a known flow; None: a known flow's
/// error that could not be rewritten. Addresses are compared and written in place, not copied:
/// the frame adds to the hook's.
#[inline(always)]
fn rewrite<P: Pkt>(p: &mut P, off: usize, dir: u8) -> Option<bool> {
    // Two-byte loads: for a one-byte one LLVM writes the bounds check in a form the verifier
    // does not follow at a variable offset.
    let Some([icmp_type, _code]) = p.load::<[u8; 2]>(off) else { return Some(false) };
    if !(ICMPV6_DEST_UNREACH..=ICMPV6_PARAM_PROBLEM).contains(&icmp_type) {
        return Some(false);
    }
    // The quote: an IPv6 header with TCP or UDP right behind it (its ports, at least).
    let inner = off + 8;
    let inner_l4 = inner + 40;
    let (Some([proto, _hop_limit]), Some(ports)) = (p.load::<[u8; 2]>(inner + 6), p.load::<[u16; 2]>(inner_l4)) else { return Some(false) };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Some(false);
    }
    // The key of the quoted packet's reply: the quote's destination is its source.
    let (Some(q_src), Some(q_dst)) = (p.load::<[u32; 4]>(inner + 8), p.load::<[u32; 4]>(inner + 24)) else { return Some(false) };
    let key = CtKey6 { saddr: q_dst, daddr: q_src, sport: ports[1], dport: ports[0], proto, dir, _pad: 0 };
    // An embryonic flow's too (a SYN's packet too big, or the backend refusing it).
    let Some(v) = (unsafe { CONNTRACK6.get(&key).or_else(|| conntrack6::after_assured_miss(&key).map(|(v, _)| &*v)) }) else { return Some(false) };
    // The quote is the forward packet of the reply the entry rewrites: its source becomes the
    // reply's new destination, its destination the reply's new source. The outer addresses
    // that are the quote's follow it.
    let out_src_is_quote_dst = holds(p, IP_OFF + 8, &key.saddr);
    let out_dst_is_quote_src = holds(p, IP_OFF + 24, &key.daddr);
    let inner_diff = csum::diff16(&key.daddr, &v.new_daddr)
        + csum::diff16(&key.saddr, &v.new_saddr)
        + csum::diff2(key.dport, v.new_dport)
        + csum::diff2(key.sport, v.new_sport);
    let mut icmp_diff = inner_diff;
    put(p, inner + 8, &v.new_daddr)?;
    put(p, inner + 24, &v.new_saddr)?;
    p.store(inner_l4, [v.new_dport, v.new_sport])?;
    if out_src_is_quote_dst {
        icmp_diff += csum::diff16(&key.saddr, &v.new_saddr);
        put(p, IP_OFF + 8, &v.new_saddr)?;
    }
    if out_dst_is_quote_src {
        icmp_diff += csum::diff16(&key.daddr, &v.new_daddr);
        put(p, IP_OFF + 24, &v.new_daddr)?;
    }
    // The quoted L4 checksum, where the quote holds it: its pseudo-header and ports changed.
    let field = inner_l4 + if proto == PROTO_UDP { 6 } else { 16 };
    if let Some(old) = p.load::<u16>(field) {
        if !(proto == PROTO_UDP && old == 0) {
            let new = csum::apply_l4(old, inner_diff, proto == PROTO_UDP);
            p.store(field, new)?;
            icmp_diff += csum::diff2(old, new);
        }
    }
    let check: u16 = p.load(off + 2)?;
    p.store(off + 2, csum::apply(check, icmp_diff))?;
    Some(true)
}
