//! The precedence rule, field by field, through the real flag parser and the real file parser.
use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    flags: Flags,
}

const HEAD: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

fn resolved(args: &[&str], yaml: Option<&str>) -> (Settings, Vec<String>) {
    let flags = Cli::try_parse_from(std::iter::once("kpr").chain(args.iter().copied())).expect("flags parse").flags;
    let file = yaml.map(|y| ("kp.yaml", kube_proxy::parse("kp.yaml", &format!("{HEAD}{y}")).expect("file parses")));
    resolve(&flags, file).expect("settings resolve")
}

fn settings(args: &[&str], yaml: Option<&str>) -> Settings {
    resolved(args, yaml).0
}

/// For one field: the flag wins over the file, the file over the default, and without either
/// the default holds.
macro_rules! layered {
    ($field:literal, flag [$($flag:literal),*], file $yaml:literal, |$s:ident| $get:expr, flag = $fv:expr, file = $filev:expr, default = $dv:expr) => {{
        let get = |args: &[&str], yaml: Option<&str>| {
            let $s = settings(args, yaml);
            $get
        };
        assert_eq!(get(&[$($flag),*], Some($yaml)), $fv, "{}: the flag wins over the file", $field);
        assert_eq!(get(&[], Some($yaml)), $filev, "{}: the file wins over the default", $field);
        assert_eq!(get(&[], None), $dv, "{}: the default", $field);
    }};
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}
fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}
fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}
fn addr(s: &str) -> Option<SocketAddr> {
    Some(s.parse().unwrap())
}

#[test]
fn every_layered_field_takes_the_flag_then_the_file_then_the_default() {
    layered!("mode", flag ["--mode", "ebpf"], file "mode: ipvs\n", |s| s.mode, flag = Mode::Ebpf, file = Mode::Ipvs, default = Mode::Ebpf);
    layered!("kubeconfig", flag ["--kubeconfig", "/a"], file "clientConnection: {kubeconfig: /b}\n", |s| s.kubeconfig.clone(),
        flag = Some(PathBuf::from("/a")), file = Some(PathBuf::from("/b")), default = None);
    layered!("clientConnection.qps", flag ["--kube-api-qps", "20"], file "clientConnection: {qps: 50}\n", |s| s.api_qps, flag = 20.0, file = 50.0, default = 5.0);
    layered!("clientConnection.burst", flag ["--kube-api-burst", "30"], file "clientConnection: {burst: 100}\n", |s| s.api_burst, flag = 30, file = 100, default = 10);
    // client-go's reading of a file's zero: its default.
    assert_eq!(
        (settings(&[], Some("clientConnection: {qps: 0, burst: 0}\n")).api_qps, settings(&[], Some("clientConnection: {burst: 0}\n")).api_burst),
        (5.0, 10)
    );
    layered!("node name", flag ["--node-name", "a"], file "hostnameOverride: b\n", |s| s.node_name.clone(),
        flag = Some("a".to_string()), file = Some("b".to_string()), default = None);
    layered!("primary IP", flag ["--bind-address", "192.0.2.1"], file "bindAddress: 192.0.2.2\n", |s| s.primary_ip,
        flag = Some(ip("192.0.2.1")), file = Some(ip("192.0.2.2")), default = None);
    layered!("NodePort addresses", flag ["--node-ip", "192.0.2.1"], file "nodePortAddresses: [primary, 10.0.0.0/8]\n", |s| s.node_port_addresses.clone(),
        flag = NodePortAddresses::Addresses(vec![ip("192.0.2.1")]),
        file = NodePortAddresses::Select(vec![NodePortFilter::Primary, NodePortFilter::Cidr(net("10.0.0.0/8"))]),
        default = NodePortAddresses::All);
    layered!("snatNodeInternalIP", flag ["--snat-node-internal-ip=false"], file "iptables: {snatNodeInternalIP: true}\n", |s| s.snat_node_internal_ip,
        flag = false, file = true, default = false);
    layered!("cluster CIDRs", flag ["--cluster-cidr", "10.1.0.0/16"], file "clusterCIDR: 10.2.0.0/16,fd00::/56\n", |s| s.cluster_cidrs.clone(),
        flag = vec![net("10.1.0.0/16")], file = vec![net("10.2.0.0/16"), net("fd00::/56")], default = vec![]);
    layered!("detectLocalMode", flag ["--detect-local-mode", "NodeCIDR"], file "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}\n", |s| s.detect_local.clone(),
        flag = DetectLocal::NodeCidr, file = DetectLocal::BridgeInterface("cbr0".into()), default = DetectLocal::ClusterCidr);
    layered!("detectLocal.interfaceNamePrefix", flag ["--pod-interface-name-prefix", "veth"], file "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: cali}\n", |s| s.detect_local.clone(),
        flag = DetectLocal::InterfaceNamePrefix("veth".into()), file = DetectLocal::InterfaceNamePrefix("cali".into()), default = DetectLocal::ClusterCidr);
    layered!("masqueradeAll", flag ["--masquerade-all=false"], file "iptables: {masqueradeAll: true}\n", |s| s.masquerade_all, flag = false, file = true, default = false);
    layered!("fast path scheduler", flag ["--scheduler", "random"], file "ipvs: {scheduler: mh}\n", |s| s.scheduler, flag = Scheduler::Random, file = Scheduler::Maglev, default = Scheduler::Random);
    layered!("ipvs.scheduler", flag ["--ipvs-scheduler", "wlc"], file "ipvs: {scheduler: sh}\n", |s| s.ipvs.scheduler.clone(),
        flag = "wlc".to_string(), file = "sh".to_string(), default = "rr".to_string());
    layered!("ipvs.strictARP", flag ["--ipvs-strict-arp=false"], file "ipvs: {strictARP: true}\n", |s| s.ipvs.strict_arp, flag = false, file = true, default = false);
    layered!("ipvs.excludeCIDRs", flag ["--ipvs-exclude-cidrs", "10.9.0.0/16"], file "ipvs: {excludeCIDRs: [10.8.0.0/16]}\n", |s| s.ipvs.exclude_cidrs.clone(),
        flag = vec![net("10.9.0.0/16")], file = vec![net("10.8.0.0/16")], default = vec![]);
    layered!("ipvs.tcpTimeout", flag ["--ipvs-tcp-timeout", "5m"], file "ipvs: {tcpTimeout: 10m}\n", |s| s.ipvs.tcp_timeout, flag = secs(300), file = secs(600), default = Duration::ZERO);
    layered!("ipvs.tcpFinTimeout", flag ["--ipvs-tcpfin-timeout", "5s"], file "ipvs: {tcpFinTimeout: 10s}\n", |s| s.ipvs.tcp_fin_timeout, flag = secs(5), file = secs(10), default = Duration::ZERO);
    layered!("ipvs.udpTimeout", flag ["--ipvs-udp-timeout", "5s"], file "ipvs: {udpTimeout: 10s}\n", |s| s.ipvs.udp_timeout, flag = secs(5), file = secs(10), default = Duration::ZERO);
    layered!("conntrack.maxPerCore", flag ["--conntrack-max-per-core", "0"], file "conntrack: {maxPerCore: 1000}\n", |s| s.conntrack.max_per_core, flag = 0, file = 1000, default = 32_768);
    layered!("conntrack.min", flag ["--conntrack-min", "5"], file "conntrack: {min: 6}\n", |s| s.conntrack.min, flag = 5, file = 6, default = 131_072);
    layered!("conntrack.tcpEstablishedTimeout", flag ["--conntrack-tcp-timeout-established", "1h"], file "conntrack: {tcpEstablishedTimeout: 2h}\n", |s| s.conntrack.tcp_established,
        flag = secs(3600), file = secs(7200), default = secs(86_400));
    layered!("conntrack.tcpCloseWaitTimeout", flag ["--conntrack-tcp-timeout-close-wait", "1m"], file "conntrack: {tcpCloseWaitTimeout: 2m}\n", |s| s.conntrack.tcp_close_wait,
        flag = secs(60), file = secs(120), default = secs(3600));
    layered!("conntrack.tcpBeLiberal", flag ["--conntrack-tcp-be-liberal=false"], file "conntrack: {tcpBeLiberal: true}\n", |s| s.conntrack.tcp_be_liberal, flag = false, file = true, default = false);
    layered!("conntrack.udpTimeout", flag ["--conntrack-udp-timeout", "5s"], file "conntrack: {udpTimeout: 6s}\n", |s| s.conntrack.udp, flag = Some(secs(5)), file = Some(secs(6)), default = None);
    layered!("conntrack.udpStreamTimeout (the fast path's UDP timeout)", flag ["--conntrack-udp-timeout-stream", "50s"], file "conntrack: {udpStreamTimeout: 60s}\n", |s| s.conntrack.fast_path_udp(),
        flag = secs(50), file = secs(60), default = secs(120));
    layered!("syncPeriod (iptables section outside IPVS mode)", flag ["--sync-period", "7s"], file "iptables: {syncPeriod: 9s}\nipvs: {syncPeriod: 11s}\n", |s| s.sync_period,
        flag = secs(7), file = secs(9), default = secs(30));
    layered!("syncPeriod (ipvs section in IPVS mode)", flag ["--sync-period", "7s"], file "mode: ipvs\niptables: {syncPeriod: 9s}\nipvs: {syncPeriod: 11s}\n", |s| s.sync_period,
        flag = secs(7), file = secs(11), default = secs(30));
    layered!("minSyncPeriod", flag ["--min-sync-period", "250ms"], file "iptables: {minSyncPeriod: 2s}\n", |s| s.min_sync_period,
        flag = Duration::from_millis(250), file = secs(2), default = secs(1));
    layered!("minSyncPeriod (top level wins over the section)", flag ["--min-sync-period", "3s"], file "minSyncPeriod: 5s\niptables: {minSyncPeriod: 2s}\n", |s| s.min_sync_period,
        flag = secs(3), file = secs(5), default = secs(1));
    layered!("healthzBindAddress", flag ["--healthz-bind-address", "127.0.0.1:1"], file "healthzBindAddress: 0.0.0.0\n", |s| s.healthz_bind_address,
        flag = addr("127.0.0.1:1"), file = addr("0.0.0.0:10256"), default = addr("0.0.0.0:10256"));
    layered!("metricsBindAddress", flag ["--metrics-bind-address", "127.0.0.1:9"], file "metricsBindAddress: 0.0.0.0:10249\n", |s| s.metrics_bind_address,
        flag = addr("127.0.0.1:9"), file = addr("0.0.0.0:10249"), default = addr("127.0.0.1:10249"));
    layered!("bindAddressHardFail", flag ["--bind-address-hard-fail=false"], file "bindAddressHardFail: true\n", |s| s.bind_address_hard_fail, flag = false, file = true, default = false);
    layered!("oomScoreAdj", flag ["--oom-score-adj", "-5"], file "oomScoreAdj: 7\n", |s| s.oom_score_adj, flag = -5, file = 7, default = -999);
    layered!("logging.verbosity", flag ["-v", "4"], file "logging: {verbosity: 2}\n", |s| s.verbosity, flag = 4, file = 2, default = 0);
}

#[test]
fn flag_only_settings_take_the_flag_else_the_default() {
    let d = settings(&[], None);
    let s = settings(
        &[
            "--max-services",
            "1000",
            "--max-backends",
            "4000",
            "--max-conntrack",
            "99",
            "--max-affinity",
            "7",
            "--max-conntrack6",
            "98",
            "--max-conntrack6-embryonic",
            "97",
            "--conntrack-tcp-timeout-closing",
            "3s",
            "--k8s-api-server",
            "https://192.0.2.1:6443",
        ],
        None,
    );
    assert_eq!((s.capacities.services, s.capacities.backends, s.capacities.slots), (1000, 4000, 16_000));
    assert_eq!((s.capacities.conntrack, s.capacities.affinity, s.conntrack.tcp_closing), (99, 7, secs(3)));
    assert_eq!((s.capacities.conntrack6, s.capacities.conntrack6_new), (98, 97));
    assert_eq!(s.k8s_api_server.as_deref(), Some("https://192.0.2.1:6443"));
    assert_eq!((d.capacities, d.conntrack.tcp_closing, d.k8s_api_server.clone()), (Capacities::default(), secs(10), None));
}

#[test]
fn an_empty_flag_disables_a_listener_and_short_forms_are_completed() {
    assert_eq!(settings(&["--metrics-bind-address", ""], Some("metricsBindAddress: 0.0.0.0:10249\n")).metrics_bind_address, None);
    assert_eq!(settings(&[], Some("healthzBindAddress: ':9999'\n")).healthz_bind_address, addr("0.0.0.0:9999"));
    assert_eq!(settings(&[], Some("metricsBindAddress: '::1'\n")).metrics_bind_address, addr("[::1]:10249"));
}

#[test]
fn kubeadms_file_resolves_without_notes() {
    let text = kube_proxy::parse("kp.yaml", kube_proxy::tests_support::KUBEADM).unwrap();
    let (s, notes) = resolve(&Flags::default(), Some(("kp.yaml", text))).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(s.mode, Mode::Ipvs);
    // Its zeros mean "unset": the defaults hold.
    assert_eq!((s.sync_period, s.min_sync_period, s.healthz_bind_address), (secs(30), secs(1), addr("0.0.0.0:10256")));
}

#[test]
fn fields_kpr_does_not_use_are_named() {
    let (_, notes) = resolved(
        &[],
        Some(
            "featureGates: {Foo: true}\nenableProfiling: true\nshowHiddenMetricsForVersion: '1.30'\nwinkernel: {enableDSR: true}\nwindowsRunAsService: true\n\
             portRange: 30000-32767\nconfigSyncPeriod: 15m\nclientConnection: {qps: 50, contentType: application/vnd.kubernetes.protobuf}\nlogging: {format: json, flushFrequency: 5s}\n\
             iptables: {localhostNodePorts: true, masqueradeBit: 12}\nipvs: {syncPeriod: 5s}\nnodePortAddresses: [localhost]\nfrobnicate: 1\nconntrack: {shiny: 2}\n",
        ),
    );
    for field in [
        "featureGates",
        "enableProfiling serves /debug/flags/v",
        "showHiddenMetricsForVersion",
        "winkernel",
        "windowsRunAsService",
        "portRange",
        "configSyncPeriod",
        "clientConnection.contentType",
        "logging.format",
        "logging.flushFrequency",
        "iptables.localhostNodePorts",
        "iptables.masqueradeBit 12",
        "ipvs.syncPeriod",
        "nodePortAddresses[0] localhost",
        "unknown field frobnicate",
        "unknown field conntrack.shiny",
    ] {
        assert!(notes.iter().any(|n| n.contains(field)), "no note names {field}: {notes:?}");
    }
}

#[test]
fn bad_values_name_their_origin() {
    let err = |args: &[&str], yaml: Option<&str>| {
        let flags = Cli::try_parse_from(std::iter::once("kpr").chain(args.iter().copied())).unwrap().flags;
        let file = yaml.map(|y| ("kp.yaml", kube_proxy::parse("kp.yaml", &format!("{HEAD}{y}")).unwrap()));
        resolve(&flags, file).unwrap_err().origin
    };
    assert_eq!(err(&[], Some("clusterCIDR: 10.244.0.0/33\n")), "kp.yaml: clusterCIDR");
    assert_eq!(err(&[], Some("nodePortAddresses: [10.0.0.0/8, nope]\n")), "kp.yaml: nodePortAddresses[1]");
    assert_eq!(err(&[], Some("ipvs: {scheduler: fastest}\n")), "kp.yaml: ipvs.scheduler");
    assert_eq!(err(&[], Some("healthzBindAddress: nowhere:x\n")), "kp.yaml: healthzBindAddress");
    assert_eq!(err(&[], Some("mode: userspace\n")), "kp.yaml: mode");
    assert_eq!(err(&[], Some("iptables: {masqueradeBit: 40}\n")), "kp.yaml: iptables.masqueradeBit");
    assert_eq!(err(&[], Some("detectLocalMode: BridgeInterface\n")), "kp.yaml: detectLocalMode");
    assert_eq!(err(&["--mode", "fast"], None), "--mode");
    assert_eq!(err(&["--scheduler", "fastest"], None), "--scheduler");
    assert_eq!(err(&["--max-backends", "0"], None), "--max-backends");
    assert_eq!(err(&["--kube-api-qps", "0"], None), "--kube-api-qps");
    assert_eq!(err(&["--kube-api-qps", "NaN"], None), "--kube-api-qps");
    assert_eq!(err(&["--kube-api-burst", "0"], None), "--kube-api-burst");
}

#[test]
fn node_port_address_selection() {
    let addrs = [ip("198.51.100.1"), ip("192.0.2.9"), ip("203.0.113.1")];
    let sel = NodePortAddresses::Select(vec![NodePortFilter::Primary, NodePortFilter::Cidr(net("192.0.2.0/24"))]);
    assert_eq!(sel.select(&addrs), addrs[..2].to_vec());
    assert_eq!(NodePortAddresses::All.select(&addrs), addrs.to_vec());
    assert_eq!(settings(&[], Some("nodePortAddresses: [all]\n")).node_port_addresses.select(&addrs), addrs.to_vec());
}

#[test]
fn detect_local_modes_parse_and_match_interfaces() {
    assert_eq!(DetectLocal::from_config("", None, None), Ok(DetectLocal::ClusterCidr));
    assert!(DetectLocal::from_config("BridgeInterface", None, None).unwrap_err().contains("detectLocal.bridgeInterface"));
    let br = DetectLocal::from_config("BridgeInterface", Some("cni0"), None).unwrap();
    assert!(br.is_local("veth1234", Some("cni0")) && !br.is_local("flannel.1", None) && !br.is_local("veth9", Some("docker0")));
    let pre = DetectLocal::from_config("InterfaceNamePrefix", None, Some("cali")).unwrap();
    assert!(pre.is_local("cali12ab", None) && !pre.is_local("eth0", None));
    assert!(!DetectLocal::ClusterCidr.is_local("cali12ab", None), "by address, not interface");
}

#[test]
fn the_mode_handover_limit_is_a_flag_with_a_default_of_an_hour() {
    assert_eq!(settings(&[], None).handover_limit, secs(3600));
    assert_eq!(settings(&["--mode-handover-limit", "10m"], None).handover_limit, secs(600));
    assert!(Cli::try_parse_from(["kpr", "--mode-handover-limit", "soon"]).is_err(), "a duration, or an error naming the flag");
}

#[test]
fn no_local_traffic_detector_is_said() {
    let detector = |args: &[&str]| resolved(args, None).1.iter().any(|n| n.contains("no local-traffic detector"));
    assert!(detector(&[]), "ClusterCIDR without a cluster CIDR");
    assert!(detector(&["--cluster-cidr", "fd00:10:244::/56"]), "an IPv6 CIDR only");
    assert!(!detector(&["--cluster-cidr", "10.244.0.0/16"]));
    assert!(!detector(&["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "cali"]));
}
