//! Passive outlier detection at L4 (eBPF mode). A backend that answers new connections with a
//! reset or an ICMP destination unreachable (counted by the data path in KPR_BE_FAIL_V1, once
//! per connection, cleared when a handshake completes; for UDP, an unreachable answering a flow
//! before any reply, cleared by a reply) or
//! lets their SYNs go unanswered for SYN_TIMEOUT (the collector adds those to the same count)
//! FAILURES times in a row is ejected: the frontends of Services that opt in
//! (kpr.io/outlier-ejection) leave it out for new connections for a back-off period, doubled
//! each time it is ejected again soon after (up to 16 times the base). Never more than half of
//! a frontend's backends are left out. Established connections are left alone.
use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use proxy_common::Backend;

use crate::{
    dataplane::ebpf::{maps::MapError, wire},
    model::{
        errors::{ObjectError, OUTLIER_EJECTED},
        BackendKey, DesiredState, Frontend, FrontendKey,
    },
};

/// KPR_BE_FAIL_V1: failures in a row by backend id.
pub trait FailureCounts {
    fn all(&self) -> Result<Vec<(u32, u32)>, MapError>;
    /// Adds `n` (a SYN the collector saw go unanswered).
    fn add(&mut self, backend_id: u32, n: u32) -> Result<(), MapError>;
    fn clear(&mut self, backend_id: u32) -> Result<(), MapError>;
}

#[derive(Debug, Default)]
pub struct FakeFailureCounts(pub BTreeMap<u32, u32>);

impl FailureCounts for FakeFailureCounts {
    fn all(&self) -> Result<Vec<(u32, u32)>, MapError> {
        Ok(self.0.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn add(&mut self, backend_id: u32, n: u32) -> Result<(), MapError> {
        *self.0.entry(backend_id).or_default() += n;
        Ok(())
    }
    fn clear(&mut self, backend_id: u32) -> Result<(), MapError> {
        self.0.remove(&backend_id);
        Ok(())
    }
}

/// One collector round's outlier work: the unanswered SYNs go into the counts; backends at
/// FAILURES are ejected (their count starts over); ejections whose back-off is over end.
/// `backend_of` names a backend id. Returns the new ejections.
pub fn round(
    counts: &mut dyn FailureCounts,
    backend_of: impl Fn(u32) -> Option<Backend>,
    outliers: &mut Outliers,
    syn_timeouts: &[u32],
    now_ns: u64,
) -> Result<Vec<(Backend, Ejection)>, MapError> {
    for id in syn_timeouts {
        counts.add(*id, 1)?;
    }
    let mut out = Vec::new();
    for (id, n) in counts.all()? {
        if n < FAILURES {
            continue;
        }
        counts.clear(id)?;
        if let Some(b) = backend_of(id) {
            if outliers.fail(b, n, now_ns) {
                out.push((b, outliers.ejected()[&b].clone()));
            }
        }
    }
    outliers.expire(now_ns);
    Ok(out)
}

/// The frontends of Services that opt in which hold an ejected backend, each without its
/// ejected backends (never more than half of a frontend's), and an Event's content for each
/// (Service, backend) left out. Only those frontends are copied: the sync programs them in
/// place of the desired state's (a copy of the whole state per sync would make every change
/// O(cluster) while a backend is ejected).
pub fn leave_out(desired: &DesiredState, ejected: &BTreeMap<Backend, Ejection>) -> (HashMap<FrontendKey, Frontend>, Vec<ObjectError>) {
    let mut left: HashMap<FrontendKey, Frontend> = HashMap::new();
    if ejected.is_empty() {
        return (left, Vec::new());
    }
    let mut events: BTreeMap<(String, BackendKey), ObjectError> = BTreeMap::new();
    for (k, f) in desired.frontends.iter().filter(|(_, f)| f.outlier_ejection) {
        let out: Vec<BackendKey> = f.backends.iter().filter(|b| ejected.contains_key(&wire::backend(b))).take(f.backends.len() / 2).collect();
        if out.is_empty() {
            continue;
        }
        let mut f = f.clone();
        f.backends = f.backends.iter().filter(|b| !out.contains(b)).collect();
        for b in out {
            let e = &ejected[&wire::backend(&b)];
            let (name, port) = f.service.rsplit_once(':').unwrap_or((&f.service, ""));
            events.entry((f.service.to_string(), b)).or_insert_with(|| ObjectError {
                source: "kpr".into(),
                object: format!("Service {name}"),
                field: format!("spec.ports[{port}]"),
                message: format!(
                    "endpoint {} refused or let time out {} new connections in a row: left out of new connections for {}s (ejection {}); its established connections stay",
                    std::net::SocketAddr::new(b.ip, b.port),
                    e.failures,
                    e.for_ns / 1_000_000_000,
                    e.times
                ),
                reason: OUTLIER_EJECTED,
            });
        }
        left.insert(*k, f);
    }
    (left, events.into_values().collect())
}

/// Refusals or unanswered SYNs in a row that eject a backend.
pub const FAILURES: u32 = 3;
/// A SYN unanswered this long counts as a failure.
pub const SYN_TIMEOUT: Duration = Duration::from_secs(3);
/// The back-off doubles up to this many times the base.
const MAX_FACTOR: u64 = 16;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ejection {
    /// CLOCK_MONOTONIC ns when it ends.
    pub until_ns: u64,
    /// Its length (for the Event).
    pub for_ns: u64,
    /// Failures in a row that ejected it.
    pub failures: u32,
    /// How many times in a row it was ejected (the back-off's exponent, from 1).
    pub times: u32,
}

#[derive(Debug)]
pub struct Outliers {
    base_ns: u64,
    ejected: BTreeMap<Backend, Ejection>,
    /// (ejections in a row, when the last ended): a backend quiet for long starts over.
    history: HashMap<Backend, (u32, u64)>,
    /// The set changed since the plane last applied it.
    changed: bool,
}

impl Outliers {
    pub fn new(base: Duration) -> Self {
        Self { base_ns: base.as_nanos().max(1) as u64, ejected: BTreeMap::new(), history: HashMap::new(), changed: false }
    }

    /// `failures` in a row for `b`: ejects it unless it is out already. Returns whether it did.
    pub fn fail(&mut self, b: Backend, failures: u32, now_ns: u64) -> bool {
        if failures < FAILURES || self.ejected.contains_key(&b) {
            return false;
        }
        let (times, last_end) = self.history.get(&b).copied().unwrap_or((0, 0));
        // Quiet for ten back-offs since its last ejection: forgiven.
        let times = if times > 0 && now_ns.saturating_sub(last_end) > 10 * self.base_ns * MAX_FACTOR { 0 } else { times };
        let for_ns = self.base_ns * (1u64 << times.min(4)).min(MAX_FACTOR);
        let e = Ejection { until_ns: now_ns + for_ns, for_ns, failures, times: times + 1 };
        self.history.insert(b, (times + 1, e.until_ns));
        self.ejected.insert(b, e);
        self.changed = true;
        true
    }

    /// Ends the ejections whose back-off is over; returns those backends.
    pub fn expire(&mut self, now_ns: u64) -> Vec<Backend> {
        let over: Vec<Backend> = self.ejected.iter().filter(|(_, e)| e.until_ns <= now_ns).map(|(b, _)| *b).collect();
        for b in &over {
            self.ejected.remove(b);
        }
        self.changed |= !over.is_empty();
        over
    }

    pub fn ejected(&self) -> &BTreeMap<Backend, Ejection> {
        &self.ejected
    }

    /// Whether the set changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    pub fn has_changed(&self) -> bool {
        self.changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FrontendKind, Protocol, Scope};

    #[test]
    fn a_round_ejects_at_the_threshold_and_a_frontend_keeps_half_of_its_backends() {
        let s = 1_000_000_000u64;
        let mut counts = FakeFailureCounts::default();
        counts.0.insert(5, 2); // two refusals of backend 5
        counts.0.insert(6, 1);
        let mut o = Outliers::new(Duration::from_secs(10));
        let names = |id: u32| Some(be(id as u8));
        assert!(round(&mut counts, names, &mut o, &[], 0).unwrap().is_empty());
        // One unanswered SYN more: backend 5 is at three in a row.
        let ejected = round(&mut counts, names, &mut o, &[5], s).unwrap();
        assert_eq!(ejected.iter().map(|(b, e)| (*b, e.failures)).collect::<Vec<_>>(), vec![(be(5), 3)]);
        assert_eq!(counts.0.get(&5), None, "its count starts over");
        // Three backends, two of them ejected: only one is left out; a Service that did not opt
        // in keeps all.
        o.fail(be(6), FAILURES, s);
        let bk = |last: u8| BackendKey { ip: std::net::IpAddr::from([10, 244, 2, last]), port: 8080, proto: Protocol::Tcp };
        let fe = |opt_in: bool| Frontend {
            outlier_ejection: opt_in,
            backends: vec![bk(4), bk(5), bk(6)].into(),
            ..Frontend::for_test(FrontendKind::ClusterIp, &[], Protocol::Tcp)
        };
        let mut d = DesiredState::default();
        let key = |ip: &str| FrontendKey { ip: ip.parse().unwrap(), port: 80, proto: Protocol::Tcp, scope: Scope::Internal };
        d.frontends.insert(key("10.96.0.10"), fe(true));
        d.frontends.insert(key("10.96.0.11"), fe(false));
        let (left, events) = leave_out(&d, o.ejected());
        assert_eq!(left[&key("10.96.0.10")].backends.to_vec(), [bk(4), bk(6)]);
        assert!(!left.contains_key(&key("10.96.0.11")), "only the frontends that change are copied");
        assert_eq!(events.len(), 1);
        assert!(events[0].message.contains("10.244.2.5:8080") && events[0].reason == OUTLIER_EJECTED, "{events:?}");
        assert!(leave_out(&d, &BTreeMap::new()).0.is_empty());
    }

    fn be(last: u8) -> Backend {
        Backend::new(std::net::IpAddr::from([10, 244, 2, last]), 8080, proxy_common::PROTO_TCP)
    }

    #[test]
    fn ejections_need_failures_in_a_row_double_and_end() {
        let s = 1_000_000_000u64;
        let mut o = Outliers::new(Duration::from_secs(10));
        assert!(!o.fail(be(2), FAILURES - 1, 0), "not yet");
        assert!(o.fail(be(2), FAILURES, 0));
        assert!(o.take_changed() && !o.take_changed());
        assert!(!o.fail(be(2), 5, s), "out already");
        assert_eq!(o.ejected()[&be(2)].until_ns, 10 * s);
        assert!(o.expire(9 * s).is_empty());
        assert_eq!(o.expire(10 * s), vec![be(2)]);
        assert!(o.take_changed());
        // Again soon after: twice as long; then four times.
        assert!(o.fail(be(2), FAILURES, 11 * s));
        assert_eq!(o.ejected()[&be(2)].for_ns, 20 * s);
        o.expire(31 * s);
        assert!(o.fail(be(2), FAILURES, 32 * s));
        assert_eq!(o.ejected()[&be(2)].times, 3);
        assert_eq!(o.ejected()[&be(2)].for_ns, 40 * s);
        o.expire(72 * s);
        // Long quiet: back to the base.
        assert!(o.fail(be(2), FAILURES, 72 * s + 10 * 10 * 16 * s + 1));
        assert_eq!(o.ejected()[&be(2)].for_ns, 10 * s);
    }
}
