//! kube-proxy's iptables-mode rules, rendered as kube-proxy renders them (KUBE-SERVICES ->
//! KUBE-SVC-* -> KUBE-SEP-* with `statistic --mode random --probability`, KUBE-MARK-MASQ,
//! KUBE-POSTROUTING MASQUERADE, KUBE-NODEPORTS), for the A/B benchmark.

/// One service port: its ClusterIP, and its NodePort where it has one.
pub struct Svc {
    pub name: String,
    pub vip: String,
    pub port: u16,
    /// "tcp" or "udp".
    pub proto: &'static str,
    pub node_port: Option<u16>,
    pub backends: Vec<(String, u16)>,
}

/// kube-proxy names chains by a hash of the service port name: same idea, stable, 16 chars.
fn chain(prefix: &str, s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let tail: String = (0..16).map(|i| ALPHABET[((h >> (i * 4)) & 31) as usize] as char).collect();
    format!("{prefix}-{tail}")
}

/// The whole nat table, for `iptables-restore` (kube-proxy writes it in one transaction too).
pub fn render(services: &[Svc], cluster_cidr: &str) -> String {
    let mut chains =
        vec![":KUBE-SERVICES - [0:0]".to_string(), ":KUBE-NODEPORTS - [0:0]".into(), ":KUBE-POSTROUTING - [0:0]".into(), ":KUBE-MARK-MASQ - [0:0]".into()];
    let mut rules = vec![
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".into(),
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING".into(),
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN".into(),
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000".into(),
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully".into(),
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000".into(),
    ];
    for s in services {
        let svc = chain("KUBE-SVC", &s.name);
        chains.push(format!(":{svc} - [0:0]"));
        let c = format!("-m comment --comment \"{} cluster IP\"", s.name);
        let p = s.proto;
        rules.push(format!("-A KUBE-SERVICES {c} -m {p} -p {p} -d {}/32 --dport {} -j {svc}", s.vip, s.port));
        rules.push(format!("-A {svc} {c} -m {p} -p {p} -d {}/32 --dport {} ! -s {cluster_cidr} -j KUBE-MARK-MASQ", s.vip, s.port));
        if let Some(np) = s.node_port {
            // externalTrafficPolicy Cluster: every external packet is masqueraded.
            let ext = chain("KUBE-EXT", &s.name);
            chains.push(format!(":{ext} - [0:0]"));
            rules.push(format!("-A KUBE-NODEPORTS -m comment --comment \"{}\" -m {p} -p {p} --dport {np} -j {ext}", s.name));
            rules.push(format!("-A {ext} -m comment --comment \"masquerade traffic for {} external destinations\" -j KUBE-MARK-MASQ", s.name));
            rules.push(format!("-A {ext} -j {svc}"));
        }
        let n = s.backends.len();
        for (i, (ip, port)) in s.backends.iter().enumerate() {
            let sep = chain("KUBE-SEP", &format!("{}/{ip}:{port}", s.name));
            chains.push(format!(":{sep} - [0:0]"));
            let left = n - i;
            if left > 1 {
                rules.push(format!(
                    "-A {svc} -m comment --comment \"{} -> {ip}:{port}\" -m statistic --mode random --probability {:.11} -j {sep}",
                    s.name,
                    1.0 / left as f64
                ));
            } else {
                rules.push(format!("-A {svc} -m comment --comment \"{} -> {ip}:{port}\" -j {sep}", s.name));
            }
            rules.push(format!("-A {sep} -m comment --comment \"{}\" -s {ip}/32 -j KUBE-MARK-MASQ", s.name));
            rules.push(format!("-A {sep} -m comment --comment \"{}\" -m {p} -p {p} -j DNAT --to-destination {ip}:{port}", s.name));
        }
    }
    rules.push("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS".into());
    let mut out = String::from("*nat\n");
    for c in chains {
        out += &c;
        out.push('\n');
    }
    for r in rules {
        out += &r;
        out.push('\n');
    }
    out += "COMMIT\n";
    out
}

/// kube-proxy's IPVS-mode sets as `ipset restore` input, from the same listing `kpr ipset`
/// prints (so both sides of the IPVS A/B hold identical members).
pub fn ipset_restore(sets: &[proxy_agent::dataplane::ipvs::sets::SetListing]) -> String {
    let mut out = String::new();
    for s in sets.iter().filter(|s| s.name.starts_with("KUBE-")) {
        let opts = if s.kind == "bitmap:port" { " range 0-65535" } else { "" };
        out += &format!("create {} {}{opts}\n", s.name, s.kind);
        for m in &s.members {
            out += &format!("add {} {m}\n", s.name);
        }
    }
    out
}

/// kube-proxy's IPVS-mode iptables rules (the ClusterIP and NodePort paths): constant chains
/// that consult the sets; for `iptables-restore`.
pub fn render_ipvs_mode(cluster_cidr: &str) -> String {
    format!(
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-NODE-PORT - [0:0]\n\
         -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
         -A KUBE-POSTROUTING -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE\n\
         -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
         -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n\
         -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n\
         -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
         -A KUBE-SERVICES ! -s {cluster_cidr} -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ\n\
         -A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT\n\
         -A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n\
         -A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port for masquerade purpose\" -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ\n\
         COMMIT\n\
         *filter\n:KUBE-FORWARD - [0:0]\n:KUBE-IPVS-FILTER - [0:0]\n\
         -A INPUT -j KUBE-IPVS-FILTER\n\
         -A FORWARD -j KUBE-FORWARD\n\
         -A KUBE-IPVS-FILTER -m set --match-set KUBE-CLUSTER-IP dst,dst -j RETURN\n\
         -A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT\n\
         -A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT\n\
         -A KUBE-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
         COMMIT\n"
    )
}
