//! `kpr`: the node agent and its operator commands.
use std::{net::IpAddr, path::PathBuf, sync::atomic::Ordering, time::Duration};

use anyhow::{Context, Result};
use aya::programs::XdpMode;
use clap::{Parser, Subcommand, ValueEnum};
use std::sync::Arc;

use proxy_agent::{
    agent::{Agent, AgentConfig, Source, STOP},
    dataplane::ebpf::kernel::{self, KernelMaps},
    dataplane::ebpf::view,
    host::netif,
    model::Scheduler,
    serve::metrics,
    settings::kube_proxy as config,
    source::kube as kube_source,
};

#[derive(Parser)]
#[command(name = "kpr", version, about = "kube-proxy replacement: eBPF service load balancing (and IPVS)")]
struct Cli {
    /// Enter this network namespace (name under /var/run/netns, or a path) before anything else.
    #[arg(long, global = true)]
    netns: Option<String>,
    /// Directory on bpffs where maps and links are pinned.
    #[arg(long, global = true, default_value = "/sys/fs/bpf/kpr")]
    pin_dir: PathBuf,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum XdpModeArg {
    Auto,
    Native,
    Generic,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent: program the fast path from the manifests and keep it in sync.
    Run(RunArgs),
    /// Remove every program link and map this agent pinned. Idempotent.
    Cleanup {
        /// Also remove kube-proxy's leftovers: KUBE-* iptables chains and the rules jumping to
        /// them, KUBE-* ipsets, the kube-ipvs0 device. Stop kube-proxy first.
        #[arg(long)]
        kube_proxy: bool,
        /// Leave kpr's own programs and maps in place (with --kube-proxy, while migrating).
        #[arg(long, requires = "kube_proxy")]
        keep_kpr: bool,
    },
    /// Shell completions for kpr (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Mode, programs attached, last sync (from the agent's /healthz) and the data path's counters.
    Status {
        #[arg(long)]
        json: bool,
        /// The agent's health listener, for the time of its last sync.
        #[arg(long, default_value = "127.0.0.1:10256")]
        healthz: String,
    },
    /// Frontends -> backends, as the kernel maps hold them.
    Services {
        #[arg(long)]
        json: bool,
    },
    /// Tracked flows and their backends.
    Conntrack {
        #[arg(long)]
        json: bool,
    },
    /// IPVS mode's sets (kube-proxy's ipsets, held in BPF maps), like `ipset list`.
    Ipset {
        #[arg(long)]
        json: bool,
        /// Only this set (e.g. KUBE-CLUSTER-IP).
        name: Option<String>,
    },
    /// IPVS virtual servers -> real servers, read from the kernel (like `ipvsadm -Ln`).
    Ipvs {
        #[arg(long)]
        json: bool,
        /// Counters, like `ipvsadm -Ln --stats`.
        #[arg(long)]
        stats: bool,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// kube-proxy's KubeProxyConfiguration file, read unchanged. Flags given explicitly win.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Directory of Service and EndpointSlice manifests (YAML or JSON), watched for changes,
    /// instead of the Kubernetes API.
    #[arg(long)]
    manifests: Option<PathBuf>,
    /// kubeconfig for the Kubernetes API (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// /healthz and /livez [default: 0.0.0.0:10256; config healthzBindAddress]; "" disables.
    #[arg(long)]
    healthz_bind_address: Option<String>,
    /// /metrics [default: 127.0.0.1:10249; config metricsBindAddress]; "" disables.
    #[arg(long)]
    metrics_bind_address: Option<String>,
    /// Least seconds between event-driven syncs [default: 1; config minSyncPeriod].
    #[arg(long)]
    min_sync_period: Option<f64>,
    /// Uplink interface(s): XDP for traffic from outside the node.
    #[arg(long = "uplink")]
    uplinks: Vec<String>,
    /// Pod-facing interface(s): TC ingress.
    #[arg(long = "pod-iface")]
    pod_ifaces: Vec<String>,
    /// Attach TC to every interface whose name starts with this (e.g. veth, cali, lxc).
    #[arg(long = "pod-iface-prefix")]
    pod_iface_prefixes: Vec<String>,
    /// cgroup v2 whose processes get connect-time balancing (the node's own traffic to
    /// services): "auto" = the cgroup2 root, "none" = off, or a path.
    #[arg(long, default_value = "auto")]
    cgroup: String,
    /// This node's name (endpoints on it are local).
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node_name: String,
    /// This node's zone for topology hints (the Node's topology.kubernetes.io/zone wins).
    #[arg(long)]
    node_zone: Option<String>,
    /// NodePort addresses (default: the uplinks' IPv4 addresses).
    #[arg(long = "node-ip")]
    node_ips: Vec<IpAddr>,
    /// Source address for masqueraded traffic (default: the first NodePort address).
    #[arg(long)]
    snat_ip: Option<IpAddr>,
    /// Pod CIDR; traffic from outside it to a ClusterIP is masqueraded, as kube-proxy does.
    #[arg(long)]
    cluster_cidr: Option<ipnet::IpNet>,
    /// How a local client is told from one outside the cluster: ClusterCIDR, NodeCIDR (the
    /// Node's podCIDR), BridgeInterface, InterfaceNamePrefix [default: ClusterCIDR; config
    /// detectLocalMode].
    #[arg(long)]
    detect_local_mode: Option<String>,
    /// detectLocalMode BridgeInterface: the pods' bridge [config detectLocal.bridgeInterface].
    #[arg(long)]
    pod_bridge_interface: Option<String>,
    /// detectLocalMode InterfaceNamePrefix [config detectLocal.interfaceNamePrefix].
    #[arg(long)]
    pod_interface_name_prefix: Option<String>,
    #[arg(long)]
    masquerade_all: bool,
    /// Default scheduler (per Service: annotation kpr.io/scheduler) [default: random].
    #[arg(long)]
    scheduler: Option<String>,
    #[arg(long, value_enum, default_value_t = XdpModeArg::Auto)]
    xdp_mode: XdpModeArg,
    /// Full resync period, seconds [default: 30].
    #[arg(long)]
    sync_period: Option<u64>,
    /// Data plane: ebpf (the fast path), ipvs (IPVS + BPF set matching), auto (ebpf where the
    /// kernel loads it, else ipvs) [default: ebpf; config mode].
    #[arg(long)]
    mode: Option<String>,
    /// IPVS mode: set arp_ignore=1/arp_announce=2 (MetalLB L2, DR) [config ipvs.strictARP].
    #[arg(long)]
    strict_arp: bool,
    /// Sync once and exit (programs and maps stay).
    #[arg(long)]
    once: bool,
    /// Assured flows the conntrack map holds (LRU) [default: 524288].
    #[arg(long)]
    max_conntrack: Option<u32>,
    /// TCP flows before their handshake completes (their own LRU) [default: 131072].
    #[arg(long)]
    max_conntrack_embryonic: Option<u32>,
}

fn init_logs(format: LogFormat) {
    use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt};
    let filter = tracing_subscriber::EnvFilter::try_from_env("KPR_LOG").unwrap_or_else(|_| "info".into());
    // The level can change at run time (PUT /debug/flags/v on the metrics listener).
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Human => registry.with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr)).init(),
        LogFormat::Json => registry.with(tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr)).init(),
    }
    metrics::set_log_level_hook(Box::new(move |level: &str| {
        let f = tracing_subscriber::EnvFilter::try_new(level).map_err(|e| e.to_string())?;
        handle.reload(f).map_err(|e| e.to_string())
    }));
}

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn main() -> Result<()> {
    // Few malloc arenas: the agent's threads mostly sleep, and per-thread arenas only inflate
    // its resident memory.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    let cli = Cli::parse();
    // Before any thread exists: setns applies to the calling thread only.
    if let Some(ns) = &cli.netns {
        netif::enter_netns(ns).with_context(|| format!("cannot enter network namespace {ns} (needs CAP_SYS_ADMIN)"))?;
    }
    init_logs(cli.log_format);
    match cli.cmd {
        Cmd::Run(a) => {
            let explicit = (a.scheduler.is_some(), a.sync_period.is_some());
            let mode_flag = a.mode.as_deref().map(|m| m.parse::<proxy_agent::agent::Mode>().map_err(anyhow::Error::msg).context("--mode")).transpose()?;
            let config_file = a.config.clone();
            let cgroup = match a.cgroup.as_str() {
                "none" => None,
                "auto" => Some(kernel::cgroup2_root().context("no cgroup v2 hierarchy found for --cgroup auto (use --cgroup none or a path)")?),
                p => Some(PathBuf::from(p)),
            };
            let source_dir = a.manifests.clone();
            let detect_local_flags = (a.detect_local_mode.clone(), a.pod_bridge_interface.clone(), a.pod_interface_name_prefix.clone());
            let kubeconfig = a.kubeconfig.clone();
            let addrs = (a.healthz_bind_address.clone(), a.metrics_bind_address.clone());
            let min_sync = a.min_sync_period;
            let cfg = AgentConfig {
                cgroup,
                source: Source::Dir(PathBuf::new()),
                pin_dir: cli.pin_dir,
                uplinks: a.uplinks,
                pod_ifaces: a.pod_ifaces,
                pod_iface_prefixes: a.pod_iface_prefixes,
                node_name: a.node_name,
                node_zone: a.node_zone,
                nodeport_addresses: a.node_ips,
                snat_ip: a.snat_ip,
                cluster_cidr: a.cluster_cidr,
                masquerade_all: a.masquerade_all,
                scheduler: match &a.scheduler {
                    Some(s) => s.parse::<Scheduler>().map_err(anyhow::Error::msg).context("--scheduler")?,
                    None => Scheduler::Random,
                },
                xdp_mode: match a.xdp_mode {
                    XdpModeArg::Auto => XdpMode::Default,
                    XdpModeArg::Native => XdpMode::Driver,
                    XdpModeArg::Generic => XdpMode::Skb,
                },
                sync_period: Duration::from_secs(a.sync_period.unwrap_or(30)),
                mode: mode_flag.unwrap_or_default(),
                ipvs: proxy_agent::agent::IpvsModeConfig { strict_arp: a.strict_arp, ..Default::default() },
                once: a.once,
                capacities: kernel::Capacities {
                    conntrack: a.max_conntrack.unwrap_or(proxy_common::limits::MAX_CONNTRACK),
                    conntrack_new: a.max_conntrack_embryonic.unwrap_or(proxy_common::limits::MAX_CONNTRACK_NEW),
                    ..Default::default()
                },
                ..AgentConfig::default()
            };
            let mut cfg = cfg;
            let mut healthz = addrs.0.unwrap_or_else(|| "0.0.0.0:10256".into());
            let mut metrics_addr = addrs.1.unwrap_or_else(|| "127.0.0.1:10249".into());
            if let Some(s) = min_sync {
                cfg.min_sync_period = Duration::from_secs_f64(s);
            }
            let mut detect_local = detect_local_flags.clone();
            if let Some(path) = &config_file {
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                let kp = config::parse(&path.display().to_string(), &text)?;
                detect_local.0 = detect_local.0.or(kp.detect_local_mode.clone());
                detect_local.1 = detect_local.1.or(kp.detect_local_bridge.clone());
                detect_local.2 = detect_local.2.or(kp.detect_local_prefix.clone());
                // The mode first: what applies (the fast path's scheduler) depends on it.
                if mode_flag.is_none() {
                    cfg.mode = match kp.mode.as_str() {
                        "ipvs" => proxy_agent::agent::Mode::Ipvs,
                        "auto" => proxy_agent::agent::Mode::Auto,
                        _ => proxy_agent::agent::Mode::Ebpf,
                    };
                }
                apply_kube_proxy_config(&mut cfg, &kp, explicit);
                if a_flags_unset(&config_file, &healthz) {
                    if let Some(h) = &kp.healthz_bind_address {
                        healthz = h.clone();
                    }
                }
                if let Some(m) = &kp.metrics_bind_address {
                    metrics_addr = m.clone();
                }
                if min_sync.is_none() {
                    if let Some(d) = kp.ipvs.min_sync_period.filter(|d| !d.is_zero()) {
                        cfg.min_sync_period = d;
                    }
                }
            }
            cfg.detect_local =
                proxy_agent::agent::DetectLocal::from_config(detect_local.0.as_deref().unwrap_or(""), detect_local.1.as_deref(), detect_local.2.as_deref())
                    .map_err(anyhow::Error::msg)
                    .context("--detect-local-mode")?;
            let parse_addr = |flag: &str, s: &str| -> Result<Option<std::net::SocketAddr>> {
                if s.is_empty() {
                    return Ok(None);
                }
                s.parse().map(Some).with_context(|| format!("--{flag} {s:?} is not IP:port"))
            };
            let healthz_addr = parse_addr("healthz-bind-address", &healthz)?;
            let metrics_sock = parse_addr("metrics-bind-address", &metrics_addr)?;

            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            let mut events = None;
            cfg.source = match source_dir {
                Some(dir) => Source::Dir(dir),
                None => {
                    let client = rt.block_on(kube_client(kubeconfig.as_deref()))?;
                    if cfg.node_name.is_empty() {
                        cfg.node_name = hostname();
                    }
                    let shared = Arc::new(kube_source::Shared::default());
                    rt.spawn(kube_source::run(client.clone(), cfg.node_name.clone(), shared.clone()));
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    rt.spawn(kube_source::publish_events(client, cfg.node_name.clone(), rx));
                    events = Some(tx);
                    Source::Kube(shared)
                }
            };
            unsafe {
                libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
                libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
            }
            let pin_dir = cfg.pin_dir.clone();
            let mut agent = Agent::new(cfg).context("starting the agent")?;
            rt.block_on(metrics::serve(healthz_addr, metrics_sock, agent.stats.clone(), pin_dir))?;
            let stats = agent.stats.clone();
            let healthy: proxy_agent::serve::healthcheck::Healthy = Arc::new(move || stats.lock().unwrap().healthy(std::time::Instant::now()));
            agent.health_checks = Some(proxy_agent::serve::healthcheck::HealthChecks::new(rt.handle().clone(), healthy));
            agent.events = events;
            agent.attach_interfaces();
            agent.run();
            rt.shutdown_timeout(Duration::from_secs(1));
        }
        Cmd::Cleanup { kube_proxy, keep_kpr } => {
            if !keep_kpr {
                // IPVS mode's state, where the kernel has IPVS.
                match proxy_agent::dataplane::ipvs::client::NetlinkIpvs::connect() {
                    Ok(mut ipvs) => {
                        let mut links = proxy_agent::netlink::rtnl::NetlinkLinks::connect()?;
                        let local: Vec<IpAddr> = netif::interfaces().iter().flat_map(|i| netif::ipv4_addresses(i)).collect();
                        for d in proxy_agent::dataplane::ipvs::sync::cleanup(&mut ipvs, &mut links, &local)? {
                            println!("{d}");
                        }
                    }
                    Err(proxy_agent::dataplane::ipvs::client::IpvsError::NoIpvs) => {}
                    Err(e) => return Err(e).context("reading IPVS for cleanup"),
                }
                match proxy_agent::dataplane::ipvs::rules::remove(&mut proxy_agent::migration::SystemNetfilter) {
                    Ok(done) => done.iter().for_each(|d| println!("{d}")),
                    Err(e) => tracing::warn!(error = %e, "netfilter rules not checked"),
                }
                let removed = kernel::cleanup(&cli.pin_dir).with_context(|| format!("cleaning {}", cli.pin_dir.display()))?;
                println!("removed {} pinned objects under {}", removed.len(), cli.pin_dir.display());
            }
            if kube_proxy {
                let done = proxy_agent::migration::cleanup(&mut proxy_agent::migration::SystemNetfilter)
                    .context("removing kube-proxy's leftovers (is kube-proxy still running? stop its DaemonSet first)")?;
                if done.is_empty() {
                    println!("no kube-proxy leftovers found");
                }
                for d in done {
                    println!("{d}");
                }
            }
        }
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "kpr", &mut std::io::stdout());
        }
        Cmd::Status { json, healthz } => {
            let maps = KernelMaps::open(&cli.pin_dir)?;
            let links = kernel::attached_links(&cli.pin_dir);
            let counters = view::counters(&maps)?;
            let services = maps_len(&maps)?;
            let health = agent_health(&healthz);
            let last_sync = health.as_ref().map(|h| h["lastUpdated"].as_str().unwrap_or("").to_string());
            // The agent says its mode; without it, IPVS mode shows as a pinned loop-back match.
            let mode = health.as_ref().and_then(|h| h["mode"].as_str().map(str::to_string)).unwrap_or_else(|| {
                if cli.pin_dir.join(proxy_common::prog_names::LOOPBACK).exists() {
                    "ipvs".into()
                } else {
                    "ebpf".into()
                }
            });
            if json {
                let v = serde_json::json!({
                    "mode": mode,
                    "agent": health,
                    "pin_dir": cli.pin_dir,
                    "links": links.iter().map(|(i, h)| serde_json::json!({"iface": i, "hook": h.tag()})).collect::<Vec<_>>(),
                    "frontends": services,
                    "counters": counters.iter().map(|(k, v)| (k.to_string(), *v)).collect::<std::collections::BTreeMap<_, _>>(),
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("mode: {mode}   pins: {}   fast-path frontends: {services}", cli.pin_dir.display());
                if mode == "ipvs" {
                    println!("IPVS mode: `kpr ipvs` (or ipvsadm -Ln) for virtual servers, `kpr ipset` for the sets");
                }
                match &last_sync {
                    Some(t) if !t.is_empty() => println!("last sync: {t} (agent healthy at {healthz})"),
                    Some(_) => println!("agent at {healthz} has not synced yet"),
                    None => println!("agent: no answer at {healthz} (not running, or --healthz elsewhere); the maps below keep forwarding"),
                }
                for (i, h) in &links {
                    println!("attached: {} on {i}", h.tag());
                }
                for (k, v) in counters {
                    println!("{k:<22} {v}");
                }
            }
        }
        Cmd::Services { json } => {
            let maps = KernelMaps::open(&cli.pin_dir)?;
            let rows = view::services(&maps)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", view::render_services(&rows));
            }
        }
        Cmd::Ipset { json, name } => {
            use proxy_agent::dataplane::ipvs::sets::SetMaps as _;
            let maps = proxy_agent::dataplane::ipvs::sets::KernelSetMaps::open(&cli.pin_dir)?;
            let mut list = proxy_agent::dataplane::ipvs::sets::listing(&maps.read()?);
            if let Some(n) = &name {
                list.retain(|s| &s.name == n);
                anyhow::ensure!(!list.is_empty(), "no set named {n} (try `kpr ipset` for all of them)");
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print!("{}", proxy_agent::dataplane::ipvs::sets::render(&list));
            }
        }
        Cmd::Ipvs { json, stats } => {
            let mut ipvs = proxy_agent::agent::connect_ipvs().context("reading IPVS (needs CAP_NET_ADMIN)")?;
            let rows = proxy_agent::dataplane::ipvs::view::virtual_servers(&mut ipvs)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                use proxy_agent::dataplane::ipvs::client::Ipvs as _;
                let info = ipvs.info()?;
                println!(
                    "IP Virtual Server version {}.{}.{} (size={})",
                    info.version >> 16,
                    (info.version >> 8) & 0xff,
                    info.version & 0xff,
                    info.conn_tab_size
                );
                print!("{}", proxy_agent::dataplane::ipvs::view::render(&rows, stats));
            }
        }
        Cmd::Conntrack { json } => {
            let maps = KernelMaps::open(&cli.pin_dir)?;
            let rows = view::conntrack(&maps, kernel::monotonic_ns())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", view::render_conntrack(&rows));
            }
        }
    }
    Ok(())
}

/// The config file's healthzBindAddress applies only when the flag kept its default.
fn a_flags_unset(config: &Option<PathBuf>, healthz: &str) -> bool {
    config.is_some() && healthz == "0.0.0.0:10256"
}

async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p).with_context(|| format!("reading kubeconfig {}", p.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes API configuration (in-cluster, $KUBECONFIG or ~/.kube/config); give --kubeconfig, or --manifests DIR to run from files")?,
    };
    Ok(kube::Client::try_from(config)?)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_lowercase()).unwrap_or_default()
}

/// Values from a KubeProxyConfiguration fill what the flags left unset.
/// `explicit`: whether --scheduler and --sync-period were given.
fn apply_kube_proxy_config(cfg: &mut AgentConfig, kp: &config::KubeProxyConfig, explicit: (bool, bool)) {
    for w in &kp.warnings {
        tracing::warn!("{w}");
    }
    if cfg.cluster_cidr.is_none() {
        cfg.cluster_cidr = kp.cluster_cidrs.iter().find(|n| n.addr().is_ipv4()).copied();
    }
    cfg.masquerade_all |= kp.masquerade_all.unwrap_or(false);
    if cfg.node_name.is_empty() {
        if let Some(h) = &kp.hostname_override {
            cfg.node_name = h.clone();
        }
    }
    if !explicit.0 {
        match kp.fast_path_scheduler() {
            Some(Ok(s)) => cfg.scheduler = s,
            // In IPVS mode IPVS itself uses it: nothing to warn about.
            Some(Err(w)) if cfg.mode != proxy_agent::agent::Mode::Ipvs => tracing::warn!("{w}"),
            _ => {}
        }
    }
    let nonzero = |d: Option<Duration>| d.filter(|d| !d.is_zero());
    if !explicit.1 {
        if let Some(d) = nonzero(kp.ipvs.sync_period) {
            cfg.sync_period = d;
        }
    }
    if let Some(d) = nonzero(kp.ipvs.tcp_timeout) {
        cfg.ct_tcp_timeout_s = d.as_secs().max(1) as u32;
        cfg.ipvs.timeouts.tcp_s = cfg.ct_tcp_timeout_s;
    }
    if let Some(d) = nonzero(kp.ipvs.tcp_fin_timeout) {
        cfg.ct_closing_timeout_s = d.as_secs().max(1) as u32;
        cfg.ipvs.timeouts.tcp_fin_s = cfg.ct_closing_timeout_s;
    }
    if let Some(d) = nonzero(kp.ipvs.udp_timeout) {
        cfg.ct_udp_timeout_s = d.as_secs().max(1) as u32;
        cfg.ipvs.timeouts.udp_s = cfg.ct_udp_timeout_s;
    }
    cfg.ipvs.scheduler = kp.ipvs.scheduler.clone();
    cfg.ipvs.strict_arp |= kp.ipvs.strict_arp.unwrap_or(false);
    cfg.ipvs.exclude_cidrs = kp.ipvs.exclude_cidrs.clone();
    if cfg.nodeport_addresses.is_empty() && !kp.node_port_addresses.is_empty() {
        let all: Vec<IpAddr> = cfg.uplinks.iter().flat_map(|u| netif::ipv4_addresses(u)).collect();
        cfg.nodeport_addresses = kp.select_node_port_addresses(&all);
    }
    if kp.masquerade_bit.is_some_and(|b| b != 14) {
        tracing::warn!("masqueradeBit {:?}: the eBPF fast path masquerades itself and marks 0x4000 for compatibility only", kp.masquerade_bit);
    }
    for (field, v) in [("healthzBindAddress", &kp.healthz_bind_address), ("metricsBindAddress", &kp.metrics_bind_address)] {
        if let Some(v) = v {
            tracing::warn!("{field} {v}: kpr does not serve health or metrics endpoints yet");
        }
    }
}

/// The agent's /healthz JSON (status 200 or 503), or None when nothing answers.
fn agent_health(addr: &str) -> Option<serde_json::Value> {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("GET /healthz HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let (head, body) = resp.split_once("\r\n\r\n")?;
    let mut v: serde_json::Value = serde_json::from_str(body).ok()?;
    v["healthy"] = serde_json::json!(head.lines().next().unwrap_or("").contains(" 200"));
    Some(v)
}

fn maps_len(maps: &KernelMaps) -> Result<usize> {
    use proxy_agent::dataplane::ebpf::maps::DatapathMaps;
    Ok(maps.services()?.len())
}
