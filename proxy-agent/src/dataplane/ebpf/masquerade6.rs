//! eBPF mode's one netfilter rule set, for IPv6: the packet path marks the flows kube-proxy
//! would masquerade (0x4000, pipeline6.rs) and leaves the masquerade to netfilter, as kube-proxy
//! does, so that its conntrack picks the ports. IPv4 masquerades in BPF and needs none.
use proxy_common::MARK_MASQ;

use crate::host::netfilter::{install_chains, remove_chains, Netfilter, NetfilterError, OwnedChain, IP6TABLES};

pub const NAT_CHAIN: &str = "KPR-EBPF6-POSTROUTING";
const CHAINS: [OwnedChain; 1] = [("nat", "POSTROUTING", NAT_CHAIN)];

/// The ip6tables-restore input (with --noflush; declaring the chain flushes it). `ports`: the
/// masquerade source ports (the IPv4 path's range, outside the NodePort and the node's
/// ephemeral ranges): a masqueraded flow's reply then never meets a NodePort, or a flow of the
/// node's own, at the uplink's ingress, which sees it before netfilter undoes the masquerade.
pub fn rules(ports: (u16, u16)) -> String {
    let m = format!("{MARK_MASQ:#x}");
    let (lo, hi) = ports;
    let comment = "-m comment --comment \"kpr: IPv6 flows marked by kpr_tc_ingress6\"";
    format!(
        "*nat\n\
         :{NAT_CHAIN} - [0:0]\n\
         -A {NAT_CHAIN} -m mark ! --mark {m}/{m} -j RETURN\n\
         -A {NAT_CHAIN} -j MARK --xor-mark {m}\n\
         -A {NAT_CHAIN} -p tcp {comment} -j MASQUERADE --to-ports {lo}-{hi} --random-fully\n\
         -A {NAT_CHAIN} -p udp {comment} -j MASQUERADE --to-ports {lo}-{hi} --random-fully\n\
         COMMIT\n"
    )
}

pub fn install(nf: &mut dyn Netfilter, ports: (u16, u16)) -> Result<(), NetfilterError> {
    install_chains(nf, IP6TABLES, &rules(ports), &CHAINS)
}

/// Idempotent; a node without ip6tables has nothing to remove.
pub fn remove(nf: &mut dyn Netfilter) -> Vec<String> {
    remove_chains(nf, IP6TABLES, &CHAINS).unwrap_or_else(|e| {
        tracing::debug!(error = %e, "no IPv6 masquerade rules to remove");
        Vec::new()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::netfilter::FakeNetfilter;

    #[test]
    fn installs_once_and_removes_what_it_installed() {
        let mut nf = FakeNetfilter::default();
        install(&mut nf, (1024, 29_999)).unwrap();
        assert_eq!(nf.restored.len(), 2, "the chain, then its jump");
        assert!(nf.restored[0]
            .1
            .contains("-p tcp -m comment --comment \"kpr: IPv6 flows marked by kpr_tc_ingress6\" -j MASQUERADE --to-ports 1024-29999 --random-fully"));
        assert!(nf.restored[0].1.contains("-p udp "));
        assert_eq!(nf.restored[1].1, format!("*nat\n-I POSTROUTING -j {NAT_CHAIN}\nCOMMIT\n"));
        // With the jump and the chain in place, a second install only refreshes the chain.
        nf.saved.insert(("ip6tables".into(), "nat".into()), format!(":{NAT_CHAIN} - [0:0]\n-A POSTROUTING -j {NAT_CHAIN}\n"));
        install(&mut nf, (1024, 29_999)).unwrap();
        assert_eq!(nf.restored.len(), 3);
        assert_eq!(remove(&mut nf), vec![format!("removed ip6tables nat chain {NAT_CHAIN}")]);
        assert_eq!(nf.restored[3].1, format!("*nat\n-D POSTROUTING -j {NAT_CHAIN}\n-F {NAT_CHAIN}\n-X {NAT_CHAIN}\nCOMMIT\n"));
    }
}
