//! One request/answer exchange on a neli socket: the loop the IPVS, rtnetlink, ctnetlink and
//! sock_diag clients share (sequence matching, dumps up to NLMSG_DONE, ACKs, errno replies),
//! and a socket of raw-bytes messages for the families kpr encodes itself.
use std::fmt::Debug;

use neli::{
    consts::{
        nl::{NlType, NlmF, Nlmsg},
        socket::NlFamily,
    },
    nl::{NlPayload, Nlmsghdr, NlmsghdrBuilder},
    socket::synchronous::NlSocketHandle,
    types::Buffer,
    utils::Groups,
    FromBytesWithInput, Size, ToBytes,
};

#[derive(Debug)]
pub enum NlError {
    /// The socket, or a message neli could not build or parse.
    Socket(String),
    /// The kernel's answer: a positive errno.
    Errno(i32),
}

/// Sends `msg` and collects the payloads of its answers: every message of a dump up to
/// NLMSG_DONE, or those before the ACK of a plain request (which must ask for one). Answers to
/// other sequence numbers (late replies to abandoned requests) are skipped.
pub fn exchange<T, P, R>(sock: &NlSocketHandle, msg: &Nlmsghdr<T, P>) -> Result<Vec<R>, NlError>
where
    T: NlType + Debug,
    P: Size + ToBytes + Debug,
    R: Size + FromBytesWithInput<Input = usize> + Debug + Clone,
{
    let socket = |e: &dyn std::fmt::Display| NlError::Socket(e.to_string());
    sock.send(msg).map_err(|e| socket(&e))?;
    let seq = *msg.nl_seq();
    let mut out = Vec::new();
    loop {
        let (msgs, _) = sock.recv::<u16, R>().map_err(|e| socket(&e))?;
        for m in msgs {
            let m = m.map_err(|e| socket(&e))?;
            if *m.nl_seq() != seq {
                continue;
            }
            if *m.nl_type() == u16::from(Nlmsg::Done) {
                return Ok(out);
            }
            match m.nl_payload() {
                NlPayload::Payload(p) => out.push(p.clone()),
                NlPayload::Ack(_) => return Ok(out),
                NlPayload::Err(e) => return Err(NlError::Errno(-*e.error())),
                NlPayload::DumpExtAck(_) | NlPayload::Empty => {}
            }
        }
    }
}

/// A netlink socket whose messages are raw bytes after the netlink header (the families kpr
/// encodes itself: ctnetlink, sock_diag), numbering its requests.
pub struct RawSocket {
    sock: NlSocketHandle,
    seq: u32,
}

impl RawSocket {
    pub fn connect(family: NlFamily) -> Result<Self, String> {
        let sock = NlSocketHandle::connect(family, None, Groups::empty()).map_err(|e| e.to_string())?;
        Ok(Self { sock, seq: 0 })
    }

    /// One request of type `ty`; the payloads of its answers.
    pub fn request(&mut self, ty: u16, flags: NlmF, body: Vec<u8>) -> Result<Vec<Buffer>, NlError> {
        self.seq = self.seq.wrapping_add(1);
        let msg = NlmsghdrBuilder::default()
            .nl_type(ty)
            .nl_flags(NlmF::REQUEST | flags)
            .nl_seq(self.seq)
            .nl_payload(NlPayload::Payload(Buffer::from(body)))
            .build()
            .map_err(|e| NlError::Socket(e.to_string()))?;
        exchange(&self.sock, &msg)
    }
}
