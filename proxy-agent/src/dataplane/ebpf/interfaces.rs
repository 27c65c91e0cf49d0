//! Which program runs on which interface, kept current as interfaces come and go, and what the
//! programs know of each interface (KPR_IFACE: masquerade address, local by detectLocalMode).
//! Both modes use it: the fast path's hooks, or IPVS mode's set matching.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::PathBuf,
};

use aya::programs::{
    tc::{self, TcAttachType},
    XdpMode,
};
use proxy_common::IfaceInfo;
use tracing::{error, info, warn};

use crate::{
    dataplane::ebpf::{
        kernel::{self, Datapath, Hook},
        kernel_maps::KernelMaps,
        maps::DatapathMaps,
    },
    host::netif,
    settings::{DetectLocal, Settings, XdpModeArg},
};

pub struct Interfaces {
    pin_dir: PathBuf,
    uplinks: Vec<String>,
    pod_ifaces: Vec<String>,
    pod_iface_prefixes: Vec<String>,
    xdp_mode: XdpModeArg,
    /// Uplinks whose IPv4 ingress runs at TC: `--xdp-mode off`, a veth under auto, or a
    /// driver that refused native XDP under auto.
    uplinks_at_tc: BTreeSet<String>,
    detect_local: DetectLocal,
    /// The fast path (XDP + TC both ways, per-interface masquerade) or IPVS mode's set
    /// matching (TC ingress only).
    fast_path: bool,
    /// iptables.snatNodeInternalIP: masquerade with the primary IP on every interface.
    snat_node_internal_ip: bool,
    attached: BTreeSet<(String, Hook)>,
    /// What KPR_IFACE holds.
    ifaces: BTreeMap<u32, IfaceInfo>,
}

impl Interfaces {
    pub fn new(s: &Settings, pin_dir: PathBuf, fast_path: bool) -> Self {
        Self {
            pin_dir,
            uplinks: s.uplinks.clone(),
            pod_ifaces: s.pod_ifaces.clone(),
            pod_iface_prefixes: s.pod_iface_prefixes.clone(),
            xdp_mode: s.xdp_mode,
            uplinks_at_tc: BTreeSet::new(),
            detect_local: s.detect_local.clone(),
            fast_path,
            snat_node_internal_ip: s.snat_node_internal_ip,
            attached: BTreeSet::new(),
            ifaces: BTreeMap::new(),
        }
    }

    /// The uplinks' addresses (NodePort addresses by default).
    pub fn uplink_addresses(&self) -> Vec<IpAddr> {
        self.uplinks.iter().flat_map(|u| netif::ipv4_addresses(u)).collect()
    }

    /// The hooks each interface gets: the fast path runs the pipeline's ingress half (XDP on
    /// uplinks, or TC where `uplinks_at_tc` says, with TC for their IPv6; TC on pod and tunnel
    /// interfaces) and its egress half (TC) on all of them; IPVS mode the set-matching program
    /// at TC ingress everywhere (XDP has no skb mark).
    fn wanted(&self, present: &[String]) -> Vec<(String, Hook)> {
        let mut wanted = Vec::new();
        for u in &self.uplinks {
            wanted.push((u.clone(), if !self.fast_path { Hook::TcIngress } else { self.uplink_ingress(u) }));
            if self.fast_path {
                wanted.push((u.clone(), Hook::TcIngress6));
                wanted.push((u.clone(), Hook::TcEgress));
            }
        }
        for i in present {
            if self.pod_ifaces.contains(i) || self.pod_iface_prefixes.iter().any(|p| i.starts_with(p.as_str())) {
                wanted.push((i.clone(), Hook::TcIngress));
                if self.fast_path {
                    wanted.push((i.clone(), Hook::TcEgress));
                }
            }
        }
        wanted
    }

    /// The fast path's IPv4 ingress hook on uplink `u`.
    fn uplink_ingress(&self, u: &str) -> Hook {
        if self.uplinks_at_tc.contains(u) {
            Hook::TcUplink
        } else {
            Hook::Xdp
        }
    }

    /// Notes the uplinks whose IPv4 ingress runs at TC by their kind: every one with
    /// `--xdp-mode off`; the veths under auto (a veth's XDP copies each frame the stack sends
    /// through it, which costs more than XDP saves; measured in docs/performance.md).
    fn note_uplinks_at_tc(&mut self) {
        match self.xdp_mode {
            XdpModeArg::Off => self.uplinks_at_tc.extend(self.uplinks.iter().cloned()),
            XdpModeArg::Auto => {
                let kinds = crate::netlink::rtnl::NetlinkLinks::connect().and_then(|mut l| l.kinds()).unwrap_or_else(|e| {
                    warn!(error = %e, "cannot read the uplinks' kinds: XDP on every uplink");
                    Default::default()
                });
                self.uplinks_at_tc.extend(self.uplinks.iter().filter(|u| kinds.get(*u).is_some_and(|k| k == "veth")).cloned());
            }
            XdpModeArg::Native | XdpModeArg::Generic => {}
        }
    }

    /// The uplink's other way of IPv4 ingress (an earlier agent's, or another --xdp-mode's)
    /// goes once `running` is attached: until then both ran, the second seeing the first's
    /// rewritten packets, which no service or flow of its own matches.
    fn detach_other_uplink_ingress(&self, iface: &str, running: Hook) {
        let other = if running == Hook::Xdp { Hook::TcUplink } else { Hook::Xdp };
        if kernel::attached_links(&self.pin_dir).contains(&(iface.to_string(), other)) {
            match kernel::detach(&self.pin_dir, iface, other) {
                Ok(()) => info!(iface, hook = other.tag(), "detached: the uplink's IPv4 ingress runs at {}", running.tag()),
                Err(e) => warn!(iface, hook = other.tag(), error = %e, "detaching the uplink's other IPv4 ingress"),
            }
        }
        // Kernels before TCX: a TC program is a filter, not a pinned link.
        if other == Hook::TcUplink && tc::qdisc_detach_program(iface, TcAttachType::Ingress, proxy_common::prog_names::TC_UPLINK).is_ok() {
            info!(iface, hook = other.tag(), "detached: the uplink's IPv4 ingress runs at xdp");
        }
    }

    /// The kernel's XDP attach mode for `--xdp-mode` (off attaches no XDP).
    fn xdp_attach_mode(&self) -> XdpMode {
        if self.xdp_mode == XdpModeArg::Generic {
            XdpMode::Skb
        } else {
            XdpMode::Driver
        }
    }

    /// Whether every packet program pinned under the pin directory is one this agent attached:
    /// no program loaded by an earlier agent (an earlier release's, maybe) runs any more. Until
    /// then the assured tables' hints are not rebuilt: such a program may fill a table without
    /// setting the hint's bits (see proxy_common::CtHinted).
    pub fn all_attached_by_this_agent(&self) -> bool {
        kernel::attached_links(&self.pin_dir).into_iter().filter(|(_, hook)| *hook != Hook::Cgroup).all(|l| self.attached.contains(&l))
    }

    /// Attaches to interfaces that do not have the programs yet, detaches from interfaces that
    /// are gone, and rewrites KPR_IFACE where it changed. Returns whether anything was attached.
    pub fn reconcile(&mut self, dp: &mut Datapath, maps: &mut KernelMaps) -> bool {
        let present = netif::interfaces();
        if self.fast_path && self.uplinks.iter().any(|u| present.contains(u) && !self.attached.iter().any(|(i, _)| i == u)) {
            self.note_uplinks_at_tc();
        }
        let mut attached_any = false;
        let mode = self.xdp_attach_mode();
        for (iface, hook) in self.wanted(&present) {
            if self.attached.contains(&(iface.clone(), hook)) {
                continue;
            }
            let attached = match dp.attach(&iface, hook, mode) {
                Err(e) if hook == Hook::Xdp && self.xdp_mode == XdpModeArg::Auto => {
                    info!(iface = %iface, error = %e, "no native XDP: the uplink's IPv4 ingress runs at TC");
                    self.uplinks_at_tc.insert(iface.clone());
                    dp.attach(&iface, Hook::TcUplink, mode).map(|()| Hook::TcUplink)
                }
                r => r.map(|()| hook),
            };
            match attached {
                Ok(hook) => {
                    info!(iface = %iface, hook = hook.tag(), "attached");
                    if matches!(hook, Hook::Xdp | Hook::TcUplink) {
                        self.detach_other_uplink_ingress(&iface, hook);
                    }
                    self.attached.insert((iface, hook));
                    attached_any = true;
                }
                Err(e) => error!(iface = %iface, hook = hook.tag(), error = %e, "attach failed"),
            }
        }
        let wanted = self.wanted(&present);
        for (iface, hook) in kernel::attached_links(&self.pin_dir) {
            if hook != Hook::Cgroup && !present.contains(&iface) {
                // The interface is gone, and its link with it; the pin is what is left.
                if let Err(e) = kernel::detach(&self.pin_dir, &iface, hook) {
                    warn!(iface = %iface, hook = hook.tag(), error = %e, "removing a gone interface's link pin");
                }
                self.attached.retain(|(i, _)| i != &iface);
            }
        }
        let masters = match &self.detect_local {
            DetectLocal::BridgeInterface(_) => crate::netlink::rtnl::NetlinkLinks::connect().and_then(|mut l| l.masters()).unwrap_or_else(|e| {
                warn!(error = %e, "cannot read the interfaces' bridges: detectLocalMode BridgeInterface sees no local pods");
                Default::default()
            }),
            _ => Default::default(),
        };
        let mut ifaces = BTreeMap::new();
        for (iface, _) in &wanted {
            let Some(index) = netif::index(iface) else { continue };
            let mut info = IfaceInfo::default();
            // Masquerade uses the address of the interface a flow leaves by, as MASQUERADE
            // does (a tunnel device's own address, so the remote node routes replies back
            // through the tunnel); interfaces without one use the node's SNAT address.
            if self.fast_path && !self.snat_node_internal_ip {
                if let Some(IpAddr::V4(a)) = netif::ipv4_addresses(iface).first() {
                    info.snat_addr = u32::from_ne_bytes(a.octets());
                }
            }
            if self.detect_local.is_local(iface, masters.get(iface).map(String::as_str)) {
                info.flags |= proxy_common::IFACE_F_LOCAL;
            }
            if info != IfaceInfo::default() {
                ifaces.insert(index, info);
            }
        }
        if ifaces != self.ifaces {
            match maps.set_ifaces(&ifaces) {
                Ok(()) => self.ifaces = ifaces,
                Err(e) => warn!(error = %e, "interface information for the data path"),
            }
        }
        attached_any
    }
}
