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

pub use super::tracker::Tracker;
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

#[cfg(test)]
mod tests;
