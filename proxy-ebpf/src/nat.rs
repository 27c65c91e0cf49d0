//! Address and port rewriting with one incremental update per checksum: the rewrite's
//! address and port differences are summed once, then applied.
use crate::{
    conntrack::Rewrite,
    csum,
    parse::{Flow, IP_CSUM, IP_DADDR, IP_SADDR},
    pkt::Pkt,
};

/// Rewrites the packet's 4-tuple to the given one (network order). Unchanged fields cost nothing.
#[inline(always)]
pub fn rewrite<P: Pkt>(p: &mut P, f: &Flow, rw: &Rewrite) -> Option<()> {
    let Rewrite { saddr, daddr, sport, dport, .. } = *rw;
    let mut addr_diff = 0;
    let mut port_diff = 0;
    if daddr != f.daddr {
        addr_diff += csum::diff4(f.daddr, daddr);
        p.store(IP_DADDR, daddr)?;
    }
    if saddr != f.saddr {
        addr_diff += csum::diff4(f.saddr, saddr);
        p.store(IP_SADDR, saddr)?;
    }
    if dport != f.dport {
        port_diff += csum::diff2(f.dport, dport);
        p.store(f.l4_off + 2, dport)?;
    }
    if sport != f.sport {
        port_diff += csum::diff2(f.sport, sport);
        p.store(f.l4_off, sport)?;
    }
    // The IPv4 header checksum is never offloaded, and its change cancels the addresses' in
    // any CHECKSUM_COMPLETE sum: plain arithmetic is right for every skb.
    if addr_diff != 0 {
        let check: u16 = p.load(IP_CSUM)?;
        p.store(IP_CSUM, csum::apply(check, addr_diff))?;
    }
    if addr_diff != 0 || port_diff != 0 {
        p.l4_csum_update(f.csum, addr_diff, port_diff)?;
    }
    Some(())
}
