//! IPVS: the kernel's virtual servers, programmed over generic netlink (neli). Every write goes
//! through the `Ipvs` trait; `NetlinkIpvs` is the kernel, `FakeIpvs` a BTreeMap for tests.
use std::{collections::BTreeMap, fmt, net::IpAddr};

pub mod netlink;
pub mod wire;

pub use netlink::NetlinkIpvs;

/// IP_VS_SVC_F_*. The SCHED1/2 bits mean fallback/port for sh and mh.
pub mod flags {
    pub const PERSISTENT: u32 = 0x1;
    pub const HASHED: u32 = 0x2;
    pub const ONEPACKET: u32 = 0x4;
    pub const SCHED1: u32 = 0x8;
    pub const SCHED2: u32 = 0x10;
    pub const SH_FALLBACK: u32 = SCHED1;
    pub const SH_PORT: u32 = SCHED2;
    pub const MH_FALLBACK: u32 = SCHED1;
    pub const MH_PORT: u32 = SCHED2;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServiceId {
    Addr { proto: u8, addr: IpAddr, port: u16 },
    Fwmark { v6: bool, mark: u32 },
}

impl fmt::Display for ServiceId {
    /// ipvsadm's notation: `-t 10.0.0.1:80`, `-u`, `--sctp-service`, `-f 5`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServiceId::Addr { proto, addr, port } => {
                let p = proxy_common::Protocol::from_number(*proto).map_or("PROTO?", |p| p.name());
                match addr {
                    IpAddr::V4(a) => write!(f, "{p} {a}:{port}"),
                    IpAddr::V6(a) => write!(f, "{p} [{a}]:{port}"),
                }
            }
            ServiceId::Fwmark { mark, .. } => write!(f, "FWM {mark}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceConfig {
    pub id: ServiceId,
    pub scheduler: String,
    /// `flags::*`.
    pub flags: u32,
    /// Persistence timeout (seconds), meaningful with `flags::PERSISTENT`.
    pub timeout_s: u32,
    /// Persistence netmask, host order (IPv4: a mask such as 0xffff_ff00, IPv6: a prefix
    /// length); the wire carries it big-endian.
    pub netmask: u32,
    pub pe_name: Option<String>,
}

/// IP_VS_CONN_F_{MASQ,TUNNEL,DROUTE}: how packets reach the real server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum FwdMethod {
    Masq = 0,
    Local = 1,
    Tunnel = 2,
    Route = 3,
    Bypass = 4,
}

impl FwdMethod {
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v & 7 {
            0 => FwdMethod::Masq,
            1 => FwdMethod::Local,
            2 => FwdMethod::Tunnel,
            3 => FwdMethod::Route,
            4 => FwdMethod::Bypass,
            _ => return None,
        })
    }
    /// ipvsadm -L's column.
    pub fn ipvsadm_name(self) -> &'static str {
        match self {
            FwdMethod::Masq => "Masq",
            FwdMethod::Local => "Local",
            FwdMethod::Tunnel => "Tunnel",
            FwdMethod::Route => "Route",
            FwdMethod::Bypass => "Bypass",
        }
    }
}

/// IP_VS_CONN_F_TUNNEL_TYPE_*.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum TunType {
    Ipip = 0,
    Gue = 1,
    Gre = 2,
}

impl TunType {
    pub fn from_raw(v: u8) -> Option<Self> {
        Some(match v {
            0 => TunType::Ipip,
            1 => TunType::Gue,
            2 => TunType::Gre,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DestConfig {
    pub addr: IpAddr,
    pub port: u16,
    pub fwd: FwdMethod,
    pub weight: u32,
    pub upper_threshold: u32,
    pub lower_threshold: u32,
    /// Tunnel type and (GUE) port; None: ipip, the kernel's default.
    pub tun_type: Option<TunType>,
    pub tun_port: Option<u16>,
    pub tun_flags: u16,
}

impl DestConfig {
    pub fn new(addr: IpAddr, port: u16, fwd: FwdMethod, weight: u32) -> Self {
        DestConfig { addr, port, fwd, weight, upper_threshold: 0, lower_threshold: 0, tun_type: None, tun_port: None, tun_flags: 0 }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub conns: u64,
    pub inpkts: u64,
    pub outpkts: u64,
    pub inbytes: u64,
    pub outbytes: u64,
    pub cps: u64,
    pub inpps: u64,
    pub outpps: u64,
    pub inbps: u64,
    pub outbps: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub config: ServiceConfig,
    pub stats: Stats,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dest {
    pub config: DestConfig,
    pub active_conns: u32,
    pub inactive_conns: u32,
    pub persistent_conns: u32,
    pub stats: Stats,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Info {
    /// (major << 16) | (minor << 8) | patch.
    pub version: u32,
    pub conn_tab_size: u32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp_s: u32,
    pub tcp_fin_s: u32,
    pub udp_s: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum IpvsError {
    #[error(
        "this kernel has no IPVS (generic netlink family \"IPVS\" not found): load ip_vs (`modprobe ip_vs`), or mount /lib/modules into the agent's container"
    )]
    NoIpvs,
    #[error("netlink socket: {0}")]
    Socket(String),
    #[error("IPVS {op} {object}: {err}")]
    Kernel { op: &'static str, object: String, err: std::io::Error },
    #[error("IPVS reply to {op}: {err}")]
    Decode { op: &'static str, err: wire::DecodeError },
    #[error(transparent)]
    Encode(#[from] wire::EncodeError),
}

impl IpvsError {
    pub fn errno(&self) -> Option<i32> {
        match self {
            IpvsError::Kernel { err, .. } => err.raw_os_error(),
            _ => None,
        }
    }
}

/// One change to the kernel's virtual servers: what `Ipvs::apply` pipelines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    AddService(ServiceConfig),
    UpdateService(ServiceConfig),
    DelService(ServiceId),
    AddDest(ServiceId, DestConfig),
    UpdateDest(ServiceId, DestConfig),
    DelDest(ServiceId, IpAddr, u16),
}

impl Write {
    /// The virtual server it writes.
    pub fn service_id(&self) -> ServiceId {
        match self {
            Write::AddService(s) | Write::UpdateService(s) => s.id,
            Write::DelService(id) | Write::AddDest(id, _) | Write::UpdateDest(id, _) | Write::DelDest(id, ..) => *id,
        }
    }
    pub fn is_delete(&self) -> bool {
        matches!(self, Write::DelService(_) | Write::DelDest(..))
    }
    pub fn op(&self) -> &'static str {
        match self {
            Write::AddService(_) => "add service",
            Write::UpdateService(_) => "update service",
            Write::DelService(_) => "delete service",
            Write::AddDest(..) => "add destination",
            Write::UpdateDest(..) => "update destination",
            Write::DelDest(..) => "delete destination",
        }
    }
    /// What it writes, in ipvsadm's notation.
    pub fn object(&self) -> String {
        match self {
            Write::AddService(s) | Write::UpdateService(s) => s.id.to_string(),
            Write::DelService(id) => id.to_string(),
            Write::AddDest(id, d) | Write::UpdateDest(id, d) => format!("{id} -> {}:{}", d.addr, d.port),
            Write::DelDest(id, addr, port) => format!("{id} -> {addr}:{port}"),
        }
    }
}

impl fmt::Display for Write {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.op(), self.object())
    }
}

/// The IPVS operations the agent and the CLI use. Deletes are idempotent (a missing object is
/// success); adds of an existing object fail with EEXIST.
pub trait Ipvs {
    /// Every write in order, each with its own outcome: a failure never stops the ones after it.
    /// The kernel's implementation pipelines them (many per sendmsg); this one writes one by one.
    fn apply(&mut self, writes: &[Write]) -> Vec<Result<(), IpvsError>> {
        writes
            .iter()
            .map(|w| match w {
                Write::AddService(s) => self.add_service(s),
                Write::UpdateService(s) => self.update_service(s),
                Write::DelService(id) => self.del_service(id),
                Write::AddDest(id, d) => self.add_dest(id, d),
                Write::UpdateDest(id, d) => self.update_dest(id, d),
                Write::DelDest(id, addr, port) => self.del_dest(id, *addr, *port),
            })
            .collect()
    }
    fn info(&mut self) -> Result<Info, IpvsError>;
    fn services(&mut self) -> Result<Vec<Service>, IpvsError>;
    fn service(&mut self, id: &ServiceId) -> Result<Option<Service>, IpvsError>;
    fn add_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError>;
    fn update_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError>;
    fn del_service(&mut self, id: &ServiceId) -> Result<(), IpvsError>;
    fn dests(&mut self, id: &ServiceId) -> Result<Vec<Dest>, IpvsError>;
    fn add_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError>;
    fn update_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError>;
    fn del_dest(&mut self, id: &ServiceId, addr: IpAddr, port: u16) -> Result<(), IpvsError>;
    fn flush(&mut self) -> Result<(), IpvsError>;
    fn zero(&mut self, id: Option<&ServiceId>) -> Result<(), IpvsError>;
    fn timeouts(&mut self) -> Result<Timeouts, IpvsError>;
    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError>;
}

fn kernel_err(op: &'static str, object: impl ToString, errno: i32) -> IpvsError {
    let mut object = object.to_string();
    if errno == libc::EPERM {
        object += " (IPVS needs CAP_NET_ADMIN in the node's network namespace)";
    }
    IpvsError::Kernel { op, object, err: std::io::Error::from_raw_os_error(errno) }
}

/// The kernel's IPVS as a map, with the same errnos, for deterministic tests. Destinations carry
/// connection counts that tests set to drive graceful termination.
/// A fake virtual server: its configuration and destinations.
type FakeService = (ServiceConfig, BTreeMap<(IpAddr, u16), Dest>);

#[derive(Default, Debug)]
pub struct FakeIpvs {
    pub services: BTreeMap<ServiceId, FakeService>,
    pub timeouts: Timeouts,
    /// Every write, in order ("add-service TCP 10.0.0.1:80", ...): what a sync touched.
    pub writes: Vec<String>,
}

impl FakeIpvs {
    fn svc(&mut self, op: &'static str, id: &ServiceId) -> Result<&mut BTreeMap<(IpAddr, u16), Dest>, IpvsError> {
        self.services.get_mut(id).map(|(_, d)| d).ok_or_else(|| kernel_err(op, id, libc::ESRCH))
    }
    pub fn set_conns(&mut self, id: &ServiceId, addr: IpAddr, port: u16, active: u32, inactive: u32) {
        if let Some(d) = self.services.get_mut(id).and_then(|(_, d)| d.get_mut(&(addr, port))) {
            d.active_conns = active;
            d.inactive_conns = inactive;
        }
    }
}

impl Ipvs for FakeIpvs {
    fn info(&mut self) -> Result<Info, IpvsError> {
        Ok(Info { version: (1 << 16) | (2 << 8) | 1, conn_tab_size: 4096 })
    }
    fn services(&mut self) -> Result<Vec<Service>, IpvsError> {
        Ok(self.services.values().map(|(c, _)| Service { config: c.clone(), stats: Stats::default() }).collect())
    }
    fn service(&mut self, id: &ServiceId) -> Result<Option<Service>, IpvsError> {
        Ok(self.services.get(id).map(|(c, _)| Service { config: c.clone(), stats: Stats::default() }))
    }
    fn add_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError> {
        if self.services.contains_key(&s.id) {
            return Err(kernel_err("add service", s.id, libc::EEXIST));
        }
        if !proxy_common::IPVS_SCHEDULERS.contains(&s.scheduler.as_str()) {
            return Err(kernel_err("add service", s.id, libc::ENOENT));
        }
        self.writes.push(format!("add-service {}", s.id));
        self.services.insert(s.id, (s.clone(), BTreeMap::new()));
        Ok(())
    }
    fn update_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError> {
        let entry = self.services.get_mut(&s.id).ok_or_else(|| kernel_err("update service", s.id, libc::ESRCH))?;
        entry.0 = s.clone();
        self.writes.push(format!("update-service {}", s.id));
        Ok(())
    }
    fn del_service(&mut self, id: &ServiceId) -> Result<(), IpvsError> {
        if self.services.remove(id).is_some() {
            self.writes.push(format!("del-service {id}"));
        }
        Ok(())
    }
    fn dests(&mut self, id: &ServiceId) -> Result<Vec<Dest>, IpvsError> {
        Ok(self.svc("list destinations", id)?.values().cloned().collect())
    }
    fn add_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError> {
        let dests = self.svc("add destination", id)?;
        if dests.contains_key(&(d.addr, d.port)) {
            return Err(kernel_err("add destination", format!("{id} -> {}:{}", d.addr, d.port), libc::EEXIST));
        }
        dests.insert((d.addr, d.port), Dest { config: d.clone(), active_conns: 0, inactive_conns: 0, persistent_conns: 0, stats: Stats::default() });
        self.writes.push(format!("add-dest {id} {}:{} w{}", d.addr, d.port, d.weight));
        Ok(())
    }
    fn update_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError> {
        let dests = self.svc("update destination", id)?;
        let cur = dests.get_mut(&(d.addr, d.port)).ok_or_else(|| kernel_err("update destination", format!("{id} -> {}:{}", d.addr, d.port), libc::ENOENT))?;
        cur.config = d.clone();
        self.writes.push(format!("update-dest {id} {}:{} w{}", d.addr, d.port, d.weight));
        Ok(())
    }
    fn del_dest(&mut self, id: &ServiceId, addr: IpAddr, port: u16) -> Result<(), IpvsError> {
        let Some((_, dests)) = self.services.get_mut(id) else {
            return Ok(());
        };
        if dests.remove(&(addr, port)).is_some() {
            self.writes.push(format!("del-dest {id} {addr}:{port}"));
        }
        Ok(())
    }
    fn flush(&mut self) -> Result<(), IpvsError> {
        self.services.clear();
        self.writes.push("flush".into());
        Ok(())
    }
    fn zero(&mut self, _id: Option<&ServiceId>) -> Result<(), IpvsError> {
        Ok(())
    }
    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        Ok(self.timeouts)
    }
    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        // The kernel leaves a zero timeout unchanged.
        for (cur, new) in [(&mut self.timeouts.tcp_s, t.tcp_s), (&mut self.timeouts.tcp_fin_s, t.tcp_fin_s), (&mut self.timeouts.udp_s, t.udp_s)] {
            if new != 0 {
                *cur = new;
            }
        }
        Ok(())
    }
}
