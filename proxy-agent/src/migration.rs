//! `kpr cleanup --kube-proxy`: removes what kube-proxy leaves behind on a node (its iptables
//! chains and the rules jumping to them, its ipsets, its kube-ipvs0 device) so that kpr is the
//! only service proxy. Everything else on the node is left alone. Writes go through the
//! `Netfilter` trait: the real one runs the node's iptables-save/-restore and ipset.
use crate::host::netfilter::{Netfilter, NetfilterError as CleanupError};

/// The iptables-restore input that removes kube-proxy's chains of one table (given its
/// iptables-save output), or None when there are none.
pub fn removal_script(table: &str, saved: &str) -> Option<String> {
    let mut chains = Vec::new();
    let mut jumps = Vec::new();
    for line in saved.lines() {
        if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or("");
            if name.starts_with("KUBE-") {
                chains.push(name.to_string());
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split_whitespace().next().unwrap_or("");
            let jumps_to_kube = rule.split_whitespace().collect::<Vec<_>>().windows(2).any(|w| (w[0] == "-j" || w[0] == "-g") && w[1].starts_with("KUBE-"));
            if !chain.starts_with("KUBE-") && jumps_to_kube {
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

/// Removes kube-proxy's leftovers; returns a line per thing removed. Backends that are not
/// installed are skipped.
pub fn cleanup(nf: &mut dyn Netfilter) -> Result<Vec<String>, CleanupError> {
    let mut done = Vec::new();
    for backend in ["iptables-legacy", "iptables-nft", "iptables"] {
        for table in ["filter", "nat", "mangle"] {
            let Ok(saved) = nf.save(backend, table) else {
                continue;
            };
            if let Some(script) = removal_script(table, &saved) {
                nf.restore(backend, &script)?;
                let n = script.lines().filter(|l| l.starts_with("-X ")).count();
                done.push(format!("{backend} {table}: removed {n} KUBE-* chains and the rules jumping to them"));
            }
        }
    }
    if let Ok(sets) = nf.ipsets() {
        for s in sets.iter().filter(|s| s.starts_with("KUBE-")) {
            nf.destroy_ipset(s)?;
            done.push(format!("ipset {s} destroyed"));
        }
    }
    if nf.delete_link("kube-ipvs0")? {
        done.push("link kube-ipvs0 deleted (IPVS virtual servers of kube-proxy: remove them with `ipvsadm -D` or `ipvsadm -C`)".into());
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_only_kube_chains_and_jumps() {
        let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:MINE - [0:0]\n-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-A PREROUTING -j MINE\n-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\nCOMMIT\n";
        let s = removal_script("nat", saved).unwrap();
        assert_eq!(
            s,
            "*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n-F KUBE-SERVICES\n-F KUBE-MARK-MASQ\n-X KUBE-SERVICES\n-X KUBE-MARK-MASQ\nCOMMIT\n"
        );
        assert!(removal_script("filter", "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j MINE\nCOMMIT\n").is_none());
    }
}
