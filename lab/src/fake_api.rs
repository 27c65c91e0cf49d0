//! An in-process server that speaks the API server's list/watch protocol for Services,
//! EndpointSlices and Nodes: resourceVersions, bookmarks, 410 Gone after compaction, dropped
//! watches, slow answers and outages. The real kube-rs client talks to it over HTTP.
#![allow(dead_code)]

use std::{
    collections::{BTreeMap, HashMap},
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::{Query, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use serde_json::{json, Value};
use tokio::sync::broadcast;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    Slice,
    Node,
}

impl Kind {
    fn list_kind(self) -> (&'static str, &'static str) {
        match self {
            Kind::Service => ("ServiceList", "v1"),
            Kind::Slice => ("EndpointSliceList", "discovery.k8s.io/v1"),
            Kind::Node => ("NodeList", "v1"),
        }
    }
    fn kind(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::Slice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }
}

#[derive(Default)]
struct Db {
    rv: u64,
    /// Each object with its JSON, serialised once when written (a list page is the joined
    /// strings, as an API server serves lists from its cache's encoded objects).
    objects: BTreeMap<(Kind, String, String), (Value, Arc<str>)>,
    /// (rv, kind, type, object): the watch history.
    history: Vec<(u64, Kind, &'static str, Value)>,
    /// Watches from a resourceVersion older than this get 410 Gone.
    compacted: u64,
    delay: Duration,
    down: bool,
    lists: u64,
    watches: u64,
    /// Events posted by the client (events.k8s.io/v1).
    events: Vec<Value>,
}

#[derive(Clone)]
pub struct FakeApi {
    db: Arc<Mutex<Db>>,
    events: broadcast::Sender<Option<(u64, Kind, &'static str, Value)>>,
    pub addr: SocketAddr,
}

fn key_of(kind: Kind, obj: &Value) -> (Kind, String, String) {
    let ns = obj["metadata"]["namespace"].as_str().unwrap_or("").to_string();
    let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
    (kind, ns, name)
}

/// Minimal label/field selector support: "!key", "key=value", "metadata.name=x", comma-joined.
fn matches(obj: &Value, labels: Option<&str>, fields: Option<&str>) -> bool {
    let lbl = &obj["metadata"]["labels"];
    for term in labels.unwrap_or("").split(',').filter(|t| !t.is_empty()) {
        let ok = if let Some(k) = term.strip_prefix('!') {
            lbl.get(k).is_none()
        } else if let Some((k, v)) = term.split_once('=') {
            lbl.get(k).and_then(Value::as_str) == Some(v)
        } else {
            lbl.get(term).is_some()
        };
        if !ok {
            return false;
        }
    }
    for term in fields.unwrap_or("").split(',').filter(|t| !t.is_empty()) {
        if let Some(v) = term.strip_prefix("metadata.name=") {
            if obj["metadata"]["name"].as_str() != Some(v) {
                return false;
            }
        }
    }
    true
}

impl FakeApi {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0").await
    }

    /// Listens on `bind` (e.g. "0.0.0.0:0": reachable at the namespace's addresses).
    pub async fn start_on(bind: &str) -> Self {
        let (events, _) = broadcast::channel(4096);
        let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let api = FakeApi { db: Arc::new(Mutex::new(Db { rv: 100, ..Default::default() })), events, addr };
        let app = Router::new()
            .route("/api/v1/services", get(|s, q| handle(s, q, Kind::Service)))
            .route("/apis/discovery.k8s.io/v1/endpointslices", get(|s, q| handle(s, q, Kind::Slice)))
            .route("/api/v1/nodes", get(|s, q| handle(s, q, Kind::Node)))
            .route("/apis/events.k8s.io/v1/namespaces/{ns}/events", axum::routing::post(post_event))
            .route("/apis/events.k8s.io/v1/namespaces/{ns}/events/{name}", axum::routing::patch(post_event))
            .with_state(api.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        api
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn write(&self, kind: Kind, ty: &'static str, mut obj: Value) {
        let mut db = self.db.lock().unwrap();
        db.rv += 1;
        let rv = db.rv;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = key_of(kind, &obj);
        if ty == "DELETED" {
            db.objects.remove(&key);
        } else {
            let json: Arc<str> = obj.to_string().into();
            db.objects.insert(key, (obj.clone(), json));
        }
        db.history.push((rv, kind, ty, obj.clone()));
        let _ = self.events.send(Some((rv, kind, ty, obj)));
    }

    pub fn apply(&self, kind: Kind, obj: Value) {
        let exists = self.db.lock().unwrap().objects.contains_key(&key_of(kind, &obj));
        self.write(kind, if exists { "MODIFIED" } else { "ADDED" }, obj);
    }

    pub fn delete(&self, kind: Kind, ns: &str, name: &str) {
        let obj = self.db.lock().unwrap().objects.get(&(kind, ns.to_string(), name.to_string())).map(|(o, _)| o.clone());
        if let Some(obj) = obj {
            self.write(kind, "DELETED", obj);
        }
    }

    /// Ends every open watch (the client must resume from its last resourceVersion).
    pub fn drop_watches(&self) {
        let _ = self.events.send(None);
    }

    /// Forgets history: resuming a watch from an older resourceVersion now gets 410 Gone.
    pub fn compact(&self) {
        let mut db = self.db.lock().unwrap();
        db.compacted = db.rv + 1;
        db.history.clear();
    }

    pub fn set_delay(&self, d: Duration) {
        self.db.lock().unwrap().delay = d;
    }

    /// An outage: every request fails with 503 until set back.
    pub fn set_down(&self, down: bool) {
        self.db.lock().unwrap().down = down;
        if down {
            self.drop_watches();
        }
    }

    /// Events posted so far.
    pub fn events(&self) -> Vec<Value> {
        self.db.lock().unwrap().events.clone()
    }

    pub fn lists(&self) -> u64 {
        self.db.lock().unwrap().lists
    }
}

async fn post_event(State(api): State<FakeApi>, body: Bytes) -> Response {
    let mut ev: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut db = api.db.lock().unwrap();
    db.rv += 1;
    if ev["metadata"]["name"].is_null() {
        ev["metadata"]["name"] = json!(format!("ev{}", db.rv));
    }
    ev["metadata"]["resourceVersion"] = json!(db.rv.to_string());
    db.events.push(ev.clone());
    (StatusCode::CREATED, [("content-type", "application/json")], ev.to_string()).into_response()
}

fn line(v: Value) -> Result<Bytes, Infallible> {
    let mut s = v.to_string();
    s.push('\n');
    Ok(Bytes::from(s))
}

async fn handle(State(api): State<FakeApi>, Query(q): Query<HashMap<String, String>>, kind: Kind) -> Response {
    let (delay, down) = {
        let db = api.db.lock().unwrap();
        (db.delay, db.down)
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if down {
        return (StatusCode::SERVICE_UNAVAILABLE, "apiserver down for the test").into_response();
    }
    let labels = q.get("labelSelector").cloned();
    let fields = q.get("fieldSelector").cloned();
    let (list_kind, api_version) = kind.list_kind();
    if q.get("watch").map(String::as_str) != Some("true") {
        let mut db = api.db.lock().unwrap();
        db.lists += 1;
        // Pages as the API server serves a list from etcd (kube-rs asks for 500 at a time): the
        // continue token names the snapshot's resourceVersion and the last key served. Later
        // pages show the current objects; the watch from the snapshot replays what changed.
        let limit: usize = q.get("limit").and_then(|s| s.parse().ok()).filter(|l| *l > 0).unwrap_or(usize::MAX);
        let (snapshot, after) = match q.get("continue").and_then(|c| c.split_once('/')) {
            Some((rv, key)) => (rv.parse().unwrap_or(db.rv), key.split_once('/').map(|(ns, n)| (ns.to_string(), n.to_string()))),
            None => (db.rv, None),
        };
        // From the last key served on (a range, not a scan from the start: 400 pages of
        // 100,000 objects each would walk the map again).
        let start = match after {
            Some((ns, name)) => std::ops::Bound::Excluded((kind, ns, name)),
            None => std::ops::Bound::Included((kind, String::new(), String::new())),
        };
        let mut page = db
            .objects
            .range((start, std::ops::Bound::Unbounded))
            .take_while(|((k, _, _), _)| *k == kind)
            .filter(|(_, (o, _))| matches(o, labels.as_deref(), fields.as_deref()))
            .map(|((_, ns, name), (_, json))| (ns, name, json));
        let mut last = None;
        let served: Vec<Arc<str>> = page
            .by_ref()
            .take(limit)
            .map(|(ns, name, json)| {
                last = Some((ns, name));
                Arc::clone(json)
            })
            .collect();
        let mut meta = json!({"resourceVersion": snapshot.to_string()});
        if page.next().is_some() {
            let (ns, name) = last.expect("a full page");
            meta["continue"] = json!(format!("{snapshot}/{ns}/{name}"));
        }
        // Joined outside the lock: concurrent lists (Services and EndpointSlices) and watches go
        // on meanwhile, as on an API server.
        drop(db);
        let head = json!({"kind": list_kind, "apiVersion": api_version, "metadata": meta}).to_string();
        let mut body = String::with_capacity(head.len() + 16 + served.iter().map(|j| j.len() + 1).sum::<usize>());
        body.push_str(&head[..head.len() - 1]);
        body.push_str(",\"items\":[");
        for (i, json) in served.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str(json);
        }
        body.push_str("]}");
        return ([("content-type", "application/json")], body).into_response();
    }
    let from: u64 = q.get("resourceVersion").and_then(|s| s.parse().ok()).unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let timeout = q.get("timeoutSeconds").and_then(|s| s.parse().ok()).unwrap_or(290u64);
    let rx = api.events.subscribe();
    let (backlog, gone, current_rv) = {
        let mut db = api.db.lock().unwrap();
        db.watches += 1;
        let gone = from < db.compacted;
        let backlog: Vec<Value> = db
            .history
            .iter()
            .filter(|(rv, k, _, o)| *rv > from && *k == kind && matches(o, labels.as_deref(), fields.as_deref()))
            .map(|(_, _, ty, o)| json!({"type": ty, "object": o}))
            .collect();
        (backlog, gone, db.rv)
    };
    if gone {
        let status = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {from} ({current_rv})"), "reason": "Expired", "code": 410}});
        let body = Body::from_stream(futures::stream::iter(vec![line(status)]));
        return ([("content-type", "application/json")], body).into_response();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout.min(30));
    let first: Vec<Result<Bytes, Infallible>> = backlog.into_iter().map(line).collect();
    let start_rv = current_rv;
    let live = futures::stream::unfold((rx, current_rv), move |(mut rx, mut rv)| {
        let labels = labels.clone();
        let fields = fields.clone();
        async move {
            loop {
                let tick = tokio::time::sleep(Duration::from_millis(300));
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => return None,
                    _ = tick, if bookmarks => {
                        let bm = json!({"type": "BOOKMARK", "object": {"kind": kind.kind(), "apiVersion": kind.list_kind().1, "metadata": {"resourceVersion": rv.to_string()}}});
                        return Some((line(bm), (rx, rv)));
                    }
                    ev = rx.recv() => match ev {
                        Ok(Some((erv, k, ty, o))) => {
                            rv = rv.max(erv);
                            // Already in the backlog.
                            if erv <= start_rv {
                                continue;
                            }
                            if k == kind && matches(&o, labels.as_deref(), fields.as_deref()) {
                                return Some((line(json!({"type": ty, "object": o})), (rx, rv)));
                            }
                        }
                        // A dropped watch, or a lagging receiver: end the stream.
                        Ok(None) | Err(_) => return None,
                    }
                }
            }
        }
    });
    let body = Body::from_stream(futures::StreamExt::chain(futures::stream::iter(first), live));
    ([("content-type", "application/json")], body).into_response()
}

/// Starts a FakeApi inside a network namespace (its listener lives there; the handle works from
/// anywhere). The runtime thread lives as long as the process.
pub fn start_in_netns(ns: &str) -> FakeApi {
    start_in_netns_on(ns, "127.0.0.1:0")
}

/// The same, listening on `bind`.
pub fn start_in_netns_on(ns: &str, bind: &str) -> FakeApi {
    let (tx, rx) = std::sync::mpsc::channel();
    let (ns, bind) = (ns.to_string(), bind.to_string());
    std::thread::spawn(move || {
        proxy_agent::host::netif::enter_netns(&ns).expect("enter netns");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            tx.send(FakeApi::start_on(&bind).await).unwrap();
            futures::future::pending::<()>().await;
        });
    });
    rx.recv().unwrap()
}

impl FakeApi {
    /// Applies every Service and EndpointSlice of a YAML file (multi-document).
    pub fn apply_yaml(&self, text: &str) {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
            match v["kind"].as_str() {
                Some("Service") => self.apply(Kind::Service, v),
                Some("EndpointSlice") => self.apply(Kind::Slice, v),
                Some("Node") => self.apply(Kind::Node, v),
                _ => {}
            }
        }
    }

    /// A kubeconfig file pointing at this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self, path: &std::path::Path) {
        self.kubeconfig_for(path, &self.url());
    }

    /// A kubeconfig naming `server` (e.g. the `kubernetes` Service's ClusterIP, as a pod's
    /// in-cluster configuration does).
    pub fn kubeconfig_for(&self, path: &std::path::Path, server: &str) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"{}\"}}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            server
        );
        std::fs::write(path, text).unwrap();
    }
}
