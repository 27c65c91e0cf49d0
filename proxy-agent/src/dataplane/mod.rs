//! The data planes, one folder per mode, behind one interface (kube-proxy's Proxier per mode):
//! the agent hands a `Dataplane` the desired state, full or per changed frontend, and each mode
//! projects it into its own kernel objects, reading the kernel's state and applying the
//! difference.
//!
//! - `ebpf/`: the fast path: the BPF object's loader, pinned maps and links, sync, views,
//!   collectors. IPVS mode loads the same object for its set-matching programs.
//! - `ipvs/`: the IPVS client, its sync, kube-proxy's sets (as BPF maps) and fixed netfilter
//!   rules, and the `ipvsadm`-like view.
//! - `handover.rs`: a switch between the two on a running node, keeping established
//!   connections.
pub mod ebpf;
pub mod handover;
pub mod ipvs;

use std::{
    collections::BTreeSet,
    net::IpAddr,
    time::{Duration, Instant},
};

use ipnet::IpNet;

use crate::{
    model::{DesiredState, FrontendKey, Ipv6Reach},
    settings::Mode,
};

/// What a data plane needs to know of the node at a sync.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// The addresses NodePorts answer on, both families.
    pub nodeport_addresses: Vec<IpAddr>,
    /// Every address of the node (NodePorts on any of them are kpr's, also those a narrower
    /// nodePortAddresses left behind).
    pub addresses: Vec<IpAddr>,
    /// The node's primary IPv4 address (the fast path's masquerade address where no interface
    /// gives one).
    pub primary_ip: Option<IpAddr>,
    /// The Node's pod CIDRs, one per family (detectLocalMode NodeCIDR).
    pub pod_cidrs: Vec<IpNet>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SyncStats {
    pub frontends: usize,
    pub backends: usize,
    pub writes: usize,
    pub deletes: usize,
    /// Every failure (logged and counted); the other frontends were still programmed.
    pub errors: Vec<String>,
    /// The failures that are one Service's (each also in `errors`), as Events' content.
    pub failed: Vec<crate::model::errors::ObjectError>,
    /// (map, "namespace/name:port") of each frontend that did not fit in a full map.
    pub full: Vec<(&'static str, String)>,
    /// (map, "namespace/name:port") of each frontend programmed in a lesser way because `map`
    /// was full (a Maglev Service balanced at random for want of a row); each also in `failed`.
    pub fallback: Vec<(&'static str, String)>,
    /// Backends left out of Services for now (outlier ejection), as Events' content.
    pub ejected: Vec<crate::model::errors::ObjectError>,
    /// New masqueraded connections the data path dropped for want of a free SNAT port, since
    /// its maps were created (0 where netfilter masquerades).
    pub snat_no_port: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error(transparent)]
    Kernel(#[from] ebpf::kernel::KernelError),
    #[error(transparent)]
    Map(#[from] ebpf::maps::MapError),
    #[error("no address for NodePorts and SNAT: give --node-ip or an uplink with an IPv4 address")]
    NoNodeAddress,
    #[error(transparent)]
    Ipvs(#[from] ipvs::client::IpvsError),
    #[error(transparent)]
    IpvsSync(#[from] ipvs::sync::IpvsSyncError),
    #[error("{0}")]
    Link(#[from] crate::netlink::rtnl::LinkError),
    #[error("installing the fixed netfilter rules (needs iptables with the bpf, ipvs and addrtype matches): {0}")]
    Netfilter(crate::host::netfilter::NetfilterError),
    #[error("mode auto: the eBPF fast path does not load ({fast_path}) and IPVS is not usable ({ipvs})")]
    NoMode { fast_path: String, ipvs: String },
}

/// One mode's data plane.
pub trait Dataplane {
    /// The mode in force.
    fn mode(&self) -> Mode;
    /// Whether it forwards SCTP (IPVS does; the fast path would have to update SCTP's CRC32c
    /// when it rewrites ports, and does not yet).
    fn programs_sctp(&self) -> bool {
        false
    }
    /// Which IPv6 parts of Services it serves (IPVS mode: all; the fast path: clusterIPs, at
    /// connect time, as its packet programs parse IPv4 only).
    fn programs_ipv6(&self) -> Ipv6Reach {
        Ipv6Reach::None
    }
    /// Whether it ends connections past a Service's maximum age (the fast path does).
    fn ends_old_connections(&self) -> bool {
        false
    }
    /// Whether it ejects backends that refuse new connections (the fast path does).
    fn ejects_outliers(&self) -> bool {
        false
    }
    /// Called every second: attach to interfaces that appeared, let go of those that left, keep
    /// what the programs know of each interface current.
    fn reconcile_interfaces(&mut self);
    /// Programs `desired`: everything, repairing drift (`touched` None), or only the touched
    /// frontends' difference from the last sync.
    fn sync(&mut self, desired: &DesiredState, node: &NodeContext, touched: Option<&BTreeSet<FrontendKey>>) -> Result<SyncStats, DataplaneError>;
    /// How soon the next full sync is wanted regardless of syncPeriod (IPVS mode re-checks
    /// draining destinations every few seconds).
    fn full_sync_within(&self) -> Option<Duration> {
        None
    }
}

impl<D: Dataplane + ?Sized> Dataplane for Box<D> {
    fn mode(&self) -> Mode {
        (**self).mode()
    }
    fn programs_sctp(&self) -> bool {
        (**self).programs_sctp()
    }
    fn programs_ipv6(&self) -> Ipv6Reach {
        (**self).programs_ipv6()
    }
    fn ends_old_connections(&self) -> bool {
        (**self).ends_old_connections()
    }
    fn ejects_outliers(&self) -> bool {
        (**self).ejects_outliers()
    }
    fn reconcile_interfaces(&mut self) {
        (**self).reconcile_interfaces()
    }
    fn sync(&mut self, desired: &DesiredState, node: &NodeContext, touched: Option<&BTreeSet<FrontendKey>>) -> Result<SyncStats, DataplaneError> {
        (**self).sync(desired, node, touched)
    }
    fn full_sync_within(&self) -> Option<Duration> {
        (**self).full_sync_within()
    }
}

/// How a handover from the previous mode (or proxy) stands after a poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// This many connections are still the previous one's (u64::MAX: not counted this time).
    Serving(u64),
    /// The previous one's objects are gone.
    Done,
}

impl Progress {
    /// Shows it in `gauge` (an uncounted poll leaves the gauge as it is); true when done.
    pub fn record(self, gauge: &prometheus::IntGauge) -> bool {
        match self {
            Progress::Serving(u64::MAX) => {}
            Progress::Serving(n) => gauge.set(n as i64),
            Progress::Done => gauge.set(0),
        }
        self == Progress::Done
    }
}

/// A handover's time: when it started, how long it may last, when it last counted.
#[derive(Debug)]
pub struct HandoverClock {
    since: Instant,
    limit: Duration,
    last_count: Instant,
}

impl HandoverClock {
    pub fn new(limit: Duration) -> Self {
        Self { since: Instant::now(), limit, last_count: Instant::now() }
    }
    /// Whether a count is due (one per `every`); a due count is taken now.
    pub fn due(&mut self, every: Duration) -> bool {
        let due = self.last_count.elapsed() >= every;
        if due {
            self.last_count = Instant::now();
        }
        due
    }
    /// Past the limit: what the previous one still serves is ended.
    pub fn expired(&self) -> bool {
        self.since.elapsed() >= self.limit
    }
    pub fn elapsed_s(&self) -> u64 {
        self.since.elapsed().as_secs()
    }
    pub fn limit_s(&self) -> u64 {
        self.limit.as_secs()
    }
}

/// What the fast path waits for after a switch from another proxy (handover.rs).
pub trait PreviousProxy {
    /// Called every second; `frontends`: the TCP Services' (address, port) at the last sync.
    fn poll(&mut self, maps: &mut dyn ebpf::maps::DatapathMaps, frontends: &BTreeSet<(IpAddr, u16)>) -> Progress;
}

/// Picks the data plane for `requested`: Auto tries the fast path first, then IPVS. The two
/// starters are passed in, so the choice is tested without a kernel.
pub fn choose<T>(
    requested: Mode,
    ebpf: impl FnOnce() -> Result<T, DataplaneError>,
    ipvs: impl FnOnce() -> Result<T, DataplaneError>,
) -> Result<(Mode, T), DataplaneError> {
    match requested {
        Mode::Ebpf => ebpf().map(|d| (Mode::Ebpf, d)),
        Mode::Ipvs => ipvs().map(|d| (Mode::Ipvs, d)),
        Mode::Auto => match ebpf() {
            Ok(d) => Ok((Mode::Ebpf, d)),
            Err(fast) => match ipvs() {
                Ok(d) => {
                    tracing::warn!(error = %fast, "mode auto: the eBPF fast path does not load on this kernel; using IPVS");
                    Ok((Mode::Ipvs, d))
                }
                Err(e) => Err(DataplaneError::NoMode { fast_path: fast.to_string(), ipvs: e.to_string() }),
            },
        },
    }
}

/// An in-memory data plane for the agent loop's tests: records every sync, and fails the
/// next `fail` of them.
#[derive(Debug, Default)]
pub struct FakeDataplane {
    pub mode: Mode,
    /// (full?, touched frontends, frontends in the desired state) per sync call.
    pub syncs: Vec<(bool, usize, usize)>,
    pub fail: usize,
    pub reconciled: usize,
    pub full_within: Option<Duration>,
    /// Reported by every sync as not fitting in a full map.
    pub full: Vec<(&'static str, String)>,
    /// Reported by every sync as programmed in a lesser way for a full map.
    pub fallback: Vec<(&'static str, String)>,
    /// Reported by every sync as failed writes.
    pub errors: Vec<String>,
    /// Reported by every sync as one Service's failures.
    pub failed: Vec<crate::model::errors::ObjectError>,
    /// Reported by every sync as the data path's SNAT drops.
    pub snat_no_port: u64,
}

impl Dataplane for FakeDataplane {
    fn mode(&self) -> Mode {
        self.mode
    }
    fn reconcile_interfaces(&mut self) {
        self.reconciled += 1;
    }
    fn sync(&mut self, desired: &DesiredState, _node: &NodeContext, touched: Option<&BTreeSet<FrontendKey>>) -> Result<SyncStats, DataplaneError> {
        self.syncs.push((touched.is_none(), touched.map_or(0, BTreeSet::len), desired.frontends.len()));
        if self.fail > 0 {
            self.fail -= 1;
            return Err(DataplaneError::NoNodeAddress);
        }
        Ok(SyncStats {
            frontends: desired.frontends.len(),
            full: self.full.clone(),
            fallback: self.fallback.clone(),
            errors: self.errors.clone(),
            failed: self.failed.clone(),
            snat_no_port: self.snat_no_port,
            ..Default::default()
        })
    }
    fn full_sync_within(&self) -> Option<Duration> {
        self.full_within
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_the_fast_path_and_falls_back_to_ipvs() {
        let ok = |m: Mode| move || -> Result<Mode, DataplaneError> { Ok(m) };
        let no = || -> Result<Mode, DataplaneError> { Err(DataplaneError::NoNodeAddress) };
        assert_eq!(choose(Mode::Auto, ok(Mode::Ebpf), ok(Mode::Ipvs)).unwrap().0, Mode::Ebpf);
        assert_eq!(choose(Mode::Auto, no, ok(Mode::Ipvs)).unwrap().0, Mode::Ipvs);
        assert!(matches!(choose(Mode::Auto, no, no), Err(DataplaneError::NoMode { .. })));
        assert!(choose(Mode::Ebpf, no, ok(Mode::Ipvs)).is_err(), "an explicit mode never falls back");
        assert_eq!(choose(Mode::Ipvs, no, ok(Mode::Ipvs)).unwrap().0, Mode::Ipvs);
    }
}
