//! One request/answer exchange on a neli socket: the loop the IPVS, rtnetlink and ctnetlink
//! clients share (sequence matching, dumps up to NLMSG_DONE, ACKs, errno replies).
use std::fmt::Debug;

use neli::{
    consts::nl::{NlType, Nlmsg},
    nl::{NlPayload, Nlmsghdr},
    socket::synchronous::NlSocketHandle,
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
