//! Address and port rewriting with one incremental update per checksum: the rewrite's
//! address and port differences are summed once, then applied.
use crate::{
    csum,
    parse::{Flow, IP_OFF},
    pkt::Pkt,
    rewrite::Rewrite,
};

/// The IPv4 header's fields the rewrite touches, at their offsets.
#[repr(C)]
struct Ipv4Hdr {
    _head: [u16; 5],
    check: u16,
    saddr: u32,
    daddr: u32,
}

/// Rewrites the packet's 4-tuple to the given one (network order). Unchanged fields cost nothing.
#[inline(always)]
pub fn rewrite<P: Pkt>(p: &mut P, f: &Flow, rw: &Rewrite) -> Option<()> {
    let Rewrite { saddr, daddr, sport, dport, .. } = *rw;
    let mut addr_diff = 0;
    if daddr != f.daddr {
        addr_diff += csum::diff4(f.daddr, daddr);
    }
    if saddr != f.saddr {
        addr_diff += csum::diff4(f.saddr, saddr);
    }
    if addr_diff != 0 {
        let ip = p.ptr::<Ipv4Hdr>(IP_OFF)?;
        // The IPv4 header checksum is never offloaded, and its change cancels the addresses'
        // in any CHECKSUM_COMPLETE sum: plain arithmetic is right for every skb.
        unsafe {
            (*ip).daddr = daddr;
            (*ip).saddr = saddr;
            (*ip).check = csum::apply((*ip).check, addr_diff);
        }
    }
    let mut port_diff = 0;
    if sport != f.sport || dport != f.dport {
        port_diff = csum::diff2(f.sport, sport) + csum::diff2(f.dport, dport);
        let ports = p.ptr::<[u16; 2]>(f.l4_off)?;
        unsafe { *ports = [sport, dport] };
    }
    if addr_diff != 0 || port_diff != 0 {
        p.l4_csum_update(f.csum, addr_diff, port_diff)?;
    }
    Some(())
}
