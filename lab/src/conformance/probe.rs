//! The conformance suite's two ends, run by kpr-lab-peer in the lab's namespaces.
//!
//! - `serve_at`: what answers at an endpoint, at the node's own addresses, and in the sink that
//!   takes whatever the node routes on untranslated. Every TCP line and UDP datagram is answered
//!   `NAME LOCAL_IP:PORT PEER_IP`: who answered, at which address, and whom it saw (the
//!   masquerade bit).
//! - `probe`: connections from one source address, each from its own source port (the runner
//!   hands out ports no earlier probe used, so no flow state of an earlier row can answer), and
//!   what became of each: an answer, refused (a reject), or silence (a drop).
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket},
    time::Duration,
};

use socket2::{Domain, Protocol, Socket, Type};

/// How long a probe waits for a connection or an answer before it calls the row a drop.
pub const SILENCE: Duration = Duration::from_millis(1500);

/// Answers on `ports` at each of `addrs`, over TCP and UDP, until the namespace goes. A socket
/// per address, so a UDP answer leaves from the address the client asked.
pub fn serve_at(name: &str, addrs: &[Ipv4Addr], ports: &[u16]) {
    let mut threads = Vec::new();
    for (&addr, &port) in addrs.iter().flat_map(|a| ports.iter().map(move |p| (a, p))) {
        let l = TcpListener::bind((addr, port)).unwrap_or_else(|e| panic!("bind tcp {addr}:{port}: {e}"));
        let n = name.to_string();
        threads.push(std::thread::spawn(move || answer_streams(l, n)));
        // SCTP where the kernel has it: one-to-one sockets read and write as TCP ones do.
        if let Some(l) = sctp_listener(SocketAddrV4::new(addr, port)) {
            let n = name.to_string();
            threads.push(std::thread::spawn(move || answer_streams(l, n)));
        }
        let u = UdpSocket::bind((addr, port)).unwrap_or_else(|e| panic!("bind udp {addr}:{port}: {e}"));
        let n = name.to_string();
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            loop {
                if let Ok((_, from)) = u.recv_from(&mut buf) {
                    let _ = u.send_to(format!("{n} {addr}:{port} {}", from.ip()).as_bytes(), from);
                }
            }
        }));
    }
    println!("ready");
    for t in threads {
        let _ = t.join();
    }
}

/// Whether this kernel has SCTP sockets.
pub fn sctp_available() -> bool {
    Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::from(libc::IPPROTO_SCTP))).is_ok()
}

fn sctp_listener(at: SocketAddrV4) -> Option<TcpListener> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::from(libc::IPPROTO_SCTP))).ok()?;
    s.bind(&SocketAddr::V4(at).into()).ok()?;
    s.listen(64).ok()?;
    Some(s.into())
}

/// Answers every line of every connection of `l`, a thread each.
fn answer_streams(l: TcpListener, name: String) {
    for conn in l.incoming().flatten() {
        let n = name.clone();
        std::thread::spawn(move || {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
            let local = conn.local_addr().map(|a| a.to_string()).unwrap_or_default();
            let peer = conn.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut w = conn;
            let mut line = String::new();
            while r.read_line(&mut line).map(|k| k > 0).unwrap_or(false) {
                if w.write_all(format!("{n} {local} {peer}\n").as_bytes()).is_err() {
                    break;
                }
                line.clear();
            }
        });
    }
}

/// The protocols a probe speaks.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Some(Proto::Tcp),
            "udp" => Some(Proto::Udp),
            "sctp" => Some(Proto::Sctp),
            _ => None,
        }
    }
}

/// What one connection or datagram met.
fn one(source: SocketAddrV4, target: SocketAddrV4, proto: Proto) -> Result<String, String> {
    let udp = proto == Proto::Udp;
    let (ty, p) = match proto {
        Proto::Tcp => (Type::STREAM, Protocol::TCP),
        Proto::Udp => (Type::DGRAM, Protocol::UDP),
        Proto::Sctp => (Type::STREAM, Protocol::from(libc::IPPROTO_SCTP)),
    };
    let s = Socket::new(Domain::IPV4, ty, Some(p)).map_err(|e| format!("no {} sockets here: {e}", if proto == Proto::Sctp { "SCTP" } else { "such" }))?;
    s.set_reuse_address(true).ok();
    s.bind(&SocketAddr::V4(source).into()).map_err(|e| format!("bind {source}: {e}"))?;
    s.set_read_timeout(Some(SILENCE)).ok();
    s.set_write_timeout(Some(SILENCE)).ok();
    let target_sa: socket2::SockAddr = SocketAddr::V4(target).into();
    let answer = if udp {
        // Connected, so an ICMP error (a reject) surfaces as ECONNREFUSED on the read.
        s.connect(&target_sa).map_err(classify)?;
        s.send(b"where").map_err(classify)?;
        let u: UdpSocket = s.into();
        let mut buf = [0u8; 256];
        let n = u.recv(&mut buf).map_err(classify)?;
        String::from_utf8_lossy(&buf[..n]).to_string()
    } else {
        s.connect_timeout(&target_sa, SILENCE).map_err(classify)?;
        let mut t: std::net::TcpStream = s.into();
        t.write_all(b"where\n").map_err(classify)?;
        let mut line = String::new();
        BufReader::new(t).read_line(&mut line).map_err(classify)?;
        line
    };
    let answer = answer.trim().to_string();
    if answer.is_empty() {
        return Err("closed".into());
    }
    Ok(answer)
}

/// A failure as the suite names it: refused is a reject, silence a drop.
fn classify(e: std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => "refused".into(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => "silence".into(),
        _ => e.to_string(),
    }
}

/// Up to `count` connections (UDP: datagrams, a socket each) from `source`, source ports
/// `first_port`.., to `target`. Stops early once `enough` distinct answers came, or once two
/// attempts in a row failed alike (a reject or a drop repeats). Prints JSON: each answer line
/// with its count, and each failure with its count.
pub fn probe(source: Ipv4Addr, first_port: u16, target: SocketAddrV4, proto: Proto, count: u16, enough: usize) {
    let mut answers: BTreeMap<String, u64> = BTreeMap::new();
    let mut failures: BTreeMap<String, u64> = BTreeMap::new();
    let mut last_failure: Option<String> = None;
    for i in 0..count {
        match one(SocketAddrV4::new(source, first_port + i), target, proto) {
            Ok(a) => {
                *answers.entry(a).or_default() += 1;
                last_failure = None;
                if answers.len() >= enough && i >= 3 {
                    break;
                }
            }
            Err(e) => {
                *failures.entry(e.clone()).or_default() += 1;
                if last_failure.as_ref() == Some(&e) {
                    break;
                }
                last_failure = Some(e);
            }
        }
    }
    println!("{}", serde_json::json!({"answers": answers, "failures": failures}));
}
