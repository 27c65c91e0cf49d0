//! The model's frontends and backends in the fast path's wire form (proxy-common's map keys,
//! values and flag bits): the one place the eBPF mode projects the model.
use proxy_common::{
    Backend, ServiceKey, ServiceValue, SCHED_LEAST_CONN, SCHED_MAGLEV, SCHED_P2C, SCHED_RANDOM, SCHED_ROUND_ROBIN, SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_F_MASQ,
    SVC_F_NO_LOCAL_ENDPOINT, SVC_F_PRESERVE_SOURCE, SVC_F_SOURCE_RANGES, SVC_F_SPLIT,
};

use crate::model::{BackendKey, Frontend, FrontendKey, Scheduler, Scope};

/// A frontend for both scopes is the internal entry, unmarked (proxy_common::SCOPE_INTERNAL).
pub fn scope(s: Scope) -> u8 {
    match s {
        Scope::Internal | Scope::Both => SCOPE_INTERNAL,
        Scope::External => SCOPE_EXTERNAL,
    }
}

/// The scope of a map entry, read back: `scope` and `service_flags`' SVC_F_SPLIT undone.
pub fn scope_of(k: &ServiceKey, v: &ServiceValue) -> Scope {
    if k.scope == SCOPE_EXTERNAL {
        Scope::External
    } else if v.flags & SVC_F_SPLIT != 0 {
        Scope::Internal
    } else {
        Scope::Both
    }
}

pub fn service_key(k: &FrontendKey) -> ServiceKey {
    ServiceKey::new(k.ip, k.port, k.proto.number(), scope(k.scope))
}

pub fn backend(b: &BackendKey) -> Backend {
    Backend::new(b.ip, b.port, b.proto.number())
}

/// The scheduler a ServiceValue names (None: a code this release does not know).
pub fn scheduler_of(code: u8) -> Option<Scheduler> {
    Scheduler::ALL.into_iter().find(|s| scheduler(*s) == code)
}

pub fn scheduler(s: Scheduler) -> u8 {
    match s {
        Scheduler::Random => SCHED_RANDOM,
        Scheduler::RoundRobin => SCHED_ROUND_ROBIN,
        Scheduler::Maglev => SCHED_MAGLEV,
        Scheduler::LeastConnection => SCHED_LEAST_CONN,
        Scheduler::PowerOfTwo => SCHED_P2C,
    }
}

/// ServiceValue's flag bits.
pub fn service_flags(k: &FrontendKey, f: &Frontend) -> u8 {
    [
        // The model makes an internal frontend only beside an external one.
        (k.scope == Scope::Internal, SVC_F_SPLIT),
        (f.masquerade, SVC_F_MASQ),
        (f.preserve_source, SVC_F_PRESERVE_SOURCE),
        (!f.source_ranges.is_empty(), SVC_F_SOURCE_RANGES),
        (f.no_local_endpoint, SVC_F_NO_LOCAL_ENDPOINT),
    ]
    .into_iter()
    .filter(|(set, _)| *set)
    .fold(0, |acc, (_, bit)| acc | bit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FrontendKind, Protocol};

    #[test]
    fn an_entrys_scope_reads_back_as_the_frontends() {
        let f = Frontend::for_test(FrontendKind::NodePort, &[("10.244.1.1", 8080)], Protocol::Tcp);
        for scope in [Scope::Internal, Scope::External, Scope::Both] {
            let k = FrontendKey { ip: "198.18.0.1".parse().unwrap(), port: 30080, proto: Protocol::Tcp, scope };
            let v = ServiceValue { flags: service_flags(&k, &f), ..Default::default() };
            assert_eq!(scope_of(&service_key(&k), &v), scope);
        }
    }

    /// Every scheduler reads back from its code: what `kpr services` shows is what was written.
    #[test]
    fn every_scheduler_reads_back_from_its_code() {
        for s in Scheduler::ALL {
            assert_eq!(scheduler_of(scheduler(s)), Some(s), "{}", s.name());
            assert_eq!(s.name().parse::<Scheduler>(), Ok(s));
        }
        assert_eq!(scheduler_of(200), None);
    }
}
