//! The real kernel side: loading the embedded object with pinned maps, and removing the pins.
//! The maps' capacities (sizes at load, checks of pinned maps) are kernel/capacity.rs;
//! attaching the programs with pinned links kernel/links.rs; earlier releases' maps at load
//! (removed, or carried over) kernel/retired.rs; the maps' aya implementations, opened from
//! their pins, are kernel_maps.rs.
use std::{
    io,
    path::{Path, PathBuf},
};

use aya::{
    programs::{links::FdLink, tc::TcAttachType, CgroupAttachMode, CgroupSockAddr, SchedClassifier, SocketFilter, Xdp},
    Ebpf, EbpfLoader,
};
use proxy_common::{prog_names, CtBucket, CtBucket6};

use crate::dataplane::ebpf::{kernel_maps::Hint, maps::MapError};

mod capacity;
mod links;
mod retired;
pub use capacity::{backend_id_limit, capacity_mismatches, capacity_of, lru_evicts_early, map_capacities, max_entries_for, small_lru_maps};
use capacity::{bucket_masks, coarse_hints, sized_maps, LRU_CPU_FREE};
use links::TC_PROGRAMS;
pub use links::{attached_links, detach, detach_fast_path, detach_tc_filters, keep_tc_ingress_for_drain, link_path, Hook};

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

/// The possible CPUs: the embryonic flows' rings have a part for each (CPU ids stay below it).
fn possible_cpus() -> u32 {
    match aya::util::nr_cpus() {
        Ok(n) => n as u32,
        Err((path, err)) => {
            tracing::warn!(path, error = %err, "cannot read the possible CPUs: only CPU 0 remembers its embryonic flows for evictions");
            1
        }
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
        let retired = retired::Retired::take(pin_dir, &caps);
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(pin_dir);
        for (name, n) in sized_maps(&caps) {
            loader.map_max_entries(name, max_entries_for(name, n));
        }
        let masks = bucket_masks(pin_dir, &caps);
        for (global, mask) in &masks {
            loader.override_global(global, mask, true);
        }
        let cpus = possible_cpus();
        let ebpf = loader.load(EBPF_OBJECT).map_err(KernelError::Load)?;
        for (map, capacity, evicts_from) in small_lru_maps(pin_dir, cpus) {
            tracing::warn!(
                map,
                capacity,
                cpus,
                evicts_from,
                "an LRU map this small for this many CPUs evicts live entries before it is full (each CPU keeps up to {LRU_CPU_FREE} free entries of its own): raise its capacity to at least {}",
                LRU_CPU_FREE * cpus * 4
            );
        }
        for (assured, entries, embryonic, embryonic_entries, share) in coarse_hints(pin_dir) {
            tracing::warn!(
                assured,
                entries,
                embryonic,
                embryonic_entries,
                share_when_full = format!("{:.0}%", share * 100.0),
                "the assured table's hint lives in the embryonic table's buckets, too few for it: once the assured table is full, most new flows look it up for their tuples (slower, still correct); raise the embryonic capacity to an eighth of the assured one or more"
            );
        }
        retired.carry_into(&ebpf, pin_dir);
        // Every bit of the assured tables' hints: every lookup happens until the collector has
        // rebuilt them from the tables (programs of an earlier release may have filled those
        // without a word to the hints).
        Hint::<CtBucket>::open(pin_dir)?.fill();
        Hint::<CtBucket6>::open(pin_dir)?.fill();
        Ok(Self { ebpf, pin_dir: pin_dir.into(), tc_program: prog_names::TC_INGRESS, after_fast_path: false })
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
        for name in [prog_names::TC_INGRESS, prog_names::TC_EGRESS, prog_names::TC_INGRESS6, prog_names::TC_UPLINK, prog_names::TC_PASS] {
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

    /// The instructions this kernel's verifier processed for each packet program loaded (it
    /// allows 1,000,000 a program), as `name count, ...`: kpr-bench and the 6.1 guest print it.
    /// A data path change can multiply it and pass on one kernel, fail on another.
    pub fn verifier_work(&self) -> String {
        [prog_names::TC_INGRESS, prog_names::TC_EGRESS, prog_names::TC_INGRESS6, prog_names::TC_IPSET, prog_names::XDP_INGRESS, prog_names::TC_UPLINK]
            .iter()
            .filter_map(|name| {
                let info = self.ebpf.program(name)?.info().ok()?;
                Some(format!("{name} {}", info.verified_instruction_count().map_or("?".to_string(), |n| n.to_string())))
            })
            .collect::<Vec<_>>()
            .join(", ")
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
    use proxy_common::map_names;

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
