//! IPVS mode's sync: the desired virtual servers (desired.rs), the kernel's (listed), and the
//! difference applied. Graceful termination is derived from the kernel's state each sync,
//! so it survives an agent restart: a destination that is no longer wanted first gets weight 0,
//! and is deleted once it has no active or inactive connections (UDP/SCTP: at once, with its
//! conntrack entries, so no client keeps sending into a removed backend).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use crate::dataplane::ipvs::desired::{bound_addresses, SyncSettings, VirtualServer};
use crate::{
    dataplane::ipvs::client::{flags, DestConfig, FwdMethod, Ipvs, IpvsError, ServiceConfig, ServiceId, Write},
    model::errors::{service_port_error, ObjectError, WRITE_FAILED},
    netlink::ctnetlink::ConntrackFlusher,
    netlink::rtnl::{LinkError, Links, IPVS_DUMMY},
    settings::VipBinding,
};

#[derive(Debug, thiserror::Error)]
pub enum IpvsSyncError {
    #[error(transparent)]
    Ipvs(#[from] IpvsError),
    #[error(transparent)]
    Link(#[from] LinkError),
}

#[derive(Debug, Default, Clone)]
pub struct IpvsSyncStats {
    pub services: usize,
    pub dests: usize,
    pub writes: usize,
    pub deletes: usize,
    /// Destinations at weight 0 waiting for their connections to end.
    pub terminating: usize,
    pub addresses_bound: usize,
    pub addresses_unbound: usize,
    /// The binding's own time; it overlaps the IPVS writes when there are many.
    pub bind_time: Duration,
    /// Per-object failures: logged, counted, the rest still programmed.
    pub errors: Vec<String>,
    /// The failures that are one Service's (each also in `errors`), as Events' content.
    pub failed: Vec<ObjectError>,
}

pub struct IpvsSyncer {
    pub settings: SyncSettings,
    /// kube-ipvs0's index and bindings as of the last sync: an incremental sync trusts them
    /// (listing 10,000 addresses per change would make a change O(N)); a full sync re-lists.
    link_cache: Option<(u32, Bindings)>,
}

/// The virtual IPs made local, each way: kube-ipvs0's addresses, kpr's local routes. Both count
/// as bound (ownership), whatever the setting: a node switched from one way to the other still
/// owns the first's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Bindings {
    addresses: BTreeSet<IpAddr>,
    routes: BTreeSet<IpAddr>,
}

impl Bindings {
    fn read(links: &mut dyn Links, ifindex: u32) -> Result<Self, LinkError> {
        Ok(Bindings { addresses: links.addresses(ifindex)?, routes: links.local_routes()? })
    }

    /// The bindings `want` takes under `binding`: IPv4 as routes in route mode, all else
    /// addresses.
    fn wanted(want: &BTreeSet<IpAddr>, binding: VipBinding) -> Self {
        let (routes, addresses) = want.iter().partition(|a| binding == VipBinding::Route && a.is_ipv4());
        Bindings { addresses, routes }
    }

    fn all(&self) -> BTreeSet<IpAddr> {
        self.addresses.union(&self.routes).copied().collect()
    }

    fn is_subset(&self, other: &Bindings) -> bool {
        self.addresses.is_subset(&other.addresses) && self.routes.is_subset(&other.routes)
    }
}

/// The VIPs a sync binds, each way.
struct Binds {
    ifindex: u32,
    routes: Vec<IpAddr>,
    addresses: Vec<IpAddr>,
}

impl Binds {
    fn len(&self) -> usize {
        self.routes.len() + self.addresses.len()
    }

    /// Binds them all: returns `bound` with each success added, and the counts and failures.
    fn apply(&self, links: &mut dyn Links, mut bound: Bindings) -> (Bindings, IpvsSyncStats) {
        let mut st = IpvsSyncStats::default();
        let t = Instant::now();
        change_bindings(links, self.ifindex, true, true, &self.routes, &mut bound.routes, &mut st);
        change_bindings(links, self.ifindex, true, false, &self.addresses, &mut bound.addresses, &mut st);
        st.bind_time = t.elapsed();
        (bound, st)
    }
}

/// Binds (`add`) or unbinds `addrs` as addresses on `ifindex` or (`routes`) as local routes,
/// recording each success in `now` and each failure in `st`.
fn change_bindings(links: &mut dyn Links, ifindex: u32, add: bool, routes: bool, addrs: &[IpAddr], now: &mut BTreeSet<IpAddr>, st: &mut IpvsSyncStats) {
    if addrs.is_empty() {
        return;
    }
    let results = if routes { links.change_local_routes(add, addrs) } else { links.change_addresses(ifindex, add, addrs) };
    let what = if routes { "local route" } else { "address" };
    for (addr, r) in addrs.iter().zip(results) {
        match (r, add) {
            (Ok(()), true) => {
                st.addresses_bound += 1;
                now.insert(*addr);
            }
            (Ok(()), false) => {
                st.addresses_unbound += 1;
                now.remove(addr);
            }
            (Err(e), true) => st.errors.push(format!("bind {addr} ({what}): {e}")),
            (Err(e), false) => st.errors.push(format!("unbind {addr} ({what}): {e}")),
        }
    }
}

fn dest_differs(want: &DestConfig, have: &DestConfig) -> bool {
    want.fwd != have.fwd
        || want.weight != have.weight
        || want.upper_threshold != have.upper_threshold
        || want.lower_threshold != have.lower_threshold
        || (want.fwd == FwdMethod::Tunnel
            && (want.tun_type.unwrap_or(crate::dataplane::ipvs::client::TunType::Ipip), want.tun_port.unwrap_or(0))
                != (have.tun_type.unwrap_or(crate::dataplane::ipvs::client::TunType::Ipip), have.tun_port.unwrap_or(0)))
}

fn service_differs(want: &ServiceConfig, have: &ServiceConfig) -> bool {
    // The kernel reports HASHED on every service it holds; it is not ours to set.
    let mask = !flags::HASHED;
    want.scheduler != have.scheduler
        || (want.flags & mask) != (have.flags & mask)
        || (want.flags & flags::PERSISTENT != 0 && (want.timeout_s != have.timeout_s || want.netmask != have.netmask))
        || want.pe_name != have.pe_name
}

impl IpvsSyncer {
    pub fn new(settings: SyncSettings) -> Self {
        IpvsSyncer { settings, link_cache: None }
    }

    /// Is this kernel virtual server one the agent manages (and may delete)? Those on addresses
    /// it binds on kube-ipvs0, and those on the node's addresses (NodePorts, and ExternalIPs or
    /// LB IPs that are node addresses); never those in ipvs.excludeCIDRs. (kube-proxy claims
    /// every virtual server outside excludeCIDRs.)
    fn owned(&self, id: &ServiceId, bound: &BTreeSet<IpAddr>) -> bool {
        let ServiceId::Addr { addr, .. } = id else {
            return false;
        };
        if self.settings.exclude_cidrs.iter().any(|c| c.contains(addr)) {
            return false;
        }
        bound.contains(addr) || self.settings.node_addresses.contains(addr)
    }

    /// Syncs the kernel to `desired`. `only`: the virtual servers that may have changed (an
    /// incremental sync); None lists every virtual server (a full sync, which also finishes
    /// graceful terminations and repairs drift).
    pub fn sync(
        &mut self,
        ipvs: &mut dyn Ipvs,
        links: &mut dyn Links,
        ct: &mut dyn ConntrackFlusher,
        desired: &BTreeMap<ServiceId, VirtualServer>,
        only: Option<&BTreeSet<ServiceId>>,
    ) -> Result<IpvsSyncStats, IpvsSyncError> {
        let mut st = IpvsSyncStats { services: desired.len(), dests: desired.values().map(|v| v.dests.len()).sum(), ..Default::default() };
        let (ifindex, bound) = match (self.link_cache.take(), only) {
            (Some(cached), Some(_)) => cached,
            _ => {
                let i = links.ensure_dummy(IPVS_DUMMY)?;
                (i, Bindings::read(links, i)?)
            }
        };
        // Bind (IPVS only sees packets to local addresses): many (a node's first sync, one per
        // Service, each address a walk of kube-ipvs0's list in the kernel) on a thread of their
        // own while the virtual servers are written, as the kernel takes RTNL for the one and
        // IPVS's own lock for the other; a few first, here.
        let want_all = bound_addresses(desired);
        let want = Bindings::wanted(&want_all, self.settings.vip_binding);
        let binds = Binds {
            ifindex,
            routes: want.routes.difference(&bound.routes).copied().collect(),
            addresses: want.addresses.difference(&bound.addresses).copied().collect(),
        };
        let bound_all = bound.all();
        let (bind_result, ipvs_result) = if binds.len() >= self.settings.concurrent_binds {
            let (bound_beside, ipvs_result) = std::thread::scope(|s| {
                let binder = std::thread::Builder::new().name("kpr-bind".into()).spawn_scoped(s, || binds.apply(&mut *links, bound.clone()));
                let ipvs_result = self.write_ipvs(ipvs, ct, desired, only, &bound_all, &want_all);
                let bound_beside = binder.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
                (bound_beside, ipvs_result)
            });
            // No thread to be had: bind after the writes instead.
            let bind_result = bound_beside.unwrap_or_else(|e| {
                tracing::warn!(error = %e, binds = binds.len(), "no thread to bind the VIPs beside the IPVS writes; binding them after");
                binds.apply(&mut *links, bound.clone())
            });
            (bind_result, ipvs_result)
        } else {
            (binds.apply(&mut *links, bound.clone()), self.write_ipvs(ipvs, ct, desired, only, &bound_all, &want_all))
        };
        let (mut now, bind_st) = bind_result;
        let IpvsSyncStats { addresses_bound, bind_time, errors: bind_errors, .. } = bind_st;
        let ipvs_result = ipvs_result.inspect_err(|_| {
            // The failed sync is retried (its binds read anew), but these would not be reported.
            for error in &bind_errors {
                tracing::warn!(%error, "a VIP binding failed in a sync whose IPVS writes failed");
            }
        });
        let IpvsSyncStats { writes, deletes, terminating, errors: ipvs_errors, failed, .. } = ipvs_result?;
        st = IpvsSyncStats { writes, deletes, terminating, addresses_bound, bind_time, errors: [bind_errors, ipvs_errors].concat(), failed, ..st };

        // Unbind what no virtual server needs, or is bound the other way now (a full sync sees
        // them all). After the binds: an address switched to a route is never unbound between.
        if only.is_none() || !bound.is_subset(&want) {
            let kept = |a: &&IpAddr| !self.settings.exclude_cidrs.iter().any(|c| c.contains(*a));
            let stale_routes: Vec<IpAddr> = bound.routes.difference(&want.routes).filter(kept).copied().collect();
            change_bindings(links, ifindex, false, true, &stale_routes, &mut now.routes, &mut st);
            let stale_addresses: Vec<IpAddr> = bound.addresses.difference(&want.addresses).filter(kept).copied().collect();
            change_bindings(links, ifindex, false, false, &stale_addresses, &mut now.addresses, &mut st);
        }
        self.link_cache = Some((ifindex, now));
        Ok(st)
    }

    /// The virtual servers' part of `sync`: reads the kernel's, plans the writes and sends
    /// them. `bound_all` and `want_all`: the VIPs bound before this sync, and wanted after it
    /// (either makes a virtual server on it the agent's to delete).
    fn write_ipvs(
        &self,
        ipvs: &mut dyn Ipvs,
        ct: &mut dyn ConntrackFlusher,
        desired: &BTreeMap<ServiceId, VirtualServer>,
        only: Option<&BTreeSet<ServiceId>>,
        bound_all: &BTreeSet<IpAddr>,
        want_all: &BTreeSet<IpAddr>,
    ) -> Result<IpvsSyncStats, IpvsError> {
        let mut st = IpvsSyncStats::default();
        let actual: BTreeMap<ServiceId, ServiceConfig> = match only {
            None => ipvs.services()?.into_iter().map(|s| (s.config.id, s.config)).collect(),
            Some(ids) => {
                let mut m = BTreeMap::new();
                for id in ids {
                    if let Some(s) = ipvs.service(id)? {
                        m.insert(*id, s.config);
                    }
                }
                m
            }
        };
        let scope: Vec<ServiceId> = match only {
            None => desired.keys().chain(actual.keys()).copied().collect::<BTreeSet<_>>().into_iter().collect(),
            Some(ids) => ids.iter().copied().collect(),
        };
        // Plan every write (reading each existing service's destinations), then send them all
        // pipelined; each write succeeds or fails alone.
        let mut plan = Vec::new();
        for id in scope {
            let r = match (desired.get(&id), actual.get(&id)) {
                (Some(want), have) => self.plan_service(ipvs, want, have, &mut st, &mut plan),
                (None, Some(_)) if self.owned(&id, bound_all) || self.owned(&id, want_all) => {
                    plan.push(Write::DelService(id));
                    Ok(())
                }
                _ => Ok(()),
            };
            if let Err(e) = r {
                st.errors.push(format!("{id}: {e}"));
                if let Some(want) = desired.get(&id) {
                    st.failed.push(service_port_error(&want.service, format!("IPVS virtual server {id}: {e}"), WRITE_FAILED));
                }
            }
        }
        for (w, r) in plan.iter().zip(ipvs.apply(&plan)) {
            if let Err(e) = r {
                st.errors.push(e.to_string());
                if let Some(want) = desired.get(&w.service_id()) {
                    st.failed.push(service_port_error(&want.service, format!("IPVS: {e}"), WRITE_FAILED));
                }
                continue;
            }
            if !w.is_delete() {
                st.writes += 1;
                continue;
            }
            st.deletes += 1;
            // A datagram destination went at once: forget its conntrack entries too, so no
            // client keeps sending into it.
            if let Write::DelDest(ServiceId::Addr { proto, addr: vip, port: vport }, addr, port) = *w {
                if proto != libc::IPPROTO_TCP as u8 {
                    if let Err(e) = ct.flush(proto, vip, vport, addr, port) {
                        st.errors.push(format!("{w}: clearing conntrack: {e}"));
                    }
                }
            }
        }

        Ok(st)
    }

    /// The writes that make the kernel's `have` (None: absent) into `want`, appended to `plan`.
    /// Only reads here (the service's destinations); an error is a failed read.
    fn plan_service(
        &self,
        ipvs: &mut dyn Ipvs,
        want: &VirtualServer,
        have: Option<&ServiceConfig>,
        st: &mut IpvsSyncStats,
        plan: &mut Vec<Write>,
    ) -> Result<(), IpvsError> {
        let id = want.config.id;
        let actual_dests = match have {
            None => {
                plan.push(Write::AddService(want.config.clone()));
                BTreeMap::new()
            }
            Some(have) => {
                if service_differs(&want.config, have) {
                    plan.push(Write::UpdateService(want.config.clone()));
                }
                ipvs.dests(&id)?.into_iter().map(|d| ((d.config.addr, d.config.port), d)).collect()
            }
        };
        for (k, d) in &want.dests {
            match actual_dests.get(k) {
                None => plan.push(Write::AddDest(id, d.clone())),
                // A real server that comes back (or changed weight/method) gets its config back.
                Some(cur) if dest_differs(d, &cur.config) => plan.push(Write::UpdateDest(id, d.clone())),
                Some(_) => {}
            }
        }
        let ServiceId::Addr { proto, .. } = id else {
            return Ok(());
        };
        for (k, cur) in actual_dests.iter().filter(|(k, _)| !want.dests.contains_key(k)) {
            let (addr, port) = *k;
            if proto != libc::IPPROTO_TCP as u8 {
                // Datagram "connections" never close: waiting would black-hole the clients
                // still sending; remove now (and their conntrack entries, once it is gone).
                plan.push(Write::DelDest(id, addr, port));
            } else if cur.config.weight != 0 {
                let mut quiesced = cur.config.clone();
                quiesced.weight = 0;
                st.terminating += 1;
                plan.push(Write::UpdateDest(id, quiesced));
            } else if cur.active_conns + cur.inactive_conns == 0 {
                plan.push(Write::DelDest(id, addr, port));
            } else {
                st.terminating += 1;
            }
        }
        Ok(())
    }
}

/// `kpr cleanup` in IPVS mode: deletes the virtual servers the agent owns (on its VIPs or on
/// `node_addresses`), then its local routes and kube-ipvs0 itself. Other virtual servers stay.
/// Returns what went.
pub fn cleanup(ipvs: &mut dyn Ipvs, links: &mut dyn Links, node_addresses: &[IpAddr]) -> Result<Vec<String>, IpvsSyncError> {
    let mut done = Vec::new();
    let (owned, bound) = owned_services(ipvs, links, node_addresses)?;
    for id in owned {
        ipvs.del_service(&id)?;
        done.push(format!("deleted IPVS service {id}"));
    }
    let routes: Vec<IpAddr> = bound.routes.iter().copied().collect();
    for (addr, r) in routes.iter().zip(links.change_local_routes(false, &routes)) {
        r?;
        done.push(format!("deleted local route {addr}"));
    }
    if links.link_index(IPVS_DUMMY)?.is_some() {
        links.delete_link(IPVS_DUMMY)?;
        done.push(format!("deleted link {IPVS_DUMMY} ({} addresses)", bound.addresses.len()));
    }
    Ok(done)
}

/// The virtual servers the agent owns (on its VIPs, or on `node_addresses`), and its VIPs.
fn owned_services(ipvs: &mut dyn Ipvs, links: &mut dyn Links, node_addresses: &[IpAddr]) -> Result<(Vec<ServiceId>, Bindings), IpvsSyncError> {
    let bound = match links.link_index(IPVS_DUMMY)? {
        Some(i) => Bindings::read(links, i)?,
        None => Bindings { addresses: BTreeSet::new(), routes: links.local_routes()? },
    };
    let syncer = IpvsSyncer::new(SyncSettings { node_addresses: node_addresses.to_vec(), ..Default::default() });
    let all = bound.all();
    let owned = ipvs.services()?.into_iter().map(|s| s.config.id).filter(|id| syncer.owned(id, &all)).collect();
    Ok((owned, bound))
}

/// Established connections through the virtual servers the agent owns (what a switch to the
/// fast path waits for).
pub fn established_connections(ipvs: &mut dyn Ipvs, links: &mut dyn Links, node_addresses: &[IpAddr]) -> Result<u64, IpvsSyncError> {
    let mut n = 0;
    for id in owned_services(ipvs, links, node_addresses)?.0 {
        n += ipvs.dests(&id)?.iter().map(|d| u64::from(d.active_conns)).sum::<u64>();
    }
    Ok(n)
}

#[cfg(test)]
mod tests;
