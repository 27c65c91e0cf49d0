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
mod tests {
    use super::*;
    use crate::dataplane::ipvs::client::flags;

    fn sample_service() -> ServiceConfig {
        ServiceConfig {
            id: ServiceId::Addr { proto: 6, addr: "10.96.0.10".parse().unwrap(), port: 53 },
            scheduler: "wrr".into(),
            flags: flags::PERSISTENT | flags::HASHED,
            timeout_s: 300,
            netmask: 0xffff_ffff,
            pe_name: None,
        }
    }

    #[test]
    fn service_round_trips() {
        let c = sample_service();
        let body = encode_body(cmd::NEW_SERVICE, &[service_attr(&c).unwrap()]);
        let Reply::Service(s) = decode_reply(&body, AF_INET).unwrap() else { panic!("not a service") };
        assert_eq!(s.config, c);
        let fw = ServiceConfig { id: ServiceId::Fwmark { v6: false, mark: 0x4001 }, ..c };
        let body = encode_body(cmd::NEW_SERVICE, &[service_attr(&fw).unwrap()]);
        assert_eq!(decode_reply(&body, AF_INET).unwrap(), Reply::Service(Service { config: fw, stats: Stats::default() }));
    }

    #[test]
    fn dest_round_trips_every_method() {
        for (fwd, tun) in [(FwdMethod::Masq, None), (FwdMethod::Route, None), (FwdMethod::Tunnel, Some(TunType::Gue))] {
            let d = DestConfig {
                addr: "10.244.1.2".parse().unwrap(),
                port: 8080,
                fwd,
                weight: 7,
                upper_threshold: 100,
                lower_threshold: 10,
                tun_type: tun,
                tun_port: tun.map(|_| 6080),
                tun_flags: 0,
            };
            let body = encode_body(cmd::NEW_DEST, &[dest_attr(&d, true).unwrap()]);
            let Reply::Dest(got) = decode_reply(&body, AF_INET).unwrap() else { panic!("not a dest") };
            assert_eq!(got.config, d);
        }
    }

    #[test]
    fn malformed_replies_are_errors() {
        let body = encode_body(cmd::NEW_SERVICE, &[service_attr(&sample_service()).unwrap()]);
        // Every truncation is an error, never a panic.
        for cut in 0..body.len() {
            let r = decode_reply(&body[..cut], AF_INET);
            assert!(r.is_err(), "truncated to {cut} decoded: {r:?}");
        }
        let unknown = encode_body(cmd::NEW_SERVICE, &[nested(top::SERVICE, vec![attr(99, vec![1, 2, 3, 4]).unwrap()]).unwrap()]);
        assert!(matches!(decode_reply(&unknown, AF_INET), Err(DecodeError::Unknown { ty: 99, .. })));
        let short_port = encode_body(cmd::NEW_DEST, &[nested(top::DEST, vec![attr(dest::PORT, vec![1]).unwrap()]).unwrap()]);
        assert!(matches!(decode_reply(&short_port, AF_INET), Err(DecodeError::BadSize { .. })));
        // Deterministic byte flips over a real message: decoding never panics.
        let mut x = 0x9e37_79b9u32;
        for _ in 0..20_000 {
            let mut m = body.clone();
            for _ in 0..3 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let i = x as usize % m.len();
                m[i] = (x >> 8) as u8;
            }
            let _ = decode_reply(&m, AF_INET);
        }
    }

    #[test]
    fn stats_prefer_64_bit() {
        let s32 = nested(svc::STATS, vec![attr(stats::CONNS, 5u32.to_ne_bytes().to_vec()).unwrap()]).unwrap();
        let s64 = nested(
            svc::STATS64,
            vec![
                attr(stats::CONNS, 7u64.to_ne_bytes().to_vec()).unwrap(),
                attr(stats::PAD, vec![]).unwrap(),
                attr(stats::INBYTES, (1u64 << 40).to_ne_bytes().to_vec()).unwrap(),
            ],
        )
        .unwrap();
        let mut inner = sample_service().id.identity_attrs().unwrap();
        inner.extend([attr(svc::SCHED_NAME, b"rr\0".to_vec()).unwrap(), attr(svc::FLAGS, vec![0; 8]).unwrap(), s32, s64]);
        let body = encode_body(cmd::NEW_SERVICE, &[nested(top::SERVICE, inner).unwrap()]);
        let Reply::Service(s) = decode_reply(&body, AF_INET).unwrap() else { panic!() };
        assert_eq!((s.stats.conns, s.stats.inbytes), (7, 1 << 40));
    }

    #[test]
    fn the_netmask_is_a_network_order_mask_for_ipv4_and_a_plain_prefix_length_for_ipv6() {
        let v6 = ServiceConfig { id: ServiceId::Addr { proto: 6, addr: "fd00::10".parse().unwrap(), port: 80 }, netmask: 128, ..sample_service() };
        let v4 = ServiceConfig { netmask: 0xffff_ff00, ..sample_service() };
        let raw = |c: &ServiceConfig| {
            let a = service_attr(c).unwrap();
            let body = encode_body(cmd::NEW_SERVICE, &[a]);
            // The one NETMASK attribute in the nested service: its 4 bytes after the header.
            let pos = body.windows(4).position(|w| w == [8, 0, svc::NETMASK as u8, 0]).expect("netmask attribute");
            [body[pos + 4], body[pos + 5], body[pos + 6], body[pos + 7]]
        };
        assert_eq!(raw(&v6), 128u32.to_ne_bytes());
        assert_eq!(raw(&v4), [255, 255, 255, 0]);
        assert_eq!(netmask_host(AF_INET6, u32::from_ne_bytes(raw(&v6))), 128);
        assert_eq!(netmask_host(AF_INET, u32::from_ne_bytes(raw(&v4))), 0xffff_ff00);
    }

    #[test]
    fn oversized_attributes_are_encode_errors() {
        // A name past a u16 attribute length: an error, not a wrapped length or an overflow panic.
        let c = ServiceConfig { scheduler: "x".repeat(70_000), ..sample_service() };
        assert!(service_attr(&c).is_err());
        let c = ServiceConfig { scheduler: "x".repeat(65_500), ..sample_service() };
        assert!(service_attr(&c).is_err(), "fits alone, not nested with the other attributes");
    }

    /// The fuzzer's seed corpus (proxy-agent/fuzz/corpus/ipvs_decode): one reply of each kind.
    fn fuzz_seeds() -> Vec<(&'static str, Vec<u8>)> {
        let v6 = ServiceConfig {
            id: ServiceId::Addr { proto: 17, addr: "fd00::10".parse().unwrap(), port: 5060 },
            scheduler: "mh".into(),
            flags: flags::PERSISTENT | flags::MH_PORT,
            timeout_s: 60,
            netmask: 128,
            pe_name: Some("sip".into()),
        };
        let mut v6_attr = service_attr(&v6).unwrap();
        let st64 = [(stats::CONNS, 3u64), (stats::INPKTS, 40), (stats::INBYTES, 1 << 33)];
        let st64 = nested(svc::STATS64, st64.iter().map(|&(t, n)| attr(t, n.to_ne_bytes().to_vec()).unwrap()).collect()).unwrap();
        v6_attr = v6_attr.nest(&st64).unwrap();
        let tun = DestConfig {
            tun_type: Some(TunType::Gue),
            tun_port: Some(6080),
            tun_flags: 0x1,
            ..DestConfig::new("10.244.1.2".parse().unwrap(), 8080, FwdMethod::Tunnel, 5)
        };
        let info = [
            attr(info::VERSION, ((1u32 << 16) | (2 << 8) | 1).to_ne_bytes().to_vec()).unwrap(),
            attr(info::CONN_TAB_SIZE, 4096u32.to_ne_bytes().to_vec()).unwrap(),
        ];
        let t = Timeouts { tcp_s: 900, tcp_fin_s: 120, udp_s: 300 };
        vec![
            ("seed-new-service", encode_body(cmd::NEW_SERVICE, &[service_attr(&sample_service()).unwrap()])),
            ("seed-new-service-v6-stats", encode_body(cmd::NEW_SERVICE, &[v6_attr])),
            ("seed-new-dest-tunnel", encode_body(cmd::NEW_DEST, &[service_id_attr(&sample_service().id).unwrap(), dest_attr(&tun, true).unwrap()])),
            ("seed-set-info", encode_body(cmd::SET_INFO, &info)),
            ("seed-set-config", encode_body(cmd::SET_CONFIG, &timeout_attrs(&t).unwrap())),
        ]
    }

    fn seed_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/ipvs_decode")
    }

    #[test]
    #[ignore = "writes the fuzz seeds: cargo test -p proxy-agent --lib write_fuzz_seeds -- --ignored"]
    fn write_fuzz_seeds() {
        for (name, body) in fuzz_seeds() {
            std::fs::write(seed_dir().join(name), body).unwrap();
        }
    }

    #[test]
    fn fuzz_seeds_are_current() {
        for (name, body) in fuzz_seeds() {
            assert!(decode_reply(&body, AF_INET).is_ok(), "{name}");
            let on_disk = std::fs::read(seed_dir().join(name)).unwrap_or_default();
            assert!(on_disk == body, "{name} is stale: run the ignored test write_fuzz_seeds");
        }
    }
}
