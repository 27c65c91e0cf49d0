//! Switching between the eBPF and IPVS modes on a running node without breaking established
//! connections, make before break: the mode going away keeps serving the connections it has,
//! the new one takes every new connection, and the old mode's kernel objects go once its
//! connections have ended (or after `--mode-handover-limit`, an hour by default).
//!
//! - eBPF → IPVS (`ipvs::drain::FastPathDrain`, IPVS mode's side): the fast path's programs stay (XDP, TC
//!   egress, and its TC ingress in front of IPVS mode's set matching), flagged
//!   CFG_F_NO_NEW_FLOWS: a packet of one of its flows is translated as before, any other goes on
//!   to IPVS mode. The node's own new connections go to IPVS at once (the balancing
//!   connect-time programs go first).
//! - IPVS → eBPF (`IpvsHandover`, the fast path's side): the virtual servers, kube-ipvs0 and the
//!   fixed rules stay while IPVS counts established connections; the fast path, flagged
//!   CFG_F_HANDOVER, passes a TCP packet that no flow of its own knows (a SYN excepted) to the
//!   stack, where IPVS serves it.
//! - kube-proxy → eBPF (`ConntrackHandover`): the same flag, while netfilter's conntrack holds
//!   established connections to a Service that it translated (kube-proxy's DNAT outlives its
//!   rules in conntrack, so `kpr cleanup --kube-proxy` does not end them).
//!
//! UDP has no connection to keep: the new mode balances the next datagram of a flow afresh.
//! Both ends of a switch must run a kpr that knows these flags (upgrade in place first).
use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use proxy_common::{prog_names, CFG_F_HANDOVER};
use tracing::{info, warn};

use crate::{
    dataplane::{
        ebpf::{
            kernel::{self, Hook},
            maps::{set_config_flag, DatapathMaps},
        },
        ipvs::{
            client::{Ipvs, IpvsError, NetlinkIpvs},
            rules, sync as ipvs_sync,
        },
        HandoverClock, PreviousProxy, Progress,
    },
    host::{
        netfilter::{Netfilter, NetfilterError, SystemNetfilter},
        netif,
    },
    netlink::{
        ctnetlink::NetlinkConntrack,
        rtnl::{Links, NetlinkLinks, IPVS_DUMMY},
    },
};

/// How often the previous proxy's connections are counted during a handover.
const POLL: Duration = Duration::from_secs(2);

/// At the fast path's start, before its programs attach: the proxy it takes over from, if
/// that proxy still carries connections (kpr's IPVS mode, else anything conntrack shows).
pub fn previous_proxy(pin_dir: &Path, uplinks: &[String], maps: &mut dyn DatapathMaps, limit: Duration) -> Option<Box<dyn PreviousProxy>> {
    if let Some(h) = IpvsHandover::start(pin_dir, uplinks, maps, limit) {
        return Some(Box::new(h));
    }
    match NetlinkConntrack::connect() {
        Ok(ct) => ConntrackHandover::start(Box::new(ct), Box::new(SystemNetfilter), maps, limit).map(|h| Box::new(h) as Box<dyn PreviousProxy>),
        Err(e) => {
            warn!(error = %e, "no ctnetlink: connections of a proxy before kpr are not handed over");
            None
        }
    }
}

/// Established TCP connections netfilter translated (see NetlinkConntrack::translated_tcp).
pub trait TranslatedConnections {
    fn translated_tcp(&mut self) -> Result<Vec<(IpAddr, u16)>, crate::netlink::socket::NlError>;
}

impl TranslatedConnections for NetlinkConntrack {
    fn translated_tcp(&mut self) -> Result<Vec<(IpAddr, u16)>, crate::netlink::socket::NlError> {
        NetlinkConntrack::translated_tcp(self)
    }
}

/// A chain no rule jumps to, holding one conntrack match: the match alone keeps netfilter's
/// conntrack running in this namespace. Without it, removing kube-proxy's rules (the last ones
/// needing conntrack on a node without kubelet's) turns conntrack off, and with it the NAT of
/// every connection kube-proxy carries.
pub const CONNTRACK_PIN_CHAIN: &str = "KPR-HANDOVER";

fn pin_conntrack(nf: &mut dyn Netfilter) -> Result<(), NetfilterError> {
    let exists = crate::host::netfilter::has_chain(&nf.save(rules::BACKEND, "filter")?, CONNTRACK_PIN_CHAIN);
    let declare = if exists { format!("-F {CONNTRACK_PIN_CHAIN}") } else { format!(":{CONNTRACK_PIN_CHAIN} - [0:0]") };
    nf.restore(rules::BACKEND, &format!("*filter\n{declare}\n-A {CONNTRACK_PIN_CHAIN} -m conntrack --ctstate INVALID -j RETURN\nCOMMIT\n"))
}

/// Removes the conntrack pin (idempotent; `kpr cleanup` calls it too). Returns what went.
pub fn unpin_conntrack(nf: &mut dyn Netfilter) -> Result<Vec<String>, NetfilterError> {
    if !crate::host::netfilter::has_chain(&nf.save(rules::BACKEND, "filter")?, CONNTRACK_PIN_CHAIN) {
        return Ok(Vec::new());
    }
    nf.restore(rules::BACKEND, &format!("*filter\n-F {CONNTRACK_PIN_CHAIN}\n-X {CONNTRACK_PIN_CHAIN}\nCOMMIT\n"))?;
    Ok(vec![format!("removed {} filter chain {CONNTRACK_PIN_CHAIN}", rules::BACKEND)])
}

/// The fast path's side of a switch from kube-proxy (or any proxy that NATs in netfilter).
pub struct ConntrackHandover {
    conntrack: Box<dyn TranslatedConnections>,
    nf: Box<dyn Netfilter>,
    clock: HandoverClock,
}

impl ConntrackHandover {
    /// None: conntrack holds no such connection (before the first sync, any translated one
    /// counts; the polls then count only those to a Service).
    pub fn start(mut conntrack: Box<dyn TranslatedConnections>, mut nf: Box<dyn Netfilter>, maps: &mut dyn DatapathMaps, limit: Duration) -> Option<Self> {
        let n = match conntrack.translated_tcp() {
            Ok(v) => v.len(),
            Err(e) => {
                warn!(error = %e, "reading conntrack: connections of a proxy before kpr are not handed over");
                0
            }
        };
        if let Err(e) = set_config_flag(maps, CFG_F_HANDOVER, n > 0) {
            warn!(error = %e, "switch from another proxy: cannot set the handover flag");
        }
        if n == 0 {
            if let Err(e) = unpin_conntrack(nf.as_mut()) {
                warn!(error = %e, "removing the conntrack pin (`kpr cleanup` removes it too)");
            }
            return None;
        }
        if let Err(e) = pin_conntrack(nf.as_mut()) {
            warn!(error = %e, "cannot keep conntrack running: if the proxy's rules go and nothing else needs conntrack, its connections break");
        }
        info!(
            connections = n,
            limit_s = limit.as_secs(),
            "connections a proxy before kpr translated (conntrack) keep their backend; the fast path takes every new one"
        );
        Some(Self { conntrack, nf, clock: HandoverClock::new(limit) })
    }
}

impl PreviousProxy for ConntrackHandover {
    fn poll(&mut self, maps: &mut dyn DatapathMaps, frontends: &BTreeSet<(IpAddr, u16)>) -> Progress {
        if frontends.is_empty() || !self.clock.due(POLL) {
            return Progress::Serving(u64::MAX);
        }
        let n = match self.conntrack.translated_tcp() {
            Ok(v) => v.iter().filter(|d| frontends.contains(d)).count() as u64,
            Err(e) => {
                warn!(error = %e, "switch from another proxy: reading conntrack failed");
                return Progress::Serving(u64::MAX);
            }
        };
        if n > 0 && !self.clock.expired() {
            return Progress::Serving(n);
        }
        if let Err(e) = set_config_flag(maps, CFG_F_HANDOVER, false) {
            warn!(error = %e, "clearing the handover flag (the next sync retries)");
        }
        if let Err(e) = unpin_conntrack(self.nf.as_mut()) {
            warn!(error = %e, "removing the conntrack pin (`kpr cleanup` removes it too)");
        }
        info!(seconds = self.clock.elapsed_s(), remaining = n, "handover from the proxy before kpr done");
        Progress::Done
    }
}

/// The fast path's side of a switch from IPVS mode.
pub struct IpvsHandover {
    ipvs: Box<dyn Ipvs>,
    links: Box<dyn Links>,
    nf: Box<dyn Netfilter>,
    /// Detach IPVS mode's programs from the kernel at the end (not in unit tests).
    kernel_programs: bool,
    pin_dir: PathBuf,
    uplinks: Vec<String>,
    clock: HandoverClock,
}

impl IpvsHandover {
    /// At the fast path's start, before its programs attach. None: no IPVS mode was here, or
    /// it serves no connection (and its objects are removed now). Never fails the start: a
    /// problem is logged, and the previous mode's objects stay for `kpr cleanup`.
    pub fn start(pin_dir: &Path, uplinks: &[String], maps: &mut dyn DatapathMaps, limit: Duration) -> Option<Self> {
        let ipvs = match NetlinkIpvs::connect() {
            Ok(i) => i,
            Err(IpvsError::NoIpvs) => return None,
            Err(e) => {
                warn!(error = %e, "IPVS is there but cannot be read: a previous IPVS mode's state, if any, stays");
                return None;
            }
        };
        let links = match NetlinkLinks::connect() {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "no rtnetlink: a previous IPVS mode's state, if any, stays");
                return None;
            }
        };
        let h = Self {
            ipvs: Box::new(ipvs),
            links: Box::new(links),
            nf: Box::new(SystemNetfilter),
            kernel_programs: true,
            pin_dir: pin_dir.into(),
            uplinks: uplinks.to_vec(),
            clock: HandoverClock::new(limit),
        };
        h.begin(maps)
    }

    fn begin(mut self, maps: &mut dyn DatapathMaps) -> Option<Self> {
        let ipvs_mode_was_here = self.pin_dir.join(prog_names::LOOPBACK).exists() || self.links.link_index(IPVS_DUMMY).ok().flatten().is_some();
        if !ipvs_mode_was_here {
            return None;
        }
        match self.established() {
            Ok(0) => {
                self.finish();
                if let Err(e) = set_config_flag(maps, CFG_F_HANDOVER, false) {
                    warn!(error = %e, "clearing the handover flag (the next sync retries)");
                }
                None
            }
            Ok(n) => {
                if let Err(e) = set_config_flag(maps, CFG_F_HANDOVER, true) {
                    warn!(error = %e, "switch from IPVS mode: cannot flag the handover; IPVS's connections will break");
                }
                info!(
                    connections = n,
                    limit_s = self.clock.limit_s(),
                    "switch from IPVS mode: IPVS keeps serving its established connections; the fast path takes every new one"
                );
                Some(self)
            }
            Err(e) => {
                warn!(error = %e, "switch from IPVS mode: cannot count IPVS's connections; its state stays for `kpr cleanup`");
                None
            }
        }
    }

    /// Removes IPVS mode's state: what `kpr cleanup` removes of it, and its programs.
    fn finish(&mut self) {
        match ipvs_sync::cleanup(self.ipvs.as_mut(), self.links.as_mut(), &node_addresses()) {
            Ok(done) => done.iter().for_each(|d| info!(what = %d, "IPVS mode's state removed")),
            Err(e) => warn!(error = %e, "removing IPVS mode's virtual servers and kube-ipvs0"),
        }
        match rules::remove(self.nf.as_mut()) {
            Ok(done) => done.iter().for_each(|d| info!(what = %d, "IPVS mode's state removed")),
            Err(e) => warn!(error = %e, "removing IPVS mode's fixed rules"),
        }
        if !self.kernel_programs {
            return;
        }
        let detach = |iface: &str, hook: Hook| {
            if let Err(e) = kernel::detach(&self.pin_dir, iface, hook) {
                warn!(iface, hook = hook.tag(), error = %e, "detaching IPVS mode's program (`kpr cleanup` removes it)");
            }
        };
        for name in prog_names::SOCK_IPVS {
            detach(name, Hook::Cgroup);
        }
        // Pod interfaces' TC ingress runs the fast path now; the uplinks' still ran the set
        // matching (the fast path has XDP there).
        for (iface, hook) in kernel::attached_links(&self.pin_dir) {
            if hook == Hook::TcIngress && self.uplinks.contains(&iface) {
                detach(&iface, hook);
            }
        }
        kernel::detach_tc_filters(aya::programs::tc::TcAttachType::Ingress, prog_names::TC_IPSET);
        match std::fs::remove_file(self.pin_dir.join(prog_names::LOOPBACK)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                warn!(error = %e, "removing IPVS mode's KUBE-LOOP-BACK pin: the next start would take IPVS mode for still here")
            }
            _ => {}
        }
    }

    fn established(&mut self) -> Result<u64, ipvs_sync::IpvsSyncError> {
        ipvs_sync::established_connections(self.ipvs.as_mut(), self.links.as_mut(), &node_addresses())
    }
}

impl PreviousProxy for IpvsHandover {
    /// Every POLL: once IPVS counts no established connection (or the limit passed), its
    /// virtual servers, kube-ipvs0, the fixed rules and IPVS mode's programs go.
    fn poll(&mut self, maps: &mut dyn DatapathMaps, _frontends: &BTreeSet<(IpAddr, u16)>) -> Progress {
        if !self.clock.due(POLL) {
            return Progress::Serving(u64::MAX);
        }
        let n = match self.established() {
            Ok(n) => n,
            Err(e) => {
                warn!(error = %e, "switch from IPVS mode: counting IPVS's connections failed");
                return Progress::Serving(u64::MAX);
            }
        };
        let expired = self.clock.expired();
        if n > 0 && !expired {
            return Progress::Serving(n);
        }
        if expired {
            warn!(connections = n, "switch from IPVS mode: IPVS's remaining connections outlived the handover limit; removing IPVS ends them");
        }
        self.finish();
        if let Err(e) = set_config_flag(maps, CFG_F_HANDOVER, false) {
            warn!(error = %e, "clearing the handover flag (the next sync retries)");
        }
        info!(seconds = self.clock.elapsed_s(), "switch from IPVS mode done: its connections ended, its state is removed");
        Progress::Done
    }
}

/// The node's addresses (which IPVS virtual servers are NodePorts), as `kpr cleanup` finds them.
fn node_addresses() -> Vec<IpAddr> {
    netif::interfaces().iter().flat_map(|i| netif::addresses(i)).collect()
}

#[cfg(test)]
mod tests;
