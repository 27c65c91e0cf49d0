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
