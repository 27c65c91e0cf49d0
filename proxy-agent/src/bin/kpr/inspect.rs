//! The operator's views: `kpr status`, `services`, `ipset`, `ipvs`, `conntrack`. Read-only:
//! the pinned maps, the kernel's IPVS, and the agent's HTTP listener.
use std::{path::Path, time::Duration};

use anyhow::{Context, Result};
use proxy_agent::{dataplane::ebpf::kernel, dataplane::ebpf::kernel_maps::KernelMaps, dataplane::ebpf::view};

pub fn status(pin_dir: &Path, json: bool, healthz: &str) -> Result<()> {
    let maps = KernelMaps::open(pin_dir)?;
    let links = kernel::attached_links(pin_dir);
    let counters = view::counters(&maps)?;
    let services = maps_len(&maps)?;
    let health = agent_health(healthz);
    let last_sync = health.as_ref().map(|h| h["lastUpdated"].as_str().unwrap_or("").to_string());
    // The agent says its mode; without it, IPVS mode shows as a pinned loop-back match.
    let mode = health.as_ref().and_then(|h| h["mode"].as_str().map(str::to_string)).unwrap_or_else(|| {
        if pin_dir.join(proxy_common::prog_names::LOOPBACK).exists() {
            "ipvs".into()
        } else {
            "ebpf".into()
        }
    });
    // A switch in progress (dataplane::handover), as the data path is told it.
    let flags = proxy_agent::dataplane::ebpf::maps::DatapathMaps::config(&maps).map(|c| c.flags).unwrap_or(0);
    let handover = if flags & proxy_common::CFG_F_NO_NEW_FLOWS != 0 {
        Some("the fast path serves its remaining flows; IPVS takes every new connection (switch from the eBPF mode)")
    } else if flags & proxy_common::CFG_F_HANDOVER != 0 {
        Some("connections of the proxy before (IPVS mode or kube-proxy) pass to it; the fast path takes every new one")
    } else {
        None
    };
    if json {
        let v = serde_json::json!({
            "mode": mode,
            "handover": handover,
            "agent": health,
            "pin_dir": pin_dir,
            "links": links.iter().map(|(i, h)| serde_json::json!({"iface": i, "hook": h.tag()})).collect::<Vec<_>>(),
            "frontends": services,
            "counters": counters.iter().map(|(k, v)| (k.to_string(), *v)).collect::<std::collections::BTreeMap<_, _>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("mode: {mode}   pins: {}   fast-path frontends: {services}", pin_dir.display());
        if mode == "ipvs" {
            println!("IPVS mode: `kpr ipvs` (or ipvsadm -Ln) for virtual servers, `kpr ipset` for the sets");
        }
        if let Some(h) = handover {
            println!("handover: {h}");
        }
        match &last_sync {
            Some(t) if !t.is_empty() => println!("last sync: {t} (agent healthy at {healthz})"),
            Some(_) => println!("agent at {healthz} has not synced yet"),
            None => println!("agent: no answer at {healthz} (not running, or --healthz elsewhere); the maps below keep forwarding"),
        }
        for (i, h) in &links {
            println!("attached: {} on {i}", h.tag());
        }
        for (k, v) in counters {
            println!("{k:<22} {v}");
        }
    }
    Ok(())
}

pub fn services(pin_dir: &Path, json: bool, skipped: bool, healthz: &str) -> Result<()> {
    let not_programmed = || -> Result<serde_json::Value> {
        agent_get(healthz, proxy_agent::serve::metrics::NOT_PROGRAMMED_PATH)
            .map(|(_, v)| v)
            .with_context(|| format!("no agent answers at {healthz} (--healthz): what it could not program is known to it alone"))
    };
    if skipped {
        let list = not_programmed()?;
        if json {
            println!("{}", serde_json::to_string_pretty(&list)?);
        } else {
            print!("{}", render_not_programmed(&list));
        }
        return Ok(());
    }
    let maps = KernelMaps::open(pin_dir)?;
    let rows = view::services(&maps)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", view::render_services(&rows));
        match not_programmed() {
            Ok(list) if list.as_array().is_some_and(|l| !l.is_empty()) => print!("\nnot programmed:\n{}", render_not_programmed(&list)),
            Ok(_) => {}
            Err(e) => println!("\n({e})"),
        }
    }
    Ok(())
}

pub fn ipset(pin_dir: &Path, json: bool, name: Option<&str>) -> Result<()> {
    use proxy_agent::dataplane::ipvs::sets::SetMaps as _;
    let maps = proxy_agent::dataplane::ipvs::sets::KernelSetMaps::open(pin_dir)?;
    let mut list = proxy_agent::dataplane::ipvs::sets::listing(&maps.read()?);
    if let Some(n) = &name {
        list.retain(|s| &s.name == n);
        anyhow::ensure!(!list.is_empty(), "no set named {n} (try `kpr ipset` for all of them)");
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        print!("{}", proxy_agent::dataplane::ipvs::sets::render(&list));
    }
    Ok(())
}

pub fn ipvs(json: bool, stats: bool) -> Result<()> {
    let mut ipvs = proxy_agent::dataplane::ipvs::plane::connect_ipvs().context("reading IPVS (needs CAP_NET_ADMIN)")?;
    let rows = proxy_agent::dataplane::ipvs::view::virtual_servers(&mut ipvs)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        use proxy_agent::dataplane::ipvs::client::Ipvs as _;
        let info = ipvs.info()?;
        println!("IP Virtual Server version {}.{}.{} (size={})", info.version >> 16, (info.version >> 8) & 0xff, info.version & 0xff, info.conn_tab_size);
        print!("{}", proxy_agent::dataplane::ipvs::view::render(&rows, stats));
    }
    Ok(())
}

pub fn conntrack(pin_dir: &Path, json: bool) -> Result<()> {
    let maps = KernelMaps::open(pin_dir)?;
    let rows = view::conntrack(&maps, kernel::monotonic_ns())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", view::render_conntrack(&rows));
    }
    Ok(())
}

/// GET `path` from the agent at `addr`: (answered 200?, its JSON), or None when nothing
/// answers.
fn agent_get(addr: &str, path: &str) -> Option<(bool, serde_json::Value)> {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let (head, body) = resp.split_once("\r\n\r\n")?;
    Some((head.lines().next().unwrap_or("").contains(" 200"), serde_json::from_str(body).ok()?))
}

/// The agent's /healthz JSON (status 200 or 503), or None when nothing answers.
fn agent_health(addr: &str) -> Option<serde_json::Value> {
    let (ok, mut v) = agent_get(addr, "/healthz")?;
    v["healthy"] = serde_json::json!(ok);
    Some(v)
}

/// One line per object and field kpr could not program: reason, object, field, why.
fn render_not_programmed(list: &serde_json::Value) -> String {
    let field = |e: &serde_json::Value, k: &str| e[k].as_str().unwrap_or("").to_string();
    list.as_array()
        .into_iter()
        .flatten()
        .map(|e| format!("  {:<18} {} {}: {}\n", field(e, "reason"), field(e, "object"), field(e, "field"), field(e, "message")))
        .collect()
}

fn maps_len(maps: &KernelMaps) -> Result<usize> {
    use proxy_agent::dataplane::ebpf::maps::DatapathMaps;
    Ok(maps.services()?.len())
}
