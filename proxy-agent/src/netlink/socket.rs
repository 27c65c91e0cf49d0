//! One request/answer exchange on a neli socket: the loop the IPVS, rtnetlink, ctnetlink and
//! sock_diag clients share (sequence matching, dumps up to NLMSG_DONE, ACKs, errno replies);
//! pipelined requests (many per sendmsg, an answer each); and a socket of raw-bytes messages
//! for the families kpr encodes itself.
use std::{collections::HashMap, fmt::Debug, io::Cursor, os::fd::AsRawFd};

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

/// Request bytes per sendmsg: under the default send buffer (a datagram larger than sk_sndbuf
/// is refused).
const PIPELINE_BYTES: usize = 32 << 10;
/// Requests per sendmsg: every answer is an skb of about 1 KiB of receive buffer (its
/// truesize, whatever its length), so 128 in flight stay well inside the default 208 KiB; more
/// and the kernel drops answers (the socket reports ENOBUFS).
pub const PIPELINE_DEPTH: usize = 128;

/// Sends `msgs` (each asking for an ACK, with distinct sequence numbers) up to `depth` per
/// sendmsg (`PIPELINE_DEPTH`; 1: one at a time, each waiting for its answer) and
/// returns each one's outcome, in order: Ok, or the kernel's errno. The kernel runs the
/// messages of a datagram one after another and answers each, so a failure costs only its own
/// message; a later message that depends on it (a destination of a service that failed) fails
/// on its own errno.
pub fn pipeline<T, P>(sock: &NlSocketHandle, msgs: &[Nlmsghdr<T, P>], depth: usize) -> Result<Vec<Result<(), i32>>, NlError>
where
    T: NlType + Debug,
    P: Size + ToBytes + Debug,
{
    let socket = |e: &dyn std::fmt::Display| NlError::Socket(e.to_string());
    let mut out = Vec::with_capacity(msgs.len());
    let mut next = 0;
    while next < msgs.len() {
        let start = next;
        let mut buf = Vec::with_capacity(PIPELINE_BYTES);
        while next < msgs.len() && (buf.is_empty() || (next - start < depth && buf.len() + msgs[next].padded_size() <= PIPELINE_BYTES)) {
            let mut c = Cursor::new(vec![0; msgs[next].padded_size()]);
            msgs[next].to_bytes(&mut c).map_err(|e| socket(&e))?;
            buf.extend_from_slice(c.get_ref());
            next += 1;
        }
        // SAFETY: a plain send(2) of an owned, initialised buffer on the socket's descriptor.
        let sent = unsafe { libc::send(sock.as_raw_fd(), buf.as_ptr().cast(), buf.len(), 0) };
        if sent < 0 {
            return Err(NlError::Socket(format!("sendmsg: {}", std::io::Error::last_os_error())));
        }
        let index: HashMap<u32, usize> = (start..next).map(|i| (*msgs[i].nl_seq(), i - start)).collect();
        let mut answers: Vec<Option<Result<(), i32>>> = vec![None; next - start];
        let mut waiting = answers.len();
        while waiting > 0 {
            let (got, _) = sock.recv::<u16, Buffer>().map_err(|e| socket(&e))?;
            for m in got {
                let m = m.map_err(|e| socket(&e))?;
                let Some(&i) = index.get(m.nl_seq()) else { continue };
                let answer = match m.nl_payload() {
                    NlPayload::Ack(_) => Ok(()),
                    NlPayload::Err(e) => Err(-*e.error()),
                    _ => continue,
                };
                if answers[i].replace(answer).is_none() {
                    waiting -= 1;
                }
            }
        }
        out.extend(answers.into_iter().flatten());
    }
    Ok(out)
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
