//! Sysctl writes go through a trait: the real one writes /proc/sys (of the agent's network
//! namespace), the fake records.
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
#[error("sysctl {key}: {err}")]
pub struct SysctlError {
    pub key: String,
    pub err: std::io::Error,
}

pub trait Sysctls {
    fn get(&self, key: &str) -> Result<String, SysctlError>;
    fn set(&mut self, key: &str, value: &str) -> Result<(), SysctlError>;
}

pub struct ProcSysctls;

fn path(key: &str) -> String {
    format!("/proc/sys/{}", key.replace('.', "/"))
}

impl Sysctls for ProcSysctls {
    fn get(&self, key: &str) -> Result<String, SysctlError> {
        std::fs::read_to_string(path(key)).map(|s| s.trim().to_string()).map_err(|err| SysctlError { key: key.into(), err })
    }
    fn set(&mut self, key: &str, value: &str) -> Result<(), SysctlError> {
        if self.get(key).ok().as_deref() == Some(value) {
            return Ok(());
        }
        std::fs::write(path(key), value).map_err(|err| SysctlError { key: key.into(), err })
    }
}

#[derive(Default, Debug)]
pub struct FakeSysctls(pub BTreeMap<String, String>);

impl Sysctls for FakeSysctls {
    fn get(&self, key: &str) -> Result<String, SysctlError> {
        self.0.get(key).cloned().ok_or_else(|| SysctlError { key: key.into(), err: std::io::ErrorKind::NotFound.into() })
    }
    fn set(&mut self, key: &str, value: &str) -> Result<(), SysctlError> {
        self.0.insert(key.into(), value.into());
        Ok(())
    }
}

/// Sets what differs; a failure is a warning (in a cluster the init container sets them, as
/// /proc/sys is read-only in an unprivileged container).
pub fn apply<K: AsRef<str>, V: AsRef<str>>(sysctls: &mut dyn Sysctls, list: &[(K, V)]) {
    for (k, v) in list {
        let (k, v) = (k.as_ref(), v.as_ref());
        if let Err(e) = sysctls.set(k, v) {
            tracing::warn!(error = %e, "cannot set {k}={v}: set it on the host (the DaemonSet's init container does)");
        }
    }
}

/// kube-proxy's conntrack settings for the kernel's table, which still tracks every flow kpr
/// balances: nf_conntrack_max = max(maxPerCore × CPUs, min) (only ever raised, as kube-proxy
/// does) and the timeouts that are set. `current_max` is the table's size now.
pub fn conntrack_sysctls(c: &crate::settings::ConntrackSettings, cpus: u32, current_max: Option<u64>) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if c.max_per_core > 0 {
        let max = u64::from(c.max_per_core) * u64::from(cpus.max(1));
        let max = max.max(u64::from(c.min));
        if current_max.is_none_or(|cur| max > cur) {
            out.push(("net.netfilter.nf_conntrack_max", max.to_string()));
        }
    }
    let secs = |d: std::time::Duration| d.as_secs().to_string();
    out.push(("net.netfilter.nf_conntrack_tcp_timeout_established", secs(c.tcp_established)));
    out.push(("net.netfilter.nf_conntrack_tcp_timeout_close_wait", secs(c.tcp_close_wait)));
    if c.tcp_be_liberal {
        out.push(("net.netfilter.nf_conntrack_tcp_be_liberal", "1".into()));
    }
    if let Some(d) = c.udp {
        out.push(("net.netfilter.nf_conntrack_udp_timeout", secs(d)));
    }
    if let Some(d) = c.udp_stream {
        out.push(("net.netfilter.nf_conntrack_udp_timeout_stream", secs(d)));
    }
    out
}

/// What the fast path needs on the node: forwarding. (Masquerade happens at egress, so no packet
/// arrives with the node's own address as its source.) In a cluster the DaemonSet's init
/// container sets it, since /proc/sys is read-only in an unprivileged container; the agent sets
/// it itself where it can.
pub const FAST_PATH_SYSCTLS: [(&str, &str); 1] = [("net.ipv4.ip_forward", "1")];

/// The node's own connections take their source ports from `net.ipv4.ip_local_port_range`:
/// masquerade must use others, or a node process's connection to a backend could meet a
/// masqueraded flow's reply tuple. The larger free stretch of 1024..=65535 outside that range
/// and the NodePort range (30000-32767); None when neither holds 4096 ports.
pub fn snat_port_range(local: &str) -> Option<(u16, u16)> {
    let mut it = local.split_whitespace().map(|p| p.parse::<u32>());
    let (lo, hi) = (it.next()?.ok()?, it.next()?.ok()?);
    let below = (1024, lo.min(u32::from(proxy_common::NODE_PORT_MIN)).saturating_sub(1));
    let above = (hi.max(u32::from(proxy_common::NODE_PORT_MAX)) + 1, 65_535);
    let size = |(a, b): (u32, u32)| if b >= a { b - a + 1 } else { 0 };
    let best = if size(below) >= size(above) { below } else { above };
    (size(best) >= 4096).then_some((best.0 as u16, best.1 as u16))
}

/// (major, minor) of a kernel release string ("6.1.0-57-amd64" -> (6, 1)).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// The kernel modules IPVS mode needs (the schedulers kube-proxy loads, conntrack, and the
/// netfilter matches of kpr's fixed rules).
pub const IPVS_MODULES: &[&str] = &["ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh", "ip_vs_mh", "nf_conntrack", "xt_bpf", "xt_ipvs", "xt_addrtype"];

/// The sysctls of kube-proxy's IPVS proxier, with its kernel-version conditions:
/// conn_reuse_mode=0 only on 4.1..5.9 (older kernels lack it; from 5.9 the 1-second stall it
/// worked around is fixed and 1 is right); ARP settings only with strictARP.
pub fn ipvs_sysctls(kernel: (u32, u32), strict_arp: bool) -> Vec<(&'static str, &'static str)> {
    let mut v = vec![
        ("net.ipv4.vs.conntrack", "1"),
        ("net.ipv4.vs.expire_nodest_conn", "1"),
        ("net.ipv4.vs.expire_quiescent_template", "1"),
        ("net.ipv4.ip_forward", "1"),
    ];
    if ((4, 1)..(5, 9)).contains(&kernel) {
        v.push(("net.ipv4.vs.conn_reuse_mode", "0"));
    }
    if strict_arp {
        v.push(("net.ipv4.conf.all.arp_ignore", "1"));
        v.push(("net.ipv4.conf.all.arp_announce", "2"));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snat_ports_avoid_the_nodes_ephemeral_range_and_node_ports() {
        assert_eq!(snat_port_range("32768\t60999"), Some((1024, 29_999)));
        assert_eq!(snat_port_range("1024 65000"), None, "no room left");
        assert_eq!(snat_port_range("10000 40000"), Some((40_001, 65_535)));
        assert_eq!(snat_port_range("garbage"), None);
    }

    #[test]
    fn ipvs_sysctls_follow_the_kernel_version() {
        assert_eq!(kernel_version("6.1.0-57-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("4.19.0"), Some((4, 19)));
        let has = |k: (u32, u32), key: &str| ipvs_sysctls(k, false).iter().any(|(n, _)| *n == key);
        assert!(has((4, 19), "net.ipv4.vs.conn_reuse_mode"));
        assert!(has((5, 8), "net.ipv4.vs.conn_reuse_mode"));
        assert!(!has((5, 9), "net.ipv4.vs.conn_reuse_mode"));
        assert!(!has((4, 0), "net.ipv4.vs.conn_reuse_mode"));
        assert!(!has((6, 1), "net.ipv4.conf.all.arp_ignore"));
        assert!(ipvs_sysctls((6, 1), true).contains(&("net.ipv4.conf.all.arp_announce", "2")));
    }
}
