//! Operator views of the kernel state: services (frontends -> backends), conntrack, counters.
//! Every view is built from the maps themselves, never from the agent's memory.
use std::collections::HashMap;

use proxy_common::{
    counter,
    user::{port_host, proto_name, v4_addr, words_addr},
    CT_F_CLOSING, CT_F_SEEN_REPLY, CT_F_SNAT, CT_F_SNAT_PENDING, PROTO_TCP, SVC_F_MASQ, SVC_F_NO_LOCAL_ENDPOINT,
    SVC_F_PRESERVE_SOURCE, SVC_F_SOURCE_RANGES,
};
use serde::Serialize;

use crate::{
    dataplane::ebpf::maps::{DatapathMaps, MapError},
    dataplane::ebpf::{conntrack::assemble, maps::Table, wire},
};

#[derive(Debug, Serialize)]
pub struct ServiceRow {
    pub frontend: String,
    pub proto: String,
    pub scope: String,
    pub service_id: u32,
    pub scheduler: String,
    pub affinity_timeout_s: u32,
    pub flags: Vec<String>,
    pub backends: Vec<String>,
}

pub fn services(maps: &dyn DatapathMaps) -> Result<Vec<ServiceRow>, MapError> {
    let backends: HashMap<u32, _> = maps.backends()?.into_iter().collect();
    let mut slots: HashMap<u32, Vec<(u32, u32)>> = HashMap::new();
    for (k, id) in maps.slots()? {
        slots.entry(k.service_id).or_default().push((k.slot, id));
    }
    let mut rows = Vec::new();
    for (k, v) in maps.services()? {
        let mut s = slots.remove(&v.service_id).unwrap_or_default();
        s.sort();
        let be = s
            .iter()
            .filter(|(slot, _)| *slot <= v.backend_count)
            .map(|(_, id)| match backends.get(id) {
                Some(b) => format!("{} (id {id})", std::net::SocketAddr::new(words_addr(b.addr), port_host(b.port))),
                None => format!("missing backend id {id}"),
            })
            .collect();
        let mut flags = Vec::new();
        for (bit, name) in [
            (SVC_F_MASQ, "masq"),
            (SVC_F_PRESERVE_SOURCE, "preserve-source"),
            (SVC_F_SOURCE_RANGES, "source-ranges"),
            (SVC_F_NO_LOCAL_ENDPOINT, "no-local-endpoint"),
        ] {
            if v.flags & bit != 0 {
                flags.push(name.to_string());
            }
        }
        rows.push(ServiceRow {
            frontend: std::net::SocketAddr::new(words_addr(k.addr), port_host(k.port)).to_string(),
            proto: proto_name(k.proto).into(),
            scope: wire::scope_of(&k, &v).name().into(),
            service_id: v.service_id,
            scheduler: wire::scheduler_of(v.scheduler).map_or_else(|| format!("unknown ({})", v.scheduler), |s| s.name().to_string()),
            affinity_timeout_s: v.affinity_timeout_s,
            flags,
            backends: be,
        });
    }
    rows.sort_by(|a, b| (&a.frontend, &a.proto, &a.scope).cmp(&(&b.frontend, &b.proto, &b.scope)));
    Ok(rows)
}

#[derive(Debug, Serialize)]
pub struct FlowRow {
    pub proto: String,
    pub client: String,
    pub frontend: String,
    pub backend: String,
    /// The masquerade address and port, once the flow left the node (None: not masqueraded).
    pub snat: Option<String>,
    pub backend_id: u32,
    /// "embryonic" (TCP before its handshake completed), "unreplied" or "replied" (UDP not
    /// assured: no reply yet, or no datagram from the client since), "established", "closing",
    /// or "orphan" (entries whose forward entry is gone, waiting to be collected).
    pub state: String,
    pub idle_s: f64,
}

/// A flow's state (see FlowRow::state) from its table and its forward entry's flags.
fn flow_state(table: Table, proto: u8, forward_flags: u16, closing: bool) -> &'static str {
    match (table, proto == PROTO_TCP) {
        (Table::Embryonic, true) => "embryonic",
        (Table::Embryonic, false) if forward_flags & CT_F_SEEN_REPLY != 0 => "replied",
        (Table::Embryonic, false) => "unreplied",
        (Table::Assured, _) if closing => "closing",
        (Table::Assured, _) => "established",
    }
}

pub fn conntrack(maps: &dyn DatapathMaps, now_ns: u64) -> Result<Vec<FlowRow>, MapError> {
    let mut rows = Vec::new();
    for table in Table::ALL {
        for f in assemble(&maps.conntrack().entries(table)?) {
            let addr = |a: u32, p: u16| format!("{}:{}", v4_addr(a), port_host(p));
            let state = match &f.forward {
                None => "orphan",
                Some((_, v)) => flow_state(table, f.proto(), v.flags, f.closing()),
            };
            let (client, frontend, backend) = match (&f.forward, &f.reverse_dnat) {
                (Some((k, v)), _) => (addr(k.saddr, k.sport), addr(k.daddr, k.dport), addr(v.new_daddr, v.new_dport)),
                (None, Some((k, v))) => (addr(v.new_daddr, v.new_dport), addr(v.new_saddr, v.new_sport), addr(k.saddr, k.sport)),
                _ => ("-".into(), "-".into(), "-".into()),
            };
            let snat = f.snat.as_ref().filter(|(_, v)| v.flags & CT_F_SNAT_PENDING == 0).map(|(_, v)| addr(v.new_saddr, v.new_sport));
            rows.push(FlowRow {
                proto: proto_name(f.proto()).into(),
                client,
                frontend,
                backend,
                snat,
                backend_id: f.ids().1,
                state: state.into(),
                idle_s: now_ns.saturating_sub(f.last_seen_ns()) as f64 / 1e9,
            });
        }
    }
    // IPv6 flows: each forward entry (its masquerade is netfilter's: `conntrack -L -f ipv6`).
    let addr6 = |a: [u32; 4], p: u16| std::net::SocketAddr::new(words_addr(a), port_host(p)).to_string();
    for table in Table::ALL {
        for (k, v) in maps.ipv6_flows(table)? {
            if !k.is_forward(&v) {
                continue;
            }
            let state = flow_state(table, k.proto, v.flags, v.flags & CT_F_CLOSING != 0);
            rows.push(FlowRow {
                proto: proto_name(k.proto).into(),
                client: addr6(k.saddr, k.sport),
                frontend: addr6(k.daddr, k.dport),
                backend: addr6(v.new_daddr, v.new_dport),
                snat: (v.flags & CT_F_SNAT != 0).then(|| "netfilter".into()),
                backend_id: v.backend_id,
                state: state.into(),
                idle_s: now_ns.saturating_sub(v.last_seen_ns) as f64 / 1e9,
            });
        }
    }
    rows.sort_by(|a, b| (&a.frontend, &a.client).cmp(&(&b.frontend, &b.client)));
    Ok(rows)
}

pub fn counters(maps: &dyn DatapathMaps) -> Result<Vec<(&'static str, u64)>, MapError> {
    Ok(counter::NAMES.iter().copied().zip(maps.counters()?).collect())
}

pub fn render_services(rows: &[ServiceRow]) -> String {
    let mut s = String::new();
    for r in rows {
        let flags = if r.flags.is_empty() { String::new() } else { format!(" [{}]", r.flags.join(",")) };
        let aff = if r.affinity_timeout_s > 0 { format!(" affinity={}s", r.affinity_timeout_s) } else { String::new() };
        s += &format!("{:<22} {:<4} {:<8} id={:<6} {}{aff}{flags}\n", r.frontend, r.proto, r.scope, r.service_id, r.scheduler);
        if r.backends.is_empty() {
            s += if r.flags.iter().any(|f| f == "no-local-endpoint") { "    (no local endpoint: dropped)\n" } else { "    (no endpoints: rejected)\n" };
        }
        for b in &r.backends {
            s += &format!("    -> {b}\n");
        }
    }
    s
}

pub fn render_conntrack(rows: &[FlowRow]) -> String {
    let mut s = format!("{:<5} {:<22} {:<22} {:<22} {:<22} {:>8} STATE\n", "PROTO", "CLIENT", "FRONTEND", "BACKEND", "SNAT", "IDLE(s)");
    for r in rows {
        s += &format!(
            "{:<5} {:<22} {:<22} {:<22} {:<22} {:>8.1} {}\n",
            r.proto,
            r.client,
            r.frontend,
            r.backend,
            r.snat.clone().unwrap_or_else(|| "-".into()),
            r.idle_s,
            r.state
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::ebpf::maps::FakeMaps;
    use proxy_common::{CtKey, CtKey6, CtValue, CtValue6, CT_DIR_INGRESS, PROTO_UDP};

    /// A flow's forward entry from client port `port`, with `flags`.
    fn forward(proto: u8, port: u16, flags: u16) -> (CtKey, CtValue) {
        let k = CtKey { saddr: 1, daddr: 2, sport: port.to_be(), dport: 53u16.to_be(), proto, dir: CT_DIR_INGRESS, _pad: 0 };
        (
            k,
            CtValue {
                new_saddr: 1,
                new_daddr: 3,
                new_sport: port.to_be(),
                new_dport: 53u16.to_be(),
                backend_id: 1,
                service_id: 1,
                flags,
                ..Default::default()
            },
        )
    }

    /// Flows not yet assured say why: TCP's handshake, or UDP's missing answer (or the client's
    /// datagram after it); assured ones are established or closing, in both families.
    #[test]
    fn each_flow_shows_its_state() {
        let mut m = FakeMaps::default();
        for (table, (k, v)) in [
            (Table::Embryonic, forward(PROTO_TCP, 1, 0)),
            (Table::Embryonic, forward(PROTO_UDP, 2, 0)),
            (Table::Embryonic, forward(PROTO_UDP, 3, CT_F_SEEN_REPLY)),
            (Table::Assured, forward(PROTO_UDP, 4, CT_F_SEEN_REPLY)),
            (Table::Assured, forward(PROTO_TCP, 5, CT_F_CLOSING)),
        ] {
            m.conntrack.table_mut(table).insert(k, v);
        }
        let k6 = CtKey6 { sport: 6u16.to_be(), proto: PROTO_UDP, dir: CT_DIR_INGRESS, ..Default::default() };
        m.ipv6_embryonic.insert(k6, CtValue6::default());
        let rows = conntrack(&m, 0).unwrap();
        let state = |port: &str| rows.iter().find(|r| r.client.ends_with(port)).map(|r| r.state.as_str()).unwrap();
        assert_eq!([":1", ":2", ":3", ":4", ":5", ":6"].map(state), ["embryonic", "unreplied", "replied", "established", "closing", "unreplied"], "{rows:?}");
    }
}
