//! The Kubernetes source: kube-rs watchers on Services, EndpointSlices and this node, feeding
//! the same `Objects` the manifest directory does. Change trackers collapse the previous and
//! current state of each object between syncs (kube-proxy's semantics), and nothing counts as
//! synced until every watch has listed once, so a restart never programs an empty world.
use std::{
    collections::BTreeMap,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, SystemTime},
};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::{
    runtime::{watcher, WatchStreamExt},
    Api, Client, Resource, ResourceExt,
};
use tracing::{info, warn};

use super::{
    decoded::{Decoded, Undecodable},
    relist::{Relist, SliceConversion},
};
use crate::model::{
    errors::{ObjectError, FIELD_NOT_PROGRAMMED},
    objects::{ObjectName, Objects, ServiceObject, Slices},
    slice_object::SliceObject,
    slice_wire::SliceWire,
};

/// kube-proxy's label selectors: services of another proxy, and headless slices, are not ours.
pub const SERVICE_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name";
pub const SLICE_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// Pending changes of one kind of object since the last sync, collapsed: an object changed and
/// changed back is no change; several updates are one.
#[derive(Debug)]
pub struct Tracker<T> {
    pending: BTreeMap<ObjectName, (Option<T>, Option<T>)>,
    pub total: u64,
}

impl<T> Default for Tracker<T> {
    fn default() -> Self {
        Self { pending: BTreeMap::new(), total: 0 }
    }
}

impl<T: PartialEq> Tracker<T> {
    pub fn record(&mut self, name: ObjectName, previous: Option<T>, current: Option<T>) {
        // Every real change counts (kube-proxy's *_changes_total); pending ones collapse.
        if previous != current {
            self.total += 1;
        }
        if let Some(entry) = self.pending.get_mut(&name) {
            entry.1 = current;
            if entry.0 == entry.1 {
                self.pending.remove(&name);
            }
        } else if previous != current {
            self.pending.insert(name, (previous, current));
        }
    }
    /// `record` for many objects, each named once. On an empty tracker (the first list, or a
    /// re-list after a sync took the changes) the pending map is built in one pass: 100,000
    /// inserts one by one walked down the map comparing names, on the way to the first sync.
    pub fn record_all(&mut self, mut changes: Vec<(ObjectName, Option<T>, Option<T>)>) {
        if !self.pending.is_empty() {
            for (name, previous, current) in changes {
                self.record(name, previous, current);
            }
            return;
        }
        changes.retain(|(_, previous, current)| previous != current);
        self.total += changes.len() as u64;
        self.pending = changes.into_iter().map(|(name, previous, current)| (name, (previous, current))).collect();
    }
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
    pub fn take(&mut self) -> Vec<ObjectName> {
        std::mem::take(&mut self.pending).into_keys().collect()
    }
    /// The pending changes with their previous and current state.
    pub fn take_entries(&mut self) -> Vec<(ObjectName, Option<T>, Option<T>)> {
        std::mem::take(&mut self.pending).into_iter().map(|(n, (p, c))| (n, p, c)).collect()
    }
}

#[derive(Debug, Default)]
pub struct KubeState {
    pub objects: Objects,
    pub node: Option<Node>,
    pub services_synced: bool,
    pub slices_synced: bool,
    pub node_synced: bool,
    pub service_changes: Tracker<Version>,
    pub slice_changes: Tracker<Version>,
    /// last-change-trigger-time of the slices changed since the last sync.
    pub trigger_times: Vec<SystemTime>,
    /// When the oldest change not yet synced arrived (health: kube-proxy's QueuedUpdate).
    pub oldest_pending: Option<std::time::Instant>,
    pub generation: u64,
    /// Objects that did not decode (by kind and name), reported at every sync while they last.
    pub undecodable: BTreeMap<(&'static str, ObjectName), ObjectError>,
}

impl KubeState {
    /// The services whose desired state may differ since the last call: changed services and
    /// the owners of changed slices (before and after the change). Clears the trackers.
    pub fn take_changed_services(&mut self) -> std::collections::BTreeSet<ObjectName> {
        let mut out: std::collections::BTreeSet<ObjectName> = self.service_changes.take().into_iter().collect();
        for ((ns, _), prev, cur) in self.slice_changes.take_entries() {
            for v in [prev, cur].into_iter().flatten() {
                if let Some(owner) = v.owner {
                    out.insert((ns.clone(), owner));
                }
            }
        }
        out
    }

    pub fn synced(&self) -> bool {
        self.services_synced && self.slices_synced && self.node_synced
    }
    fn touched(&mut self) {
        self.generation += 1;
        self.oldest_pending.get_or_insert_with(std::time::Instant::now);
    }
}

#[derive(Debug, Default)]
pub struct Shared {
    pub state: Mutex<KubeState>,
    pub changed: Condvar,
}

impl Shared {
    /// Waits up to `timeout` for a change after `generation`; returns the current generation.
    pub fn wait(&self, generation: u64, timeout: Duration) -> u64 {
        let st = self.state.lock().unwrap();
        let (st, _) = self.changed.wait_timeout_while(st, timeout, |s| s.generation == generation).unwrap();
        st.generation
    }
}

/// The cluster autoscaler's taint on a node it is about to remove.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether load balancers should still send new connections to this node (kube-proxy's
/// `nodeEligible`, KEP-3836): not when it is being deleted, nor when the cluster autoscaler
/// has marked it for removal. /healthz then answers 503 so they drain it first.
pub fn node_eligible(node: Option<&Node>) -> bool {
    let Some(n) = node else { return true };
    let marked = n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    n.metadata.deletion_timestamp.is_none() && !marked
}

/// What a tracker keeps of an object (not the object: at 10,000 services that would double the
/// cache): its resourceVersion, which every change renews, and a slice's owning Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Version {
    rv: Option<Box<str>>,
    owner: Option<String>,
}

/// An object as the source keeps it.
trait Cached {
    fn version(&self) -> Version;
}

impl Cached for ServiceObject {
    fn version(&self) -> Version {
        Version { rv: self.resource_version.clone(), owner: None }
    }
}

impl Cached for SliceObject {
    fn version(&self) -> Version {
        Version { rv: self.resource_version.clone(), owner: self.service.clone() }
    }
}

/// Where the source keeps one kind of object.
trait Store<K>: Default {
    fn put(&mut self, name: ObjectName, o: K) -> Option<K>;
    fn take(&mut self, name: &ObjectName) -> Option<K>;
    fn lookup(&self, name: &ObjectName) -> Option<&K>;
    fn entries(&self) -> Box<dyn Iterator<Item = (&ObjectName, &K)> + '_>;
}

impl<K> Store<K> for BTreeMap<ObjectName, K> {
    fn put(&mut self, name: ObjectName, o: K) -> Option<K> {
        self.insert(name, o)
    }
    fn take(&mut self, name: &ObjectName) -> Option<K> {
        self.remove(name)
    }
    fn lookup(&self, name: &ObjectName) -> Option<&K> {
        self.get(name)
    }
    fn entries(&self) -> Box<dyn Iterator<Item = (&ObjectName, &K)> + '_> {
        Box::new(self.iter())
    }
}

impl Store<SliceObject> for Slices {
    fn put(&mut self, name: ObjectName, o: SliceObject) -> Option<SliceObject> {
        self.insert(name, o)
    }
    fn take(&mut self, name: &ObjectName) -> Option<SliceObject> {
        self.remove(name)
    }
    fn lookup(&self, name: &ObjectName) -> Option<&SliceObject> {
        self.get(name)
    }
    fn entries(&self) -> Box<dyn Iterator<Item = (&ObjectName, &SliceObject)> + '_> {
        Box::new(self.iter())
    }
}

/// The node as kpr keeps it: no managed fields, no last-applied copy.
fn slim_node(mut node: Node) -> Node {
    node.metadata.managed_fields = None;
    if let Some(a) = node.metadata.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    node
}

fn name_of<K: Resource>(o: &K) -> ObjectName {
    (o.namespace().unwrap_or_default(), o.name_any())
}

// Moved once per event: boxing the larger would cost an allocation per object of a list.
#[allow(clippy::large_enum_variant)]
enum Kind {
    Service(watcher::Event<Decoded<Service>>),
    Slice(watcher::Event<Decoded<SliceWire>>),
    Node(watcher::Event<Decoded<Node>>),
}

const SERVICE_KIND: &str = <Service as k8s_openapi::Resource>::KIND;
const SLICE_KIND: &str = <k8s_openapi::api::discovery::v1::EndpointSlice as k8s_openapi::Resource>::KIND;
const NODE_KIND: &str = <Node as k8s_openapi::Resource>::KIND;

/// An object that did not decode, as the sync reports it (an Event, kpr_objects_not_programmed).
/// Its last decoded version, if the source holds one (`kept`), stays: a bad update loses
/// nothing that was programmed.
fn note_undecodable(errors: &mut BTreeMap<(&'static str, ObjectName), ObjectError>, kept: bool, kind: &'static str, name: ObjectName, u: &Undecodable) {
    let consequence = if kept { "kpr uses its last version that decoded" } else { "kpr ignores it until it decodes" };
    let e = ObjectError {
        source: "kubernetes".into(),
        object: format!("{kind} {}/{}", name.0, name.1),
        field: u.field.clone(),
        message: format!("cannot decode: {}; {consequence}", u.message),
        reason: FIELD_NOT_PROGRAMMED,
    };
    warn!(object = %e.object, field = %e.field, error = %u.message, "object does not decode");
    errors.insert((kind, name), e);
}

/// A re-list's object that did not decode, held with the re-list.
fn buffer_undecodable<K: Resource<DynamicType = ()>>(relist: &mut Relist, d: Decoded<K>) {
    let name = name_of(&d);
    if let Decoded::Undecodable(u) = d {
        relist.undecodable.push((name, u));
    }
}

/// A re-list's objects that did not decode: each keeps its last decoded version from `cache`
/// in `fresh`; their errors replace the kind's earlier ones.
fn relisted_undecodable<K: Clone, S: Store<K>>(
    errors: &mut BTreeMap<(&'static str, ObjectName), ObjectError>,
    cache: &S,
    fresh: &mut S,
    kind: &'static str,
    undecodable: Vec<(ObjectName, Undecodable)>,
) {
    errors.retain(|(k, _), _| *k != kind);
    for (name, u) in undecodable {
        note_undecodable(errors, cache.lookup(&name).is_some(), kind, name.clone(), &u);
        if let Some(o) = cache.lookup(&name) {
            fresh.put(name, o.clone());
        }
    }
}

/// Replaces `cache` with a re-listed set, recording every difference; `changed` sees each
/// object that is new or different.
fn replace_all<K: Cached, S: Store<K>>(cache: &mut S, fresh: S, tracker: &mut Tracker<Version>, mut changed: impl FnMut(&K)) {
    let old = std::mem::replace(cache, fresh);
    let mut changes = Vec::new();
    for (n, o) in old.entries() {
        if cache.lookup(n).is_none() {
            changes.push((n.clone(), Some(o.version()), None));
        }
    }
    for (n, o) in cache.entries() {
        let prev = old.lookup(n).map(K::version);
        let cur = o.version();
        if prev.as_ref() != Some(&cur) {
            changed(o);
        }
        changes.push((n.clone(), prev, Some(cur)));
    }
    tracker.record_all(changes);
}

/// Keeps what the model reads of `o` (converted once, on arrival).
fn upsert<'a, R: Resource, K: Cached + From<R>, S: Store<K>>(cache: &'a mut S, tracker: &mut Tracker<Version>, o: R) -> &'a K {
    let n = name_of(&o);
    let o = K::from(o);
    let v = o.version();
    let prev = cache.put(n.clone(), o);
    tracker.record(n.clone(), prev.as_ref().map(K::version), Some(v));
    cache.lookup(&n).expect("just stored")
}

/// `upsert` for an object that may not have decoded: one that did clears its error; one that
/// did not is reported, and its last decoded version stays (None then).
fn upsert_decoded<'a, R: Resource<DynamicType = ()>, K: Cached + From<R>, S: Store<K>>(
    cache: &'a mut S,
    tracker: &mut Tracker<Version>,
    errors: &mut BTreeMap<(&'static str, ObjectName), ObjectError>,
    kind: &'static str,
    d: Decoded<R>,
) -> Option<&'a K> {
    let name = name_of(&d);
    match d {
        Decoded::Object(o) => {
            errors.remove(&(kind, name));
            Some(upsert(cache, tracker, o))
        }
        Decoded::Undecodable(u) => {
            note_undecodable(errors, cache.lookup(&name).is_some(), kind, name, &u);
            None
        }
    }
}

fn remove<R: Resource, K: Cached, S: Store<K>>(cache: &mut S, tracker: &mut Tracker<Version>, o: &R) {
    let n = name_of(o);
    let prev = cache.take(&n);
    tracker.record(n, prev.as_ref().map(K::version), None);
}

/// A watch event once its re-list buffer has had its part: what changes the shared state.
enum Change {
    Services(BTreeMap<ObjectName, ServiceObject>, Vec<(ObjectName, Undecodable)>),
    Slices(Slices, Vec<(ObjectName, Undecodable)>),
    Node(Option<Node>, Vec<(ObjectName, Undecodable)>),
    Event(Kind),
}

fn apply(shared: &Shared, relist: &mut Relist, ev: Kind) {
    // Init and InitApply only fill the buffer, and InitDone builds the new cache from it, all
    // without the lock: the sync and the other watches go on meanwhile (a slice may wait for
    // the converter). Nothing changes until InitDone swaps the cache in.
    let change = match ev {
        Kind::Service(watcher::Event::Init) | Kind::Slice(watcher::Event::Init) => {
            relist.undecodable.clear();
            match ev {
                Kind::Service(_) => relist.services = Some(Vec::new()),
                _ => relist.slices = Some(SliceConversion::start()),
            }
            return;
        }
        Kind::Service(watcher::Event::InitApply(Decoded::Object(o))) => return relist.services.get_or_insert_with(Vec::new).push((name_of(&o), o.into())),
        // In full nodes (`packed`); a name listed twice keeps its last object.
        Kind::Service(watcher::Event::InitDone) => {
            Change::Services(relist.services.take().unwrap_or_default().into_iter().collect(), std::mem::take(&mut relist.undecodable))
        }
        Kind::Slice(watcher::Event::InitApply(Decoded::Object(o))) => return relist.slices.get_or_insert_with(SliceConversion::start).push(o),
        Kind::Service(watcher::Event::InitApply(d)) => return buffer_undecodable(relist, d),
        Kind::Slice(watcher::Event::InitApply(d)) => return buffer_undecodable(relist, d),
        Kind::Slice(watcher::Event::InitDone) => {
            Change::Slices(Slices::from_list(relist.slices.take().map(SliceConversion::finish).unwrap_or_default()), std::mem::take(&mut relist.undecodable))
        }
        Kind::Node(watcher::Event::Init) => {
            relist.undecodable.clear();
            return relist.node = Some(None);
        }
        Kind::Node(watcher::Event::InitApply(Decoded::Object(o))) => return relist.node = Some(Some(slim_node(o))),
        Kind::Node(watcher::Event::InitApply(d)) => return buffer_undecodable(relist, d),
        Kind::Node(watcher::Event::InitDone) => Change::Node(relist.node.take().flatten(), std::mem::take(&mut relist.undecodable)),
        ev => Change::Event(ev),
    };
    let mut guard = shared.state.lock().unwrap();
    let st = &mut *guard;
    match change {
        Change::Services(mut fresh, undecodable) => {
            relisted_undecodable(&mut st.undecodable, &st.objects.services, &mut fresh, SERVICE_KIND, undecodable);
            replace_all(&mut st.objects.services, fresh, &mut st.service_changes, |_| {});
            if !st.services_synced {
                info!(services = st.objects.services.len(), "services listed");
            }
            st.services_synced = true;
        }
        Change::Slices(mut fresh, undecodable) => {
            relisted_undecodable(&mut st.undecodable, &st.objects.slices, &mut fresh, SLICE_KIND, undecodable);
            let triggers = &mut st.trigger_times;
            replace_all(&mut st.objects.slices, fresh, &mut st.slice_changes, |o| triggers.extend(o.trigger_time));
            if !st.slices_synced {
                info!(slices = st.objects.slices.len(), "endpoint slices listed");
            }
            st.slices_synced = true;
        }
        Change::Node(node, undecodable) => {
            st.undecodable.retain(|(k, _), _| *k != NODE_KIND);
            for (name, u) in &undecodable {
                note_undecodable(&mut st.undecodable, st.node.is_some(), NODE_KIND, name.clone(), u);
            }
            // The Node did not decode: its last decoded version stays.
            let node = if node.is_none() && !undecodable.is_empty() { st.node.take() } else { node };
            st.node = node;
            st.node_synced = true;
        }
        Change::Event(Kind::Service(watcher::Event::Apply(d))) => {
            upsert_decoded(&mut st.objects.services, &mut st.service_changes, &mut st.undecodable, SERVICE_KIND, d);
        }
        Change::Event(Kind::Service(watcher::Event::Delete(o))) => {
            st.undecodable.remove(&(SERVICE_KIND, name_of(&o)));
            remove(&mut st.objects.services, &mut st.service_changes, &o)
        }
        Change::Event(Kind::Slice(watcher::Event::Apply(d))) => {
            if let Some(slice) = upsert_decoded(&mut st.objects.slices, &mut st.slice_changes, &mut st.undecodable, SLICE_KIND, d) {
                st.trigger_times.extend(slice.trigger_time);
            }
        }
        Change::Event(Kind::Slice(watcher::Event::Delete(o))) => {
            st.undecodable.remove(&(SLICE_KIND, name_of(&o)));
            remove(&mut st.objects.slices, &mut st.slice_changes, &o)
        }
        Change::Event(Kind::Node(watcher::Event::Apply(d))) => {
            let name = name_of(&d);
            match d {
                Decoded::Object(o) => {
                    st.undecodable.remove(&(NODE_KIND, name));
                    st.node = Some(slim_node(o));
                }
                Decoded::Undecodable(u) => note_undecodable(&mut st.undecodable, st.node.is_some(), NODE_KIND, name, &u),
            }
        }
        Change::Event(Kind::Node(watcher::Event::Delete(d))) => {
            st.undecodable.remove(&(NODE_KIND, name_of(&d)));
            st.node = None;
        }
        // Taken by the first match.
        Change::Event(_) => return,
    }
    st.touched();
    shared.changed.notify_all();
}

/// Runs the three watches until the runtime stops. Errors are logged and retried with backoff
/// (410 Gone leads to a re-list, inside kube-rs's watcher). Each watch is a task of its own, so
/// the initial lists of Services and EndpointSlices decode on two threads.
pub async fn run(client: Client, node_name: String, shared: Arc<Shared>) {
    let services = watcher(Api::<Decoded<Service>>::all(client.clone()), watcher::Config::default().labels(SERVICE_SELECTOR))
        .default_backoff()
        .map(|r| r.map(Kind::Service));
    let slices = watcher(Api::<Decoded<SliceWire>>::all(client.clone()), watcher::Config::default().labels(SLICE_SELECTOR))
        .default_backoff()
        .map(|r| r.map(Kind::Slice));
    let node_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    let nodes = watcher(Api::<Decoded<Node>>::all(client), node_cfg).default_backoff().map(|r| r.map(Kind::Node));
    let tasks = [tokio::spawn(follow(services, shared.clone())), tokio::spawn(follow(slices, shared.clone())), tokio::spawn(follow(nodes, shared))];
    for t in tasks {
        if let Err(e) = t.await {
            warn!(error = %e, "a watch stopped");
        }
    }
}

/// Applies one watch's events as they come.
async fn follow(events: impl futures::Stream<Item = Result<Kind, watcher::Error>>, shared: Arc<Shared>) {
    let mut events = std::pin::pin!(events);
    let mut relist = Relist::default();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(k) => apply(&shared, &mut relist, k),
            Err(e) => warn!(error = %e, "watch failed; retrying"),
        }
    }
}

/// Publishes Kubernetes Events (events.k8s.io/v1, type Warning) for objects kpr could not
/// program, so `kubectl describe service` shows why.
pub async fn publish_events(client: Client, node_name: String, mut rx: tokio::sync::mpsc::UnboundedReceiver<crate::model::errors::ObjectError>) {
    use k8s_openapi::api::core::v1::ObjectReference;
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(client, Reporter { controller: "kpr".into(), instance: Some(node_name) });
    while let Some(e) = rx.recv().await {
        let Some((kind, rest)) = e.object.split_once(' ') else {
            continue;
        };
        let Some((ns, name)) = rest.split_once('/') else {
            continue;
        };
        let api_version = match kind {
            "Service" | "Node" => "v1",
            "EndpointSlice" => "discovery.k8s.io/v1",
            _ => continue,
        };
        let reference = ObjectReference {
            api_version: Some(api_version.into()),
            kind: Some(kind.into()),
            // A Node has none ("Node /name").
            namespace: (!ns.is_empty()).then(|| ns.into()),
            name: Some(name.into()),
            ..Default::default()
        };
        let ev = Event {
            type_: EventType::Warning,
            reason: e.reason.into(),
            note: Some(format!("field {}: {}", e.field, e.message)),
            action: "Programming".into(),
            secondary: None,
        };
        if let Err(err) = recorder.publish(&ev, &reference).await {
            warn!(error = %err, object = %e.object, "cannot publish event");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_collapses() {
        let mut t: Tracker<u32> = Tracker::default();
        let n = ("ns".to_string(), "a".to_string());
        t.record(n.clone(), Some(1), Some(2));
        t.record(n.clone(), Some(2), Some(3));
        assert_eq!(t.pending(), 1);
        t.record(n.clone(), Some(3), Some(1));
        assert_eq!(t.pending(), 0, "changed back: nothing pending");
        t.record(n.clone(), None, Some(5));
        assert_eq!(t.take(), vec![n]);
        assert_eq!(t.pending(), 0);
    }

    #[test]
    fn recording_many_at_once_is_recording_each() {
        let n = |s: &str| ("ns".to_string(), s.to_string());
        let changes = || vec![(n("b"), None, Some(1)), (n("a"), Some(1), Some(2)), (n("c"), Some(3), None), (n("d"), Some(4), Some(4))];
        let entries = |t: &mut Tracker<u32>| (t.total, t.take_entries());
        // An empty tracker (built in one pass) and one with changes pending (one by one).
        for pending in [None, Some((n("a"), Some(2), Some(1)))] {
            let (mut at_once, mut each) = (Tracker::default(), Tracker::default());
            for t in [&mut at_once, &mut each] {
                if let Some((name, p, c)) = pending.clone() {
                    t.record(name, p, c);
                }
            }
            at_once.record_all(changes());
            for (name, p, c) in changes() {
                each.record(name, p, c);
            }
            assert_eq!(entries(&mut at_once), entries(&mut each), "pending before: {pending:?}");
        }
        let mut t = Tracker::default();
        t.record_all(changes());
        assert_eq!(t.take(), vec![n("a"), n("b"), n("c")], "in name order, the unchanged one left out");
    }

    #[test]
    fn a_node_being_deleted_or_marked_by_the_autoscaler_is_not_eligible() {
        use k8s_openapi::api::core::v1::{NodeSpec, Taint};
        assert!(node_eligible(None), "no Node yet: eligible, as kube-proxy");
        let mut node = Node::default();
        assert!(node_eligible(Some(&node)));
        let taint = |key: &str| Taint { key: key.into(), effect: "NoSchedule".into(), ..Default::default() };
        node.spec = Some(NodeSpec { taints: Some(vec![taint("node.kubernetes.io/unschedulable")]), ..Default::default() });
        assert!(node_eligible(Some(&node)), "cordoned only: still eligible");
        node.spec = Some(NodeSpec { taints: Some(vec![taint("node.kubernetes.io/unschedulable"), taint(TO_BE_DELETED_TAINT)]), ..Default::default() });
        assert!(!node_eligible(Some(&node)));
        node.spec = None;
        node.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()));
        assert!(!node_eligible(Some(&node)));
    }

    #[test]
    fn an_object_that_does_not_decode_is_reported_and_keeps_its_last_decoded_version() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let shared = Arc::new(Shared::default());
        let mut relist = Relist::default();
        let meta = |name: &str, rv: &str| ObjectMeta {
            name: Some(name.into()),
            namespace: Some("demo".into()),
            resource_version: Some(rv.into()),
            ..Default::default()
        };
        let good = |name: &str, rv: &str| Decoded::Object(Service { metadata: meta(name, rv), ..Default::default() });
        let bad = |name: &str, rv: &str| {
            Decoded::Undecodable(Undecodable { metadata: meta(name, rv), field: "spec.ports[0].port".into(), message: "invalid type".into() })
        };
        let list = |relist: &mut Relist, items: Vec<Decoded<Service>>| {
            apply(&shared, relist, Kind::Service(watcher::Event::Init));
            for o in items {
                apply(&shared, relist, Kind::Service(watcher::Event::InitApply(o)));
            }
            apply(&shared, relist, Kind::Service(watcher::Event::InitDone));
        };
        let state = |shared: &Shared| {
            let st = shared.state.lock().unwrap();
            let services: Vec<(String, String)> =
                st.objects.services.iter().map(|((_, n), o)| (n.clone(), o.resource_version.as_deref().unwrap_or_default().to_string())).collect();
            let errors: Vec<String> = st.undecodable.values().map(|e| e.to_string()).collect();
            (services, errors)
        };
        let pair = |n: &str, rv: &str| (n.to_string(), rv.to_string());

        list(&mut relist, vec![good("a", "1"), bad("b", "2")]);
        let (services, errors) = state(&shared);
        assert_eq!(services, vec![pair("a", "1")], "the rest of the list is programmed");
        assert_eq!(errors, vec!["kubernetes: Service demo/b: field spec.ports[0].port: cannot decode: invalid type; kpr ignores it until it decodes"]);

        // A bad update keeps the version programmed.
        apply(&shared, &mut relist, Kind::Service(watcher::Event::Apply(bad("a", "3"))));
        let (services, errors) = state(&shared);
        assert_eq!(services, vec![pair("a", "1")]);
        assert!(errors[0].starts_with("kubernetes: Service demo/a: ") && errors[0].ends_with("kpr uses its last version that decoded"), "{errors:?}");
        // What the sync reads: the errors with the objects.
        use crate::source::Source;
        let mut source = crate::source::KubeSource::new(shared.clone());
        assert_eq!(source.with_input(|i| i.errors.len()), 2);

        // A re-list: a still bad (kept), b fixed (its error gone).
        list(&mut relist, vec![bad("a", "3"), good("b", "4")]);
        let (services, errors) = state(&shared);
        assert_eq!(services, vec![pair("a", "1"), pair("b", "4")]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("Service demo/a"), "{errors:?}");

        // Fixed by an update; an undecodable object deleted.
        apply(&shared, &mut relist, Kind::Service(watcher::Event::Apply(good("a", "5"))));
        apply(&shared, &mut relist, Kind::Service(watcher::Event::Apply(bad("b", "6"))));
        apply(&shared, &mut relist, Kind::Service(watcher::Event::Delete(bad("b", "7"))));
        assert_eq!(state(&shared), (vec![pair("a", "5")], vec![]));
    }

    #[test]
    fn a_node_that_does_not_decode_keeps_its_last_decoded_version_and_counts_as_listed() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let shared = Shared::default();
        let mut relist = Relist::default();
        let meta = |rv: &str| ObjectMeta { name: Some("n1".into()), resource_version: Some(rv.into()), ..Default::default() };
        let bad = |rv: &str| Decoded::Undecodable(Undecodable { metadata: meta(rv), field: "spec.podCIDRs".into(), message: "invalid type".into() });
        let list = |relist: &mut Relist, o: Decoded<Node>| {
            for ev in [watcher::Event::Init, watcher::Event::InitApply(o), watcher::Event::InitDone] {
                apply(&shared, relist, Kind::Node(ev));
            }
        };
        let node_rv = |shared: &Shared| shared.state.lock().unwrap().node.as_ref().and_then(|n| n.metadata.resource_version.clone());
        list(&mut relist, bad("1"));
        {
            let st = shared.state.lock().unwrap();
            assert!(st.node_synced && st.node.is_none(), "listed: the sync is not held back");
            assert_eq!(
                st.undecodable.values().map(|e| e.to_string()).collect::<Vec<_>>(),
                vec!["kubernetes: Node /n1: field spec.podCIDRs: cannot decode: invalid type; kpr ignores it until it decodes"]
            );
        }
        apply(&shared, &mut relist, Kind::Node(watcher::Event::Apply(Decoded::Object(Node { metadata: meta("2"), ..Default::default() }))));
        assert_eq!((node_rv(&shared).as_deref(), shared.state.lock().unwrap().undecodable.len()), (Some("2"), 0));
        apply(&shared, &mut relist, Kind::Node(watcher::Event::Apply(bad("3"))));
        list(&mut relist, bad("3"));
        assert_eq!(node_rv(&shared).as_deref(), Some("2"), "the last version that decoded");
        assert_eq!(shared.state.lock().unwrap().undecodable.len(), 1);
    }

    #[test]
    fn trigger_time_is_read_from_the_annotation() {
        let at = |t: &str| {
            let mut slice = k8s_openapi::api::discovery::v1::EndpointSlice::default();
            slice.metadata.annotations = Some([(crate::model::slice_object::TRIGGER_TIME_ANNOTATION.to_string(), t.to_string())].into());
            SliceObject::from(slice).trigger_time.map(|t| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis())
        };
        assert_eq!(at("2024-02-29T12:34:56Z"), Some(1_709_210_096_000));
        assert_eq!(at("1970-01-01T00:00:01.5Z"), Some(1500));
        assert_eq!(at("yesterday"), None);
    }
}
