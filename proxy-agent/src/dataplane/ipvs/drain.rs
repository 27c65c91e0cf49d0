//! IPVS mode's side of a switch from the eBPF mode that keeps established connections (see
//! dataplane::handover for the whole): the fast path's programs stay attached, flagged
//! CFG_F_NO_NEW_FLOWS, its TC ingress in front of IPVS mode's set matching, until a collector
//! pass finds none of its flows left (or the handover limit passes); then they are detached.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use proxy_common::{prog_names, CFG_F_NO_NEW_FLOWS};
use tracing::{info, warn};

use crate::dataplane::{
    ebpf::{
        conntrack::{Gc, Timeouts},
        kernel::{self, Datapath, Hook},
        kernel_maps::KernelConntrack,
        maps::{set_config_flag, DatapathMaps, MapError},
    },
    HandoverClock, Progress,
};

/// Conntrack entries the drain's collector reads per table per call (one call a second).
const DRAIN_BATCH: usize = 16_384;

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error(transparent)]
    Map(#[from] MapError),
    #[error("keeping the fast path's TC links for the drain: {0}")]
    Pins(std::io::Error),
}

/// IPVS mode's side of a switch from the fast path.
pub struct FastPathDrain {
    pin_dir: PathBuf,
    tables: KernelConntrack,
    gc: Gc,
    clock: HandoverClock,
}

impl FastPathDrain {
    /// At IPVS mode's start: counts the fast path's flows (collecting idle ones). None: there
    /// are none, and whatever of the fast path was attached is detached now.
    pub fn start(pin_dir: &Path, dp: &mut Datapath, maps: &mut dyn DatapathMaps, timeouts: Timeouts, limit: Duration) -> Result<Option<Self>, DrainError> {
        let mut tables = KernelConntrack::open(pin_dir)?;
        let mut gc = Gc::new(timeouts, DRAIN_BATCH);
        let flows = loop {
            gc.round(&mut tables, kernel::monotonic_ns())?;
            if let Some(n) = gc.live_flows() {
                break n;
            }
        };
        if flows == 0 {
            detach_fast_path(pin_dir, dp);
            set_config_flag(maps, CFG_F_NO_NEW_FLOWS, false)?;
            return Ok(None);
        }
        // A restart during the drain finds the links already kept.
        if maps.config().map_or(true, |c| c.flags & CFG_F_NO_NEW_FLOWS == 0) {
            kernel::keep_tc_ingress_for_drain(pin_dir).map_err(DrainError::Pins)?;
            set_config_flag(maps, CFG_F_NO_NEW_FLOWS, true)?;
        }
        for name in [prog_names::CONNECT4, prog_names::SENDMSG4] {
            if let Err(e) = kernel::detach(pin_dir, name, Hook::Cgroup) {
                warn!(program = name, error = %e, "detaching the fast path's connect-time program: the node's own connections stay balanced by it");
            }
        }
        dp.set_after_fast_path(true);
        info!(flows, limit_s = limit.as_secs(), "switch from the eBPF fast path: it keeps serving its flows; IPVS takes every new connection");
        Ok(Some(Self { pin_dir: pin_dir.into(), tables, gc, clock: HandoverClock::new(limit) }))
    }

    /// One collector round; once a pass finds no flow left (or the limit passed), the fast
    /// path's programs are detached.
    pub fn poll(&mut self, dp: &mut Datapath, maps: &mut dyn DatapathMaps) -> Progress {
        if let Err(e) = self.gc.round(&mut self.tables, kernel::monotonic_ns()) {
            warn!(error = %e, "drain: conntrack round failed");
        }
        let flows = self.gc.live_flows().map_or(u64::MAX, |n| n as u64);
        let expired = self.clock.expired();
        if flows > 0 && !expired {
            return Progress::Serving(flows);
        }
        if expired {
            warn!(flows, "drain: the fast path's remaining flows outlived the handover limit; detaching it ends them");
        }
        detach_fast_path(&self.pin_dir, dp);
        if let Err(e) = set_config_flag(maps, CFG_F_NO_NEW_FLOWS, false) {
            warn!(error = %e, "drain: clearing the flag (the next sync retries)");
        }
        info!(seconds = self.clock.elapsed_s(), "switch from the eBPF fast path done: its flows ended, its programs are detached");
        Progress::Done
    }
}

fn detach_fast_path(pin_dir: &Path, dp: &mut Datapath) {
    let removed = kernel::detach_fast_path(pin_dir, &prog_names::SOCK);
    if !removed.is_empty() {
        info!(detached = ?removed, "the eBPF fast path's programs");
    }
    dp.set_after_fast_path(false);
}
