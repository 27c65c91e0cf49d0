//! `kpr run` (settings, host setup, the data plane, the servers, the loop) and `kpr
//! prepare-host` (the init container's privileged part, from the same settings).
use std::{
    path::PathBuf,
    sync::{atomic::Ordering, Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_agent::{
    agent::{Agent, LoopSettings},
    dataplane::ebpf::kernel,
    dataplane::{self, ebpf::maps::DatapathMaps, ebpf::plane::EbpfPlane, handover, ipvs::plane::IpvsPlane, Dataplane},
    host::{
        netif,
        sysctl::{self, ProcSysctls, Sysctls},
    },
    serve::metrics,
    settings,
    source::kube as kube_source,
    source::{DirSource, KubeSource},
    stats::{SharedStats, Stats},
    STOP,
};

use crate::{init_logs, LogFormat};
/// `kpr run`: settings, host setup, the data plane, the servers, then the loop.
pub fn run(pin_dir: PathBuf, log_format: LogFormat, flags: &settings::Flags) -> Result<()> {
    let (mut s, notes) = read_settings(flags)?;
    init_logs(log_format, s.verbosity);
    for n in &notes {
        tracing::warn!("{n}");
    }
    find_interfaces(&mut s)?;
    host_setup(&s);
    let node_name = s.node_name.clone().unwrap_or_else(hostname);
    let cgroup = match &s.cgroup {
        settings::Cgroup::None => None,
        settings::Cgroup::Auto => Some(kernel::cgroup2_root().context("no cgroup v2 hierarchy found for --cgroup auto (use --cgroup none or a path)")?),
        settings::Cgroup::Path(p) => Some(p.clone()),
    };
    let stats: SharedStats = Arc::new(Mutex::new(Stats::new(s.sync_period * 2)));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // The watches list while the data plane loads its programs: at 100,000 Services each takes
    // about a second, and the list alone keeps a core busy decoding.
    let input = match &s.manifests {
        Some(dir) => Input::Manifests(dir.clone()),
        None => {
            let client = rt.block_on(kube_client(s.kubeconfig.as_deref(), s.k8s_api_server.as_deref()))?;
            let shared = Arc::new(kube_source::Shared::default());
            rt.spawn(kube_source::run(client.clone(), node_name.clone(), shared.clone()));
            Input::Kube(client, shared)
        }
    };
    let (mode, plane) = dataplane::choose(
        s.mode,
        || {
            let previous = |maps: &mut dyn DatapathMaps| handover::previous_proxy(&pin_dir, &s.uplinks, maps, s.handover_limit);
            Ok(Box::new(EbpfPlane::start(&s, pin_dir.clone(), cgroup.clone(), stats.clone(), previous)?) as Box<dyn Dataplane>)
        },
        || Ok(Box::new(IpvsPlane::start(&s, pin_dir.clone(), cgroup.clone(), stats.clone())?) as Box<dyn Dataplane>),
    )
    .context("starting the data plane")?;
    tracing::info!(mode = mode.name(), requested = s.mode.name(), "data plane mode");

    match rt.block_on(metrics::serve(s.healthz_bind_address, s.metrics_bind_address, s.enable_profiling, stats.clone(), pin_dir)) {
        Ok(()) => {}
        Err(e) if s.bind_address_hard_fail => return Err(e.into()),
        Err(e) => tracing::error!(error = %e, "serving without it (bindAddressHardFail is off)"),
    }
    let health_stats = stats.clone();
    let healthy: proxy_agent::serve::healthcheck::Healthy = Arc::new(move || health_stats.lock().unwrap().healthy(std::time::Instant::now()));
    let health_checks = proxy_agent::serve::healthcheck::HealthChecks::new(rt.handle().clone(), healthy);
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let cfg = LoopSettings::new(&s, node_name.clone());
    match input {
        Input::Manifests(dir) => {
            let mut agent = Agent::new(cfg, DirSource::new(dir), plane, stats);
            agent.health_checks = Some(health_checks);
            agent.run();
        }
        Input::Kube(client, shared) => {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            rt.spawn(proxy_agent::source::events::publish_events(client, node_name, (s.api_qps, s.api_burst), rx));
            let mut agent = Agent::new(cfg, KubeSource::new(shared), plane, stats);
            agent.health_checks = Some(health_checks);
            agent.events = Some(tx);
            agent.run();
        }
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// Where the objects come from.
enum Input {
    Manifests(PathBuf),
    /// The API client and the watches' shared state.
    Kube(kube::Client, Arc<kube_source::Shared>),
}

/// What a node's settings left unnamed, found on it: its uplinks (the interface of its primary
/// IP and those of its default routes) and its pods' interfaces (the common CNIs' prefixes).
fn find_interfaces(s: &mut settings::Settings) -> Result<()> {
    if s.uplinks.is_empty() {
        // The one holding the node's primary IP (bindAddress), then the default routes'.
        let primary = s.primary_ip.and_then(|ip| netif::interfaces().into_iter().find(|i| netif::addresses(i).contains(&ip)));
        s.uplinks = primary.into_iter().collect();
        for i in netif::default_route_interfaces() {
            if !s.uplinks.contains(&i) {
                s.uplinks.push(i);
            }
        }
        anyhow::ensure!(!s.uplinks.is_empty(), "no uplink: this node has no default route; name its uplinks (--uplink, KPR_UPLINKS)");
        tracing::info!(uplinks = s.uplinks.join(","), "uplinks: the primary IP's and the default routes' interfaces");
    }
    if s.pod_iface_prefixes.is_empty() && s.pod_ifaces.is_empty() {
        s.pod_iface_prefixes = netif::KNOWN_POD_IFACE_PREFIXES.iter().map(|p| p.to_string()).collect();
        tracing::info!(prefixes = s.pod_iface_prefixes.join(","), "pod interfaces: the common CNIs' prefixes");
    }
    Ok(())
}

fn read_settings(flags: &settings::Flags) -> Result<(settings::Settings, Vec<String>)> {
    let file = match &flags.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let name = path.display().to_string();
            let parsed = settings::kube_proxy::parse(&name, &text)?;
            Some((name, parsed))
        }
        None => None,
    };
    Ok(settings::resolve(flags, file.as_ref().map(|(n, k)| (n.as_str(), k.clone())))?)
}

/// `kpr prepare-host`: the init container's work, from the same settings as `run`.
pub fn prepare_host(pin_dir: &std::path::Path, flags: &settings::Flags) -> Result<()> {
    init_logs(LogFormat::Human, 0);
    let (s, _) = read_settings(flags)?;
    let bpffs = pin_dir.parent().unwrap_or(std::path::Path::new("/sys/fs/bpf"));
    let mounted = std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == bpffs.to_str() && l.split_whitespace().nth(2) == Some("bpf"));
    if !mounted {
        std::fs::create_dir_all(bpffs)?;
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let target = c(&bpffs.display().to_string());
        if unsafe { libc::mount(c("bpf").as_ptr(), target.as_ptr(), c("bpf").as_ptr(), 0, std::ptr::null()) } != 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("mounting bpffs on {}", bpffs.display()));
        }
        println!("mounted bpffs on {}", bpffs.display());
    }
    host_setup(&s);
    sysctl::apply(&mut ProcSysctls, &sysctl::FAST_PATH_SYSCTLS);
    if matches!(s.mode, settings::Mode::Ipvs | settings::Mode::Auto) {
        for m in sysctl::IPVS_MODULES {
            if !std::process::Command::new("modprobe").arg(m).status().is_ok_and(|st| st.success()) {
                tracing::warn!(module = m, "cannot load (built in, or missing from /lib/modules)");
            }
        }
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        sysctl::apply(&mut ProcSysctls, &sysctl::ipvs_sysctls(sysctl::kernel_version(release.trim()).unwrap_or((0, 0)), s.ipvs.strict_arp));
    }
    println!("host prepared for mode {}", s.mode);
    Ok(())
}

/// What kube-proxy sets on the node whatever its mode: its OOM score and the kernel's
/// conntrack table (which still tracks every flow kpr balances). Failures are warnings: in a
/// cluster the DaemonSet's init container sets the sysctls.
fn host_setup(s: &settings::Settings) {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", s.oom_score_adj.to_string()) {
        tracing::warn!(error = %e, value = s.oom_score_adj, "cannot set oom_score_adj");
    }
    let cpus = std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
    let current = ProcSysctls.get("net.netfilter.nf_conntrack_max").ok().and_then(|v| v.parse().ok());
    let list = sysctl::conntrack_sysctls(&s.conntrack, cpus, current);
    if let Some((_, max)) = list.iter().find(|(k, _)| *k == "net.netfilter.nf_conntrack_max") {
        // kube-proxy sizes the hash table a quarter of the maximum.
        if let Ok(max) = max.parse::<u64>() {
            if let Err(e) = std::fs::write("/sys/module/nf_conntrack/parameters/hashsize", (max / 4).to_string()) {
                tracing::warn!(error = %e, "cannot size netfilter's conntrack hash table (nf_conntrack loaded?)");
            }
        }
    }
    sysctl::apply(&mut ProcSysctls, &list);
}

async fn kube_client(kubeconfig: Option<&std::path::Path>, api_server: Option<&str>) -> Result<kube::Client> {
    let mut config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p).with_context(|| format!("reading kubeconfig {}", p.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes API configuration (in-cluster, $KUBECONFIG or ~/.kube/config); give --kubeconfig, or --manifests DIR to run from files")?,
    };
    // The API server's real address: a cold node cannot reach the `kubernetes` Service's
    // ClusterIP before kpr has programmed it.
    if let Some(url) = api_server {
        config.cluster_url = url.parse().with_context(|| format!("--k8s-api-server {url:?} is not a URL (https://host:port)"))?;
    }
    Ok(kube::Client::try_from(config)?)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_lowercase()).unwrap_or_default()
}

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}
