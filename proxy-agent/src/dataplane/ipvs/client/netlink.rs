//! The kernel's IPVS over generic netlink, with neli's socket, message and attribute types.
use std::net::IpAddr;

use neli::{
    consts::{
        genl::{CtrlAttr, CtrlCmd},
        nl::{GenlId, NlmF},
        socket::NlFamily,
    },
    genl::{AttrTypeBuilder, Genlmsghdr, GenlmsghdrBuilder, NlattrBuilder},
    nl::{NlPayload, NlmsghdrBuilder},
    socket::synchronous::NlSocketHandle,
    types::{Buffer, GenlBuffer},
    utils::Groups,
};

use crate::netlink::socket::{Acks, NlError};

use super::{
    kernel_err,
    wire::{self, cmd, Attr, Reply},
    Dest, DestConfig, Info, Ipvs, IpvsError, Service, ServiceConfig, ServiceId, Timeouts, Write,
};

pub struct NetlinkIpvs {
    sock: NlSocketHandle,
    family: u16,
    seq: u32,
    /// Requests in flight per sendmsg (1: one at a time).
    depth: usize,
    /// Which of them ask for an ACK.
    acks: Acks,
}

fn sock_err(e: impl std::fmt::Display) -> IpvsError {
    IpvsError::Socket(e.to_string())
}

impl NetlinkIpvs {
    /// Opens a socket in the caller's network namespace and resolves the "IPVS" family.
    pub fn connect() -> Result<Self, IpvsError> {
        let sock = NlSocketHandle::connect(NlFamily::Generic, None, Groups::empty()).map_err(sock_err)?;
        // Large dumps (tens of thousands of services) arrive as many datagrams; a bigger buffer
        // keeps the kernel from dropping any while we decode.
        let _ = sock.set_recv_buffer_size(4 << 20);
        let mut me = NetlinkIpvs { sock, family: 0, seq: 0, depth: crate::netlink::socket::PIPELINE_DEPTH, acks: Acks::Last };
        me.family = me.resolve_family()?;
        Ok(me)
    }

    /// Writes one request at a time, each waiting for its answer (the benchmark's baseline).
    pub fn one_at_a_time(mut self) -> Self {
        self.depth = 1;
        self
    }

    /// Asks for an ACK to every pipelined request (the previous release's way: the benchmark's
    /// baseline).
    pub fn ack_every_request(mut self) -> Self {
        self.acks = Acks::Every;
        self
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn resolve_family(&mut self) -> Result<u16, IpvsError> {
        let seq = self.next_seq();
        let name = NlattrBuilder::default()
            .nla_type(AttrTypeBuilder::default().nla_type(CtrlAttr::FamilyName).build().map_err(sock_err)?)
            .nla_payload(wire::FAMILY)
            .build()
            .map_err(sock_err)?;
        let genl = GenlmsghdrBuilder::<CtrlCmd, CtrlAttr>::default()
            .cmd(CtrlCmd::Getfamily)
            .version(2)
            .attrs(std::iter::once(name).collect::<GenlBuffer<_, _>>())
            .build()
            .map_err(sock_err)?;
        let msg = NlmsghdrBuilder::default()
            .nl_type(GenlId::Ctrl)
            .nl_flags(NlmF::REQUEST | NlmF::ACK)
            .nl_seq(seq)
            .nl_payload(NlPayload::Payload(genl))
            .build()
            .map_err(sock_err)?;
        match crate::netlink::socket::exchange::<_, _, Genlmsghdr<CtrlCmd, CtrlAttr>>(&self.sock, &msg) {
            Ok(replies) => {
                replies.iter().find_map(|p| p.attrs().get_attr_handle().get_attr_payload_as::<u16>(CtrlAttr::FamilyId).ok()).ok_or(IpvsError::NoIpvs)
            }
            Err(NlError::Errno(libc::ENOENT)) => Err(IpvsError::NoIpvs),
            Err(NlError::Errno(errno)) => Err(kernel_err("resolve family", wire::FAMILY, errno)),
            Err(NlError::Socket(e)) => Err(IpvsError::Socket(e)),
        }
    }

    /// Sends one request and collects the generic netlink bodies of its replies: every message
    /// of a dump up to NLMSG_DONE, or up to the ACK of a plain request.
    fn request(&mut self, command: u8, dump: bool, attrs: Vec<Attr>, op: &'static str, object: &dyn std::fmt::Display) -> Result<Vec<Buffer>, IpvsError> {
        let msg = self.message(command, if dump { NlmF::REQUEST | NlmF::DUMP } else { NlmF::REQUEST | NlmF::ACK }, attrs)?;
        match crate::netlink::socket::exchange::<_, _, Buffer>(&self.sock, &msg) {
            Ok(bodies) => Ok(bodies),
            Err(NlError::Errno(errno)) => Err(kernel_err(op, object, errno)),
            Err(NlError::Socket(e)) => Err(IpvsError::Socket(e)),
        }
    }

    fn message(&mut self, command: u8, flags: NlmF, attrs: Vec<Attr>) -> Result<neli::nl::Nlmsghdr<u16, Genlmsghdr<u8, u16>>, IpvsError> {
        let seq = self.next_seq();
        let genl = GenlmsghdrBuilder::<u8, u16>::default().cmd(command).version(wire::VERSION).attrs(wire::buffer(attrs)).build().map_err(sock_err)?;
        NlmsghdrBuilder::default().nl_type(self.family).nl_flags(flags).nl_seq(seq).nl_payload(NlPayload::Payload(genl)).build().map_err(sock_err)
    }

    /// A write's command and attributes.
    fn encode(w: &Write) -> Result<(u8, Vec<Attr>), IpvsError> {
        Ok(match w {
            Write::AddService(s) => (cmd::NEW_SERVICE, vec![wire::service_attr(s)?]),
            Write::UpdateService(s) => (cmd::SET_SERVICE, vec![wire::service_attr(s)?]),
            Write::DelService(id) => (cmd::DEL_SERVICE, vec![wire::service_id_attr(id)?]),
            Write::AddDest(id, d) => (cmd::NEW_DEST, vec![wire::service_id_attr(id)?, wire::dest_attr(d, true)?]),
            Write::UpdateDest(id, d) => (cmd::SET_DEST, vec![wire::service_id_attr(id)?, wire::dest_attr(d, true)?]),
            Write::DelDest(id, addr, port) => {
                let d = DestConfig::new(*addr, *port, super::FwdMethod::Masq, 0);
                (cmd::DEL_DEST, vec![wire::service_id_attr(id)?, wire::dest_attr(&d, false)?])
            }
        })
    }

    fn apply_one(&mut self, w: Write) -> Result<(), IpvsError> {
        self.apply(std::slice::from_ref(&w)).pop().unwrap_or(Ok(()))
    }

    fn decode_all(&self, op: &'static str, bodies: Vec<Buffer>, svc_af: u16) -> Result<Vec<Reply>, IpvsError> {
        bodies.iter().map(|b| wire::decode_reply(b.as_ref(), svc_af).map_err(|err| IpvsError::Decode { op, err })).collect()
    }
}

impl Ipvs for NetlinkIpvs {
    /// Pipelined: many requests per sendmsg, an answer each. Deletes are idempotent (a missing
    /// object is what the caller wanted).
    fn apply(&mut self, writes: &[Write]) -> Vec<Result<(), IpvsError>> {
        let mut out: Vec<Option<Result<(), IpvsError>>> = Vec::with_capacity(writes.len());
        let mut msgs = Vec::with_capacity(writes.len());
        let mut sent = Vec::with_capacity(writes.len());
        for (i, w) in writes.iter().enumerate() {
            match Self::encode(w).and_then(|(c, attrs)| self.message(c, NlmF::REQUEST | NlmF::ACK, attrs)) {
                Ok(m) => {
                    msgs.push(m);
                    sent.push(i);
                    out.push(None);
                }
                Err(e) => out.push(Some(Err(e))),
            }
        }
        match crate::netlink::socket::pipeline(&self.sock, &msgs, self.depth, self.acks) {
            Ok(answers) => {
                for (i, answer) in sent.into_iter().zip(answers) {
                    let w = &writes[i];
                    out[i] = Some(match answer {
                        Ok(()) => Ok(()),
                        Err(libc::ESRCH | libc::ENOENT) if w.is_delete() => Ok(()),
                        Err(errno) => Err(kernel_err(w.op(), w.object(), errno)),
                    });
                }
            }
            Err(e) => {
                let e = match e {
                    NlError::Errno(errno) => kernel_err("write", "", errno).to_string(),
                    NlError::Socket(s) => s,
                };
                for i in sent {
                    out[i] = Some(Err(IpvsError::Socket(e.clone())));
                }
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Ok(()))).collect()
    }

    fn info(&mut self) -> Result<Info, IpvsError> {
        let b = self.request(cmd::GET_INFO, false, vec![], "get info", &"")?;
        match self.decode_all("get info", b, 0)?.pop() {
            Some(Reply::Info(i)) => Ok(i),
            _ => Err(IpvsError::Decode { op: "get info", err: wire::DecodeError::Missing { ctx: "info", what: "reply" } }),
        }
    }

    fn services(&mut self) -> Result<Vec<Service>, IpvsError> {
        let b = self.request(cmd::GET_SERVICE, true, vec![], "list services", &"")?;
        Ok(self.decode_all("list services", b, 0)?.into_iter().filter_map(|r| if let Reply::Service(s) = r { Some(s) } else { None }).collect())
    }

    fn service(&mut self, id: &ServiceId) -> Result<Option<Service>, IpvsError> {
        match self.request(cmd::GET_SERVICE, false, vec![wire::service_id_attr(id)?], "get service", id) {
            Err(e) if matches!(e.errno(), Some(libc::ESRCH) | Some(libc::ENOENT)) => Ok(None),
            r => Ok(self.decode_all("get service", r?, 0)?.into_iter().find_map(|r| if let Reply::Service(s) = r { Some(s) } else { None })),
        }
    }

    fn add_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError> {
        self.apply_one(Write::AddService(s.clone()))
    }

    fn update_service(&mut self, s: &ServiceConfig) -> Result<(), IpvsError> {
        self.apply_one(Write::UpdateService(s.clone()))
    }

    fn del_service(&mut self, id: &ServiceId) -> Result<(), IpvsError> {
        self.apply_one(Write::DelService(*id))
    }

    fn dests(&mut self, id: &ServiceId) -> Result<Vec<Dest>, IpvsError> {
        let b = self.request(cmd::GET_DEST, true, vec![wire::service_id_attr(id)?], "list destinations", id)?;
        Ok(self.decode_all("list destinations", b, id.family())?.into_iter().filter_map(|r| if let Reply::Dest(d) = r { Some(d) } else { None }).collect())
    }

    fn add_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError> {
        self.apply_one(Write::AddDest(*id, d.clone()))
    }

    fn update_dest(&mut self, id: &ServiceId, d: &DestConfig) -> Result<(), IpvsError> {
        self.apply_one(Write::UpdateDest(*id, d.clone()))
    }

    fn del_dest(&mut self, id: &ServiceId, addr: IpAddr, port: u16) -> Result<(), IpvsError> {
        self.apply_one(Write::DelDest(*id, addr, port))
    }

    fn flush(&mut self) -> Result<(), IpvsError> {
        self.request(cmd::FLUSH, false, vec![], "flush", &"").map(drop)
    }

    fn zero(&mut self, id: Option<&ServiceId>) -> Result<(), IpvsError> {
        let attrs = match id {
            Some(id) => vec![wire::service_id_attr(id)?],
            None => vec![],
        };
        self.request(cmd::ZERO, false, attrs, "zero counters", &"").map(drop)
    }

    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        let b = self.request(cmd::GET_CONFIG, false, vec![], "get timeouts", &"")?;
        match self.decode_all("get timeouts", b, 0)?.pop() {
            Some(Reply::Timeouts(t)) => Ok(t),
            _ => Err(IpvsError::Decode { op: "get timeouts", err: wire::DecodeError::Missing { ctx: "config", what: "reply" } }),
        }
    }

    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        self.request(cmd::SET_CONFIG, false, wire::timeout_attrs(t)?, "set timeouts", &"").map(drop)
    }
}
