//! ICMP errors about translated flows (fragmentation needed, port or host unreachable, time
//! exceeded) are translated as netfilter's NAT does: the error is a reply to the packet it
//! quotes, so the entry of that packet's reply at this hook rewrites the quote (both of its
//! addresses and ports) and the outer addresses that are the quote's. Without it a client never
//! learns the path MTU towards a VIP, and a refused UDP port looks like a silent one.
use proxy_common::{counter, CtKey};

use crate::{
    conntrack, counters::bump, csum,
    parse::{IcmpError, ICMP_OFF, INNER_IP_OFF, INNER_L4_OFF, IP_OFF},
    pkt::{Pkt, Verdict},
};

/// The outer IPv4 header's fields the rewrite touches, at their offsets.
#[repr(C)]
struct Ipv4Addrs {
    _head: [u16; 5],
    check: u16,
    saddr: u32,
    daddr: u32,
}

/// A BPF subprogram of its own (rare packets): its stack does not add to the hot path's.
#[inline(never)]
pub fn translate<P: Pkt>(p: &mut P, e: &IcmpError, dir: u8) -> Verdict {
    let quoted_reply = CtKey {
        saddr: e.inner_daddr,
        daddr: e.inner_saddr,
        sport: e.inner_dport,
        dport: e.inner_sport,
        proto: e.inner_proto,
        dir,
        _pad: 0,
    };
    let Some(rw) = conntrack::for_icmp_error(&quoted_reply, e.refusal) else {
        return Verdict::Pass;
    };
    // The quote is the forward packet of the reply `rw` rewrites: its source becomes the
    // reply's new destination, its destination the reply's new source.
    let (in_saddr, in_sport, in_daddr, in_dport) = (rw.daddr, rw.dport, rw.saddr, rw.sport);
    let out_saddr = if e.saddr == e.inner_daddr { in_daddr } else { e.saddr };
    let out_daddr = if e.daddr == e.inner_saddr { in_saddr } else { e.daddr };
    match rewrite(p, e, (in_saddr, in_sport, in_daddr, in_dport), (out_saddr, out_daddr)) {
        Some(()) => {
            bump(counter::ICMP_ERROR_NAT);
            Verdict::Pass
        }
        None => Verdict::Drop,
    }
}

#[inline(always)]
fn rewrite<P: Pkt>(p: &mut P, e: &IcmpError, quote: (u32, u16, u32, u16), outer: (u32, u32)) -> Option<()> {
    let (in_saddr, in_sport, in_daddr, in_dport) = quote;
    // The quoted packet: addresses (and its header checksum), ports, and its L4 checksum where
    // the quote holds it. Every changed word also changes the ICMP checksum, which covers the
    // whole message.
    let addr_diff = csum::diff4(e.inner_saddr, in_saddr) + csum::diff4(e.inner_daddr, in_daddr);
    let port_diff = csum::diff2(e.inner_sport, in_sport) + csum::diff2(e.inner_dport, in_dport);
    let mut icmp_diff = addr_diff + port_diff;
    let ip = p.ptr::<Ipv4Addrs>(INNER_IP_OFF)?;
    unsafe {
        let old = (*ip).check;
        let new = csum::apply(old, addr_diff);
        (*ip).saddr = in_saddr;
        (*ip).daddr = in_daddr;
        (*ip).check = new;
        icmp_diff += csum::diff2(old, new);
    }
    let ports = p.ptr::<[u16; 2]>(INNER_L4_OFF)?;
    unsafe { *ports = [in_sport, in_dport] };
    let c = e.inner_csum;
    if c.off != 0 {
        let field = p.ptr::<u16>(c.off)?;
        unsafe {
            let old = *field;
            if !(c.udp && old == 0) {
                let new = csum::apply_l4(old, addr_diff + port_diff, c.udp);
                *field = new;
                icmp_diff += csum::diff2(old, new);
            }
        }
    }
    let icmp_check = p.ptr::<u16>(ICMP_OFF + 2)?;
    unsafe { *icmp_check = csum::apply(*icmp_check, icmp_diff) };
    // The outer header.
    let (out_saddr, out_daddr) = outer;
    if out_saddr != e.saddr || out_daddr != e.daddr {
        let diff = csum::diff4(e.saddr, out_saddr) + csum::diff4(e.daddr, out_daddr);
        let ip = p.ptr::<Ipv4Addrs>(IP_OFF)?;
        unsafe {
            (*ip).saddr = out_saddr;
            (*ip).daddr = out_daddr;
            (*ip).check = csum::apply((*ip).check, diff);
        }
    }
    Some(())
}
