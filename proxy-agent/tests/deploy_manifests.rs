//! The deploy/ manifests parsed into the real k8s-openapi types, and their invariants: RBAC
//! covers exactly what the agent uses, ports and probes match the configuration, and the
//! container has the stated capabilities and nothing more.
use std::collections::BTreeSet;

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Node, Service, ServiceAccount},
        discovery::v1::EndpointSlice,
        events::v1::Event,
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    Resource,
};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kubernetes");

fn docs() -> Vec<serde_yaml::Value> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(DIR).unwrap().flatten() {
        let text = std::fs::read_to_string(e.path()).unwrap();
        for d in serde_yaml::Deserializer::from_str(&text) {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d).unwrap();
            if !v.is_null() {
                out.push(v);
            }
        }
    }
    out
}

fn one<T: serde::de::DeserializeOwned + Resource>() -> T {
    let found: Vec<T> = docs()
        .into_iter()
        .filter(|d| d["kind"].as_str() == Some(T::KIND))
        .map(|d| serde_yaml::from_value(d).unwrap_or_else(|e| panic!("{} does not parse: {e}", T::KIND)))
        .collect();
    assert_eq!(found.len(), 1, "exactly one {}", T::KIND);
    found.into_iter().next().unwrap()
}

/// (group, resource, verb) the agent needs: the watches and the event recorder.
fn needed() -> BTreeSet<(String, String, String)> {
    let mut n = BTreeSet::new();
    for (g, r) in [(Service::GROUP, Service::URL_PATH_SEGMENT), (EndpointSlice::GROUP, EndpointSlice::URL_PATH_SEGMENT), (Node::GROUP, Node::URL_PATH_SEGMENT)]
    {
        for v in ["get", "list", "watch"] {
            n.insert((g.to_string(), r.to_string(), v.to_string()));
        }
    }
    for v in ["create", "patch"] {
        n.insert((Event::GROUP.to_string(), Event::URL_PATH_SEGMENT.to_string(), v.to_string()));
    }
    n
}

#[test]
fn rbac_grants_exactly_what_the_agent_uses() {
    let role: ClusterRole = one();
    let mut granted = BTreeSet::new();
    for rule in role.rules.unwrap_or_default() {
        for g in rule.api_groups.clone().unwrap_or_default() {
            for r in rule.resources.clone().unwrap_or_default() {
                for v in &rule.verbs {
                    granted.insert((g.clone(), r.clone(), v.clone()));
                }
            }
        }
    }
    assert_eq!(granted, needed());
    let binding: ClusterRoleBinding = one();
    let sa: ServiceAccount = one();
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());
    let subject = &binding.subjects.unwrap()[0];
    assert_eq!((Some(subject.name.clone()), subject.namespace.clone()), (sa.metadata.name.clone(), sa.metadata.namespace.clone()));
}

#[test]
fn daemonset_privileges_ports_and_mounts() {
    let ds: DaemonSet = one();
    let spec = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(spec.host_network, Some(true));
    assert_eq!(spec.priority_class_name.as_deref(), Some("system-node-critical"));
    assert!(spec.tolerations.unwrap().iter().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()), "tolerates every taint");
    let sa: ServiceAccount = one();
    assert_eq!(spec.service_account_name, sa.metadata.name);
    let c = &spec.containers[0];
    let sc = c.security_context.clone().unwrap();
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.unwrap();
    let added: BTreeSet<String> = caps.add.unwrap().into_iter().collect();
    assert_eq!(added, ["BPF", "NET_ADMIN", "PERFMON"].iter().map(|s| s.to_string()).collect());
    assert_eq!(caps.drop.unwrap(), vec!["ALL".to_string()]);
    let mounts = c.volume_mounts.clone().unwrap();
    let bpffs = mounts.iter().find(|m| m.mount_path == "/sys/fs/bpf").expect("bpffs mounted");
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("HostToContainer"));
    let modules = mounts.iter().find(|m| m.mount_path == "/lib/modules").expect("/lib/modules mounted");
    assert_eq!(modules.read_only, Some(true));

    // kube-proxy's own ConfigMap, mounted unchanged where its kubeconfig expects to be: every
    // path the agent reads is under the mount, in both containers.
    let cm = kubeadm_configmap();
    let data = cm.data.clone().unwrap();
    let text = data["config.conf"].clone();
    let kp = proxy_agent::settings::kube_proxy::parse("configmap", &text).expect("kubeadm's KubeProxyConfiguration is valid");
    let (resolved, notes) = proxy_agent::settings::resolve(&Default::default(), Some(("configmap", kp))).expect("it resolves");
    assert!(notes.iter().all(|n| !n.contains("error")), "{notes:?}");
    let volumes = spec.volumes.clone().unwrap();
    let ds: DaemonSet = one();
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let init = &pod.init_containers.as_ref().unwrap()[0];
    assert_eq!(init.image, c.image, "the init container prepares the host from the same image");
    for (who, args, mounts) in [("kpr", c.args.clone().unwrap(), mounts.clone()), ("prepare-host", init.args.clone().unwrap(), init.volume_mounts.clone().unwrap())] {
        let config = args.iter().find_map(|a| a.strip_prefix("--config=")).unwrap_or_else(|| panic!("{who}: --config"));
        let kubeconfig = resolved.kubeconfig.clone().expect("kubeadm's config names its kubeconfig");
        for (path, key) in [(std::path::Path::new(config), "config.conf"), (kubeconfig.as_path(), "kubeconfig.conf")] {
            let m = mounts.iter().find(|m| path.starts_with(&m.mount_path)).unwrap_or_else(|| panic!("{who}: {} is on no mount", path.display()));
            assert_eq!(m.read_only, Some(true));
            let v = volumes.iter().find(|v| v.name == m.name).unwrap();
            assert_eq!(v.config_map.as_ref().map(|c| c.name.as_str()), Some("kube-proxy"), "{who}: {} comes from kube-proxy's ConfigMap", path.display());
            assert_eq!(path.strip_prefix(&m.mount_path).unwrap().to_str(), Some(key), "{who}: the ConfigMap's key {key}");
        }
    }
    // The API server's address comes from kube-proxy's kubeconfig: nothing names it by hand.
    let kc = kube::config::Kubeconfig::from_yaml(&data["kubeconfig.conf"]).expect("kubeadm's kubeconfig.conf parses");
    assert_eq!(kc.clusters[0].cluster.as_ref().unwrap().server.as_deref(), Some("https://control-plane.example:6443"));
    assert!(kc.auth_infos[0].auth_info.as_ref().unwrap().token_file.is_some(), "the service account's token");
    assert!(c.env.clone().unwrap_or_default().iter().all(|e| e.name != "KPR_K8S_API_SERVER"), "no address by hand");
    // Nothing per node by hand: uplinks and pod interfaces are found on the node.
    assert!(c.args.clone().unwrap().iter().all(|a| !a.starts_with("--uplink") && !a.starts_with("--pod-iface")), "{:?}", c.args);
    // The node's resolver: the cluster's DNS is a Service not yet programmed on a cold node.
    assert_eq!(pod.dns_policy.as_deref(), Some("Default"));
    // The maps are charged to the container's cgroup: the limit holds them (about 200 MiB at the
    // default capacities, docs/configuration.md) and the agent (its goal at 100,000 Services:
    // 250 MB).
    let limit = c.resources.clone().unwrap().limits.unwrap()["memory"].0.clone();
    let mib: u64 = limit.strip_suffix("Gi").map(|g| g.parse::<u64>().unwrap() * 1024).or_else(|| limit.strip_suffix("Mi").map(|m| m.parse().unwrap())).unwrap();
    assert!(mib >= 200 + 250 * 1_000_000 / (1 << 20), "memory limit {limit}");
    // Ports and probes agree with what the configuration resolves to.
    let healthz = i32::from(resolved.healthz_bind_address.expect("health served").port());
    let metrics = i32::from(resolved.metrics_bind_address.expect("metrics served").port());
    let ports: BTreeSet<i32> = c.ports.clone().unwrap().iter().map(|p| p.container_port).collect();
    assert_eq!(ports, [healthz, metrics].into_iter().collect());
    for (probe, path) in [(&c.liveness_probe, "/livez"), (&c.readiness_probe, "/healthz")] {
        let g = probe.clone().unwrap().http_get.unwrap();
        assert_eq!(g.path.as_deref(), Some(path));
        assert_eq!(g.port, k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(healthz));
    }
}

/// kube-system/kube-proxy as kubeadm writes it.
fn kubeadm_configmap() -> ConfigMap {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kubeadm-kube-proxy-configmap.yaml")).unwrap();
    serde_yaml::from_str(&text).unwrap()
}

/// `kubectl apply -k` renders the base and each overlay (Debian's kubectl and its kustomize),
/// and every object it renders decodes into its k8s-openapi type.
#[test]
fn the_kustomizations_render_and_decode() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    for dir in ["kubernetes", "overlays/ipvs", "overlays/without-kube-proxy"] {
        let o = std::process::Command::new("kubectl").args(["kustomize", &format!("{root}/{dir}")]).output().expect("kubectl (Debian: kubernetes-client)");
        assert!(o.status.success(), "{dir}: {}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8(o.stdout).unwrap();
        let mut kinds = BTreeSet::new();
        for d in serde_yaml::Deserializer::from_str(&text) {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d).unwrap();
            let kind = v["kind"].as_str().unwrap().to_string();
            let ok = match kind.as_str() {
                "DaemonSet" => serde_yaml::from_value::<DaemonSet>(v.clone()).is_ok(),
                "ServiceAccount" => serde_yaml::from_value::<ServiceAccount>(v.clone()).is_ok(),
                "ClusterRole" => serde_yaml::from_value::<ClusterRole>(v.clone()).is_ok(),
                "ClusterRoleBinding" => serde_yaml::from_value::<ClusterRoleBinding>(v.clone()).is_ok(),
                "ConfigMap" => serde_yaml::from_value::<ConfigMap>(v.clone()).is_ok(),
                _ => false,
            };
            assert!(ok, "{dir}: {kind} does not decode: {v:?}");
            kinds.insert(kind);
        }
        assert!(["DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"].iter().all(|k| kinds.contains(*k)), "{dir}: {kinds:?}");
        match dir {
            "overlays/ipvs" => assert!(text.contains("--mode=ipvs")),
            "overlays/without-kube-proxy" => {
                // Its own KubeProxyConfiguration, under the name the DaemonSet mounts.
                let cm: ConfigMap = serde_yaml::Deserializer::from_str(&text)
                    .map(|d| <serde_yaml::Value as serde::Deserialize>::deserialize(d).unwrap())
                    .filter(|v| v["kind"] == "ConfigMap" && v["metadata"]["name"] == "kube-proxy")
                    .map(|v| serde_yaml::from_value(v).unwrap())
                    .next()
                    .expect("a kube-proxy ConfigMap");
                let kp = proxy_agent::settings::kube_proxy::parse("overlay", &cm.data.unwrap()["config.conf"]).unwrap();
                let (_, notes) = proxy_agent::settings::resolve(&Default::default(), Some(("overlay", kp))).unwrap();
                assert!(notes.is_empty(), "{notes:?}");
            }
            _ => assert!(!kinds.contains("ConfigMap"), "the base brings no configuration of its own: kube-proxy's is read"),
        }
    }
}
