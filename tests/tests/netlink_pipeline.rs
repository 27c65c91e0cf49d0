//! Pipelined netlink requests against the running kernel (rtnetlink, in a network namespace of
//! the test thread's own): every request gets its own outcome although only each datagram's
//! last one asks for an answer, wherever in a datagram the failures fall; the same as when
//! every request asks.
use std::{collections::BTreeSet, net::IpAddr, thread};

use neli::{
    consts::{
        nl::NlmF,
        rtnl::{Ifa, RtAddrFamily, RtScope, Rtm},
        socket::NlFamily,
    },
    nl::{NlPayload, Nlmsghdr, NlmsghdrBuilder},
    rtnl::{Ifaddrmsg, IfaddrmsgBuilder, RtattrBuilder},
    socket::synchronous::NlSocketHandle,
    types::{Buffer, RtBuffer},
    utils::Groups,
};
use proxy_agent::netlink::{
    rtnl::{Links, NetlinkLinks},
    socket::{pipeline, Acks, PIPELINE_DEPTH},
};

/// An address request for `addr`/32 on link `ifindex`, numbered `seq`, asking for no answer
/// (the pipeline decides which requests ask).
fn addr_request(ty: Rtm, flags: NlmF, seq: u32, ifindex: u32, addr: IpAddr) -> Nlmsghdr<Rtm, Ifaddrmsg> {
    let IpAddr::V4(v4) = addr else { unreachable!("IPv4 only") };
    let mut attrs = RtBuffer::<Ifa, Buffer>::new();
    for ty in [Ifa::Local, Ifa::Address] {
        attrs.push(RtattrBuilder::default().rta_type(ty).rta_payload(v4.octets().to_vec()).build().unwrap());
    }
    let body = IfaddrmsgBuilder::default()
        .ifa_family(RtAddrFamily::Inet)
        .ifa_prefixlen(32)
        .ifa_scope(RtScope::Universe)
        .ifa_index(ifindex)
        .rtattrs(attrs)
        .build()
        .unwrap();
    NlmsghdrBuilder::default().nl_type(ty).nl_flags(NlmF::REQUEST | flags).nl_seq(seq).nl_payload(NlPayload::Payload(body)).build().unwrap()
}

fn vip(i: u32) -> IpAddr {
    IpAddr::from([10, 77, (i / 250) as u8, (i % 250 + 1) as u8])
}

/// The link's addresses in the test's 10.77.0.0/16.
fn ours(links: &mut NetlinkLinks, ifindex: u32) -> BTreeSet<IpAddr> {
    links.addresses(ifindex).expect("list addresses").into_iter().filter(|a| matches!(a, IpAddr::V4(v) if v.octets()[..2] == [10, 77])).collect()
}

/// Runs `f` on a thread moved into a new, empty network namespace (gone when the thread ends).
fn in_new_netns(f: impl FnOnce() + Send + 'static) {
    thread::spawn(move || {
        // SAFETY: unshare(2) on the calling thread only; it shares no file system state here.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare(CLONE_NEWNET): {} (run as root)", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("the test thread");
}

#[test]
fn each_pipelined_request_gets_its_own_outcome_wherever_the_failures_fall() {
    outcomes_per_request(Acks::Last);
}

#[test]
fn asking_every_request_for_an_ack_gives_the_same_outcomes() {
    outcomes_per_request(Acks::Every);
}

fn outcomes_per_request(acks: Acks) {
    in_new_netns(move || {
        let mut links = NetlinkLinks::connect().expect("rtnetlink");
        // The namespace's loopback (this kernel may have no dummy links).
        let ifindex = links.link_index("lo").expect("list links").expect("lo");
        let sock = NlSocketHandle::connect(NlFamily::Route, None, Groups::empty()).expect("rtnetlink");
        // 300 adds: three datagrams of 128, 128 and 44. Failures at a datagram's first and last
        // requests, in the middle, on the very last, and two in a row.
        let n = 300u32;
        let duplicate_of = |i: u32| match i {
            127 | 128 | 255 | 299 => Some(i - 100),
            5 | 6 => Some(0),
            _ => None,
        };
        let no_such_link = |i: u32| i == 200;
        let msgs: Vec<_> = (0..n)
            .map(|i| {
                let addr = duplicate_of(i).map_or(vip(i), vip);
                let link = if no_such_link(i) { 999_999 } else { ifindex };
                addr_request(Rtm::Newaddr, NlmF::CREATE | NlmF::EXCL, i + 1, link, addr)
            })
            .collect();
        let got: Vec<Option<i32>> = pipeline(&sock, &msgs, PIPELINE_DEPTH, acks).expect("the pipeline").into_iter().map(Result::err).collect();
        let want: Vec<Option<i32>> = (0..n)
            .map(|i| {
                if duplicate_of(i).is_some() {
                    Some(libc::EEXIST)
                } else if no_such_link(i) {
                    Some(libc::ENODEV)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(got, want, "per-request outcomes");
        let bound: BTreeSet<IpAddr> = (0..n).filter(|&i| duplicate_of(i).is_none() && !no_such_link(i)).map(vip).collect();
        assert_eq!(ours(&mut links, ifindex), bound, "the link holds exactly the addresses whose requests succeeded");

        // One at a time, deletes: those of addresses never bound fail alone.
        let missing = |i: u32| i % 7 == 3;
        let dels: Vec<_> =
            (0..20u32).map(|i| addr_request(Rtm::Deladdr, NlmF::empty(), 1000 + i, ifindex, if missing(i) { vip(n + i) } else { vip(i) })).collect();
        let got: Vec<Option<i32>> = pipeline(&sock, &dels, 1, acks).expect("one at a time").into_iter().map(Result::err).collect();
        let want: Vec<Option<i32>> = (0..20u32).map(|i| (missing(i) || !bound.contains(&vip(i))).then_some(libc::EADDRNOTAVAIL)).collect();
        assert_eq!(got, want, "per-request outcomes, one at a time");
        let left = ours(&mut links, ifindex);
        for i in 0..20u32 {
            assert_eq!(left.contains(&vip(i)), missing(i) && bound.contains(&vip(i)), "{} after the deletes", vip(i));
        }
    });
}
