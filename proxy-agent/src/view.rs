//! Operator views of the kernel state: services (frontends -> backends), conntrack, counters.
//! Every view is built from the maps themselves, never from the agent's memory.
use std::collections::HashMap;

use proxy_common::{
    counter,
    user::{port_host, proto_name, v4_addr, words_addr},
    CT_F_CLOSING, CT_F_SNAT, SCOPE_EXTERNAL, SCHED_MAGLEV, SCHED_ROUND_ROBIN,
    SVC_F_MASQ, SVC_F_PRESERVE_SOURCE, SVC_F_SOURCE_RANGES,
};
use serde::Serialize;

use crate::maps::{DatapathMaps, MapError};

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
                Some(b) => format!("{}:{} (id {id})", words_addr(b.addr), port_host(b.port)),
                None => format!("missing backend id {id}"),
            })
            .collect();
        let mut flags = Vec::new();
        for (bit, name) in [(SVC_F_MASQ, "masq"), (SVC_F_PRESERVE_SOURCE, "preserve-source"), (SVC_F_SOURCE_RANGES, "source-ranges")] {
            if v.flags & bit != 0 {
                flags.push(name.to_string());
            }
        }
        rows.push(ServiceRow {
            frontend: format!("{}:{}", words_addr(k.addr), port_host(k.port)),
            proto: proto_name(k.proto).into(),
            scope: if k.scope == SCOPE_EXTERNAL { "external" } else { "internal" }.into(),
            service_id: v.service_id,
            scheduler: match v.scheduler {
                SCHED_MAGLEV => "maglev",
                SCHED_ROUND_ROBIN => "round-robin",
                _ => "random",
            }
            .into(),
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
    pub snat: Option<String>,
    pub backend_id: u32,
    pub closing: bool,
    pub idle_s: f64,
}

pub fn conntrack(maps: &dyn DatapathMaps, now_ns: u64) -> Result<Vec<FlowRow>, MapError> {
    let mut rows: Vec<FlowRow> = maps
        .conntrack()?
        .into_iter()
        .filter(|(_, v)| !v.is_reply())
        .map(|(k, v)| FlowRow {
            proto: proto_name(k.proto).into(),
            client: format!("{}:{}", v4_addr(k.saddr), port_host(k.sport)),
            frontend: format!("{}:{}", v4_addr(k.daddr), port_host(k.dport)),
            backend: format!("{}:{}", v4_addr(v.new_daddr), port_host(v.new_dport)),
            snat: (v.flags & CT_F_SNAT != 0).then(|| format!("{}:{}", v4_addr(v.new_saddr), port_host(v.new_sport))),
            backend_id: v.backend_id,
            closing: v.flags & CT_F_CLOSING != 0,
            idle_s: now_ns.saturating_sub(v.last_seen_ns) as f64 / 1e9,
        })
        .collect();
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
            s += "    (no endpoints: rejected)\n";
        }
        for b in &r.backends {
            s += &format!("    -> {b}\n");
        }
    }
    s
}

pub fn render_conntrack(rows: &[FlowRow]) -> String {
    let mut s = format!("{:<4} {:<22} {:<22} {:<22} {:<22} {:>8}\n", "PROTO", "CLIENT", "FRONTEND", "BACKEND", "SNAT", "IDLE(s)");
    for r in rows {
        s += &format!(
            "{:<5} {:<22} {:<22} {:<22} {:<22} {:>8.1}{}\n",
            r.proto,
            r.client,
            r.frontend,
            r.backend,
            r.snat.clone().unwrap_or_else(|| "-".into()),
            r.idle_s,
            if r.closing { " closing" } else { "" }
        );
    }
    s
}
