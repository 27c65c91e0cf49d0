//! A sync whose writes all fit holds its puts back and writes them map by map
//! (BPF_MAP_UPDATE_BATCH): the real maps must end up exactly as the model maps (FakeMaps) do
//! under the same syncs, across several rounds of held puts and with deletes in between.
use std::{collections::BTreeMap, net::IpAddr};

use kpr_lab::PinDir;
use proxy_agent::{
    dataplane::ebpf::{
        kernel::{Capacities, Datapath},
        kernel_maps::KernelMaps,
        maps::{DatapathMaps, FakeMaps},
        sync::Syncer,
    },
    model::{BackendKey, DesiredState, Frontend, FrontendKey, FrontendKind, Protocol, Scheduler, Scope},
};
use proxy_common::{Backend, DatapathConfig, ServiceKey, ServiceValue, SlotKey};

/// `n` ClusterIPs (one frontend each, for both scopes) with `eps` backends each, `shift` moving
/// their backends.
fn desired(n: u32, eps: u32, shift: u32) -> DesiredState {
    let mut d = DesiredState::default();
    for i in 0..n {
        let vip = IpAddr::from((0x0a60_0000u32 + i).to_be_bytes());
        let backends: Vec<BackendKey> = (0..eps)
            .map(|j| BackendKey { ip: IpAddr::from((0x0af4_0000u32 + (i * eps + j + shift) % 50_000).to_be_bytes()), port: 8080, proto: Protocol::Tcp })
            .collect();
        // A few Maglev Services: their rows name backend ids, written before the rows.
        let scheduler = if i % 2000 == 0 { Scheduler::Maglev } else { Scheduler::Random };
        let fe = Frontend { scheduler, ..Frontend::plain(&format!("t/s{i}:http"), FrontendKind::ClusterIp, backends) };
        d.frontends.insert(FrontendKey { ip: vip, port: 80, proto: Protocol::Tcp, scope: Scope::Both }, fe);
    }
    d
}

type Contents = (BTreeMap<ServiceKey, ServiceValue>, BTreeMap<SlotKey, u32>, BTreeMap<u32, Backend>, Vec<Vec<u32>>);

const MAGLEV_ROWS: u32 = 16;

fn contents(m: &dyn DatapathMaps) -> Contents {
    (
        m.services().unwrap().into_iter().collect(),
        m.slots().unwrap().into_iter().collect(),
        m.backends().unwrap().into_iter().collect(),
        (0..MAGLEV_ROWS).map(|r| m.maglev_row(r).unwrap()).collect(),
    )
}

#[test]
fn held_puts_write_what_entry_by_entry_puts_write() {
    let pins = PinDir::new("bulksync");
    let caps = Capacities {
        services: 65_536,
        backends: 131_072,
        slots: 262_144,
        conntrack: 1024,
        conntrack_new: 1024,
        conntrack6: 1024,
        conntrack6_new: 1024,
        affinity: 1024,
    };
    let _dp = Datapath::load(pins.path(), caps).expect("load");
    let mut kernel = KernelMaps::open(pins.path()).unwrap();
    let mut fake = FakeMaps::default();
    let (mut real_syncer, mut model_syncer) = (Syncer::new(caps.services, caps.backends, MAGLEV_ROWS), Syncer::new(caps.services, caps.backends, MAGLEV_ROWS));
    let cfg = DatapathConfig::default();
    // 24,000 Services: 24,000 frontends, 72,000 slots: several batches of held puts (16,384 each).
    // Then a sync that drops a quarter of them and moves the backends of the rest: deletes
    // between held puts.
    for (n, shift) in [(24_000, 0), (18_000, 7)] {
        let d = desired(n, 3, shift);
        let st = real_syncer.sync(&mut kernel, &d, cfg).expect("sync into the kernel");
        model_syncer.sync(&mut fake, &d, cfg).expect("sync into the model");
        assert!(st.errors.is_empty(), "{:?}", st.errors);
        let (real, model) = (contents(&kernel), contents(&fake));
        assert_eq!(real.0.len(), n as usize);
        assert_eq!(real.1.len(), 3 * n as usize);
        assert!(real.3.iter().filter(|row| row.iter().any(|id| *id != 0)).count() >= 10, "the Maglev rows are written");
        assert!(real == model, "the kernel's maps differ from the model's after {n} Services");
    }
    assert_eq!(fake.bulks, 2, "both syncs fit: both held their puts");
}
