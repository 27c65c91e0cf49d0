//! Where Services, EndpointSlices and the Node come from, behind one interface: the Kubernetes
//! API through kube-rs watchers (`kube`), or a directory of manifests (`manifests`; the lab and
//! tests).
pub mod decoded;
pub mod events;
pub mod kube;
pub mod manifests;
mod relist;
pub mod tracker;

use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use k8s_openapi::api::core::v1::Node;

use crate::{
    model::{
        errors::ObjectError,
        objects::{ObjectName, Objects},
    },
    stats::Stats,
};

/// What one sync reads.
pub struct SyncInput<'a> {
    pub objects: &'a Objects,
    pub node: Option<&'a Node>,
    /// The services that may have changed since the last input (their own changes and their
    /// slices'); None: unknown, compute everything.
    pub changed: Option<BTreeSet<ObjectName>>,
    /// Problems the source found in its input (a manifest that does not parse, an object
    /// that does not decode).
    pub errors: Vec<ObjectError>,
    /// The changed slices' last-change-trigger-times (network programming latency).
    pub trigger_times: Vec<SystemTime>,
    /// Set when the source cannot be read at all: the sync fails (and is retried) rather
    /// than programming a stale or empty state.
    pub unavailable: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poll {
    /// Not every cache has listed yet: nothing may be programmed (what the kernel holds keeps
    /// forwarding).
    NotReady,
    Unchanged,
    Changed,
}

pub trait Source {
    /// Waits up to `timeout` for a change since the last `with_input`.
    fn poll(&mut self, timeout: Duration) -> Poll;
    /// Hands the current input to `f`; the changes it reports are consumed.
    fn with_input<R>(&mut self, f: impl FnOnce(SyncInput<'_>) -> R) -> R;
    /// The source's own figures (pending changes, node eligibility) for metrics and health.
    fn observe(&self, _stats: &mut Stats) {}
}

/// A directory of manifests, re-read whole when a file changes.
pub struct DirSource {
    dir: PathBuf,
    fingerprint: Option<Vec<(PathBuf, u64, Option<SystemTime>)>>,
    seen: Option<Vec<(PathBuf, u64, Option<SystemTime>)>>,
    objects: Objects,
}

impl DirSource {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir, fingerprint: None, seen: None, objects: Objects::default() }
    }
}

impl Source for DirSource {
    fn poll(&mut self, timeout: Duration) -> Poll {
        std::thread::sleep(timeout.min(Duration::from_millis(100)));
        self.fingerprint = manifests::fingerprint(&self.dir).ok();
        if self.seen.is_none() || self.fingerprint != self.seen {
            Poll::Changed
        } else {
            Poll::Unchanged
        }
    }

    fn with_input<R>(&mut self, f: impl FnOnce(SyncInput<'_>) -> R) -> R {
        self.seen = manifests::fingerprint(&self.dir).ok();
        let (errors, unavailable) = match manifests::load_dir(&self.dir) {
            Ok(report) => {
                self.objects = report.objects;
                (report.errors, None)
            }
            Err(e) => (Vec::new(), Some(e.to_string())),
        };
        f(SyncInput { objects: &self.objects, node: None, changed: None, errors, trigger_times: Vec::new(), unavailable })
    }
}

/// The Kubernetes API: the watchers (`kube::run`) fill `Shared`; this reads it.
pub struct KubeSource {
    shared: Arc<kube::Shared>,
    /// The generation of the state last handed out.
    seen: u64,
    /// The generation the last poll saw: the next one waits for a newer one. (Waiting for one
    /// newer than `seen` returned at once while a change was pending and not yet taken, during
    /// the initial list and under the sync rate limit: the loop spun a core.)
    polled: u64,
}

impl KubeSource {
    pub fn new(shared: Arc<kube::Shared>) -> Self {
        Self { shared, seen: u64::MAX, polled: u64::MAX }
    }
}

impl Source for KubeSource {
    fn poll(&mut self, timeout: Duration) -> Poll {
        let generation = self.shared.wait(self.polled, timeout);
        self.polled = generation;
        if !self.shared.state.lock().unwrap().synced() {
            return Poll::NotReady;
        }
        if generation != self.seen {
            Poll::Changed
        } else {
            Poll::Unchanged
        }
    }

    fn with_input<R>(&mut self, f: impl FnOnce(SyncInput<'_>) -> R) -> R {
        let mut st = self.shared.state.lock().unwrap();
        self.seen = st.generation;
        let changed = st.take_changed_services();
        let trigger_times = std::mem::take(&mut st.trigger_times);
        st.oldest_pending = None;
        let st = &*st;
        let errors = st.undecodable.values().cloned().collect();
        f(SyncInput { objects: &st.objects, node: st.node.as_ref(), changed: Some(changed), errors, trigger_times, unavailable: None })
    }

    fn observe(&self, stats: &mut Stats) {
        let st = self.shared.state.lock().unwrap();
        stats.m.service_changes_pending.set(st.service_changes.pending() as i64);
        stats.m.endpoint_changes_pending.set(st.slice_changes.pending() as i64);
        crate::stats::counter_to(&stats.m.service_changes_total, st.service_changes.total);
        crate::stats::counter_to(&stats.m.endpoint_changes_total, st.slice_changes.total);
        stats.node_eligible = kube::node_eligible(st.node.as_ref());
    }
}

/// A source for the agent loop's tests: objects and the changes to report are set directly.
#[derive(Default)]
pub struct FakeSource {
    pub objects: Objects,
    pub node: Option<Node>,
    pub ready: bool,
    /// Reported by the next poll.
    pub pending: Option<BTreeSet<ObjectName>>,
    pub inputs: usize,
    pub unavailable: Option<String>,
}

impl Source for FakeSource {
    fn poll(&mut self, _timeout: Duration) -> Poll {
        match (self.ready, &self.pending) {
            (false, _) => Poll::NotReady,
            (true, Some(_)) => Poll::Changed,
            (true, None) => Poll::Unchanged,
        }
    }
    fn with_input<R>(&mut self, f: impl FnOnce(SyncInput<'_>) -> R) -> R {
        self.inputs += 1;
        let changed = Some(self.pending.take().unwrap_or_default());
        f(SyncInput {
            objects: &self.objects,
            node: self.node.as_ref(),
            changed,
            errors: Vec::new(),
            trigger_times: Vec::new(),
            unavailable: self.unavailable.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn bump(shared: &kube::Shared) {
        shared.state.lock().unwrap().generation += 1;
        shared.changed.notify_all();
    }

    #[test]
    fn a_pending_change_does_not_make_the_loop_spin() {
        let shared = Arc::new(kube::Shared::default());
        {
            let mut st = shared.state.lock().unwrap();
            (st.services_synced, st.slices_synced, st.node_synced) = (true, true, true);
        }
        bump(&shared);
        let mut source = KubeSource::new(shared.clone());
        assert_eq!(source.poll(Duration::from_secs(5)), Poll::Changed);
        // Not taken yet (the rate limit holds the sync back): still pending, but the next poll
        // waits for news instead of returning at once.
        let t = Instant::now();
        assert_eq!(source.poll(Duration::from_millis(100)), Poll::Changed);
        assert!(t.elapsed() >= Duration::from_millis(90), "returned after {:?}", t.elapsed());
        // News wakes a waiting poll.
        let waker = std::thread::spawn({
            let shared = shared.clone();
            move || {
                std::thread::sleep(Duration::from_millis(50));
                bump(&shared);
            }
        });
        let t = Instant::now();
        assert_eq!(source.poll(Duration::from_secs(30)), Poll::Changed);
        assert!(t.elapsed() < Duration::from_secs(10));
        waker.join().unwrap();
        source.with_input(|_| ());
        assert_eq!(source.poll(Duration::from_millis(10)), Poll::Unchanged);
    }
}
