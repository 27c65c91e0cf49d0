//! IPVS mode's constant netfilter rules: the same handful whatever the number of services
//! (kube-proxy's grow with them through ipset references). Set matching happens in BPF; these
//! rules only masquerade what it marked, hairpin traffic (KUBE-LOOP-BACK, an xt_bpf match on
//! the pinned `kpr_loopback`), and the node's own connections to VIPs; and accept marked
//! forwarded traffic on nodes whose FORWARD policy is DROP.
use std::path::Path;

use proxy_common::MARK_MASQ;

use crate::host::netfilter::{install_chains, remove_chains, Netfilter, NetfilterError, OwnedChain};

pub const NAT_CHAIN: &str = "KPR-POSTROUTING";
pub const FILTER_CHAIN: &str = "KPR-FORWARD";
/// The iptables front ends, IPv4's then IPv6's. The same rules serve both: the set program and
/// the KUBE-LOOP-BACK match read either family.
pub const BACKEND: &str = crate::host::netfilter::IPTABLES;
pub const BACKEND6: &str = crate::host::netfilter::IP6TABLES;

/// The iptables-restore input (with --noflush): declaring a chain flushes it, so applying it
/// again is idempotent.
pub fn rules(loopback_pin: &Path) -> String {
    let m = format!("{MARK_MASQ:#x}");
    format!(
        "*nat\n\
         :{NAT_CHAIN} - [0:0]\n\
         -A {NAT_CHAIN} -m comment --comment \"kpr: hairpin (KUBE-LOOP-BACK)\" -m bpf --object-pinned {pin} -j MASQUERADE\n\
         -A {NAT_CHAIN} -m comment --comment \"kpr: node to service through IPVS\" -m addrtype --src-type LOCAL -m ipvs --ipvs --vdir ORIGINAL --vmethod MASQ -j MASQUERADE\n\
         -A {NAT_CHAIN} -m mark ! --mark {m}/{m} -j RETURN\n\
         -A {NAT_CHAIN} -j MARK --xor-mark {m}\n\
         -A {NAT_CHAIN} -m comment --comment \"kpr: marked by kpr_tc_ipset\" -j MASQUERADE --random-fully\n\
         COMMIT\n\
         *filter\n\
         :{FILTER_CHAIN} - [0:0]\n\
         -A {FILTER_CHAIN} -m mark --mark {m}/{m} -j ACCEPT\n\
         -A {FILTER_CHAIN} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
         COMMIT\n",
        pin = loopback_pin.display()
    )
}

/// IPVS mode's chains and the jumps to them.
const CHAINS: [OwnedChain; 2] = [("nat", "POSTROUTING", NAT_CHAIN), ("filter", "FORWARD", FILTER_CHAIN)];

/// Installs (or refreshes) the chains and the jumps to them, in `backend` (BACKEND, BACKEND6).
pub fn install(nf: &mut dyn Netfilter, backend: &str, loopback_pin: &Path) -> Result<(), NetfilterError> {
    install_chains(nf, backend, &rules(loopback_pin), &CHAINS)
}

/// Removes the jumps and the chains of both families; idempotent. Returns what went. A node
/// without ip6tables (or IPv6) has no IPv6 rules to remove.
pub fn remove(nf: &mut dyn Netfilter) -> Result<Vec<String>, NetfilterError> {
    let mut done = remove_chains(nf, BACKEND, &CHAINS)?;
    match remove_chains(nf, BACKEND6, &CHAINS) {
        Ok(d) => done.extend(d),
        Err(e) => tracing::debug!(error = %e, "no IPv6 rules to remove"),
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_are_constant_and_cover_kube_proxys_masquerades() {
        let r = rules(Path::new("/sys/fs/bpf/kpr/kpr_loopback"));
        assert_eq!(r.lines().filter(|l| l.starts_with("-A")).count(), 7);
        assert!(r.contains("-m bpf --object-pinned /sys/fs/bpf/kpr/kpr_loopback -j MASQUERADE"));
        assert!(r.contains("-m mark ! --mark 0x4000/0x4000 -j RETURN"));
    }
}
