//! `kpr cleanup`: kpr's own state (pins, IPVS mode's virtual servers and rules), and with
//! `--kube-proxy` kube-proxy's leftovers.
use std::path::Path;

use anyhow::{Context, Result};
use proxy_agent::{dataplane::ebpf::kernel, host::netif};

pub fn cleanup(pin_dir: &Path, kube_proxy: bool, keep_kpr: bool) -> Result<()> {
    // The node's addresses: which IPVS virtual servers are NodePorts (kpr's or kube-proxy's).
    let local: Vec<std::net::IpAddr> = netif::interfaces().iter().flat_map(|i| netif::ipv4_addresses(i)).collect();
    if !keep_kpr {
        // IPVS mode's state, where the kernel has IPVS.
        match proxy_agent::dataplane::ipvs::client::NetlinkIpvs::connect() {
            Ok(mut ipvs) => {
                let mut links = proxy_agent::netlink::rtnl::NetlinkLinks::connect()?;
                for d in proxy_agent::dataplane::ipvs::sync::cleanup(&mut ipvs, &mut links, &local)? {
                    println!("{d}");
                }
            }
            Err(proxy_agent::dataplane::ipvs::client::IpvsError::NoIpvs) => {}
            Err(e) => return Err(e).context("reading IPVS for cleanup"),
        }
        match proxy_agent::dataplane::ipvs::rules::remove(&mut proxy_agent::host::netfilter::SystemNetfilter) {
            Ok(done) => done.iter().for_each(|d| println!("{d}")),
            Err(e) => tracing::warn!(error = %e, "netfilter rules not checked"),
        }
        for d in proxy_agent::dataplane::ebpf::masquerade6::remove(&mut proxy_agent::host::netfilter::SystemNetfilter) {
            println!("{d}");
        }
        match proxy_agent::dataplane::handover::unpin_conntrack(&mut proxy_agent::host::netfilter::SystemNetfilter) {
            Ok(done) => done.iter().for_each(|d| println!("{d}")),
            Err(e) => tracing::warn!(error = %e, "the handover's conntrack pin not checked"),
        }
        let removed = kernel::cleanup(pin_dir).with_context(|| format!("cleaning {}", pin_dir.display()))?;
        println!("removed {} pinned objects under {}", removed.len(), pin_dir.display());
    }
    if kube_proxy {
        // kpr's own IPVS mode owns kube-ipvs0 and its virtual servers now: leave them.
        let kpr_ipvs = keep_kpr && pin_dir.join(proxy_common::prog_names::LOOPBACK).exists();
        let mut ipvs = proxy_agent::dataplane::ipvs::client::NetlinkIpvs::connect().ok();
        let mut links = proxy_agent::netlink::rtnl::NetlinkLinks::connect()?;
        let handles = (!kpr_ipvs).then(|| proxy_agent::migration::IpvsHandles {
            ipvs: ipvs.as_mut().map(|i| i as &mut dyn proxy_agent::dataplane::ipvs::client::Ipvs),
            links: &mut links,
            node_addresses: &local,
        });
        let done = proxy_agent::migration::cleanup(&mut proxy_agent::host::netfilter::SystemNetfilter, handles)
            .context("removing kube-proxy's leftovers (is kube-proxy still running? stop its DaemonSet first)")?;
        if kpr_ipvs {
            println!("kpr runs in IPVS mode here: kube-ipvs0 and its virtual servers are kpr's now and stay");
        }
        if done.is_empty() {
            println!("no kube-proxy leftovers found");
        }
        for d in done {
            println!("{d}");
        }
    }
    Ok(())
}
