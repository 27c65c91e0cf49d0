//! The real agent on the Kubernetes API (an in-process list/watch server in the node
//! namespace), forwarding real traffic; health and metrics as kube-proxy serves them; an API
//! outage during which forwarding goes on.
use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use kpr_lab::{
    fake_api::start_in_netns,
    lab::{errors, per_backend, Lab},
};

fn get(lab: &Lab, addr: &str, path: &str) -> (String, String) {
    http(lab, addr, path, None)
}

fn http(lab: &Lab, addr: &str, path: &str, put: Option<&str>) -> (String, String) {
    let o = Command::new("ip")
        .args(["netns", "exec", &lab.ns("node")])
        .arg(kpr_lab::sibling_bin("kpr-lab-peer"))
        .args(["get", addr, path])
        .args(put)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let (status, body) = out.split_once('\n').unwrap_or((&out, ""));
    (status.to_string(), body.to_string())
}

fn metric(text: &str, name: &str) -> f64 {
    metric_if_any(text, name).unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}

/// A metric's value; None where it is not exported (yet: a labelled counter appears with its
/// first increment).
fn metric_if_any(text: &str, name: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' ')).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

/// The first Event about the object `name`, waited for.
fn event_about(api: &kpr_lab::fake_api::FakeApi, name: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(e) = api.events().into_iter().find(|e| e["regarding"]["name"] == name) {
            return e;
        }
        assert!(std::time::Instant::now() < deadline, "no event about {name}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn agent_on_the_kubernetes_api_forwards_serves_health_and_metrics_and_survives_an_outage() {
    let empty = std::env::temp_dir().join(format!("kpr-kube-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let mut lab = Lab::build("kpe5", &empty);
    let api = start_in_netns(&lab.ns("node"));
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    for e in std::fs::read_dir(&examples).unwrap().flatten() {
        api.apply_yaml(&std::fs::read_to_string(e.path()).unwrap());
    }
    api.apply_yaml("apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n");
    let kubeconfig = empty.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let agent_args = ["--kubeconfig".as_ref(), kubeconfig.as_os_str(), "--sync-period".as_ref(), "2".as_ref()];
    lab.start_agent_with(&agent_args);
    lab.wait_backends("10.96.0.10:80", 3);

    let v = lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "60"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "{v}");

    // A change through the API reaches the kernel.
    api.apply_yaml(
        &std::fs::read_to_string(examples.join("web.yaml"))
            .unwrap()
            .replace("- addresses: [\"10.244.3.2\"]\n  conditions: {ready: true, serving: true, terminating: false}\n  nodeName: node-a\n", ""),
    );
    lab.wait_backends("10.96.0.10:80", 2);

    let (status, body) = get(&lab, "127.0.0.1:10256", "/healthz");
    assert!(status.contains("200"), "{status} {body}");
    assert!(body.contains("lastUpdated") && body.contains("\"nodeEligible\":true"), "{body}");
    assert!(get(&lab, "127.0.0.1:10256", "/livez").0.contains("200"));
    let (status, m) = get(&lab, "127.0.0.1:10249", "/metrics");
    assert!(status.contains("200"), "{status}");
    assert!(metric(&m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 1.0e9);
    assert!(metric(&m, "kubeproxy_sync_proxy_rules_duration_seconds_count") >= 2.0);
    assert!(metric(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_total") >= 1.0);
    assert!(metric(&m, "kubeproxy_network_programming_duration_seconds_count") >= 0.0);
    assert!(metric(&m, "kpr_datapath_packets_total{reason=\"new_flow\"}") >= 60.0, "{m}");
    assert!(m.contains("kpr_backend_flows{backend=\"10.244.1.2:8080\"}"), "{m}");
    assert!(metric(&m, "kpr_backend_new_connections_total{backend=\"10.244.1.2:8080\"}") >= 1.0, "{m}");

    // healthCheckNodePort for externalTrafficPolicy Local: 200 with local endpoints, else 503.
    let local_svc = |name: &str, hc: u16, node: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec: {{type: LoadBalancer, clusterIP: 10.96.0.{}, externalTrafficPolicy: Local, healthCheckNodePort: {hc}, ports: [{{name: http, port: 80, nodePort: {}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{{addresses: [10.244.1.2], conditions: {{ready: true}}, nodeName: {node}}}]\n",
            hc - 31900,
            hc - 1000
        )
    };
    api.apply_yaml(&local_svc("here", 32000, "node-a"));
    api.apply_yaml(&local_svc("elsewhere", 32001, "node-b"));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (status, body) = loop {
        let r = get(&lab, "127.0.0.1:32000", "/healthz");
        if r.0.contains("200") || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.contains("200"), "{status} {body}");
    assert!(body.contains("\"localEndpoints\":1") && body.contains("\"name\":\"here\""), "{body}");
    let (status, body) = get(&lab, "127.0.0.1:32001", "/");
    assert!(status.contains("503") && body.contains("\"localEndpoints\":0"), "{status} {body}");

    // kube-proxy's metric set, the process's, kpr's map fill; /proxyMode.
    let (_, m) = get(&lab, "127.0.0.1:10249", "/metrics");
    assert_eq!(metric(&m, "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"}"), 1.0, "{m}");
    assert!(metric(&m, "kubeproxy_proxy_healthz_total{code=\"200\"}") >= 1.0, "{m}");
    assert!(metric(&m, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count") >= 1.0, "{m}");
    assert!(metric(&m, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") > 1.0e9, "{m}");
    assert!(metric(&m, "process_resident_memory_bytes") > 1.0e6, "{m}");
    assert!(metric(&m, "kpr_map_capacity{map=\"KPR_SVC_V2\"}") >= 1024.0, "{m}");
    // The collector rebuilds the assured tables' hints once every packet program is this
    // agent's (a pass over a table at most once a second): a few flows set a small share of
    // the bits.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut m = m;
    let passes = |m: &str, f: &str| metric_if_any(m, &format!("kpr_conntrack_hint_passes_total{{family=\"{f}\"}}")).unwrap_or(0.0);
    while ["ipv4", "ipv6"].iter().any(|f| passes(&m, f) < 2.0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
        m = get(&lab, "127.0.0.1:10249", "/metrics").1;
    }
    assert!(metric(&m, "kpr_conntrack_hint_passes_total{family=\"ipv4\"}") >= 2.0, "{m}");
    assert!(metric(&m, "kpr_conntrack_hint_bits_set_ratio{family=\"ipv4\"}") < 0.01, "{m}");
    assert!(metric(&m, "kpr_conntrack_hint_passes_total{family=\"ipv6\"}") >= 2.0, "{m}");
    // The syncer, both collectors, the hints and the metrics all share one mapping of each
    // mapped array (the two embryonic tables): each mapping is the whole array in the RSS.
    let pid = lab.agent_pid().expect("the agent runs");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mapped: Vec<&str> = maps.lines().filter(|l| l.ends_with("anon_inode:bpf-map")).collect();
    assert_eq!(mapped.len(), 2, "IPv4's and IPv6's embryonic tables, once each: {mapped:#?}");
    assert!(
        m.contains("# TYPE kubeproxy_network_programming_duration_seconds histogram")
            && m.contains("kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\"}"),
        "{m}"
    );
    let (status, mode) = get(&lab, "127.0.0.1:10249", "/proxyMode");
    assert!(status.contains("200") && mode.trim() == "ebpf", "{status} {mode}");
    // Every metric the shipped Grafana dashboard queries is served.
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/kpr-dashboard.json")).unwrap()).unwrap();
    let mut names = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
                if ["kpr_", "kubeproxy_", "process_"].iter().any(|p| word.starts_with(p)) {
                    names.insert(word.to_string());
                }
            }
        }
    }
    assert!(names.len() >= 20, "{names:?}");
    for name in &names {
        assert!(
            m.lines().any(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{"))),
            "the dashboard queries {name}, which /metrics does not serve"
        );
    }

    // `kpr status` shows the last sync from the agent's health endpoint.
    let status = Command::new(&lab.kpr).args(["--netns", &lab.ns("node"), "--pin-dir"]).arg(lab.pins.path()).arg("status").output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.contains("last sync: 20") && status.contains("new_flow"), "{status}");

    // The log level changes at run time, as kube-proxy's does, where enableProfiling serves the
    // debug handlers; without it, the metrics port takes no such request.
    let (status, _) = http(&lab, "127.0.0.1:10249", "/debug/flags/v", Some("4"));
    assert!(status.contains("404") || status.contains("405"), "debug handlers served without --profiling: {status}");
    lab.kill_agent();
    let profiling: Vec<&std::ffi::OsStr> = agent_args.iter().copied().chain(["--profiling".as_ref()]).collect();
    lab.start_agent_with(&profiling);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !get(&lab, "127.0.0.1:10256", "/livez").1.contains("\"lastUpdated\":\"2") {
        assert!(std::time::Instant::now() < deadline, "no sync after the restart");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, body) = http(&lab, "127.0.0.1:10249", "/debug/flags/v", Some("4"));
    assert!(status.contains("200") && body.contains("debug"), "{status} {body}");
    let (status, _) = http(&lab, "127.0.0.1:10249", "/debug/flags/v", Some("no such level ["));
    assert!(status.contains("400"), "{status}");
    http(&lab, "127.0.0.1:10249", "/debug/flags/v", Some("2"));

    // A Service that cannot be programmed: reported as a Kubernetes Event, the rest unaffected.
    api.apply_yaml("apiVersion: v1\nkind: Service\nmetadata: {name: broken, namespace: demo}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}\n");
    let event = event_about(&api, "broken");
    assert_eq!(event["type"], "Warning", "{event}");
    assert!(event["note"].as_str().unwrap().contains("spec.clusterIP"), "{event}");
    let v = lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "20"]);
    assert_eq!(errors(&v), 0, "{v}");

    // A Service whose JSON does not fit its type (a port that is a string) fails no list or
    // watch: an Event names the field, and the other objects go on (a later change and the
    // restart's list below).
    api.apply_yaml("apiVersion: v1\nkind: Service\nmetadata: {name: undecodable, namespace: demo}\nspec: {clusterIP: 10.96.0.250, ports: [{port: eighty}]}\n");
    let event = event_about(&api, "undecodable");
    let note = event["note"].as_str().unwrap();
    assert!(note.starts_with("field spec.ports[0].port: cannot decode") && note.contains("eighty"), "{event}");
    // The Event leaves before the sync's writes, the gauge is set after them.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, m) = get(&lab, "127.0.0.1:10249", "/metrics");
        if metric(&m, "kpr_objects_not_programmed{reason=\"FieldNotProgrammed\"}") >= 2.0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the undecodable Service is not counted:\n{m}");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Drift: an entry deleted by hand is repaired by the next full sync (syncPeriod 2 s here).
    {
        use proxy_agent::dataplane::ebpf::maps::DatapathMaps;
        let mut maps = proxy_agent::dataplane::ebpf::kernel_maps::KernelMaps::open(lab.pins.path()).unwrap();
        let key = proxy_common::ServiceKey::new("10.96.0.11".parse().unwrap(), 80, proxy_common::PROTO_TCP, proxy_common::SCOPE_INTERNAL);
        maps.del_service(key).unwrap();
        assert!(!maps.services().unwrap().iter().any(|(k, _)| *k == key));
        lab.wait_backends("10.96.0.11:80", 3);
    }

    // A restart while the API answers slowly: nothing is programmed before the caches have
    // listed, so the maps keep forwarding meanwhile instead of being flushed.
    lab.kill_agent();
    api.set_delay(Duration::from_millis(2500));
    lab.start_agent_with(&agent_args);
    std::thread::sleep(Duration::from_millis(1000));
    let v = lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "20"]);
    assert_eq!(errors(&v), 0, "forwarding during the restart: {v}");
    assert!(lab.services().as_array().is_some_and(|a| a.len() >= 10), "maps kept while the caches sync");
    api.set_delay(Duration::ZERO);
    lab.wait_for("the restarted agent's first sync", |_| lab.agent_log().matches("synced full=true").count() >= 2);

    // Outage: forwarding goes on with what is programmed; nothing is flushed.
    api.set_down(true);
    std::thread::sleep(Duration::from_millis(1500));
    let v = lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "30"]);
    assert_eq!(errors(&v), 0, "{v}");
    assert_eq!(per_backend(&v).len(), 2, "{v}");
    assert!(get(&lab, "127.0.0.1:10256", "/healthz").0.contains("200"), "nothing pending: still healthy");
    api.set_down(false);
    api.apply_yaml(&std::fs::read_to_string(examples.join("web.yaml")).unwrap());
    lab.wait_backends("10.96.0.10:80", 3);
    let _ = std::fs::remove_dir_all(&empty);
}

/// A node whose maps are empty (a new node, or after a reboot) must reach the API server
/// before anything programs the `kubernetes` Service's ClusterIP: through the ClusterIP alone
/// it never starts; with the API server's real address (--k8s-api-server, as the DaemonSet
/// sets it) it programs everything, that ClusterIP included.
#[test]
fn a_cold_node_reaches_the_api_server_at_its_real_address() {
    use kpr_lab::{fake_api::start_in_netns_on, lab::NODE_IP};
    let dir = std::env::temp_dir().join(format!("kpr-kube-cold-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut lab = Lab::build("kpe8", &dir);
    // The API server listens on the node's address (host network), as a control-plane node's does.
    let api = start_in_netns_on(&lab.ns("node"), "0.0.0.0:0");
    let port = api.port();
    api.apply_yaml(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: kubernetes, namespace: default}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{name: https, port: 443, targetPort: {port}}}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: kubernetes, namespace: default, labels: {{kubernetes.io/service-name: kubernetes}}}}\n\
         addressType: IPv4\nports: [{{name: https, port: {port}}}]\nendpoints: [{{addresses: [{NODE_IP}], conditions: {{ready: true}}}}]\n"
    ));
    api.apply_yaml(&std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/web.yaml")).unwrap());
    api.apply_yaml("apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n");
    // A pod's in-cluster configuration: the Service's ClusterIP.
    let kubeconfig = dir.join("kubeconfig");
    api.kubeconfig_for(&kubeconfig, "http://10.96.0.1:443");

    lab.start_agent_with(&["--kubeconfig".as_ref(), kubeconfig.as_os_str()]);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(lab.services().as_array().map(|a| a.len()), Some(0), "nothing can be programmed: {}", lab.agent_log());
    lab.kill_agent();

    let real = format!("http://{NODE_IP}:{port}");
    lab.start_agent_with(&["--kubeconfig".as_ref(), kubeconfig.as_os_str(), "--k8s-api-server".as_ref(), real.as_ref()]);
    lab.wait_backends("10.96.0.1:443", 1);
    lab.wait_backends("10.96.0.10:80", 3);
    // And now pods reach the API server through its ClusterIP.
    let o = Command::new("ip")
        .args(["netns", "exec", &lab.ns("pod")])
        .arg(kpr_lab::sibling_bin("kpr-lab-peer"))
        .args(["get", "10.96.0.1:443", "/api/v1/nodes"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with("HTTP/1.") && out.contains(" 200") && out.contains("node-a"), "{out}");
    drop(lab);
    let _ = std::fs::remove_dir_all(&dir);
}
