//! The IPVS generic netlink reply decoder on arbitrary bytes: it must never panic, and a decoded
//! service or destination must survive a round trip through the request encoder.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The module's own sources: the fuzz crate can't afford to depend on proxy-agent. The client
// reaches the shared netlink pieces as `crate::netlink::...`, so they sit at the same path here.
#[allow(dead_code, unused_imports)]
#[path = "../../src/dataplane/ipvs/client/mod.rs"]
mod ipvs;

#[allow(dead_code)]
#[path = "../../src/netlink"]
mod netlink {
    pub mod attrs;
    pub mod socket;
}

use ipvs::{
    wire::{self, cmd, Reply},
    DestConfig, ServiceConfig,
};

const FAMILIES: [u16; 2] = [libc::AF_INET as u16, libc::AF_INET6 as u16];

fuzz_target!(|data: &[u8]| {
    // The attribute walker always advances and stops after its first error.
    let mut n = 0;
    for a in netlink::attrs::attrs("fuzz", data) {
        n += 1;
        if a.is_err() {
            break;
        }
    }
    assert!(n <= data.len() / 4 + 1);
    // Whole messages, and the nested decoders directly (a shorter path to their branches).
    let _ = wire::decode_service(data);
    for af in FAMILIES {
        let _ = wire::decode_dest(data, af);
        match wire::decode_reply(data, af) {
            Ok(Reply::Service(s)) => service_round_trip(&s.config, af),
            Ok(Reply::Dest(d)) => dest_round_trip(&d.config, af),
            _ => {}
        }
    }
});

fn service_round_trip(c: &ServiceConfig, af: u16) {
    // Stats are read-only (never encoded): compare the config alone. A config too large for one
    // netlink attribute is an encode error, not a round trip.
    let Ok(a) = wire::service_attr(c) else { return };
    match wire::decode_reply(&wire::encode_body(cmd::NEW_SERVICE, &[a]), af) {
        Ok(Reply::Service(s)) => assert_eq!(&s.config, c),
        other => panic!("{c:?} re-encoded decodes as {other:?}"),
    }
}

fn dest_round_trip(c: &DestConfig, af: u16) {
    let Ok(a) = wire::dest_attr(c, true) else { return };
    // The encoder sends TUN_FLAGS only with a tunnel type (the kernel ignores them otherwise),
    // so a decoded non-tunnel destination's flags legitimately come back as 0.
    let want = DestConfig { tun_flags: if c.tun_type.is_some() { c.tun_flags } else { 0 }, ..c.clone() };
    match wire::decode_reply(&wire::encode_body(cmd::NEW_DEST, &[a]), af) {
        Ok(Reply::Dest(d)) => assert_eq!(d.config, want),
        other => panic!("{c:?} re-encoded decodes as {other:?}"),
    }
}
