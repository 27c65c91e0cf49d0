//! The IPVS generic netlink message format (include/uapi/linux/ip_vs.h). Requests are built with
//! neli's attribute types; replies are decoded here from raw bytes, defensively: an unknown,
//! short or malformed attribute is a `DecodeError`, never a panic (fuzzed: proxy-agent/fuzz).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use neli::{
    genl::{AttrTypeBuilder, Nlattr, NlattrBuilder},
    types::{Buffer, GenlBuffer},
};

use crate::netlink::attrs::attrs;
pub use crate::netlink::attrs::DecodeError;

use super::{Dest, DestConfig, FwdMethod, Info, Service, ServiceConfig, ServiceId, Stats, Timeouts, TunType};

pub const FAMILY: &str = "IPVS";
pub const VERSION: u8 = 1;

pub mod cmd {
    pub const NEW_SERVICE: u8 = 1;
    pub const SET_SERVICE: u8 = 2;
    pub const DEL_SERVICE: u8 = 3;
    pub const GET_SERVICE: u8 = 4;
    pub const NEW_DEST: u8 = 5;
    pub const SET_DEST: u8 = 6;
    pub const DEL_DEST: u8 = 7;
    pub const GET_DEST: u8 = 8;
    pub const SET_CONFIG: u8 = 12;
    pub const GET_CONFIG: u8 = 13;
    pub const SET_INFO: u8 = 14;
    pub const GET_INFO: u8 = 15;
    pub const ZERO: u8 = 16;
    pub const FLUSH: u8 = 17;
}

/// IPVS_CMD_ATTR_*: the top level of every message.
mod top {
    pub const SERVICE: u16 = 1;
    pub const DEST: u16 = 2;
    pub const TIMEOUT_TCP: u16 = 4;
    pub const TIMEOUT_TCP_FIN: u16 = 5;
    pub const TIMEOUT_UDP: u16 = 6;
}

mod svc {
    pub const AF: u16 = 1;
    pub const PROTOCOL: u16 = 2;
    pub const ADDR: u16 = 3;
    pub const PORT: u16 = 4;
    pub const FWMARK: u16 = 5;
    pub const SCHED_NAME: u16 = 6;
    pub const FLAGS: u16 = 7;
    pub const TIMEOUT: u16 = 8;
    pub const NETMASK: u16 = 9;
    pub const STATS: u16 = 10;
    pub const PE_NAME: u16 = 11;
    pub const STATS64: u16 = 12;
}

mod dest {
    pub const ADDR: u16 = 1;
    pub const PORT: u16 = 2;
    pub const FWD_METHOD: u16 = 3;
    pub const WEIGHT: u16 = 4;
    pub const U_THRESH: u16 = 5;
    pub const L_THRESH: u16 = 6;
    pub const ACTIVE_CONNS: u16 = 7;
    pub const INACT_CONNS: u16 = 8;
    pub const PERSIST_CONNS: u16 = 9;
    pub const STATS: u16 = 10;
    pub const ADDR_FAMILY: u16 = 11;
    pub const STATS64: u16 = 12;
    pub const TUN_TYPE: u16 = 13;
    pub const TUN_PORT: u16 = 14;
    pub const TUN_FLAGS: u16 = 15;
}

mod stats {
    pub const CONNS: u16 = 1;
    pub const INPKTS: u16 = 2;
    pub const OUTPKTS: u16 = 3;
    pub const INBYTES: u16 = 4;
    pub const OUTBYTES: u16 = 5;
    pub const CPS: u16 = 6;
    pub const INPPS: u16 = 7;
    pub const OUTPPS: u16 = 8;
    pub const INBPS: u16 = 9;
    pub const OUTBPS: u16 = 10;
    pub const PAD: u16 = 11;
}

mod info {
    pub const VERSION: u16 = 1;
    pub const CONN_TAB_SIZE: u16 = 2;
}

const AF_INET: u16 = libc::AF_INET as u16;
const AF_INET6: u16 = libc::AF_INET6 as u16;

fn size_err(ctx: &'static str, ty: u16, len: usize, expected: &'static str) -> DecodeError {
    DecodeError::BadSize { ctx, ty, len, expected }
}

fn u8_of(ctx: &'static str, ty: u16, p: &[u8]) -> Result<u8, DecodeError> {
    match p {
        [v] => Ok(*v),
        _ => Err(size_err(ctx, ty, p.len(), "1")),
    }
}

fn u16_of(ctx: &'static str, ty: u16, p: &[u8]) -> Result<u16, DecodeError> {
    p.try_into().map(u16::from_ne_bytes).map_err(|_| size_err(ctx, ty, p.len(), "2"))
}

/// Ports travel in network byte order.
fn port_of(ctx: &'static str, ty: u16, p: &[u8]) -> Result<u16, DecodeError> {
    p.try_into().map(u16::from_be_bytes).map_err(|_| size_err(ctx, ty, p.len(), "2"))
}

fn u32_of(ctx: &'static str, ty: u16, p: &[u8]) -> Result<u32, DecodeError> {
    p.try_into().map(u32::from_ne_bytes).map_err(|_| size_err(ctx, ty, p.len(), "4"))
}

/// Counters are u32 in IPVS_*_ATTR_STATS and u64 in STATS64.
fn counter_of(ctx: &'static str, ty: u16, p: &[u8]) -> Result<u64, DecodeError> {
    match p.len() {
        4 => Ok(u32::from_ne_bytes(p.try_into().unwrap_or_default()) as u64),
        8 => Ok(u64::from_ne_bytes(p.try_into().unwrap_or_default())),
        n => Err(size_err(ctx, ty, n, "4 or 8")),
    }
}

fn string_of(ctx: &'static str, ty: u16, p: &[u8]) -> Result<String, DecodeError> {
    let end = p.iter().position(|&b| b == 0).unwrap_or(p.len());
    std::str::from_utf8(&p[..end]).map(str::to_string).map_err(|_| DecodeError::Invalid { ctx, what: format!("attribute {ty} is not UTF-8") })
}

/// union nf_inet_addr: 16 bytes, an IPv4 address in the first 4.
fn addr_of(ctx: &'static str, af: u16, p: &[u8]) -> Result<IpAddr, DecodeError> {
    match (af, p.len()) {
        (AF_INET, 4..=16) => Ok(IpAddr::V4(Ipv4Addr::new(p[0], p[1], p[2], p[3]))),
        (AF_INET6, 16) => Ok(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(p).unwrap_or_default()))),
        (AF_INET | AF_INET6, n) => Err(size_err(ctx, 0, n, "4 or 16")),
        (other, _) => Err(DecodeError::Invalid { ctx, what: format!("address family {other}") }),
    }
}

fn decode_stats(ctx: &'static str, p: &[u8]) -> Result<Stats, DecodeError> {
    let mut s = Stats::default();
    for a in attrs(ctx, p) {
        let (ty, v) = a?;
        let field = match ty {
            stats::CONNS => &mut s.conns,
            stats::INPKTS => &mut s.inpkts,
            stats::OUTPKTS => &mut s.outpkts,
            stats::INBYTES => &mut s.inbytes,
            stats::OUTBYTES => &mut s.outbytes,
            stats::CPS => &mut s.cps,
            stats::INPPS => &mut s.inpps,
            stats::OUTPPS => &mut s.outpps,
            stats::INBPS => &mut s.inbps,
            stats::OUTBPS => &mut s.outbps,
            stats::PAD => continue,
            ty => return Err(DecodeError::Unknown { ctx, ty }),
        };
        *field = counter_of(ctx, ty, v)?;
    }
    Ok(s)
}

pub fn decode_service(p: &[u8]) -> Result<Service, DecodeError> {
    const CTX: &str = "service";
    let (mut af, mut proto, mut addr, mut port, mut fwmark) = (None, None, None, None, None);
    let (mut sched, mut flags, mut timeout, mut netmask, mut pe) = (None, None, None, None, None);
    let (mut st32, mut st64) = (None, None);
    for a in attrs(CTX, p) {
        let (ty, v) = a?;
        match ty {
            svc::AF => af = Some(u16_of(CTX, ty, v)?),
            svc::PROTOCOL => proto = Some(u16_of(CTX, ty, v)?),
            svc::ADDR => addr = Some(v),
            svc::PORT => port = Some(port_of(CTX, ty, v)?),
            svc::FWMARK => fwmark = Some(u32_of(CTX, ty, v)?),
            svc::SCHED_NAME => sched = Some(string_of(CTX, ty, v)?),
            svc::FLAGS if v.len() == 8 => flags = Some(u32::from_ne_bytes([v[0], v[1], v[2], v[3]])),
            svc::FLAGS => return Err(size_err(CTX, ty, v.len(), "8")),
            svc::TIMEOUT => timeout = Some(u32_of(CTX, ty, v)?),
            svc::NETMASK => netmask = Some(u32_of(CTX, ty, v)?),
            svc::STATS => st32 = Some(decode_stats("service stats", v)?),
            svc::STATS64 => st64 = Some(decode_stats("service stats64", v)?),
            svc::PE_NAME => pe = Some(string_of(CTX, ty, v)?).filter(|s: &String| !s.is_empty()),
            ty => return Err(DecodeError::Unknown { ctx: CTX, ty }),
        }
    }
    let af = af.ok_or(DecodeError::Missing { ctx: CTX, what: "AF" })?;
    let id = match (fwmark.filter(|&m| m != 0), proto, addr, port) {
        (Some(mark), _, _, _) => ServiceId::Fwmark { v6: af == AF_INET6, mark },
        (None, Some(proto), Some(addr), Some(port)) => ServiceId::Addr { proto: proto as u8, addr: addr_of(CTX, af, addr)?, port },
        _ => return Err(DecodeError::Missing { ctx: CTX, what: "FWMARK or PROTOCOL+ADDR+PORT" }),
    };
    Ok(Service {
        config: ServiceConfig {
            id,
            scheduler: sched.ok_or(DecodeError::Missing { ctx: CTX, what: "SCHED_NAME" })?,
            flags: flags.ok_or(DecodeError::Missing { ctx: CTX, what: "FLAGS" })?,
            timeout_s: timeout.unwrap_or(0),
            netmask: netmask.map_or(0, |raw| netmask_host(af, raw)),
            pe_name: pe,
        },
        stats: st64.or(st32).unwrap_or_default(),
    })
}

/// `svc_af`: the service's family, the default for a destination without ADDR_FAMILY.
pub fn decode_dest(p: &[u8], svc_af: u16) -> Result<Dest, DecodeError> {
    const CTX: &str = "destination";
    let (mut addr, mut port, mut fwd, mut weight, mut uth, mut lth) = (None, None, None, None, None, None);
    let (mut active, mut inact, mut persist, mut af) = (0, 0, 0, svc_af);
    let (mut st32, mut st64, mut tun_type, mut tun_port, mut tun_flags) = (None, None, None, None, 0);
    for a in attrs(CTX, p) {
        let (ty, v) = a?;
        match ty {
            dest::ADDR => addr = Some(v),
            dest::PORT => port = Some(port_of(CTX, ty, v)?),
            dest::FWD_METHOD => fwd = Some(u32_of(CTX, ty, v)?),
            dest::WEIGHT => weight = Some(u32_of(CTX, ty, v)?),
            dest::U_THRESH => uth = Some(u32_of(CTX, ty, v)?),
            dest::L_THRESH => lth = Some(u32_of(CTX, ty, v)?),
            dest::ACTIVE_CONNS => active = u32_of(CTX, ty, v)?,
            dest::INACT_CONNS => inact = u32_of(CTX, ty, v)?,
            dest::PERSIST_CONNS => persist = u32_of(CTX, ty, v)?,
            dest::STATS => st32 = Some(decode_stats("destination stats", v)?),
            dest::STATS64 => st64 = Some(decode_stats("destination stats64", v)?),
            dest::ADDR_FAMILY => af = u16_of(CTX, ty, v)?,
            dest::TUN_TYPE => tun_type = Some(u8_of(CTX, ty, v)?),
            dest::TUN_PORT => tun_port = Some(port_of(CTX, ty, v)?),
            dest::TUN_FLAGS => tun_flags = u16_of(CTX, ty, v)?,
            ty => return Err(DecodeError::Unknown { ctx: CTX, ty }),
        }
    }
    let fwd_raw = fwd.ok_or(DecodeError::Missing { ctx: CTX, what: "FWD_METHOD" })?;
    let fwd = FwdMethod::from_raw(fwd_raw).ok_or_else(|| DecodeError::Invalid { ctx: CTX, what: format!("forwarding method {fwd_raw}") })?;
    let tun_type = match (fwd, tun_type) {
        (FwdMethod::Tunnel, Some(t)) => Some(TunType::from_raw(t).ok_or_else(|| DecodeError::Invalid { ctx: CTX, what: format!("tunnel type {t}") })?),
        _ => None,
    };
    Ok(Dest {
        config: DestConfig {
            addr: addr_of(CTX, af, addr.ok_or(DecodeError::Missing { ctx: CTX, what: "ADDR" })?)?,
            port: port.ok_or(DecodeError::Missing { ctx: CTX, what: "PORT" })?,
            fwd,
            weight: weight.ok_or(DecodeError::Missing { ctx: CTX, what: "WEIGHT" })?,
            upper_threshold: uth.unwrap_or(0),
            lower_threshold: lth.unwrap_or(0),
            tun_type,
            tun_port: tun_port.filter(|_| tun_type.is_some()),
            tun_flags,
        },
        active_conns: active,
        inactive_conns: inact,
        persistent_conns: persist,
        stats: st64.or(st32).unwrap_or_default(),
    })
}

/// A decoded reply message (the generic netlink header and its attributes).
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Service(Service),
    Dest(Dest),
    Info(Info),
    Timeouts(Timeouts),
}

/// Decodes one reply; `svc_af` is the family of the service a destination dump was for.
pub fn decode_reply(genl: &[u8], svc_af: u16) -> Result<Reply, DecodeError> {
    let (&[command, _version, _, _], body) = genl.split_first_chunk::<4>().ok_or(DecodeError::ShortHeader)?;
    let mut found = None;
    let mut timeouts = Timeouts::default();
    let mut info = Info::default();
    for a in attrs("message", body) {
        let (ty, v) = a?;
        match (command, ty) {
            (cmd::NEW_SERVICE, top::SERVICE) => found = Some(Reply::Service(decode_service(v)?)),
            (cmd::NEW_DEST, top::DEST) => found = Some(Reply::Dest(decode_dest(v, svc_af)?)),
            (cmd::NEW_DEST, top::SERVICE) => {} // some kernels echo the service in a dest dump
            (cmd::SET_CONFIG, top::TIMEOUT_TCP) => timeouts.tcp_s = u32_of("config", ty, v)?,
            (cmd::SET_CONFIG, top::TIMEOUT_TCP_FIN) => timeouts.tcp_fin_s = u32_of("config", ty, v)?,
            (cmd::SET_CONFIG, top::TIMEOUT_UDP) => timeouts.udp_s = u32_of("config", ty, v)?,
            (cmd::SET_INFO, info::VERSION) => info.version = u32_of("info", ty, v)?,
            (cmd::SET_INFO, info::CONN_TAB_SIZE) => info.conn_tab_size = u32_of("info", ty, v)?,
            (cmd::NEW_SERVICE | cmd::NEW_DEST | cmd::SET_CONFIG | cmd::SET_INFO, ty) => return Err(DecodeError::Unknown { ctx: "message", ty }),
            (c, _) => return Err(DecodeError::UnexpectedCommand(c)),
        }
    }
    match command {
        cmd::NEW_SERVICE | cmd::NEW_DEST => found.ok_or(DecodeError::Missing { ctx: "message", what: "SERVICE or DEST" }),
        cmd::SET_CONFIG => Ok(Reply::Timeouts(timeouts)),
        cmd::SET_INFO => Ok(Reply::Info(info)),
        c => Err(DecodeError::UnexpectedCommand(c)),
    }
}

// ---- requests (neli attributes) ----

pub type Attr = Nlattr<u16, Buffer>;

#[derive(Debug, thiserror::Error)]
#[error("building netlink attribute {ty}: {msg}")]
pub struct EncodeError {
    ty: u16,
    msg: String,
}

/// An attribute's length is a u16: neli would wrap (or, nesting, overflow) past it.
fn check_len(ty: u16, payload: usize) -> Result<(), EncodeError> {
    if payload > usize::from(u16::MAX) - 4 {
        return Err(EncodeError { ty, msg: format!("{payload} bytes do not fit in a netlink attribute") });
    }
    Ok(())
}

pub fn attr(ty: u16, payload: Vec<u8>) -> Result<Attr, EncodeError> {
    check_len(ty, payload.len())?;
    let err = |e: &dyn std::fmt::Display| EncodeError { ty, msg: e.to_string() };
    NlattrBuilder::default().nla_type(AttrTypeBuilder::default().nla_type(ty).build().map_err(|e| err(&e))?).nla_payload(payload).build().map_err(|e| err(&e))
}

fn nested(ty: u16, children: Vec<Attr>) -> Result<Attr, EncodeError> {
    check_len(ty, children.iter().map(|c| (usize::from(*c.nla_len()) + 3) & !3).sum())?;
    let mut outer = NlattrBuilder::default()
        .nla_type(AttrTypeBuilder::default().nla_type(ty).nla_nested(true).build().map_err(|e| EncodeError { ty, msg: e.to_string() })?)
        .nla_payload(Vec::<u8>::new())
        .build()
        .map_err(|e| EncodeError { ty, msg: e.to_string() })?;
    for c in &children {
        outer = outer.nest(c).map_err(|e| EncodeError { ty, msg: e.to_string() })?;
    }
    Ok(outer)
}

/// IPVS_SVC_ATTR_NETMASK is a __be32 the kernel keeps raw: an IPv4 mask in network order, but
/// an IPv6 prefix length as a plain number (ip_vs_ctl.c casts it without a byte swap, and
/// rejects one outside 1..=128).
fn netmask_wire(af: u16, netmask: u32) -> [u8; 4] {
    if af == AF_INET6 {
        netmask.to_ne_bytes()
    } else {
        netmask.to_be_bytes()
    }
}

/// The inverse of `netmask_wire`, from the attribute's bytes read as a native u32.
fn netmask_host(af: u16, raw: u32) -> u32 {
    if af == AF_INET6 {
        raw
    } else {
        u32::from_be(raw)
    }
}

fn addr_bytes(addr: IpAddr) -> Vec<u8> {
    let mut b = vec![0u8; 16];
    match addr {
        IpAddr::V4(a) => b[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => b.copy_from_slice(&a.octets()),
    }
    b
}

fn family(addr: IpAddr) -> u16 {
    if addr.is_ipv4() {
        AF_INET
    } else {
        AF_INET6
    }
}

impl ServiceId {
    pub fn family(&self) -> u16 {
        match self {
            ServiceId::Addr { addr, .. } => family(*addr),
            ServiceId::Fwmark { v6: true, .. } => AF_INET6,
            ServiceId::Fwmark { .. } => AF_INET,
        }
    }

    fn identity_attrs(&self) -> Result<Vec<Attr>, EncodeError> {
        let mut v = vec![attr(svc::AF, self.family().to_ne_bytes().to_vec())?];
        match *self {
            ServiceId::Addr { proto, addr, port } => {
                v.push(attr(svc::PROTOCOL, (proto as u16).to_ne_bytes().to_vec())?);
                v.push(attr(svc::ADDR, addr_bytes(addr))?);
                v.push(attr(svc::PORT, port.to_be_bytes().to_vec())?);
            }
            ServiceId::Fwmark { mark, .. } => v.push(attr(svc::FWMARK, mark.to_ne_bytes().to_vec())?),
        }
        Ok(v)
    }
}

/// IPVS_CMD_ATTR_SERVICE with only the identity (for delete, dest ops and dest dumps).
pub fn service_id_attr(id: &ServiceId) -> Result<Attr, EncodeError> {
    nested(top::SERVICE, id.identity_attrs()?)
}

/// IPVS_CMD_ATTR_SERVICE with every settable field (new and set need them all).
pub fn service_attr(c: &ServiceConfig) -> Result<Attr, EncodeError> {
    let mut v = c.id.identity_attrs()?;
    let mut sched = c.scheduler.as_bytes().to_vec();
    sched.push(0);
    v.push(attr(svc::SCHED_NAME, sched)?);
    let mut flags = c.flags.to_ne_bytes().to_vec();
    flags.extend_from_slice(&u32::MAX.to_ne_bytes()); // mask: set every flag as given
    v.push(attr(svc::FLAGS, flags)?);
    v.push(attr(svc::TIMEOUT, c.timeout_s.to_ne_bytes().to_vec())?);
    v.push(attr(svc::NETMASK, netmask_wire(c.id.family(), c.netmask).to_vec())?);
    if let Some(pe) = &c.pe_name {
        let mut p = pe.as_bytes().to_vec();
        p.push(0);
        v.push(attr(svc::PE_NAME, p)?);
    }
    nested(top::SERVICE, v)
}

/// IPVS_CMD_ATTR_DEST with every settable field, or only the identity when `full` is false.
pub fn dest_attr(d: &DestConfig, full: bool) -> Result<Attr, EncodeError> {
    let mut v = vec![
        attr(dest::ADDR, addr_bytes(d.addr))?,
        attr(dest::PORT, d.port.to_be_bytes().to_vec())?,
        attr(dest::ADDR_FAMILY, family(d.addr).to_ne_bytes().to_vec())?,
    ];
    if full {
        v.push(attr(dest::FWD_METHOD, (d.fwd as u32).to_ne_bytes().to_vec())?);
        v.push(attr(dest::WEIGHT, d.weight.to_ne_bytes().to_vec())?);
        v.push(attr(dest::U_THRESH, d.upper_threshold.to_ne_bytes().to_vec())?);
        v.push(attr(dest::L_THRESH, d.lower_threshold.to_ne_bytes().to_vec())?);
        if let (FwdMethod::Tunnel, Some(t)) = (d.fwd, d.tun_type) {
            v.push(attr(dest::TUN_TYPE, vec![t as u8])?);
            if let Some(port) = d.tun_port {
                v.push(attr(dest::TUN_PORT, port.to_be_bytes().to_vec())?);
            }
            v.push(attr(dest::TUN_FLAGS, d.tun_flags.to_ne_bytes().to_vec())?);
        }
    }
    nested(top::DEST, v)
}

pub fn timeout_attrs(t: &Timeouts) -> Result<Vec<Attr>, EncodeError> {
    Ok(vec![
        attr(top::TIMEOUT_TCP, t.tcp_s.to_ne_bytes().to_vec())?,
        attr(top::TIMEOUT_TCP_FIN, t.tcp_fin_s.to_ne_bytes().to_vec())?,
        attr(top::TIMEOUT_UDP, t.udp_s.to_ne_bytes().to_vec())?,
    ])
}

pub fn buffer(attrs: Vec<Attr>) -> GenlBuffer<u16, Buffer> {
    attrs.into_iter().collect()
}

/// Serializes a message body as the kernel would send it (generic netlink header + attributes):
/// the round-trip tests and the fuzzer's seeds use it.
pub fn encode_body(command: u8, attrs: &[Attr]) -> Vec<u8> {
    use neli::ToBytes;
    let mut out = std::io::Cursor::new(vec![command, VERSION, 0, 0]);
    out.set_position(4);
    for a in attrs {
        // Writing into a Vec cannot fail.
        let _ = a.to_bytes(&mut out);
    }
    out.into_inner()
}

#[cfg(test)]
mod tests;
