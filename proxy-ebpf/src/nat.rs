//! Address and port rewriting with incremental L3/L4 checksum updates.
use crate::{
    conntrack::Rewrite,
    parse::{Flow, IP_CSUM, IP_DADDR, IP_SADDR},
    pkt::Pkt,
};

/// Rewrites the packet's 4-tuple to the given one (network order). Unchanged fields cost nothing.
#[inline(always)]
pub fn rewrite<P: Pkt>(p: &mut P, f: &Flow, rw: &Rewrite) -> Option<()> {
    let Rewrite { saddr, daddr, sport, dport, .. } = *rw;
    if daddr != f.daddr {
        p.l3_csum4(IP_CSUM, f.daddr, daddr)?;
        p.l4_csum4(f.csum, f.daddr, daddr, true)?;
        p.store(IP_DADDR, daddr)?;
    }
    if saddr != f.saddr {
        p.l3_csum4(IP_CSUM, f.saddr, saddr)?;
        p.l4_csum4(f.csum, f.saddr, saddr, true)?;
        p.store(IP_SADDR, saddr)?;
    }
    if dport != f.dport {
        p.l4_csum2(f.csum, f.dport, dport)?;
        p.store(f.l4_off + 2, dport)?;
    }
    if sport != f.sport {
        p.l4_csum2(f.csum, f.sport, sport)?;
        p.store(f.l4_off, sport)?;
    }
    Some(())
}
