//! IPVS mode's `Dataplane`: virtual servers and destinations over netlink, kube-ipvs0's
//! addresses, kube-proxy's sets as BPF maps read by the set-matching program, and a handful
//! of fixed netfilter rules.
use std::{collections::BTreeSet, net::IpAddr, path::PathBuf, time::Duration};

use tracing::{info, warn};

use crate::{
    dataplane::{
        ebpf::{
            conntrack::Timeouts as FlowTimeouts, interfaces::Interfaces, kernel::Datapath, kernel_maps::KernelMaps, maps::DatapathMaps, plane::ConfigInputs,
        },
        ipvs::drain::FastPathDrain,
        ipvs::{
            client::{Ipvs, IpvsError, NetlinkIpvs, ServiceId, Timeouts},
            desired::{bound_addresses, desired_virtual_servers, SyncSettings},
            rules,
            sets::{self, KernelSetMaps, SetMaps, Sets},
            sync::IpvsSyncer,
        },
        Dataplane, DataplaneError, NodeContext, SyncStats,
    },
    host::{
        netfilter::SystemNetfilter,
        sysctl::{self, ProcSysctls},
    },
    model::{DesiredState, FrontendKey, Ipv6Reach},
    netlink::{
        ctnetlink::{ConntrackFlusher, FakeConntrack, NetlinkConntrack},
        rtnl::NetlinkLinks,
    },
    settings::{Mode, Settings},
    stats::SharedStats,
};

/// Draining destinations (weight 0) are re-checked this often, not every syncPeriod.
const DRAIN_CHECK: Duration = Duration::from_secs(2);

pub struct IpvsPlane {
    dp: Datapath,
    maps: KernelMaps,
    interfaces: Interfaces,
    ipvs: NetlinkIpvs,
    links: NetlinkLinks,
    ct: Option<NetlinkConntrack>,
    syncer: IpvsSyncer,
    sets: KernelSetMaps,
    /// What the set maps hold after the last sync (None: read them at the next one).
    sets_mirror: Option<Sets>,
    config: ConfigInputs,
    terminating: usize,
    stats: SharedStats,
    /// The IPv6 netfilter rules are in place: IPv6 Services are served.
    ipv6: bool,
    /// After a switch from the eBPF mode: the fast path's flows, served until they end.
    drain: Option<FastPathDrain>,
}

/// Opens IPVS, loading the module first if the kernel has it as one.
pub fn connect_ipvs() -> Result<NetlinkIpvs, IpvsError> {
    match NetlinkIpvs::connect() {
        Err(IpvsError::NoIpvs) => {
            let _ = std::process::Command::new("modprobe").arg("ip_vs").status();
            NetlinkIpvs::connect()
        }
        r => r,
    }
}

impl IpvsPlane {
    /// One-time setup: the netlink handles, the set-matching programs and fixed rules, the
    /// proxier's sysctls, the timeouts.
    pub fn start(s: &Settings, pin_dir: PathBuf, cgroup: Option<PathBuf>, stats: SharedStats) -> Result<Self, DataplaneError> {
        let mut ipvs = connect_ipvs()?;
        let mut dp = Datapath::load_object(&pin_dir, s.capacities)?;
        let loopback = dp.load_ipset()?;
        if let Some(cg) = &cgroup {
            dp.attach_cgroup(cg, &proxy_common::prog_names::SOCK_IPVS)?;
            info!(cgroup = %cg.display(), "node connections to LB IPs outside their source ranges refused at connect time");
        }
        rules::install(&mut SystemNetfilter, rules::BACKEND, &loopback).map_err(DataplaneError::Netfilter)?;
        // Without the IPv6 rules, IPv6 Services could not be masqueraded: they are then reported
        // as not programmed, not served half-way.
        let ipv6 = match rules::install(&mut SystemNetfilter, rules::BACKEND6, &loopback) {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "no ip6tables rules: IPv6 Services are not programmed (each is reported)");
                false
            }
        };
        let info = ipvs.info()?;
        info!(version = format!("{}.{}.{}", info.version >> 16, (info.version >> 8) & 0xff, info.version & 0xff), conn_tab = info.conn_tab_size, "IPVS");
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let kver = sysctl::kernel_version(release.trim()).unwrap_or((0, 0));
        sysctl::apply(&mut ProcSysctls, &sysctl::ipvs_sysctls(kver, s.ipvs.strict_arp));
        let secs = |d: Duration| d.as_secs().min(u64::from(u32::MAX)) as u32;
        let t = Timeouts { tcp_s: secs(s.ipvs.tcp_timeout), tcp_fin_s: secs(s.ipvs.tcp_fin_timeout), udp_s: secs(s.ipvs.udp_timeout) };
        if t.tcp_s + t.tcp_fin_s + t.udp_s > 0 {
            ipvs.set_timeouts(&t)?;
        }
        let ct = match NetlinkConntrack::connect() {
            Ok(c) => Some(c),
            Err(e) => {
                warn!(error = %e, "no ctnetlink: conntrack entries of removed UDP backends will not be cleared");
                None
            }
        };
        let settings = SyncSettings {
            scheduler: s.ipvs.scheduler.clone(),
            exclude_cidrs: s.ipvs.exclude_cidrs.clone(),
            vip_binding: s.ipvs.vip_binding,
            ..SyncSettings::default()
        };
        let mut maps = KernelMaps::open(&pin_dir)?;
        let timeouts = FlowTimeouts::from_settings(&s.conntrack);
        let drain = FastPathDrain::start(&pin_dir, &mut dp, &mut maps, timeouts, s.handover_limit).unwrap_or_else(|e| {
            warn!(error = %e, "switch from the eBPF fast path: its flows cannot be kept; IPVS takes over at once");
            None
        });
        Ok(Self {
            maps,
            sets: KernelSetMaps::open(&pin_dir)?,
            interfaces: Interfaces::new(s, pin_dir, false),
            dp,
            ipvs,
            links: NetlinkLinks::connect()?,
            ct,
            syncer: IpvsSyncer::new(settings),
            sets_mirror: None,
            config: ConfigInputs::new(s, timeouts),
            terminating: 0,
            stats,
            ipv6,
            drain,
        })
    }
}

impl Dataplane for IpvsPlane {
    fn mode(&self) -> Mode {
        Mode::Ipvs
    }

    fn programs_sctp(&self) -> bool {
        true
    }

    fn programs_ipv6(&self) -> Ipv6Reach {
        if self.ipv6 {
            Ipv6Reach::All
        } else {
            Ipv6Reach::None
        }
    }

    fn reconcile_interfaces(&mut self) {
        if let Some(d) = &mut self.drain {
            if d.poll(&mut self.dp, &mut self.maps).record(&self.stats.lock().unwrap().m.handover_connections) {
                self.drain = None;
            }
        }
        self.interfaces.reconcile(&mut self.dp, &mut self.maps);
    }

    fn sync(&mut self, desired: &DesiredState, node: &NodeContext, touched: Option<&BTreeSet<FrontendKey>>) -> Result<SyncStats, DataplaneError> {
        let node_addrs: &[IpAddr] = &node.nodeport_addresses;
        // Which virtual servers are NodePorts (kpr's): those on any address of the node.
        self.syncer.settings.node_addresses = node.addresses.iter().chain(node_addrs).copied().collect();
        let vs = desired_virtual_servers(desired, &self.syncer.settings);
        let only: Option<BTreeSet<ServiceId>> =
            touched.map(|t| t.iter().map(|k| ServiceId::Addr { proto: k.proto.number(), addr: k.ip, port: k.port }).collect());
        let mut noct = FakeConntrack::default();
        let ct: &mut dyn ConntrackFlusher = match &mut self.ct {
            Some(c) => c,
            None => &mut noct,
        };
        let st = self.syncer.sync(&mut self.ipvs, &mut self.links, ct, &vs, only.as_ref())?;
        let bound = bound_addresses(&vs);
        let want = sets::compute(desired, node_addrs, &bound);
        let have = match (touched, self.sets_mirror.take()) {
            (Some(_), Some(m)) => m,
            _ => self.sets.read()?,
        };
        let (set_writes, set_deletes) = sets::sync_from(&mut self.sets, &have, &want)?;
        self.sets_mirror = Some(want);
        let mut dcfg = self.config.config(node, false)?;
        if self.drain.is_some() {
            dcfg.flags |= proxy_common::CFG_F_NO_NEW_FLOWS;
        }
        if self.maps.config().ok() != Some(dcfg) {
            self.maps.set_config(dcfg)?;
        }
        self.terminating = st.terminating;
        self.stats.lock().unwrap().m.ipvs_terminating.set(st.terminating as i64);
        Ok(SyncStats {
            frontends: st.services,
            backends: st.dests,
            writes: st.writes + st.addresses_bound + set_writes,
            deletes: st.deletes + st.addresses_unbound + set_deletes,
            errors: st.errors,
            failed: st.failed,
            ..SyncStats::default()
        })
    }

    fn full_sync_within(&self) -> Option<Duration> {
        (self.terminating > 0).then_some(DRAIN_CHECK)
    }
}
