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

#[derive(Debug, thiserror::Error)]
pub enum NlError {
    /// The socket, or a message neli could not build or parse.
    #[error("netlink socket: {0}")]
    Socket(String),
    /// The kernel's answer: a positive errno.
    #[error("{}", std::io::Error::from_raw_os_error(*.0))]
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
/// Requests per sendmsg. Only failures and each datagram's last request are answered, but if
/// every request failed each answer would be an skb of about 1 KiB of receive buffer (its
/// truesize, whatever its length): 128 stay well inside the default 208 KiB; more and the
/// kernel could drop answers (the socket reports ENOBUFS).
pub const PIPELINE_DEPTH: usize = 128;

/// Byte offset of `nlmsg_flags` in a netlink header (after the u32 length and the u16 type).
const NLMSG_FLAGS_OFFSET: usize = 6;

/// Which requests of a pipelined datagram ask for an ACK. The kernel answers a failure either
/// way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Acks {
    /// Only the last: its answer comes after every earlier failure's, so a request not
    /// answered by then succeeded.
    #[default]
    Last,
    /// Every request (the previous release's way: the benchmark's baseline).
    Every,
}

/// Sends `msgs` (with distinct sequence numbers) up to `depth` per sendmsg (`PIPELINE_DEPTH`;
/// 1: one at a time, each waiting for its answer) and returns each one's outcome, in order: Ok,
/// or the kernel's errno. The kernel runs the messages of a datagram one after another, in the
/// sender's context, and answers a failure whether or not it was asked to (`netlink_rcv_skb`).
/// With `Acks::Last` only each datagram's last request asks for an ACK, which saves the kernel
/// an skb and this process a read for each request that succeeds (neli's read re-zeroes its
/// 32 KiB buffer every time, and one read returns one answer). A failure costs only its own
/// message; a later message that depends on it (a destination of a service that failed) fails
/// on its own errno.
pub fn pipeline<T, P>(sock: &NlSocketHandle, msgs: &[Nlmsghdr<T, P>], depth: usize, acks: Acks) -> Result<Vec<Result<(), i32>>, NlError>
where
    T: NlType + Debug,
    P: Size + ToBytes + Debug,
{
    let socket = |e: &dyn std::fmt::Display| NlError::Socket(e.to_string());
    let mut out = Vec::with_capacity(msgs.len());
    let mut next = 0;
    let mut c = Cursor::new(Vec::with_capacity(PIPELINE_BYTES));
    let mut starts = Vec::with_capacity(depth.min(PIPELINE_DEPTH));
    while next < msgs.len() {
        let start = next;
        c.get_mut().clear();
        c.set_position(0);
        starts.clear();
        while next < msgs.len() && (starts.is_empty() || (next - start < depth && c.get_ref().len() + msgs[next].padded_size() <= PIPELINE_BYTES)) {
            let at = c.get_ref().len();
            msgs[next].to_bytes(&mut c).map_err(|e| socket(&e))?;
            let end = at + msgs[next].padded_size();
            c.get_mut().resize(end, 0);
            c.set_position(end as u64);
            starts.push(at);
            next += 1;
        }
        let buf = c.get_mut();
        let last = *starts.last().expect("a batch has a request");
        for &at in &starts {
            let flags = &mut buf[at + NLMSG_FLAGS_OFFSET..at + NLMSG_FLAGS_OFFSET + 2];
            let f = u16::from_ne_bytes([flags[0], flags[1]]);
            let ack = u16::from(NlmF::ACK);
            let asks = acks == Acks::Every || at == last;
            flags.copy_from_slice(&if asks { f | ack } else { f & !ack }.to_ne_bytes());
        }
        // SAFETY: a plain send(2) of an owned, initialised buffer on the socket's descriptor.
        let sent = unsafe { libc::send(sock.as_raw_fd(), buf.as_ptr().cast(), buf.len(), 0) };
        if sent < 0 {
            return Err(NlError::Socket(format!("sendmsg: {}", std::io::Error::last_os_error())));
        }
        let index: HashMap<u32, usize> = (start..next).map(|i| (*msgs[i].nl_seq(), i - start)).collect();
        let mut answers: Vec<Result<(), i32>> = vec![Ok(()); next - start];
        let mut answered = vec![false; next - start];
        // Every: each request's answer; Last: the last one's (all others' precede it).
        let mut waiting = if acks == Acks::Every { answers.len() } else { 1 };
        while waiting > 0 {
            let (got, _) = sock.recv::<u16, Buffer>().map_err(|e| socket(&e))?;
            for m in got {
                let m = m.map_err(|e| socket(&e))?;
                let Some(&i) = index.get(m.nl_seq()) else { continue };
                match m.nl_payload() {
                    NlPayload::Ack(_) => {}
                    NlPayload::Err(e) => answers[i] = Err(-*e.error()),
                    _ => continue,
                }
                if !std::mem::replace(&mut answered[i], true) && (acks == Acks::Every || i + 1 == answers.len()) {
                    waiting -= 1;
                }
            }
        }
        out.extend(answers);
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
    pub fn connect(family: NlFamily) -> Result<Self, NlError> {
        let sock = NlSocketHandle::connect(family, None, Groups::empty()).map_err(|e| NlError::Socket(e.to_string()))?;
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
