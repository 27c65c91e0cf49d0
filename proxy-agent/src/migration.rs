//! `kpr cleanup --kube-proxy`: removes what kube-proxy's own `--cleanup` removes, and nothing
//! else — its iptables chains (by name, in each table, with the rules jumping to them), its
//! nftables tables, the IPVS virtual servers it owns (addresses on kube-ipvs0, NodePorts on the
//! node's addresses), kube-ipvs0 (rtnetlink), and its ipsets (by name). Kubelet's chains
//! (KUBE-FIREWALL in filter, KUBE-KUBELET-CANARY, KUBE-MARK-DROP) and other components' KUBE-*
//! objects stay. Every write goes through the `Netfilter`, `Ipvs` and `Links` traits.
use std::net::IpAddr;

use crate::{
    dataplane::ipvs::{client::Ipvs, sync as ipvs_sync},
    host::netfilter::{Netfilter, NetfilterError},
    netlink::rtnl::{Links, IPVS_DUMMY},
};

/// kube-proxy's fixed chains, per table (iptables and IPVS modes, current and earlier
/// releases). Kubelet's own (KUBE-FIREWALL in filter, KUBE-KUBELET-CANARY, KUBE-MARK-DROP) are
/// not here.
const CHAINS: &[(&str, &[&str])] = &[
    (
        "nat",
        &[
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ",
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
            // IPVS mode's load-balancer firewall lives in nat; kubelet's KUBE-FIREWALL in filter.
            "KUBE-FIREWALL",
            "KUBE-PROXY-CANARY",
        ],
    ),
    (
        "filter",
        &[
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-FORWARD",
            "KUBE-PROXY-FIREWALL",
            "KUBE-NODE-PORT",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
            "KUBE-PROXY-CANARY",
        ],
    ),
    ("mangle", &["KUBE-PROXY-CANARY"]),
];

/// Per-service chains of the iptables mode (nat).
const CHAIN_PREFIXES: &[&str] = &["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-"];

/// kube-proxy's ipsets (IPVS mode).
pub const IPSETS: &[&str] = &[
    "KUBE-CLUSTER-IP",
    "KUBE-LOOP-BACK",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
];

/// kube-proxy's nftables mode: one table per family.
pub const NFT_TABLE: &str = "kube-proxy";

/// Whether `chain` in `table` is kube-proxy's.
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    CHAINS.iter().any(|(t, names)| *t == table && names.contains(&chain)) || (table == "nat" && CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)))
}

/// The iptables-restore input that removes kube-proxy's chains of one table (given its
/// iptables-save output) and the rules of other chains that jump to them; None when there are
/// none.
pub fn removal_script(table: &str, saved: &str) -> Option<String> {
    let mut chains = Vec::new();
    let mut jumps = Vec::new();
    for line in saved.lines() {
        if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or("");
            if is_kube_proxy_chain(table, name) {
                chains.push(name.to_string());
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split_whitespace().next().unwrap_or("");
            let jumps_to_ours =
                rule.split_whitespace().collect::<Vec<_>>().windows(2).any(|w| (w[0] == "-j" || w[0] == "-g") && is_kube_proxy_chain(table, w[1]));
            if !is_kube_proxy_chain(table, chain) && jumps_to_ours {
                jumps.push(format!("-D {rule}"));
            }
        }
    }
    if chains.is_empty() && jumps.is_empty() {
        return None;
    }
    let mut s = format!("*{table}\n");
    for j in &jumps {
        s += j;
        s.push('\n');
    }
    for c in &chains {
        s += &format!("-F {c}\n");
    }
    for c in &chains {
        s += &format!("-X {c}\n");
    }
    s += "COMMIT\n";
    Some(s)
}

/// kube-proxy's IPVS state: its virtual servers (`ipvs` None where the kernel has no IPVS)
/// and kube-ipvs0. The whole of it is None where kpr's own IPVS mode runs and owns them now.
pub struct IpvsHandles<'a> {
    pub ipvs: Option<&'a mut dyn Ipvs>,
    pub links: &'a mut dyn Links,
    pub node_addresses: &'a [IpAddr],
}

/// Removes kube-proxy's leftovers; returns a line per thing removed. iptables front ends that
/// are not installed are skipped.
pub fn cleanup(nf: &mut dyn Netfilter, ipvs: Option<IpvsHandles<'_>>) -> Result<Vec<String>, NetfilterError> {
    let mut done = Vec::new();
    for backend in ["iptables-legacy", "iptables-nft", "ip6tables-legacy", "ip6tables-nft"] {
        for table in ["filter", "nat", "mangle"] {
            let Ok(saved) = nf.save(backend, table) else {
                continue;
            };
            if let Some(script) = removal_script(table, &saved) {
                nf.restore(backend, &script)?;
                let n = script.lines().filter(|l| l.starts_with("-X ")).count();
                done.push(format!("{backend} {table}: removed kube-proxy's {n} chains and the rules jumping to them"));
            }
        }
    }
    if let Ok(tables) = nf.nft_tables() {
        for (family, name) in tables.iter().filter(|(f, n)| n == NFT_TABLE && matches!(f.as_str(), "ip" | "ip6" | "inet")) {
            nf.delete_nft_table(family, name)?;
            done.push(format!("nftables table {family} {name} deleted"));
        }
    }
    if let Some(h) = ipvs {
        let err = |e: &dyn std::fmt::Display| NetfilterError { cmd: "IPVS / kube-ipvs0".into(), message: e.to_string() };
        match h.ipvs {
            Some(ipvs) => done.extend(ipvs_sync::cleanup(ipvs, h.links, h.node_addresses).map_err(|e| err(&e))?),
            None => {
                if h.links.link_index(IPVS_DUMMY).map_err(|e| err(&e))?.is_some() {
                    h.links.delete_link(IPVS_DUMMY).map_err(|e| err(&e))?;
                    done.push(format!("deleted link {}", IPVS_DUMMY));
                }
            }
        }
    }
    if let Ok(sets) = nf.ipsets() {
        for s in
            sets.iter().filter(|s| IPSETS.contains(&s.as_str()) || s.strip_prefix("KUBE-6-").is_some_and(|r| IPSETS.contains(&format!("KUBE-{r}").as_str())))
        {
            nf.destroy_ipset(s)?;
            done.push(format!("ipset {s} destroyed"));
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_kube_proxys_chains_and_jumps_and_keeps_kubelets() {
        let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n:KUBE-MARK-DROP - [0:0]\n:MINE - [0:0]\n\
                     -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-A PREROUTING -j MINE\n-A KUBE-SERVICES -j KUBE-SVC-ABC\nCOMMIT\n";
        let s = removal_script("nat", saved).unwrap();
        assert_eq!(
            s,
            "*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-F KUBE-SERVICES\n-F KUBE-SVC-ABC\n-X KUBE-SERVICES\n-X KUBE-SVC-ABC\nCOMMIT\n"
        );
        // Kubelet's filter chains stay, with their jumps.
        let filter = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n";
        assert!(removal_script("filter", filter).is_none());
        assert!(is_kube_proxy_chain("nat", "KUBE-FIREWALL") && !is_kube_proxy_chain("filter", "KUBE-FIREWALL"));
        assert!(!is_kube_proxy_chain("filter", "KUBE-SVC-ABC"), "per-service chains are nat's");
    }
}
