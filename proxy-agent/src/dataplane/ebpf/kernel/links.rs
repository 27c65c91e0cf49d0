//! Pinned links: attaching the programs with links pinned under the pin directory (so
//! forwarding survives the agent), finding them again, and detaching them.
use std::{
    io,
    path::{Path, PathBuf},
};

use aya::programs::{
    links::{FdLink, PinnedLink},
    tc::{self, SchedClassifierLink, TcAttachType},
    xdp::XdpLink,
    XdpMode,
};
use aya::util::KernelVersion;
use proxy_common::prog_names;

use super::{Datapath, KernelError};

/// The TC filter priority of IPVS mode's set matching behind a draining fast path (whose filter
/// got the kernel's first automatic priority, 49152; lower runs first).
const AFTER_FAST_PATH_PRIORITY: u16 = 0xC001;
/// The TC filter priority of the uplinks' IPv6 program on kernels before TCX: ahead of the
/// automatic ones.
const FIRST_PRIORITY: u16 = 0xBFFF;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hook {
    TcIngress,
    /// The uplinks' IPv6 ingress (kpr_tc_ingress6): XDP passes IPv6 on to it.
    TcIngress6,
    /// The fast path's second half (masquerade, reverse DNAT), on every interface it runs on.
    TcEgress,
    Xdp,
    /// The uplinks' IPv4 ingress at TC (kpr_tc_uplink) where XDP is not used there
    /// (`--xdp-mode`; auto: veths).
    TcUplink,
    /// Connect-time programs on a cgroup; the "interface" is the program name.
    Cgroup,
    /// The fast path's TC ingress link, kept in front of IPVS mode's set matching while a
    /// switch to IPVS mode drains its flows (see dataplane::handover).
    TcDrain,
}

impl Hook {
    /// The name in link pins, logs and `kpr status`.
    pub fn tag(self) -> &'static str {
        match self {
            Hook::TcIngress => "tc_ingress",
            Hook::TcIngress6 => "tc_ingress6",
            Hook::TcEgress => "tc_egress",
            Hook::Xdp => "xdp",
            Hook::TcUplink => "tc_uplink",
            Hook::Cgroup => "cgroup",
            Hook::TcDrain => "tc_drain",
        }
    }
}

impl Datapath {
    pub fn link_path(&self, iface: &str, hook: Hook) -> PathBuf {
        link_path(&self.pin_dir, iface, hook)
    }

    /// Attaches `hook`'s program to `iface`. An existing pinned link is updated in place
    /// (bpf_link_update): the old program runs until the new one replaces it atomically.
    pub fn attach(&mut self, iface: &str, hook: Hook, xdp_mode: XdpMode) -> Result<(), KernelError> {
        let path = self.link_path(iface, hook);
        let fail = |what: &'static str, err: String| KernelError::Attach { iface: iface.into(), what, err };
        let existing = if path.exists() {
            match PinnedLink::from_pin(&path) {
                Ok(p) => Some(FdLink::from(p)),
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                    None
                }
            }
        } else {
            None
        };
        match hook {
            Hook::TcIngress | Hook::TcIngress6 | Hook::TcUplink | Hook::TcEgress => {
                let (program, attach_type, what) = match hook {
                    Hook::TcIngress => (self.tc_program, TcAttachType::Ingress, "tc ingress"),
                    Hook::TcIngress6 => (prog_names::TC_INGRESS6, TcAttachType::Ingress, "tc ingress (IPv6)"),
                    Hook::TcUplink => (prog_names::TC_UPLINK, TcAttachType::Ingress, "tc ingress (uplink)"),
                    _ => (prog_names::TC_EGRESS, TcAttachType::Egress, "tc egress"),
                };
                if let Some(link) = existing {
                    let prog = self.classifier(program)?;
                    let link = SchedClassifierLink::try_from(link).map_err(|e| fail("reuse pinned tc link", e.to_string()))?;
                    let id = prog.attach_to_link(link).map_err(|e| fail("update tc link", e.to_string()))?;
                    // The pin keeps the link; our fd may go.
                    drop(prog.take_link(id));
                    return Ok(());
                }
                // Only needed on kernels before TCX (6.6); harmless otherwise. There, filters are
                // not links: remove ours before adding one, or restarts would stack them.
                let _ = tc::qdisc_add_clsact(iface);
                // Behind a draining fast path, its filter stays and ours goes after it (TCX
                // links: after by default).
                let behind = self.after_fast_path && hook == Hook::TcIngress;
                // The uplinks' programs share the hook with whatever TC ingress runs there
                // (IPVS mode's set matching during a switch): each replaces only itself.
                let ours = |n: &&str| match hook {
                    Hook::TcIngress6 | Hook::TcUplink => *n == program,
                    _ if behind => *n == prog_names::TC_IPSET,
                    _ => !UPLINK_TC_PROGRAMS.contains(n),
                };
                for name in TC_PROGRAMS.into_iter().filter(ours) {
                    let _ = tc::qdisc_detach_program(iface, attach_type, name);
                }
                let prog = self.classifier(program)?;
                let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
                let netlink_behind = behind && !tcx;
                let id = if netlink_behind {
                    let options = tc::NlOptions { priority: AFTER_FAST_PATH_PRIORITY, ..Default::default() };
                    prog.attach_with_options(iface, attach_type, tc::TcAttachOptions::Netlink(options))
                } else if matches!(hook, Hook::TcIngress6 | Hook::TcUplink) {
                    // First on the hook: during a switch from IPVS mode its set matching is
                    // there too, and the new flows must be the fast path's, as XDP makes them
                    // (what is not its own goes on to the next program).
                    let options = if tcx {
                        tc::TcAttachOptions::TcxOrder(aya::programs::LinkOrder::first())
                    } else {
                        let priority = if hook == Hook::TcUplink { FIRST_PRIORITY - 1 } else { FIRST_PRIORITY };
                        tc::TcAttachOptions::Netlink(tc::NlOptions { priority, ..Default::default() })
                    };
                    prog.attach_with_options(iface, attach_type, options)
                } else {
                    prog.attach(iface, attach_type)
                }
                .map_err(|e| fail(what, e.to_string()))?;
                let link = prog.take_link(id).map_err(|e| fail("take tc link", e.to_string()))?;
                // Netlink-attached filters (kernels < 6.6) are no FdLink: they outlive the process
                // by themselves.
                if let Ok(fd) = FdLink::try_from(link) {
                    fd.pin(&path).map_err(|e| fail("pin tc link", e.to_string()))?;
                }
            }
            Hook::Cgroup | Hook::TcDrain => {
                return Err(fail("attach", "cgroup programs attach with attach_cgroup; drain links are kept, never attached".into()))
            }
            Hook::Xdp => {
                let prog = self.xdp(prog_names::XDP_INGRESS)?;
                if let Some(link) = existing {
                    let link = XdpLink::try_from(link).map_err(|e| fail("reuse pinned xdp link", e.to_string()))?;
                    let id = prog.attach_to_link(link).map_err(|e| fail("update xdp link", e.to_string()))?;
                    drop(prog.take_link(id));
                    return Ok(());
                }
                let id = prog.attach(iface, xdp_mode).map_err(|e| fail("attach xdp", e.to_string()))?;
                let link = prog.take_link(id).map_err(|e| fail("take xdp link", e.to_string()))?;
                let fd = FdLink::try_from(link).map_err(|e| fail("xdp link is not a bpf_link (kernel < 5.9?)", e.to_string()))?;
                fd.pin(&path).map_err(|e| fail("pin xdp link", e.to_string()))?;
            }
        }
        Ok(())
    }
}

/// Every TC program kpr attaches (what a cleanup removes from pre-TCX kernels' filters).
pub(super) const TC_PROGRAMS: [&str; 5] = [prog_names::TC_INGRESS, prog_names::TC_INGRESS6, prog_names::TC_UPLINK, prog_names::TC_EGRESS, prog_names::TC_IPSET];
/// The uplinks' TC ingress programs of the fast path, first on the hook: a TC ingress
/// attached behind them leaves them there.
const UPLINK_TC_PROGRAMS: [&str; 2] = [prog_names::TC_INGRESS6, prog_names::TC_UPLINK];

/// bpffs refuses '.' in names, and interface names may hold one (flannel.1); ':' never
/// appears in an interface name, so it stands for the dot.
pub fn link_path(pin_dir: &Path, iface: &str, hook: Hook) -> PathBuf {
    pin_dir.join("links").join(format!("{}_{}", hook.tag(), iface.replace('.', ":")))
}

/// Interfaces with a pinned link, and the hook.
pub fn attached_links(pin_dir: &Path) -> Vec<(String, Hook)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(pin_dir.join("links")) else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().replace(':', ".");
        if let Some(i) = name.strip_prefix("tc_ingress_") {
            out.push((i.to_string(), Hook::TcIngress));
        } else if let Some(i) = name.strip_prefix("tc_ingress6_") {
            out.push((i.to_string(), Hook::TcIngress6));
        } else if let Some(i) = name.strip_prefix("tc_egress_") {
            out.push((i.to_string(), Hook::TcEgress));
        } else if let Some(i) = name.strip_prefix("tc_uplink_") {
            out.push((i.to_string(), Hook::TcUplink));
        } else if let Some(i) = name.strip_prefix("xdp_") {
            out.push((i.to_string(), Hook::Xdp));
        } else if let Some(p) = name.strip_prefix("cgroup_") {
            out.push((p.to_string(), Hook::Cgroup));
        } else if let Some(i) = name.strip_prefix("tc_drain_") {
            out.push((i.to_string(), Hook::TcDrain));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Detaches one pinned link, then unpins it.
pub fn detach(pin_dir: &Path, iface: &str, hook: Hook) -> io::Result<()> {
    let path = link_path(pin_dir, iface, hook);
    let _ = crate::dataplane::ebpf::bpf_batch::detach_pinned_link(&path);
    match std::fs::remove_file(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Keeps the fast path's TC ingress links as drain links (IPVS mode's set matching then gets
/// links of its own, after them). Returns the interfaces.
pub fn keep_tc_ingress_for_drain(pin_dir: &Path) -> io::Result<Vec<String>> {
    let mut kept = Vec::new();
    for (iface, hook) in attached_links(pin_dir) {
        if matches!(hook, Hook::TcIngress | Hook::TcUplink) {
            std::fs::rename(link_path(pin_dir, &iface, hook), link_path(pin_dir, &iface, Hook::TcDrain))?;
            kept.push(iface);
        }
    }
    Ok(kept)
}

/// Detaches the fast path's programs from every interface and the cgroup, leaving IPVS mode's
/// (set matching, connect-time filters) and every map. `sock`: the connect-time programs to
/// detach. Idempotent; returns what went.
pub fn detach_fast_path(pin_dir: &Path, sock: &[&str]) -> Vec<String> {
    let mut removed = Vec::new();
    for (iface, hook) in attached_links(pin_dir) {
        let fast = match hook {
            Hook::Xdp | Hook::TcUplink | Hook::TcIngress6 | Hook::TcEgress | Hook::TcDrain => true,
            Hook::Cgroup => sock.contains(&iface.as_str()),
            Hook::TcIngress => false,
        };
        if fast && detach(pin_dir, &iface, hook).is_ok() {
            removed.push(format!("{} {iface}", hook.tag()));
        }
    }
    // Kernels before TCX: the TC filters (no pins).
    removed.extend(detach_tc_filters(TcAttachType::Ingress, prog_names::TC_INGRESS));
    removed.extend(detach_tc_filters(TcAttachType::Ingress, prog_names::TC_INGRESS6));
    removed.extend(detach_tc_filters(TcAttachType::Ingress, prog_names::TC_UPLINK));
    removed.extend(detach_tc_filters(TcAttachType::Egress, prog_names::TC_EGRESS));
    removed
}

/// Kernels before TCX: removes the TC filters running program `name` at `at` from every
/// interface. Returns what went.
pub fn detach_tc_filters(at: TcAttachType, name: &str) -> Vec<String> {
    crate::host::netif::interfaces()
        .into_iter()
        .filter(|iface| tc::qdisc_detach_program(iface, at, name).is_ok())
        .map(|iface| format!("tc filter {name} on {iface}"))
        .collect()
}
