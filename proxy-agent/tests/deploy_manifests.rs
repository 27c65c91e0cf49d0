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

    // Ports and probes agree with the configuration the ConfigMap gives the agent.
    let cm: ConfigMap = one();
    let text = cm.data.unwrap()["config.conf"].clone();
    let kp = proxy_agent::settings::kube_proxy::parse("configmap", &text).expect("the ConfigMap's KubeProxyConfiguration is valid");
    // It resolves without a note: every field it sets is one kpr uses.
    let (_, notes) = proxy_agent::settings::resolve(&Default::default(), Some(("configmap", kp.clone()))).expect("it resolves");
    assert!(notes.is_empty(), "{notes:?}");
    // The init container prepares the host from the same configuration, in the same image.
    let ds: DaemonSet = one();
    let init = &ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap().init_containers.as_ref().unwrap()[0];
    assert_eq!(init.image, c.image);
    assert_eq!(init.args.clone().unwrap(), vec!["prepare-host".to_string(), "--config=/etc/kpr/config.conf".into()]);
    assert!(mounts.iter().any(|m| m.mount_path == "/run/xtables.lock"), "iptables' lock is the host's");
    let port_of = |a: &Option<String>| a.as_deref().unwrap().rsplit(':').next().unwrap().parse::<i32>().unwrap();
    let healthz = port_of(&kp.healthz_bind_address);
    let metrics = port_of(&kp.metrics_bind_address);
    let ports: BTreeSet<i32> = c.ports.clone().unwrap().iter().map(|p| p.container_port).collect();
    assert_eq!(ports, [healthz, metrics].into_iter().collect());
    for (probe, path) in [(&c.liveness_probe, "/livez"), (&c.readiness_probe, "/healthz")] {
        let g = probe.clone().unwrap().http_get.unwrap();
        assert_eq!(g.path.as_deref(), Some(path));
        assert_eq!(g.port, k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(healthz));
    }
    assert!(c.args.clone().unwrap().iter().any(|a| a == "--config=/etc/kpr/config.conf"));
    let cfg_mount = mounts.iter().find(|m| m.mount_path == "/etc/kpr").expect("config mounted");
    assert_eq!(cfg_mount.read_only, Some(true));
}
