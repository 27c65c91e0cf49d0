//! `kpr ipvs`: the kernel's virtual servers, read over netlink, shown like `ipvsadm -Ln`
//! (optionally with `--stats`), or as JSON.
use serde::Serialize;

use crate::dataplane::ipvs::client::{flags, Dest, Ipvs, IpvsError, Service, Stats};

#[derive(Debug, Serialize)]
pub struct VirtualServerRow {
    /// "TCP 10.96.0.1:80".
    pub service: String,
    pub scheduler: String,
    pub flags: Vec<String>,
    pub persistence_timeout_s: Option<u32>,
    pub stats: Stats,
    pub destinations: Vec<DestRow>,
}

#[derive(Debug, Serialize)]
pub struct DestRow {
    pub address: String,
    pub forward: String,
    pub weight: u32,
    pub active_conns: u32,
    pub inactive_conns: u32,
    /// "active", or "draining" (weight 0: graceful termination or an operator's quiesce).
    pub state: String,
    pub stats: Stats,
}

fn addr_port(addr: std::net::IpAddr, port: u16) -> String {
    match addr {
        std::net::IpAddr::V4(a) => format!("{a}:{port}"),
        std::net::IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

fn row(s: &Service, dests: Vec<Dest>) -> VirtualServerRow {
    let c = &s.config;
    let mut f = Vec::new();
    let (sched1, sched2) = match c.scheduler.as_str() {
        "sh" => ("sh-fallback", "sh-port"),
        "mh" => ("mh-fallback", "mh-port"),
        _ => ("flag-1", "flag-2"),
    };
    for (bit, name) in [(flags::PERSISTENT, "persistent"), (flags::ONEPACKET, "ops"), (flags::SCHED1, sched1), (flags::SCHED2, sched2)] {
        if c.flags & bit != 0 {
            f.push(name.to_string());
        }
    }
    VirtualServerRow {
        service: c.id.to_string(),
        scheduler: c.scheduler.clone(),
        flags: f,
        persistence_timeout_s: (c.flags & flags::PERSISTENT != 0).then_some(c.timeout_s),
        stats: s.stats,
        destinations: dests
            .into_iter()
            .map(|d| DestRow {
                address: addr_port(d.config.addr, d.config.port),
                forward: d.config.fwd.ipvsadm_name().into(),
                weight: d.config.weight,
                active_conns: d.active_conns,
                inactive_conns: d.inactive_conns,
                state: if d.config.weight == 0 { "draining".into() } else { "active".into() },
                stats: d.stats,
            })
            .collect(),
    }
}

pub fn virtual_servers(ipvs: &mut dyn Ipvs) -> Result<Vec<VirtualServerRow>, IpvsError> {
    let mut services = ipvs.services()?;
    services.sort_by_key(|s| s.config.id);
    let mut rows = Vec::new();
    for s in services {
        let mut d = ipvs.dests(&s.config.id)?;
        d.sort_by_key(|d| (d.config.addr, d.config.port));
        rows.push(row(&s, d));
    }
    Ok(rows)
}

/// ipvsadm -Ln's layout, plus a state column; with `stats`, ipvsadm -Ln --stats's counters.
pub fn render(rows: &[VirtualServerRow], stats: bool) -> String {
    let mut o = String::new();
    if stats {
        o += "Prot LocalAddress:Port               Conns   InPkts  OutPkts  InBytes OutBytes\n";
        o += "  -> RemoteAddress:Port\n";
    } else {
        o += "Prot LocalAddress:Port Scheduler Flags\n";
        o += "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn State\n";
    }
    for r in rows {
        let (proto, addr) = r.service.split_once(' ').unwrap_or(("", &r.service));
        if stats {
            let s = &r.stats;
            o += &format!("{proto:<4} {addr:<30} {:>6} {:>8} {:>8} {:>8} {:>8}\n", s.conns, s.inpkts, s.outpkts, s.inbytes, s.outbytes);
        } else {
            let mut flags = r.flags.join(",");
            if let Some(t) = r.persistence_timeout_s {
                flags = format!("{flags} {t}");
            }
            o += &format!("{proto:<4} {addr} {} {}\n", r.scheduler, flags.trim());
        }
        for d in &r.destinations {
            if stats {
                let s = &d.stats;
                o += &format!("  -> {:<28} {:>6} {:>8} {:>8} {:>8} {:>8}\n", d.address, s.conns, s.inpkts, s.outpkts, s.inbytes, s.outbytes);
            } else {
                o += &format!("  -> {:<28} {:<7} {:<6} {:<10} {:<9} {}\n", d.address, d.forward, d.weight, d.active_conns, d.inactive_conns, d.state);
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::ipvs::client::{DestConfig, FakeIpvs, FwdMethod, ServiceConfig, ServiceId};

    #[test]
    fn renders_like_ipvsadm() {
        let mut f = FakeIpvs::default();
        let id = ServiceId::Addr { proto: 6, addr: "10.96.0.1".parse().unwrap(), port: 80 };
        f.add_service(&ServiceConfig { id, scheduler: "wrr".into(), flags: flags::PERSISTENT, timeout_s: 600, netmask: u32::MAX, pe_name: None }).unwrap();
        f.add_dest(&id, &DestConfig::new("10.244.1.2".parse().unwrap(), 8080, FwdMethod::Masq, 3)).unwrap();
        f.add_dest(&id, &DestConfig::new("10.244.2.2".parse().unwrap(), 8080, FwdMethod::Masq, 0)).unwrap();
        let rows = virtual_servers(&mut f).unwrap();
        let text = render(&rows, false);
        assert!(text.contains("TCP  10.96.0.1:80 wrr persistent 600\n"), "{text}");
        assert!(text.contains("  -> 10.244.1.2:8080"), "{text}");
        assert!(text.lines().any(|l| l.contains("10.244.2.2:8080") && l.ends_with("draining")), "{text}");
    }
}
