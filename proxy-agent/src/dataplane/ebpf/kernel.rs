//! The real kernel side: loading the embedded object with pinned maps, attaching programs with
//! pinned links (so forwarding survives the agent), the maps' capacities, and removing the pins.
//! The maps' aya implementations, opened from their pins, are kernel_maps.rs.
use std::{
    io,
    path::{Path, PathBuf},
};

use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        tc::{self, SchedClassifierLink, TcAttachType},
        xdp::XdpLink,
        CgroupAttachMode, CgroupSockAddr, SchedClassifier, SocketFilter, Xdp, XdpMode,
    },
    util::KernelVersion,
    Ebpf, EbpfLoader,
};
use proxy_common::{map_names, prog_names};

use crate::dataplane::ebpf::maps::MapError;

/// The eBPF object, built by build.rs (see xtask/src/ebpf_build.rs).
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf.o"));

pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("bpffs is not mounted at {0}: run `mount -t bpf bpf {0}` (or mount the host's /sys/fs/bpf into the pod)")]
    NoBpffs(PathBuf),
    #[error("cannot create pin directory {path}: {err}")]
    PinDir { path: PathBuf, err: io::Error },
    #[error("loading the eBPF object failed (missing CAP_BPF/CAP_SYS_ADMIN, or a map pinned by an incompatible build?): {0}")]
    Load(#[source] aya::EbpfError),
    #[error("program {name}: {err}")]
    Program { name: &'static str, err: aya::programs::ProgramError },
    #[error("interface {iface}: {what}: {err}")]
    Attach { iface: String, what: &'static str, err: String },
    #[error(transparent)]
    Map(#[from] MapError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hook {
    TcIngress,
    /// The uplinks' IPv6 ingress (kpr_tc_ingress6): XDP passes IPv6 on to it.
    TcIngress6,
    /// The fast path's second half (masquerade, reverse DNAT), on every interface it runs on.
    TcEgress,
    Xdp,
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
            Hook::Cgroup => "cgroup",
            Hook::TcDrain => "tc_drain",
        }
    }
}

pub use crate::settings::Capacities;

fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
}

/// The loaded fast path: programs loaded, maps pinned under `pin_dir`.
pub struct Datapath {
    ebpf: Ebpf,
    pub pin_dir: PathBuf,
    /// What TC ingress runs: the fast path, or IPVS mode's set matching.
    tc_program: &'static str,
    /// IPVS mode while the fast path drains: on kernels before TCX, the set matching goes
    /// after the fast path's TC filter, which stays.
    after_fast_path: bool,
}

/// The TC filter priority of IPVS mode's set matching behind a draining fast path (whose filter
/// got the kernel's first automatic priority, 49152; lower runs first).
const AFTER_FAST_PATH_PRIORITY: u16 = 0xC001;
/// The TC filter priority of the uplinks' IPv6 program on kernels before TCX: ahead of the
/// automatic ones.
const FIRST_PRIORITY: u16 = 0xBFFF;

/// The backends of an earlier release's hash map (KPR_BE_V2), if it is pinned: they move into
/// the array with their ids, so the next sync takes the ids over (the flows in conntrack and the
/// per-backend counters name them). Ids past the new capacity stay behind: the sync gives their
/// backends new ones. A pinned KPR_BE_V2 is always the newer data (this release unpins it once
/// carried over), so a KPR_BE_V3 beside it is a leftover of an upgrade that a rollback undid:
/// it is unpinned, to be made anew. Best effort: without the entries the sync re-ids every
/// backend, as it does after `kpr cleanup`.
fn earlier_backends(pin_dir: &Path, capacity: u32) -> Option<Vec<(u32, proxy_common::Backend)>> {
    let v2 = map_names::BACKENDS_V2;
    if !pin_dir.join(v2).exists() {
        return None;
    }
    if std::fs::remove_file(pin_dir.join(map_names::BACKENDS)).is_ok() {
        tracing::warn!(stale = map_names::BACKENDS, newer = v2, "an older release ran after this one: its backend map replaces the one this release left");
    }
    let read = crate::dataplane::ebpf::kernel_maps::open(pin_dir, v2).and_then(|m| match map_data(&m) {
        Some(d) => crate::dataplane::ebpf::kernel_maps::read_all(v2, d, |(id, b): &(u32, proxy_common::Backend)| *id < capacity && b.is_present()),
        None => Ok(Vec::new()),
    });
    Some(read.unwrap_or_else(|err| {
        tracing::warn!(map = v2, error = %err, "cannot read the earlier backend map: the sync gives every backend a new id");
        Vec::new()
    }))
}

/// The descriptor side of the two kinds the carry-over touches.
fn map_data(m: &aya::maps::Map) -> Option<&aya::maps::MapData> {
    match m {
        aya::maps::Map::Array(d) | aya::maps::Map::HashMap(d) => Some(d),
        _ => None,
    }
}

impl Datapath {
    /// Loads the embedded object. Maps already pinned under `pin_dir` are reused, so the
    /// flows and services of a previous agent stay in force.
    /// Loads the object (maps created or reused from the pins) and the fast path's programs.
    pub fn load(pin_dir: &Path, caps: Capacities) -> Result<Self, KernelError> {
        let mut dp = Self::load_object(pin_dir, caps)?;
        dp.load_fast_path()?;
        Ok(dp)
    }

    /// The object with its maps, no program loaded yet.
    pub fn load_object(pin_dir: &Path, caps: Capacities) -> Result<Self, KernelError> {
        let root = pin_dir.parent().unwrap_or(Path::new(DEFAULT_BPFFS));
        if !is_bpffs(root) && !is_bpffs(pin_dir) {
            return Err(KernelError::NoBpffs(root.into()));
        }
        for dir in [pin_dir.to_path_buf(), pin_dir.join("links")] {
            std::fs::create_dir_all(&dir).map_err(|err| KernelError::PinDir { path: dir.clone(), err })?;
        }
        for (map, have, want) in capacity_mismatches(pin_dir, &caps) {
            tracing::warn!(
                map,
                pinned = have,
                wanted = want,
                "a pinned map keeps its capacity: run `kpr cleanup` on this node (forwarding stops until the agent is back) for the new one to apply"
            );
        }
        let carried = earlier_backends(pin_dir, caps.backends);
        let unpin = |name: &'static str| {
            if std::fs::remove_file(pin_dir.join(name)).is_ok() {
                tracing::info!(map = name, "removed the pin of a map an earlier version used");
            }
        };
        map_names::RETIRED.into_iter().filter(|n| *n != map_names::BACKENDS_V2).for_each(unpin);
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(pin_dir);
        for (name, n) in sized_maps(&caps) {
            loader.map_max_entries(name, n);
        }
        let ebpf = loader.load(EBPF_OBJECT).map_err(KernelError::Load)?;
        let dp = Self { ebpf, pin_dir: pin_dir.into(), tc_program: prog_names::TC_INGRESS, after_fast_path: false };
        if let Some(carried) = carried {
            if !carried.is_empty() {
                dp.carry_backends_over(&carried);
            }
            // Only now: a load that failed leaves it for the next one to carry over.
            unpin(map_names::BACKENDS_V2);
        }
        Ok(dp)
    }

    /// Writes an earlier release's backends (`earlier_backends`) into the new backend array.
    fn carry_backends_over(&self, carried: &[(u32, proxy_common::Backend)]) {
        let Some(map) = self.ebpf.map(map_names::BACKENDS).and_then(map_data) else { return };
        let (ids, backends): (Vec<u32>, Vec<proxy_common::Backend>) = carried.iter().copied().unzip();
        match crate::dataplane::ebpf::bpf_batch::update_batch(map.fd(), &ids, &backends) {
            Ok(()) => tracing::info!(backends = ids.len(), from = map_names::BACKENDS_V2, to = map_names::BACKENDS, "carried the backends and their ids over"),
            Err((i, err)) => {
                tracing::warn!(written = i, of = ids.len(), error = %err, "carrying the earlier backends over failed: the sync gives the rest new ids")
            }
        }
    }

    /// IPVS mode: loads the set-matching TC program (attached instead of the fast path) and the
    /// KUBE-LOOP-BACK match, pinned for the fixed POSTROUTING rule's `-m bpf --object-pinned`.
    pub fn load_ipset(&mut self) -> Result<PathBuf, KernelError> {
        let prog = self.classifier(prog_names::TC_IPSET)?;
        load(prog_names::TC_IPSET, || prog.load())?;
        self.tc_program = prog_names::TC_IPSET;
        let name = prog_names::LOOPBACK;
        let path = self.pin_dir.join(name);
        let prog: &mut SocketFilter = self.program(name)?;
        load(name, || prog.load())?;
        // The rule holds the program it was created with; a new pin serves the next rule.
        let _ = std::fs::remove_file(&path);
        prog.pin(&path).map_err(|e| KernelError::Attach { iface: path.display().to_string(), what: "pin loop-back match", err: e.to_string() })?;
        for name in prog_names::SOCK_IPVS {
            let prog = self.sock_addr(name)?;
            load(name, || prog.load())?;
        }
        Ok(path)
    }

    /// Verifies and loads the eBPF fast path (TC, XDP, connect-time programs).
    pub fn load_fast_path(&mut self) -> Result<(), KernelError> {
        for name in [prog_names::TC_INGRESS, prog_names::TC_EGRESS, prog_names::TC_INGRESS6, prog_names::TC_PASS] {
            let prog = self.classifier(name)?;
            load(name, || prog.load())?;
        }
        for name in [prog_names::XDP_INGRESS, prog_names::XDP_PASS] {
            let prog = self.xdp(name)?;
            load(name, || prog.load())?;
        }
        for name in prog_names::SOCK {
            let prog = self.sock_addr(name)?;
            load(name, || prog.load())?;
        }
        Ok(())
    }

    /// IPVS mode behind a draining fast path: see `after_fast_path`.
    pub fn set_after_fast_path(&mut self, on: bool) {
        self.after_fast_path = on;
    }

    pub fn sock_addr(&mut self, name: &'static str) -> Result<&mut CgroupSockAddr, KernelError> {
        self.program(name)
    }

    /// Attaches the connect-time programs `names` (prog_names::SOCK, or SOCK_IPVS in IPVS mode)
    /// to a cgroup (v2) and pins their links. A link pinned by an earlier agent is replaced
    /// after the new one is attached: for a moment both run, which is harmless (the second sees
    /// a backend address, not a service).
    pub fn attach_cgroup(&mut self, cgroup: &Path, names: &[&'static str]) -> Result<(), KernelError> {
        let fail = |what: &'static str, err: String| KernelError::Attach { iface: cgroup.display().to_string(), what, err };
        let fail_sys = |what: &'static str, e: aya::programs::ProgramError| {
            fail(what, format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default()))
        };
        let dir = std::fs::File::open(cgroup).map_err(|e| fail("open cgroup", e.to_string()))?;
        for &name in names {
            let path = self.pin_dir.join("links").join(format!("cgroup_{name}"));
            let prog = self.sock_addr(name)?;
            let id = prog.attach(&dir, CgroupAttachMode::Single).map_err(|e| fail_sys("attach cgroup program", e))?;
            // (bpf_link on a cgroup always allows several programs; Single is the flags value 0
            // that BPF_LINK_CREATE requires.)
            let link = prog.take_link(id).map_err(|e| fail("take cgroup link", e.to_string()))?;
            let fd = FdLink::try_from(link).map_err(|e| fail("cgroup link is not a bpf_link (kernel < 5.7?)", e.to_string()))?;
            // bpffs refuses '.' in names.
            let tmp = self.pin_dir.join("links").join(format!("new_cgroup_{name}"));
            let _ = std::fs::remove_file(&tmp);
            fd.pin(&tmp).map_err(|e| fail("pin cgroup link", e.to_string()))?;
            std::fs::rename(&tmp, &path).map_err(|e| fail("replace pinned cgroup link", e.to_string()))?;
        }
        Ok(())
    }

    /// A program of the object, as its type.
    fn program<'a, T>(&'a mut self, name: &'static str) -> Result<&'a mut T, KernelError>
    where
        &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
    {
        let p = self.ebpf.program_mut(name).ok_or(KernelError::Program { name, err: aya::programs::ProgramError::UnexpectedProgramType })?;
        p.try_into().map_err(|err| KernelError::Program { name, err })
    }

    pub fn classifier(&mut self, name: &'static str) -> Result<&mut SchedClassifier, KernelError> {
        self.program(name)
    }

    pub fn xdp(&mut self, name: &'static str) -> Result<&mut Xdp, KernelError> {
        self.program(name)
    }

    pub fn socket_filter(&mut self, name: &'static str) -> Result<&mut SocketFilter, KernelError> {
        self.program(name)
    }

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
            Hook::TcIngress | Hook::TcIngress6 | Hook::TcEgress => {
                let (program, attach_type, what) = match hook {
                    Hook::TcIngress => (self.tc_program, TcAttachType::Ingress, "tc ingress"),
                    Hook::TcIngress6 => (prog_names::TC_INGRESS6, TcAttachType::Ingress, "tc ingress (IPv6)"),
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
                // The uplinks' IPv6 program shares the hook with whatever TC ingress runs there
                // (IPVS mode's set matching during a switch): it replaces only itself.
                let ours = |n: &&str| match hook {
                    Hook::TcIngress6 => *n == prog_names::TC_INGRESS6,
                    _ if behind => *n == prog_names::TC_IPSET,
                    _ => *n != prog_names::TC_INGRESS6,
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
                } else if hook == Hook::TcIngress6 {
                    // First on the hook: during a switch from IPVS mode its set matching is
                    // there too, and the new IPv6 flows must be the fast path's, as XDP makes
                    // the IPv4 ones (what is not its own goes on to the next program).
                    let options = if tcx {
                        tc::TcAttachOptions::TcxOrder(aya::programs::LinkOrder::first())
                    } else {
                        tc::TcAttachOptions::Netlink(tc::NlOptions { priority: FIRST_PRIORITY, ..Default::default() })
                    };
                    prog.attach_with_options(iface, attach_type, options)
                } else {
                    prog.attach(iface, attach_type)
                }
                .map_err(|e| fail(what, e.to_string()))?;
                let link = prog.take_link(id).map_err(|e| fail("take tc link", e.to_string()))?;
                match FdLink::try_from(link) {
                    Ok(fd) => {
                        fd.pin(&path).map_err(|e| fail("pin tc link", e.to_string()))?;
                    }
                    // Netlink-attached filters (kernels < 6.6) outlive the process by themselves.
                    Err(_) => {}
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

    pub fn ebpf(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

/// Loads a program, again if the verifier was interrupted: it gives up with EAGAIN when a signal
/// arrives while it works (a long program, a busy node), and the kernel means "try again".
fn load(name: &'static str, mut load: impl FnMut() -> Result<(), aya::programs::ProgramError>) -> Result<(), KernelError> {
    let mut interrupted = 0;
    loop {
        match load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. }) if io_error.raw_os_error() == Some(libc::EAGAIN) && interrupted < 5 => {
                interrupted += 1;
                tracing::debug!(program = name, interrupted, "the verifier was interrupted; loading again");
            }
            r => return r.map_err(|err| KernelError::Program { name, err }),
        }
    }
}

/// Every TC program kpr attaches (what a cleanup removes from pre-TCX kernels' filters).
const TC_PROGRAMS: [&str; 4] = [prog_names::TC_INGRESS, prog_names::TC_INGRESS6, prog_names::TC_EGRESS, prog_names::TC_IPSET];

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
        if hook == Hook::TcIngress {
            std::fs::rename(link_path(pin_dir, &iface, Hook::TcIngress), link_path(pin_dir, &iface, Hook::TcDrain))?;
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
            Hook::Xdp | Hook::TcIngress6 | Hook::TcEgress | Hook::TcDrain => true,
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

/// Removes everything the agent created under `pin_dir` and on this namespace's interfaces:
/// TC filters (kernels before TCX, 6.6, attach TC programs as netlink filters, which no pin
/// holds), then links (detaching the programs), then maps. Idempotent.
pub fn cleanup(pin_dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for name in TC_PROGRAMS {
        for at in [TcAttachType::Ingress, TcAttachType::Egress] {
            removed.extend(detach_tc_filters(at, name).into_iter().map(PathBuf::from));
        }
    }
    removed.extend(unpin_all(pin_dir)?);
    Ok(removed)
}

/// The maps whose capacity the settings give, with it.
fn sized_maps(caps: &Capacities) -> [(&'static str, u32); 9] {
    [
        (map_names::SERVICES, caps.services),
        (map_names::RR_STATE, caps.services),
        (map_names::BACKENDS, caps.backends),
        (map_names::BACKEND_NEW, caps.backends),
        (map_names::BACKEND_ACTIVE, caps.backends),
        (map_names::SLOTS, caps.slots),
        (map_names::CONNTRACK, caps.conntrack),
        (map_names::CONNTRACK_NEW, caps.conntrack_new),
        (map_names::AFFINITY, caps.affinity),
    ]
}

/// The maps indexed by backend id: the backends and their per-backend counters.
const BY_BACKEND_ID: [&str; 3] = [map_names::BACKENDS, map_names::BACKEND_NEW, map_names::BACKEND_ACTIVE];

/// How many backend ids the pinned maps hold (at most `wanted`): each map indexed by backend id
/// keeps its capacity when it is pinned (a larger setting applies after `kpr cleanup`), and an
/// upgrade may have replaced one of them at the new size while the others stayed, so the ids
/// stay below the smallest. A count past an array's end would be dropped without a word.
pub fn backend_id_limit(pin_dir: &Path, wanted: u32) -> u32 {
    BY_BACKEND_ID.iter().filter_map(|name| aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok()).fold(wanted, |limit, info| limit.min(info.max_entries()))
}

/// Each pinned map's capacity (max_entries), for `kpr_map_capacity`.
pub fn map_capacities(pin_dir: &Path) -> Vec<(&'static str, u32)> {
    map_names::ALL
        .iter()
        .chain(map_names::SETS.iter())
        .filter_map(|name| aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok().map(|i| (*name, i.max_entries())))
        .collect()
}

/// The maps whose pinned copy holds a different capacity than the settings ask for: a pinned
/// map keeps its size (the object reuses it), so such a change needs `kpr cleanup` first. A
/// larger one that allocates per entry (BPF_F_NO_PREALLOC) costs nothing and is left out
/// (earlier releases made the services map twice the service ids).
pub fn capacity_mismatches(pin_dir: &Path, caps: &Capacities) -> Vec<(&'static str, u32, u32)> {
    sized_maps(caps)
        .into_iter()
        .filter_map(|(name, want)| {
            let info = aya::maps::MapInfo::from_pin(pin_dir.join(name)).ok()?;
            let have = info.max_entries();
            let harmless = have > want && info.map_flags() & proxy_common::BPF_F_NO_PREALLOC != 0;
            (have != want && !harmless).then_some((name, have, want))
        })
        .collect()
}

/// Detaches and unpins every link, and unpins every map, under `pin_dir` (interfaces
/// untouched). Idempotent.
pub fn unpin_all(pin_dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for sub in [pin_dir.join("links"), pin_dir.to_path_buf()] {
        let Ok(rd) = std::fs::read_dir(&sub) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_file() || p.is_symlink() || !p.is_dir() {
                if sub.ends_with("links") {
                    // Now, not when the kernel gets round to freeing the pin's inode.
                    let _ = crate::dataplane::ebpf::bpf_batch::detach_pinned_link(&p);
                }
                std::fs::remove_file(&p)?;
                removed.push(p);
            }
        }
    }
    for dir in [pin_dir.join("links"), pin_dir.to_path_buf()] {
        match std::fs::remove_dir(&dir) {
            Ok(()) => removed.push(dir),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// CLOCK_MONOTONIC in ns: the clock of bpf_ktime_get_ns.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The cgroup v2 root: /sys/fs/cgroup on unified hierarchies, /sys/fs/cgroup/unified on hybrid ones.
pub fn cgroup2_root() -> Option<PathBuf> {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"].iter().map(PathBuf::from).find(|p| {
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == CGROUP2_SUPER_MAGIC }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Retired pins are removed at every load: a name in use there would unpin a live map.
    #[test]
    fn no_retired_map_name_is_in_use() {
        let in_use: Vec<&str> = map_names::ALL.iter().chain(map_names::SETS.iter()).copied().collect();
        for name in map_names::RETIRED {
            assert!(!in_use.contains(&name), "{name} is retired and in use");
            assert!(!EBPF_OBJECT.windows(name.len()).any(|w| w == name.as_bytes()), "{name} is retired but in the eBPF object");
        }
    }
}
