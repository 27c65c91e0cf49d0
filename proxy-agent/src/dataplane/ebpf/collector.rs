//! eBPF mode's collectors on their own thread: the conntrack collector (one bounded round of
//! each table every GC_INTERVAL, IPv6's embryonic table too), outlier detection from what its
//! rounds observe, the active-flow counts for least-connection and P2C, the rebuild of the
//! assured tables' hints (a batch of each a round), the affinity collector, and at once the
//! cleanup of endpoints that left their service (sent by the syncs).
use std::{
    collections::{BTreeSet, HashMap},
    path::PathBuf,
    sync::{atomic::Ordering, mpsc, Arc, Mutex},
    time::{Duration, Instant},
};

use proxy_common::{CtBucket, CtBucket6};
use tracing::{error, info, warn};

use crate::{
    dataplane::ebpf::{
        affinity_gc::AffinityGc,
        conntrack::{Gc, Timeouts},
        conntrack6::Gc6,
        endpoint_cleanup,
        hint::{PassBatch, Rebuild},
        kernel,
        kernel_maps::{
            Hint, HintedFamily, KernelAssured, KernelBackendLoads, KernelBackendNames, KernelConntrack, KernelEmbryonic6, KernelFailureCounts, KernelSockRev,
        },
        maps::write_loads,
        outlier::{self, Outliers},
        sync::RemovedBackend,
    },
    netlink::{ctnetlink::NetlinkConntrack, sockdiag::NetlinkSockets},
    stats::SharedStats,
    STOP,
};

/// The conntrack collector reads at most this many entries of each table per round...
const GC_BATCH: usize = 16_384;
/// ...every this often: a full pass over 524,288 entries takes about 8 s.
const GC_INTERVAL: Duration = Duration::from_millis(250);
/// A pass over a table starts at most this often. A sparse assured table's pass is one round,
/// one system call walking every bucket without a break (about 1 ms on the CI machine, 7 ms in
/// the emulated guest, where it showed in connections' p99 when it ran every round): once a
/// second instead. Not longer: a flow's maximum age counts from the pass that first sees it.
const GC_PASS_EVERY: Duration = Duration::from_secs(1);
/// Rounds between two clears of a hint's half once it was rebuilt whole (5 s): a clear writes
/// every embryonic bucket's lock line, and a small table's pass is one round. A key gone
/// loses its bits within two passes, about 10 s then.
const HINT_REST_ROUNDS: u32 = 20;

/// What a sync tells the collector.
pub(super) enum GcMessage {
    /// Endpoints whose flows go at once.
    Removed(BTreeSet<RemovedBackend>),
    /// Maximum connection age (seconds) by service id, for every Service that has one.
    MaxAges(HashMap<u32, u32>),
    /// Every packet program is this agent's: the assured tables' hints may be rebuilt (until
    /// then a program of an earlier agent may fill a table without setting their bits).
    RebuildHints,
}

/// The conntrack collector's thread: one bounded round every GC_INTERVAL, and at once the
/// cleanup of endpoints that left their service (sent by the syncs).
pub(super) fn start(pin_dir: PathBuf, timeouts: Timeouts, stats: SharedStats, outliers: Arc<Mutex<Outliers>>) -> Option<mpsc::Sender<GcMessage>> {
    let (tx, rx) = mpsc::channel::<GcMessage>();
    let spawned = std::thread::Builder::new().name("kpr-gc".into()).spawn(move || {
        let (mut tables, balanced) = match (KernelConntrack::open(&pin_dir), KernelSockRev::open(&pin_dir)) {
            (Ok(t), Ok(b)) => (t, b),
            (Err(e), _) | (_, Err(e)) => return error!(error = %e, "conntrack collector cannot open its maps; idle flows are not collected"),
        };
        let mut kernel_ct = NetlinkConntrack::connect()
            .map_err(|e| warn!(error = %e, "no ctnetlink: kernel conntrack entries of removed UDP endpoints are left to time out"))
            .ok();
        let mut sockets =
            NetlinkSockets::connect().map_err(|e| warn!(error = %e, "no sock_diag: the node's UDP sockets connected to removed endpoints are not ended")).ok();
        let mut affinity = AffinityGc::new(&pin_dir);
        let mut loads = KernelBackendLoads::open(&pin_dir).map_err(|e| warn!(error = %e, "least-connection and P2C see no flow counts")).ok();
        let mut loads_written: HashMap<u32, u32> = HashMap::new();
        let mut failures = match (KernelFailureCounts::open(&pin_dir), KernelBackendNames::open(&pin_dir)) {
            (Ok(f), Ok(n)) => Some((f, n)),
            (Err(e), _) | (_, Err(e)) => {
                warn!(error = %e, "no outlier detection");
                None
            }
        };
        let mut embryonic6 = KernelEmbryonic6::open(&pin_dir)
            .map_err(|e| warn!(error = %e, "IPv6's embryonic flows are not collected: a table full of flows that never completed admits new IPv6 flows only by eviction"))
            .ok();
        let mut rebuild_hints = false;
        let mut hints = (
            // IPv4's follows the collector's passes over its table (`gc` below); IPv6's reads
            // its own (no collector reads that LRU).
            Hinted::<CtBucket>::open(&pin_dir, false),
            Hinted::<CtBucket6>::open(&pin_dir, true),
        );
        let mut gc6 = Gc6::new(GC_BATCH);
        let mut gc = Gc::new(timeouts, GC_BATCH);
        gc.pass_every_ns = GC_PASS_EVERY.as_nanos() as u64;
        let mut last_affinity = Instant::now();
        while !STOP.load(Ordering::Relaxed) {
            match rx.recv_timeout(GC_INTERVAL) {
                Ok(GcMessage::RebuildHints) => {
                    info!("every packet program is this agent's: the assured tables' hints are rebuilt from now on");
                    rebuild_hints = true;
                    gc.hand_over_assured_keys = hints.0.is_some();
                }
                Ok(GcMessage::MaxAges(ages)) => {
                    info!(services = ages.len(), "frontends with a maximum connection age");
                    gc.set_max_ages(ages);
                }
                Ok(GcMessage::Removed(removed)) => {
                    let handles = endpoint_cleanup::Handles {
                        tables: &mut tables,
                        affinity: &mut affinity,
                        kernel_conntrack: kernel_ct.as_mut().map(|c| c as &mut dyn crate::netlink::ctnetlink::ConntrackFlusher),
                        sockets: sockets.as_mut().map(|s| s as &mut dyn crate::netlink::sockdiag::Sockets),
                        balanced: &balanced,
                    };
                    let r = endpoint_cleanup::endpoints_removed(&removed, &mut gc, handles);
                    info!(
                        endpoints = removed.len(),
                        flows = r.flows,
                        kernel_entries = r.kernel_entries,
                        sockets = r.sockets,
                        affinity = r.affinity,
                        "cleared what held clients to endpoints that left their service"
                    );
                    for e in r.errors {
                        warn!(error = %e, "removed endpoint cleanup");
                    }
                    stats.lock().unwrap().m.gc_flows_total.inc_by(r.flows as u64);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            // One clock reading for the round: both families' tables are judged at one instant.
            let now = kernel::monotonic_ns();
            let mut assured_batch = None;
            match gc.round(&mut tables, now) {
                Ok(mut st) => {
                    assured_batch = Some(std::mem::take(&mut st.assured));
                    if st.flows > 0 || st.aged > 0 {
                        tracing::debug!(read = st.read, flows = st.flows, entries = st.entries, kept = st.kept, aged = st.aged, "collected idle flows");
                    }
                    let s = stats.lock().unwrap();
                    s.m.gc_flows_total.inc_by(st.flows as u64);
                    s.m.max_age_flows_total.inc_by(st.aged as u64);
                    drop(s);
                    if let Some((f, names)) = failures.as_mut() {
                        let mut o = outliers.lock().unwrap();
                        match outlier::round(f, |id| names.get(id), &mut o, &st.syn_timeouts, now) {
                            Ok(new) => {
                                for (b, e) in &new {
                                    warn!(backend = %std::net::SocketAddr::new(b.ip(), b.port_host()), failures = e.failures, seconds = e.for_ns / 1_000_000_000, times = e.times, "outlier ejected: refused or let time out new connections in a row");
                                }
                                stats.lock().unwrap().m.outlier_ejections_total.inc_by(new.len() as u64);
                            }
                            Err(e) => warn!(error = %e, "outlier detection round failed"),
                        }
                    }
                    if let (true, Some(l)) = (st.pass_done, loads.as_mut()) {
                        if let Err(e) = write_loads(l, &mut loads_written, &gc.active_flows()) {
                            warn!(error = %e, "writing the active-flow counts failed");
                        }
                    }
                }
                Err(e) => warn!(error = %e, "conntrack gc round failed"),
            }
            if let Some(t) = embryonic6.as_mut() {
                match gc6.round(t, &gc.timeouts, now) {
                    Ok(flows) => stats.lock().unwrap().m.gc_flows_total.inc_by(flows as u64),
                    Err(e) => warn!(error = %e, "IPv6 embryonic gc round failed"),
                }
            }
            if rebuild_hints {
                if let Some(h) = hints.0.as_mut() {
                    h.follow(assured_batch.as_ref(), &stats);
                }
                if let Some(h) = hints.1.as_mut() {
                    h.round(&stats);
                }
            }
            if last_affinity.elapsed() >= Duration::from_secs(5) {
                if let Err(e) = affinity.collect(kernel::monotonic_ns()) {
                    warn!(error = %e, "affinity gc failed");
                }
                last_affinity = Instant::now();
            }
        }
    });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            error!(error = %e, "cannot start the conntrack collector");
            None
        }
    }
}

/// An assured table's hint and its rebuild (dataplane/ebpf/hint.rs): reading the table itself
/// (`table`: IPv6's), or following the conntrack collector's passes over it (None: IPv4's,
/// which the collector reads every round anyway).
struct Hinted<B: HintedFamily> {
    table: Option<KernelAssured<B::Key, B::AssuredValue>>,
    hint: Hint<B>,
    rebuild: Rebuild,
}

impl<B: HintedFamily> Hinted<B> {
    /// None, with a warning, where a map cannot be opened: the hint keeps every bit it has,
    /// and new flows look the assured table up as often as it says (all of them after a load).
    fn open(pin_dir: &std::path::Path, own_reads: bool) -> Option<Self> {
        let opened = (|| {
            let table = if own_reads { Some(KernelAssured::open(pin_dir, B::ASSURED)?) } else { None };
            Ok::<_, crate::dataplane::ebpf::maps::MapError>(Self { table, hint: Hint::open(pin_dir)?, rebuild: Rebuild::resting(HINT_REST_ROUNDS) })
        })();
        opened
            .map_err(
                |e| warn!(family = B::FAMILY, error = %e, "the assured table's hint is not rebuilt: new flows look the table up for their tuples every time"),
            )
            .ok()
    }

    /// A round of its own reads of the table.
    fn round(&mut self, stats: &SharedStats) {
        let Some(table) = self.table.as_ref() else { return };
        match self.rebuild.round(table, &mut self.hint, GC_BATCH) {
            Ok(rebuilt) => self.report(rebuilt, stats),
            Err(e) => warn!(family = B::FAMILY, error = %e, "a round of the assured table's hint rebuild failed; the next round reads the batch again"),
        }
    }

    /// The conntrack collector's batch of the table this round (None: its round failed).
    fn follow(&mut self, batch: Option<&PassBatch<B::Key>>, stats: &SharedStats) {
        let rebuilt = self.rebuild.follow(&mut self.hint, batch);
        self.report(rebuilt, stats);
    }

    fn report(&self, rebuilt: Option<u32>, stats: &SharedStats) {
        if let Some(half) = rebuilt {
            let s = stats.lock().unwrap();
            s.m.hint_passes_total.with_label_values(&[B::FAMILY]).inc();
            s.m.hint_bits_set.with_label_values(&[B::FAMILY]).set(self.hint.share_set(half));
        }
    }
}
