//! eBPF mode's `Dataplane`: the fast path's programs on the node's interfaces and cgroup, its
//! maps synced by difference, and the collectors' thread (collector.rs) it starts and feeds.
use std::{
    collections::{BTreeSet, HashMap},
    path::PathBuf,
    sync::{mpsc, Arc, Mutex},
    time::Duration,
};

use proxy_common::{user::addr_words, DatapathConfig, CFG_F_LOCAL_BY_IFACE, CFG_F_MASQUERADE_ALL, CFG_F_NO_LOCAL_DETECTOR};
use tracing::{error, info, warn};

use crate::{
    dataplane::{
        ebpf::{
            collector::{self, GcMessage},
            conntrack::Timeouts,
            interfaces::Interfaces,
            kernel::{self, Datapath},
            kernel_maps::KernelMaps,
            maps::{DatapathMaps, MapError},
            masquerade6,
            outlier::{self, Outliers},
            sync::{MapsRead, SyncError, Syncer},
        },
        Dataplane, DataplaneError, NodeContext, PreviousProxy, SyncStats,
    },
    host::{
        netfilter::SystemNetfilter,
        netif,
        sysctl::{self, ProcSysctls, Sysctls},
    },
    model::{DesiredState, Frontend, FrontendKey, Ipv6Reach, Protocol},
    settings::{DetectLocal, Mode, Settings},
    stats::SharedStats,
};

/// How long an ejected backend is first left out (doubled when it is ejected again soon after).
const OUTLIER_EJECTION_TIME: Duration = Duration::from_secs(10);

pub struct EbpfPlane {
    dp: Datapath,
    maps: KernelMaps,
    syncer: Syncer,
    interfaces: Interfaces,
    config: ConfigInputs,
    /// The collector's inbox.
    gc: Option<mpsc::Sender<GcMessage>>,
    /// The maximum connection ages last sent to the collector.
    max_ages: HashMap<u32, u32>,
    /// Frontends with a maximum connection age (kpr.io/max-connection-age), in seconds.
    max_age_frontends: HashMap<FrontendKey, u32>,
    /// Backends ejected by the collector's outlier detection.
    outliers: Arc<Mutex<Outliers>>,
    /// After a switch from IPVS mode or kube-proxy: the connections it carries, left to it
    /// until they end.
    handover: Option<Box<dyn PreviousProxy>>,
    /// While handing over: the TCP Services' (address, port) at the last sync.
    tcp_frontends: BTreeSet<(std::net::IpAddr, u16)>,
    stats: SharedStats,
    /// The maps read on a thread of their own while the API server lists, for the first sync.
    read_ahead: Option<std::thread::JoinHandle<Result<MapsRead, MapError>>>,
    /// IPv6 is served with the connect-time programs attached (`--cgroup`: they alone serve
    /// IPv6 clusterIPs); its NodePorts, externalIPs and LB IPs also need the IPv6 masquerade
    /// rule (masquerade6).
    ipv6: Ipv6Reach,
    /// Whether the collector was told to rebuild the assured tables' hints: once every packet
    /// program is this agent's (Interfaces::all_attached_by_this_agent).
    hint_rebuild_requested: bool,
}

/// What KPR_CFG is made of. Both modes write it: IPVS mode's programs read the local-client
/// test (CIDR or interface), masqueradeAll and the namespace cookie.
pub struct ConfigInputs {
    masquerade_all: bool,
    detect_local: DetectLocal,
    /// detectLocalMode ClusterCIDR's CIDRs, at most one per family.
    cluster_cidrs: Vec<ipnet::IpNet>,
    snat_ip: Option<std::net::IpAddr>,
    timeouts: Timeouts,
    /// Masquerade source ports (see sysctl::snat_port_range).
    snat_ports: (u16, u16),
    /// This namespace's cookie: connect-time balancing is for its sockets only.
    host_netns_cookie: u64,
}

impl ConfigInputs {
    pub fn new(s: &Settings, timeouts: Timeouts) -> Self {
        Self {
            masquerade_all: s.masquerade_all,
            detect_local: s.detect_local.clone(),
            cluster_cidrs: s.cluster_cidrs.clone(),
            snat_ip: s.snat_ip,
            timeouts,
            snat_ports: masquerade_ports(),
            host_netns_cookie: host_netns_cookie(),
        }
    }

    /// The fast path needs a masquerade address; IPVS mode (which masquerades in netfilter)
    /// does not.
    pub fn config(&self, node: &NodeContext, need_snat: bool) -> Result<DatapathConfig, DataplaneError> {
        // The fast path masquerades IPv4 only.
        let snat = self.snat_ip.or(node.primary_ip).or_else(|| node.nodeport_addresses.iter().find(|a| a.is_ipv4()).copied());
        if snat.is_none() && need_snat {
            return Err(DataplaneError::NoNodeAddress);
        }
        let local_cidrs: &[ipnet::IpNet] = match self.detect_local {
            DetectLocal::ClusterCidr => &self.cluster_cidrs,
            DetectLocal::NodeCidr => &node.pod_cidrs,
            DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => &[],
        };
        let of_family = |v4: bool| match local_cidrs.iter().find(|n| n.addr().is_ipv4() == v4) {
            Some(net) => (addr_words(net.network()), u32::from(net.prefix_len())),
            None => ([0; 4], 0),
        };
        let ((cidr, len), (cluster_cidr6, len6)) = (of_family(true), of_family(false));
        // The pod interfaces' traffic is IPv4 (IPv6 from pods is balanced at connect time).
        let no_detector = !self.detect_local.by_interface() && len == 0;
        Ok(DatapathConfig {
            snat_addr: snat.map(addr_words).unwrap_or_default(),
            cluster_cidr: cidr,
            cluster_cidr_len: len,
            cluster_cidr6,
            cluster_cidr6_len: len6,
            flags: if self.masquerade_all { CFG_F_MASQUERADE_ALL } else { 0 }
                | if self.detect_local.by_interface() { CFG_F_LOCAL_BY_IFACE } else { 0 }
                | if no_detector { CFG_F_NO_LOCAL_DETECTOR } else { 0 },
            ct_tcp_timeout_s: self.timeouts.tcp,
            ct_udp_timeout_s: self.timeouts.udp,
            snat_port_min: self.snat_ports.0,
            snat_port_max: self.snat_ports.1,
            host_netns_cookie: self.host_netns_cookie,
        })
    }
}

impl EbpfPlane {
    /// Loads the fast path (reusing the maps pinned under `pin_dir`), attaches connect-time
    /// balancing and starts the collector.
    /// `previous`: what a switch from another proxy leaves to it (dataplane::handover), asked
    /// before the programs attach.
    pub fn start(
        s: &Settings,
        pin_dir: PathBuf,
        cgroup: Option<PathBuf>,
        stats: SharedStats,
        previous: impl FnOnce(&mut dyn DatapathMaps) -> Option<Box<dyn PreviousProxy>>,
    ) -> Result<Self, DataplaneError> {
        let mut dp = Datapath::load_object(&pin_dir, s.capacities)?;
        dp.load_fast_path()?;
        if let Some(cg) = &cgroup {
            dp.attach_cgroup(cg, &proxy_common::prog_names::SOCK)?;
            info!(cgroup = %cg.display(), "connect-time balancing attached");
        }
        let mut maps = KernelMaps::open(&pin_dir)?;
        // Before the programs attach: IPVS's connections must pass through from the first packet.
        let handover = previous(&mut maps);
        // Nothing but the syncer writes what this reads (the handover sets a config flag; the
        // collector writes conntrack and per-backend counts): read now, while the API server
        // lists, not after.
        let read_ahead = {
            let pin_dir = pin_dir.clone();
            std::thread::Builder::new().name("kpr-read".into()).spawn(move || KernelMaps::open(&pin_dir).and_then(|m| MapsRead::read(&m))).ok()
        };
        let timeouts = Timeouts::from_settings(&s.conntrack);
        let outliers = Arc::new(Mutex::new(Outliers::new(OUTLIER_EJECTION_TIME)));
        let gc = collector::start(pin_dir.clone(), timeouts, stats.clone(), outliers.clone());
        let config = ConfigInputs::new(s, timeouts);
        let ipv6 = match &cgroup {
            None => Ipv6Reach::None,
            Some(_) => match masquerade6::install(&mut SystemNetfilter, config.snat_ports) {
                Ok(()) => Ipv6Reach::AllWithoutFlowFeatures,
                Err(e) => {
                    error!(error = %e, "the IPv6 masquerade rule (ip6tables) could not be installed: IPv6 clusterIPs are served at connect time, IPv6 NodePorts, externalIPs and LB IPs are reported, not served");
                    Ipv6Reach::ClusterIps
                }
            },
        };
        // Not set here: on a node that learns its IPv6 routes from router advertisements,
        // turning forwarding on stops accepting them (accept_ra 1). The node's provisioning
        // decides; without it the IPv6 packet path's DNATed packets are not forwarded.
        if ipv6.serves_external() && ProcSysctls.get("net.ipv6.conf.all.forwarding").is_ok_and(|v| v.trim() != "1") {
            warn!("net.ipv6.conf.all.forwarding is off: IPv6 NodePorts, externalIPs and LB IPs reach no backend until it is on");
        }
        let backend_ids = kernel::backend_id_limit(&pin_dir, s.capacities.backends);
        Ok(Self {
            dp,
            maps,
            syncer: Syncer::new(s.capacities.services, backend_ids, proxy_common::limits::MAGLEV_ROWS),
            interfaces: Interfaces::new(s, pin_dir, true),
            config,
            gc,
            max_ages: HashMap::new(),
            max_age_frontends: HashMap::new(),
            outliers,
            handover,
            tcp_frontends: BTreeSet::new(),
            stats,
            read_ahead,
            ipv6,
            hint_rebuild_requested: false,
        })
    }
}

impl Dataplane for EbpfPlane {
    fn mode(&self) -> Mode {
        Mode::Ebpf
    }

    fn ends_old_connections(&self) -> bool {
        true
    }

    fn programs_ipv6(&self) -> Ipv6Reach {
        self.ipv6
    }

    fn ejects_outliers(&self) -> bool {
        true
    }

    /// At once when the set of ejected backends changed.
    fn full_sync_within(&self) -> Option<Duration> {
        self.outliers.lock().unwrap().has_changed().then_some(Duration::ZERO)
    }

    fn reconcile_interfaces(&mut self) {
        if let Some(h) = &mut self.handover {
            if h.poll(&mut self.maps, &self.tcp_frontends).record(&self.stats.lock().unwrap().m.handover_connections) {
                self.handover = None;
            }
        }
        if self.interfaces.reconcile(&mut self.dp, &mut self.maps) {
            sysctl::apply(&mut ProcSysctls, &sysctl::FAST_PATH_SYSCTLS);
        }
        if !self.hint_rebuild_requested && self.interfaces.all_attached_by_this_agent() {
            if let Some(gc) = &self.gc {
                let _ = gc.send(GcMessage::RebuildHints);
            }
            self.hint_rebuild_requested = true;
        }
    }

    fn sync(&mut self, desired: &DesiredState, node: &NodeContext, touched: Option<&BTreeSet<FrontendKey>>) -> Result<SyncStats, DataplaneError> {
        let mut config = self.config.config(node, true)?;
        if self.handover.is_some() {
            config.flags |= proxy_common::CFG_F_HANDOVER;
            if touched.is_none() {
                self.tcp_frontends = desired.frontends.keys().filter(|k| k.proto == Protocol::Tcp).map(|k| (k.ip, k.port)).collect();
            }
        }
        // Ejected backends leave the frontends of Services that opt in. A change of the set
        // comes with a full sync (full_sync_within), so an incremental one sees the same set.
        let ejected = {
            let mut o = self.outliers.lock().unwrap();
            if touched.is_none() {
                o.take_changed();
            }
            o.ejected().clone()
        };
        let (left_out, ejected_events) = outlier::leave_out(desired, &ejected);
        self.syncer.set_overrides(left_out);
        if let Some(reading) = self.read_ahead.take() {
            match reading.join() {
                Ok(Ok(read)) => self.syncer.set_read_ahead(read),
                // The sync reads the maps itself.
                Ok(Err(e)) => warn!(error = %e, "reading the maps ahead of the first sync failed"),
                Err(_) => warn!("the thread reading the maps ahead of the first sync panicked"),
            }
        }
        let r = match touched {
            None => self.syncer.sync(&mut self.maps, desired, config),
            Some(t) => self.syncer.sync_subset(&mut self.maps, desired, config, t),
        };
        let st = r.map_err(|e| match e {
            SyncError::Map(m) => DataplaneError::Map(m),
        })?;
        if let (Some(gc), false) = (&self.gc, st.removed.is_empty()) {
            let _ = gc.send(GcMessage::Removed(st.removed));
        }
        track_max_ages(&mut self.max_age_frontends, desired, touched);
        let max_ages: HashMap<u32, u32> = self.max_age_frontends.iter().filter_map(|(k, age)| Some((self.syncer.service_id(k)?, *age))).collect();
        if max_ages != self.max_ages {
            if let Some(gc) = &self.gc {
                let _ = gc.send(GcMessage::MaxAges(max_ages.clone()));
            }
            self.max_ages = max_ages;
        }
        // Read once a sync: the Node's Event for connections dropped without a SNAT port.
        let snat_no_port = self.maps.counters().ok().and_then(|c| c.get(proxy_common::counter::SNAT_NO_PORT as usize).copied()).unwrap_or(0);
        Ok(SyncStats { ejected: ejected_events, snat_no_port, ..st.plane })
    }
}

/// Keeps `ages` (frontend -> its maximum connection age) equal to the desired state's, by key:
/// a removed frontend's service id is gone after the sync. A full sync (`touched` None) reads
/// every frontend, an incremental one its touched frontends alone.
fn track_max_ages(ages: &mut HashMap<FrontendKey, u32>, desired: &DesiredState, touched: Option<&BTreeSet<FrontendKey>>) {
    let age = |f: &Frontend| Some(f.max_connection_age_s).filter(|s| *s > 0);
    match touched {
        None => *ages = desired.frontends.iter().filter_map(|(k, f)| Some((*k, age(f)?))).collect(),
        Some(t) => {
            for k in t {
                match desired.frontends.get(k).and_then(age) {
                    Some(age) => ages.insert(*k, age),
                    None => ages.remove(k),
                };
            }
        }
    }
}

/// The node's network namespace cookie, for connect-time balancing of its own processes only.
fn host_netns_cookie() -> u64 {
    netif::netns_cookie().unwrap_or_else(|| {
        warn!("the kernel has no SO_NETNS_COOKIE (Linux < 5.14): connect-time balancing applies to pods' sockets too, with the node's address for their affinity and source ranges");
        0
    })
}

/// The masquerade port range for this node (its namespace's ephemeral range decides).
fn masquerade_ports() -> (u16, u16) {
    let local = ProcSysctls.get("net.ipv4.ip_local_port_range").unwrap_or_default();
    match sysctl::snat_port_range(&local) {
        Some(r) => {
            info!(ephemeral = %local, snat_ports = %format!("{}-{}", r.0, r.1), "masquerade source ports");
            r
        }
        None => {
            let r = (proxy_common::SNAT_PORT_MIN, proxy_common::SNAT_PORT_MAX);
            warn!(ephemeral = %local, snat_ports = %format!("{}-{}", r.0, r.1), "net.ipv4.ip_local_port_range leaves no 4096 ports outside it and the NodePort range for masquerade: using the default range, which the node's own connections may also use");
            r
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FrontendKind, Scope};

    #[test]
    fn maximum_ages_follow_full_and_incremental_syncs() {
        let key = |ip: &str| FrontendKey { ip: ip.parse().unwrap(), port: 80, proto: Protocol::Tcp, scope: Scope::Internal };
        let aged = |s: u32| Frontend { max_connection_age_s: s, ..Frontend::for_test(FrontendKind::ClusterIp, &[("10.244.1.2", 8080)], Protocol::Tcp) };
        let mut d = DesiredState::default();
        d.frontends.insert(key("10.96.0.1"), aged(600));
        d.frontends.insert(key("10.96.0.2"), aged(0));
        d.frontends.insert(key("10.96.0.3"), aged(60));
        let mut ages = HashMap::new();
        track_max_ages(&mut ages, &d, None);
        assert_eq!(ages, [(key("10.96.0.1"), 600), (key("10.96.0.3"), 60)].into());
        // An incremental sync: one gets an age, one loses it, one goes; the same as a full one.
        d.frontends.insert(key("10.96.0.2"), aged(30));
        d.frontends.insert(key("10.96.0.1"), aged(0));
        d.frontends.remove(&key("10.96.0.3"));
        let touched: BTreeSet<FrontendKey> = [key("10.96.0.1"), key("10.96.0.2"), key("10.96.0.3")].into();
        track_max_ages(&mut ages, &d, Some(&touched));
        assert_eq!(ages, [(key("10.96.0.2"), 30)].into());
        let mut full = HashMap::new();
        track_max_ages(&mut full, &d, None);
        assert_eq!(ages, full);
    }
}
