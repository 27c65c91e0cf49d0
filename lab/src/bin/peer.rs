//! kpr-lab-peer: the TCP/UDP servers and clients of the namespace lab and the end-to-end tests.
//! Every loop is bounded by a count and a deadline.
//!
//!   serve  NAME TCP_PORT UDP_PORT          answer every request with NAME, over TCP and UDP, and over
//!                                          SCTP on TCP_PORT where the kernel has SCTP, over IPv6 too where the
//!                                          namespace has it ("who": NAME and the
//!                                          client address it sees; "up N" + N bytes: NAME once read;
//!                                          "down N": N bytes, then NAME)
//!   burst  IP:PORT tcp|udp|sctp COUNT      COUNT short connections (IPv6: [IP]:PORT); prints JSON {name: count, "errors": n}
//!   hold   IP:PORT SECONDS                 one TCP connection, a request every 50 ms; prints JSON
//!   stream IP:PORT SECONDS                 new TCP connections back to back for SECONDS; prints JSON
//!   rate   IP:PORT SECONDS                 back-to-back short TCP connections; prints JSON with the
//!                                          rate and the latency percentiles (µs) of a connection
//!   churn  IP:PORT SECONDS fin|rst|server|udp
//!                                          back-to-back short connections as a busy client opens
//!                                          them: TCP with a request line and its answer, closed by
//!                                          the client (FIN, or RST with SO_LINGER 0) or by the
//!                                          server first ("server": the backend keeps TIME_WAIT);
//!                                          udp: a new socket per query (DNS-style). Prints JSON
//!                                          with the rate, the connect (UDP: answer) latency
//!                                          percentiles (µs), the connects that took a SYN's
//!                                          retransmission (>= 900 ms), and the failures
//!   get    IP:PORT PATH [BODY]             one HTTP/1.0 GET (PUT with a body); prints the status line, then the body
//!   who    IP:PORT                         one TCP request "who"; prints JSON {name, seen}: whom the backend saw
//!   bulk   IP:PORT BYTES                   one TCP connection: BYTES up, then BYTES down; prints JSON
//!   udpc   IP:PORT COUNT                   COUNT requests on one connected UDP socket (ICMP errors
//!                                          surface as errors, e.g. "Connection refused"); prints JSON
//!   udpu   IP:PORT COUNT                   COUNT requests on one unconnected UDP socket (sendto,
//!                                          recvfrom; an answer from another address is an error);
//!                                          prints JSON
//!   udpc-hold IP:PORT SECONDS              a connected UDP socket, a request every 50 ms; prints
//!                                          "MS NAME" per answer, "MS error E" per failure (then
//!                                          reconnects), finally JSON
//!   skew   IP:PORT N                       N rounds of one long-held and two short TCP connections,
//!                                          100 ms apart, on CPU 0; prints JSON {name: long ones}
//!   hold-many IP:PORT N                    N TCP connections, one request each; prints "ready"; half
//!                                          of them stay busy, half idle; on a stdin line, one more
//!                                          request on each: JSON {same, moved, errors}
//!   serve-at NAME ADDRS PORTS              the conformance suite's server: TCP and UDP on each of
//!                                          PORTS at each of ADDRS (comma-separated); answers
//!                                          "NAME LOCAL PEER"
//!   probe  SRC FIRST_PORT IP:PORT tcp|udp|sctp COUNT ENOUGH
//!                                          the conformance suite's client: up to COUNT connections
//!                                          from SRC:FIRST_PORT.. ; prints JSON {answers, failures}
//!   synflood IP:PORT COUNT                 COUNT TCP SYNs from random spoofed sources in
//!                                          10.244.128.0/17 (raw socket); prints JSON
//!   udpflood IP:PORT COUNT                 the same with UDP datagrams (4 bytes each)
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

/// A one-to-one (stream) SCTP socket: it reads and writes like a TCP one, so std's TCP types
/// carry it. None where the kernel has no SCTP.
fn sctp_socket() -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: socket(2); the descriptor is owned from here on.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, libc::IPPROTO_SCTP) };
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn sockaddr(a: SocketAddr) -> libc::sockaddr_in {
    let SocketAddr::V4(a) = a else { panic!("IPv4 only: {a}") };
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
        sin_zero: [0; 8],
    }
}

fn sctp_listener(port: u16) -> Option<TcpListener> {
    use std::os::fd::AsRawFd;
    let fd = sctp_socket()?;
    let sa = sockaddr(SocketAddr::from(([0, 0, 0, 0], port)));
    // SAFETY: bind(2) and listen(2) on our descriptor with a valid sockaddr_in.
    let ok = unsafe {
        libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as u32) == 0
            && libc::listen(fd.as_raw_fd(), 128) == 0
    };
    ok.then(|| TcpListener::from(fd))
}

fn one_sctp(target: SocketAddr) -> Result<String, String> {
    use std::os::fd::AsRawFd;
    let fd = sctp_socket().ok_or("no SCTP in this kernel")?;
    let tv = libc::timeval { tv_sec: 5, tv_usec: 0 };
    let sa = sockaddr(target);
    // SAFETY: setsockopt(2) and connect(2) on our descriptor with valid arguments; the send
    // timeout bounds the connect.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        );
        libc::connect(fd.as_raw_fd(), (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as u32)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    exchange(TcpStream::from(fd))
}

/// An IPv6-only socket bound to [::]:port (beside the IPv4 one on the same port), listening
/// when it is a stream socket. None where the namespace has no IPv6.
fn v6_only(kind: libc::c_int, port: u16) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: socket(2), setsockopt(2), bind(2), listen(2) on our own descriptor with valid
    // arguments; the descriptor is owned from its creation.
    unsafe {
        let fd = libc::socket(libc::AF_INET6, kind | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
        let one: libc::c_int = 1;
        libc::setsockopt(fd.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, (&one as *const libc::c_int).cast(), 4);
        let mut sa: libc::sockaddr_in6 = std::mem::zeroed();
        sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        sa.sin6_port = port.to_be();
        let ok = libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_in6).cast(), std::mem::size_of::<libc::sockaddr_in6>() as u32) == 0
            && (kind != libc::SOCK_STREAM || libc::listen(fd.as_raw_fd(), 128) == 0);
        ok.then_some(fd)
    }
}

fn serve(name: String, tcp: u16, udp: u16) {
    if let Some(l) = sctp_listener(tcp) {
        let name = name.clone();
        std::thread::spawn(move || answer_all(l, name));
    }
    // The same answers over IPv6, where the namespace has it (dual-stack tests).
    if let Some(fd) = v6_only(libc::SOCK_STREAM, tcp) {
        let name = name.clone();
        std::thread::spawn(move || answer_all(TcpListener::from(fd), name));
    }
    if let Some(fd) = v6_only(libc::SOCK_DGRAM, udp) {
        let name = name.clone();
        std::thread::spawn(move || {
            let s = UdpSocket::from(fd);
            let mut buf = [0u8; 1500];
            loop {
                if let Ok((_, from)) = s.recv_from(&mut buf) {
                    let _ = s.send_to(name.as_bytes(), from);
                }
            }
        });
    }
    let n2 = name.clone();
    std::thread::spawn(move || {
        let s = UdpSocket::bind(("0.0.0.0", udp)).expect("udp bind");
        let mut buf = [0u8; 1500];
        loop {
            if let Ok((_, from)) = s.recv_from(&mut buf) {
                let _ = s.send_to(n2.as_bytes(), from);
            }
        }
    });
    let l = TcpListener::bind(("0.0.0.0", tcp)).expect("tcp bind");
    println!("ready");
    answer_all(l, name);
}

/// Answers the connections of `l` (TCP, or SCTP in a TCP type), a thread each.
fn answer_all(l: TcpListener, name: String) {
    for conn in l.incoming().flatten() {
        let name = name.clone();
        std::thread::spawn(move || {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
            let peer = conn.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut w = conn;
            let mut line = String::new();
            // One answer per request line, until the client closes.
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                let answer = match line.trim().split_once(' ') {
                    _ if line.trim() == "who" => format!("{name} {peer}\n"),
                    // The server closes first: its side of the tuple keeps TIME_WAIT.
                    _ if line.trim() == "bye" => {
                        let _ = w.write_all(format!("{name}\n").as_bytes());
                        break;
                    }
                    Some(("up", n)) => {
                        let n: u64 = n.parse().unwrap_or(0).min(1 << 30);
                        if std::io::copy(&mut (&mut r).take(n), &mut std::io::sink()).map(|got| got != n).unwrap_or(true) {
                            break;
                        }
                        format!("{name}\n")
                    }
                    Some(("down", n)) => {
                        let n: usize = n.parse().unwrap_or(0).min(1 << 30);
                        if w.write_all(&vec![b'x'; n]).is_err() {
                            break;
                        }
                        format!("{name}\n")
                    }
                    _ => format!("{name}\n"),
                };
                if w.write_all(answer.as_bytes()).is_err() {
                    break;
                }
                line.clear();
            }
        });
    }
}

fn one_tcp(target: SocketAddr) -> Result<String, String> {
    // Generous timeouts: a broken flow shows up as a reset at once; only a loaded machine is slow.
    exchange(TcpStream::connect_timeout(&target, Duration::from_secs(5)).map_err(|e| e.to_string())?)
}

/// One request line, one answer line.
fn exchange(mut s: TcpStream) -> Result<String, String> {
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    s.write_all(b"hi\n").map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    if line.is_empty() {
        return Err("closed".into());
    }
    Ok(line.trim().to_string())
}

fn one_udp(target: SocketAddr) -> Result<String, String> {
    let s = UdpSocket::bind(if target.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_millis(1500))).ok();
    s.send_to(b"hi", target).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 256];
    let (n, from) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
    // A resolver drops answers from another address than it asked: so do we.
    if from != target {
        return Err(format!("reply from {from}, not {target}"));
    }
    Ok(String::from_utf8_lossy(&buf[..n]).to_string())
}

/// How `churn` ends each connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Close {
    /// The client closes first: FIN.
    Fin,
    /// The client aborts: RST (SO_LINGER 0), as load generators and health checkers do.
    Rst,
    /// The server closes first, then the client.
    Server,
    /// UDP: a new socket per query.
    Udp,
}

impl Close {
    fn parse(s: &str) -> Self {
        match s {
            "fin" => Close::Fin,
            "rst" => Close::Rst,
            "server" => Close::Server,
            "udp" => Close::Udp,
            _ => panic!("churn closes by fin, rst, server or udp, not {s:?}"),
        }
    }
}

/// One `churn` connection (or UDP query); how long its connect (UDP: its answer) took.
fn churn_one(target: SocketAddr, close: Close) -> Result<Duration, String> {
    let t = Instant::now();
    if close == Close::Udp {
        one_udp(target)?;
        return Ok(t.elapsed());
    }
    let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    let connect = t.elapsed();
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    s.write_all(if close == Close::Server { b"bye\n" } else { b"hi\n" }).map_err(|e| e.to_string())?;
    // The answer is a short line: one read takes it whole on a loopback-speed path.
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).map_err(|e| e.to_string())?;
    if n == 0 {
        return Err("closed before the answer".into());
    }
    match close {
        Close::Rst => {
            use std::os::fd::AsRawFd;
            let linger = libc::linger { l_onoff: 1, l_linger: 0 };
            // SAFETY: setsockopt(2) on our own descriptor with a valid struct linger.
            unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&linger as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as u32,
                );
            }
        }
        // Wait for the server's FIN before ours.
        Close::Server => while s.read(&mut buf).map_err(|e| e.to_string())? > 0 {},
        Close::Fin | Close::Udp => {}
    }
    Ok(connect)
}

/// Answers per backend name, failures, and the first failure's reason: every mode's report.
#[derive(Default)]
struct Tally {
    counts: BTreeMap<String, u64>,
    errors: u64,
    first_error: Option<String>,
}

impl Tally {
    fn add(&mut self, r: Result<String, String>) {
        match r {
            Ok(name) => *self.counts.entry(name).or_insert(0) += 1,
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, e: String) {
        self.errors += 1;
        self.first_error.get_or_insert(e);
    }

    fn answers(&self) -> u64 {
        self.counts.values().sum()
    }

    fn report(self) {
        let mut m: BTreeMap<String, serde_json::Value> = self.counts.into_iter().map(|(k, v)| (k, v.into())).collect();
        m.insert("errors".into(), self.errors.into());
        if let Some(e) = self.first_error {
            m.insert("first_error".into(), e.into());
        }
        println!("{}", serde_json::to_string(&m).unwrap());
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_else(|| panic!("missing argument {i}; see the file header for usage"));
    let cmd = arg(0);
    match cmd.as_str() {
        "serve" => serve(arg(1), arg(2).parse().unwrap(), arg(3).parse().unwrap()),
        "serve-at" => {
            let ports: Vec<u16> = arg(3).split(',').map(|p| p.parse().unwrap()).collect();
            let addrs: Vec<std::net::Ipv4Addr> = arg(2).split(',').map(|a| a.parse().unwrap()).collect();
            kpr_lab::conformance::probe::serve_at(&arg(1), &addrs, &ports)
        }
        "probe" => {
            let (count, enough) = (arg(5).parse::<u16>().unwrap().min(100), arg(6).parse().unwrap());
            kpr_lab::conformance::probe::probe(arg(1).parse().unwrap(), arg(2).parse().unwrap(), arg(3).parse().unwrap(), kpr_lab::conformance::probe::Proto::parse(&arg(4)).expect("tcp, udp or sctp"), count, enough)
        }
        "burst" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let proto = arg(2);
            let count: u64 = arg(3).parse().unwrap();
            let mut t = Tally::default();
            let deadline = Instant::now() + Duration::from_secs(60);
            for _ in 0..count.min(100_000) {
                if Instant::now() > deadline {
                    t.fail("burst deadline (60 s) reached".into());
                    break;
                }
                t.add(match proto.as_str() {
                    "udp" => one_udp(target),
                    "sctp" => one_sctp(target),
                    _ => one_tcp(target),
                });
            }
            t.report();
        }
        "hold" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let secs: f64 = arg(2).parse().unwrap();
            let deadline = Instant::now() + Duration::from_secs_f64(secs.min(120.0));
            let mut t = Tally::default();
            match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
                Ok(s) => {
                    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
                    let mut w = s.try_clone().unwrap();
                    let mut r = BufReader::new(s);
                    println!("connected");
                    while Instant::now() < deadline {
                        let mut line = String::new();
                        let ok = w.write_all(b"ping\n").is_ok() && r.read_line(&mut line).map(|n| n > 0).unwrap_or(false);
                        if !ok {
                            t.fail(format!("request on held connection failed after {} answers", t.answers()));
                            break;
                        }
                        t.add(Ok(line.trim().to_string()));
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let mut rest = Vec::new();
                    let _ = r.get_mut().shutdown(std::net::Shutdown::Write);
                    let _ = r.read_to_end(&mut rest);
                }
                Err(e) => t.fail(e.to_string()),
            }
            t.report();
        }
        "stream" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let secs: f64 = arg(2).parse().unwrap();
            let deadline = Instant::now() + Duration::from_secs_f64(secs.min(120.0));
            let mut t = Tally::default();
            let mut n = 0;
            while Instant::now() < deadline && n < 1_000_000 {
                n += 1;
                t.add(one_tcp(target));
            }
            t.report();
        }
        "rate" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let secs: f64 = arg(2).parse().unwrap();
            let start = Instant::now();
            let deadline = start + Duration::from_secs_f64(secs.min(120.0));
            let (mut lat, mut errors, mut first) = (Vec::new(), 0u64, None);
            while Instant::now() < deadline && lat.len() < 5_000_000 {
                let t = Instant::now();
                match one_tcp(target) {
                    Ok(_) => lat.push(t.elapsed().as_secs_f64() * 1e6),
                    Err(e) => {
                        errors += 1;
                        first.get_or_insert(e);
                    }
                }
            }
            let elapsed = start.elapsed().as_secs_f64();
            lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let pct = |p: f64| {
                if lat.is_empty() {
                    0.0
                } else {
                    lat[((lat.len() - 1) as f64 * p) as usize]
                }
            };
            let v = serde_json::json!({"connections": lat.len(), "rate": lat.len() as f64 / elapsed, "p50_us": pct(0.5), "p99_us": pct(0.99), "errors": errors, "first_error": first});
            println!("{v}");
        }
        "churn" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let secs: f64 = arg(2).parse().unwrap();
            let close = Close::parse(&arg(3));
            let start = Instant::now();
            let deadline = start + Duration::from_secs_f64(secs.min(600.0));
            let (mut lat, mut errors, mut first) = (Vec::new(), 0u64, None);
            while Instant::now() < deadline && lat.len() < 20_000_000 {
                match churn_one(target, close) {
                    Ok(connect) => lat.push(connect.as_secs_f64() * 1e6),
                    Err(e) => {
                        errors += 1;
                        first.get_or_insert(e);
                    }
                }
            }
            let elapsed = start.elapsed().as_secs_f64();
            let slow = lat.iter().filter(|&&us| us >= 900_000.0).count();
            lat.sort_by(f64::total_cmp);
            let pct = |p: f64| if lat.is_empty() { 0.0 } else { lat[((lat.len() - 1) as f64 * p) as usize] };
            let v = serde_json::json!({"connections": lat.len(), "rate": lat.len() as f64 / elapsed, "p50_us": pct(0.5), "p99_us": pct(0.99), "slow_connects": slow, "errors": errors, "first_error": first});
            println!("{v}");
        }
        "get" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(2)).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(5))).ok();
            let req = match args.get(3) {
                None => format!("GET {} HTTP/1.0\r\nHost: {target}\r\n\r\n", arg(2)),
                Some(body) => format!("PUT {} HTTP/1.0\r\nHost: {target}\r\nContent-Length: {}\r\n\r\n{body}", arg(2), body.len()),
            };
            s.write_all(req.as_bytes()).unwrap();
            let mut resp = String::new();
            let _ = s.read_to_string(&mut resp);
            let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
            println!("{}", head.lines().next().unwrap_or(""));
            print!("{body}");
        }
        "who" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let r = (|| -> Result<String, String> {
                let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(Duration::from_secs(5))).ok();
                s.write_all(b"who\n").map_err(|e| e.to_string())?;
                let mut line = String::new();
                BufReader::new(s).read_line(&mut line).map_err(|e| e.to_string())?;
                Ok(line.trim().to_string())
            })();
            let v = match r {
                Ok(l) => {
                    let (name, seen) = l.split_once(' ').unwrap_or((&l, ""));
                    serde_json::json!({"name": name, "seen": seen, "errors": 0})
                }
                Err(e) => serde_json::json!({"errors": 1, "first_error": e}),
            };
            println!("{v}");
        }
        "bulk" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let n: usize = arg(2).parse::<usize>().unwrap().min(64 << 20);
            let start = Instant::now();
            let mut t = Tally::default();
            let r = (|| -> Result<String, String> {
                let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).map_err(|e| e.to_string())?;
                // A path MTU black hole stalls a transfer: fail after a while instead.
                s.set_read_timeout(Some(Duration::from_secs(10))).ok();
                s.set_write_timeout(Some(Duration::from_secs(10))).ok();
                s.write_all(format!("up {n}\n").as_bytes()).map_err(|e| e.to_string())?;
                s.write_all(&vec![b'u'; n]).map_err(|e| format!("upload: {e}"))?;
                let mut r = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
                let mut line = String::new();
                r.read_line(&mut line).map_err(|e| format!("upload acknowledgement: {e}"))?;
                s.write_all(format!("down {n}\n").as_bytes()).map_err(|e| e.to_string())?;
                let mut got = 0usize;
                let mut buf = vec![0u8; 65536];
                while got < n {
                    let k = r.read(&mut buf[..(n - got).min(65536)]).map_err(|e| format!("download after {got} bytes: {e}"))?;
                    if k == 0 {
                        return Err(format!("closed after {got} of {n} bytes"));
                    }
                    got += k;
                }
                line.clear();
                r.read_line(&mut line).map_err(|e| e.to_string())?;
                Ok(line.trim().to_string())
            })();
            t.add(r);
            let mut m: BTreeMap<String, serde_json::Value> = t.counts.iter().map(|(k, v)| (k.clone(), (*v).into())).collect();
            m.insert("errors".into(), t.errors.into());
            m.insert("bytes".into(), if t.errors == 0 { (2 * n).into() } else { 0.into() });
            m.insert("seconds".into(), start.elapsed().as_secs_f64().into());
            if let Some(e) = t.first_error {
                m.insert("first_error".into(), e.into());
            }
            println!("{}", serde_json::to_string(&m).unwrap());
        }
        "udpc" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let count: u64 = arg(2).parse::<u64>().unwrap().min(10_000);
            let mut t = Tally::default();
            match UdpSocket::bind("0.0.0.0:0").and_then(|s| s.connect(target).map(|_| s)) {
                Ok(s) => {
                    s.set_read_timeout(Some(Duration::from_millis(1500))).ok();
                    for _ in 0..count {
                        let mut buf = [0u8; 256];
                        let r = s.send(b"hi").and_then(|_| s.recv(&mut buf)).map(|n| String::from_utf8_lossy(&buf[..n]).to_string());
                        t.add(r.map_err(|e| e.to_string()));
                    }
                }
                Err(e) => t.fail(e.to_string()),
            }
            t.report();
        }
        "udpu" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let count: u64 = arg(2).parse::<u64>().unwrap().min(10_000);
            let mut t = Tally::default();
            match UdpSocket::bind(if target.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }) {
                Ok(s) => {
                    s.set_read_timeout(Some(Duration::from_millis(1500))).ok();
                    for _ in 0..count {
                        let mut buf = [0u8; 256];
                        let r = s.send_to(b"hi", target).and_then(|_| s.recv_from(&mut buf));
                        t.add(match r {
                            Ok((n, from)) if from == target => Ok(String::from_utf8_lossy(&buf[..n]).to_string()),
                            Ok((_, from)) => Err(format!("reply from {from}, not {target}")),
                            Err(e) => Err(e.to_string()),
                        });
                    }
                }
                Err(e) => t.fail(e.to_string()),
            }
            t.report();
        }
        "udpc-hold" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let secs: f64 = arg(2).parse::<f64>().unwrap().min(120.0);
            let start = Instant::now();
            let mut t = Tally::default();
            let any = if target.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
            let connect = || UdpSocket::bind(any).and_then(|s| s.connect(target).and_then(|_| s.set_read_timeout(Some(Duration::from_millis(500))).map(|_| s)));
            let mut sock = connect().expect("udp socket");
            while start.elapsed().as_secs_f64() < secs {
                let mut buf = [0u8; 256];
                let ms = start.elapsed().as_millis();
                match sock.send(b"hi").and_then(|_| sock.recv(&mut buf)) {
                    Ok(n) => {
                        let name = String::from_utf8_lossy(&buf[..n]).to_string();
                        println!("{ms} {name}");
                        t.add(Ok(name));
                    }
                    Err(e) => {
                        println!("{ms} error {e}");
                        t.fail(e.to_string());
                        // What a resolver does when its socket fails: a new one.
                        if e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut {
                            sock = connect().expect("udp socket");
                        }
                    }
                }
                let _ = std::io::stdout().flush();
                std::thread::sleep(Duration::from_millis(50));
            }
            t.report();
        }
        "skew" => {
            // Skewed connection lengths: N rounds of one long-lived connection (held to the end)
            // and two short ones, 100 ms apart. Pinned to one CPU, so a per-CPU round-robin
            // cursor sees the pattern whole. Reports where the long ones went.
            let target: SocketAddr = arg(1).parse().unwrap();
            let n: usize = arg(2).parse::<usize>().unwrap().min(200);
            // SAFETY: sched_setaffinity(2) on this thread with a zeroed, then set, cpu_set_t.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
            let mut t = Tally::default();
            let mut held = Vec::new();
            for _ in 0..n {
                match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
                    Ok(s) => {
                        let keep = s.try_clone().unwrap();
                        t.add(exchange(s));
                        held.push(keep);
                    }
                    Err(e) => t.fail(e.to_string()),
                }
                for _ in 0..2 {
                    if let Err(e) = one_tcp(target) {
                        t.fail(e);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            t.report();
            drop(held);
        }
        "hold-many" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let n: usize = arg(2).parse::<usize>().unwrap().min(1000);
            let ask = |s: &mut TcpStream| -> Result<String, String> {
                s.write_all(b"hi\n").map_err(|e| e.to_string())?;
                let mut r = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
                let mut line = String::new();
                match r.read_line(&mut line) {
                    Ok(0) => Err("closed".into()),
                    Ok(_) => Ok(line.trim().to_string()),
                    Err(e) => Err(e.to_string()),
                }
            };
            let mut conns: Vec<(TcpStream, String)> = Vec::new();
            for _ in 0..n {
                let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(5))).ok();
                let name = ask(&mut s).expect("first request");
                conns.push((s, name));
            }
            println!("ready");
            let _ = std::io::stdout().flush();
            // Half stay busy until the check, half idle.
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let busy: Vec<(TcpStream, String)> = conns.drain(..n / 2).collect();
            let worker = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut busy = busy;
                    let mut failed = vec![false; busy.len()];
                    let deadline = Instant::now() + Duration::from_secs(300);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline {
                        for (i, (s, want)) in busy.iter_mut().enumerate() {
                            if !failed[i] && ask(s).as_deref() != Ok(want.as_str()) {
                                failed[i] = true;
                            }
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    (busy, failed)
                })
            };
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let (busy, busy_failed) = worker.join().unwrap();
            let (mut same, mut moved, mut errors) = (0u64, 0u64, 0u64);
            let mut first_error = None;
            let held =
                busy.into_iter().zip(busy_failed).map(|((s, want), failed)| (s, want, failed)).chain(conns.into_iter().map(|(s, want)| (s, want, false)));
            for (mut s, want, failed_while_busy) in held {
                match ask(&mut s) {
                    _ if failed_while_busy => {
                        errors += 1;
                        first_error.get_or_insert("a busy connection failed during the hold".to_string());
                    }
                    Ok(got) if got == want => same += 1,
                    Ok(_) => moved += 1,
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            println!("{}", serde_json::json!({"same": same, "moved": moved, "errors": errors, "first_error": first_error}));
        }
        "synflood" | "udpflood" => {
            let target: SocketAddr = arg(1).parse().unwrap();
            let count: u64 = arg(2).parse::<u64>().unwrap().min(20_000_000);
            let SocketAddr::V4(t4) = target else { panic!("IPv4 only") };
            let proto = if cmd == "synflood" { 6 } else { 17 };
            let sent = flood(*t4.ip(), t4.port(), count, proto);
            println!("{}", serde_json::json!({"sent": sent}));
        }
        other => panic!("unknown command {other:?}; see the file header for usage"),
    }
}

/// Raw TCP SYNs (`proto` 6) or UDP datagrams (17) with spoofed sources (IP_HDRINCL); bounded
/// by `count` and 120 s.
fn flood(dst: std::net::Ipv4Addr, dport: u16, count: u64, proto: u8) -> u64 {
    fn csum(data: &[u8], mut sum: u32) -> u16 {
        for c in data.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    addr.sin_family = libc::AF_INET as u16;
    addr.sin_addr.s_addr = u32::from_ne_bytes(dst.octets());
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut sent = 0;
    while sent < count && (sent % 4096 != 0 || Instant::now() < deadline) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let src = std::net::Ipv4Addr::from(0x0af4_8000u32 | (x as u32 & 0x7fff));
        let sport = 1024 + ((x >> 32) as u16 % 60_000);
        // TCP: a 20-byte header, SYN; UDP: 8 bytes and a 4-byte payload.
        let l4_len: usize = if proto == 6 { 20 } else { 12 };
        let len = 20 + l4_len;
        let mut pkt = [0u8; 40];
        pkt[0] = 0x45;
        pkt[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        pkt[8] = 64;
        pkt[9] = proto;
        pkt[12..16].copy_from_slice(&src.octets());
        pkt[16..20].copy_from_slice(&dst.octets());
        let c = csum(&pkt[..20], 0);
        pkt[10..12].copy_from_slice(&c.to_be_bytes());
        let l4 = &mut pkt[20..len];
        l4[0..2].copy_from_slice(&sport.to_be_bytes());
        l4[2..4].copy_from_slice(&dport.to_be_bytes());
        let csum_at = if proto == 6 {
            l4[4..8].copy_from_slice(&(x as u32).to_be_bytes());
            l4[12] = 5 << 4;
            l4[13] = 0x02;
            l4[14..16].copy_from_slice(&64240u16.to_be_bytes());
            16
        } else {
            l4[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
            l4[8..12].copy_from_slice(b"kpr!");
            6
        };
        let mut pseudo = Vec::with_capacity(32);
        pseudo.extend_from_slice(&src.octets());
        pseudo.extend_from_slice(&dst.octets());
        pseudo.extend_from_slice(&[0, proto, 0, l4_len as u8]);
        pseudo.extend_from_slice(l4);
        // UDP sends a computed zero as all ones (zero says "no checksum").
        let c = match csum(&pseudo, 0) {
            0 if proto == 17 => 0xffff,
            c => c,
        };
        l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        let rc = unsafe {
            libc::sendto(fd, pkt.as_ptr().cast(), len, 0, (&addr as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as u32)
        };
        if rc < 0 {
            // ENOBUFS under load: back off a little, bounded by the deadline.
            std::thread::sleep(Duration::from_micros(50));
            if Instant::now() > deadline {
                break;
            }
            continue;
        }
        sent += 1;
    }
    unsafe { libc::close(fd) };
    sent
}
