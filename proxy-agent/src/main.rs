//! `kpr`: the node agent and its operator commands.
use std::{
    path::PathBuf,
    sync::{atomic::Ordering, Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use proxy_agent::{
    agent::{Agent, LoopSettings},
    dataplane::ebpf::kernel::{self, KernelMaps},
    dataplane::ebpf::view,
    dataplane::{self, ebpf::plane::EbpfPlane, ipvs::plane::IpvsPlane, Dataplane},
    host::netif,
    host::sysctl::{self, ProcSysctls, Sysctls},
    serve::metrics,
    settings,
    source::kube as kube_source,
    source::{DirSource, KubeSource},
    stats::{SharedStats, Stats},
    STOP,
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

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent: program the fast path from the manifests and keep it in sync.
    Run(Box<settings::Flags>),
    /// What needs more privileges than the agent has, for the DaemonSet's privileged init
    /// container: mount bpffs where the host has none, set the sysctls (forwarding, kube-proxy's
    /// conntrack settings, IPVS mode's) and load IPVS mode's modules. Takes `run`'s flags and
    /// configuration file, so the values are the agent's.
    PrepareHost(Box<settings::Flags>),
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
    /// Frontends -> backends, as the kernel maps hold them, then what the agent could not
    /// program (object, field, reason; from the agent's /notProgrammed).
    Services {
        #[arg(long)]
        json: bool,
        /// Only what the agent could not program.
        #[arg(long)]
        skipped: bool,
        /// The agent's health listener.
        #[arg(long, default_value = "127.0.0.1:10256")]
        healthz: String,
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

/// Logs to stderr; KPR_LOG (a tracing filter) wins over `verbosity` (kube-proxy's -v). Colour
/// only on a terminal: a file or a pipe gets plain text.
fn init_logs(format: LogFormat, verbosity: u32) {
    use std::io::IsTerminal;
    use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt};
    let filter = tracing_subscriber::EnvFilter::try_from_env("KPR_LOG").unwrap_or_else(|_| metrics::verbosity_to_filter(&verbosity.to_string()).into());
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    // The level can change at run time (PUT /debug/flags/v on the metrics listener).
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Human => registry.with(tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr)).init(),
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
    if !matches!(cli.cmd, Cmd::Run(_) | Cmd::PrepareHost(_)) {
        init_logs(cli.log_format, 0);
    }
    let Cli { pin_dir, log_format, cmd, .. } = cli;
    match cmd {
        Cmd::Run(flags) => run(pin_dir, log_format, &flags)?,
        Cmd::PrepareHost(flags) => prepare_host(&pin_dir, &flags)?,
        Cmd::Cleanup { kube_proxy, keep_kpr } => {
            if !keep_kpr {
                // IPVS mode's state, where the kernel has IPVS.
                match proxy_agent::dataplane::ipvs::client::NetlinkIpvs::connect() {
                    Ok(mut ipvs) => {
                        let mut links = proxy_agent::netlink::rtnl::NetlinkLinks::connect()?;
                        let local: Vec<std::net::IpAddr> = netif::interfaces().iter().flat_map(|i| netif::ipv4_addresses(i)).collect();
                        for d in proxy_agent::dataplane::ipvs::sync::cleanup(&mut ipvs, &mut links, &local)? {
                            println!("{d}");
                        }
                    }
                    Err(proxy_agent::dataplane::ipvs::client::IpvsError::NoIpvs) => {}
                    Err(e) => return Err(e).context("reading IPVS for cleanup"),
                }
                match proxy_agent::dataplane::ipvs::rules::remove(&mut proxy_agent::host::netfilter::SystemNetfilter) {
                    Ok(done) => done.iter().for_each(|d| println!("{d}")),
                    Err(e) => tracing::warn!(error = %e, "netfilter rules not checked"),
                }
                let removed = kernel::cleanup(&pin_dir).with_context(|| format!("cleaning {}", pin_dir.display()))?;
                println!("removed {} pinned objects under {}", removed.len(), pin_dir.display());
            }
            if kube_proxy {
                // kpr's own IPVS mode owns kube-ipvs0 and its virtual servers now: leave them.
                let kpr_ipvs = keep_kpr && pin_dir.join(proxy_common::prog_names::LOOPBACK).exists();
                let mut ipvs = proxy_agent::dataplane::ipvs::client::NetlinkIpvs::connect().ok();
                let mut links = proxy_agent::netlink::rtnl::NetlinkLinks::connect()?;
                let local: Vec<std::net::IpAddr> = netif::interfaces().iter().flat_map(|i| netif::ipv4_addresses(i)).collect();
                let handles = (!kpr_ipvs).then(|| proxy_agent::migration::IpvsHandles {
                    ipvs: ipvs.as_mut().map(|i| i as &mut dyn proxy_agent::dataplane::ipvs::client::Ipvs),
                    links: &mut links,
                    node_addresses: &local,
                });
                let done = proxy_agent::migration::cleanup(&mut proxy_agent::host::netfilter::SystemNetfilter, handles)
                    .context("removing kube-proxy's leftovers (is kube-proxy still running? stop its DaemonSet first)")?;
                if kpr_ipvs {
                    println!("kpr runs in IPVS mode here: kube-ipvs0 and its virtual servers are kpr's now and stay");
                }
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
            let maps = KernelMaps::open(&pin_dir)?;
            let links = kernel::attached_links(&pin_dir);
            let counters = view::counters(&maps)?;
            let services = maps_len(&maps)?;
            let health = agent_health(&healthz);
            let last_sync = health.as_ref().map(|h| h["lastUpdated"].as_str().unwrap_or("").to_string());
            // The agent says its mode; without it, IPVS mode shows as a pinned loop-back match.
            let mode = health.as_ref().and_then(|h| h["mode"].as_str().map(str::to_string)).unwrap_or_else(|| {
                if pin_dir.join(proxy_common::prog_names::LOOPBACK).exists() {
                    "ipvs".into()
                } else {
                    "ebpf".into()
                }
            });
            if json {
                let v = serde_json::json!({
                    "mode": mode,
                    "agent": health,
                    "pin_dir": pin_dir,
                    "links": links.iter().map(|(i, h)| serde_json::json!({"iface": i, "hook": h.tag()})).collect::<Vec<_>>(),
                    "frontends": services,
                    "counters": counters.iter().map(|(k, v)| (k.to_string(), *v)).collect::<std::collections::BTreeMap<_, _>>(),
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("mode: {mode}   pins: {}   fast-path frontends: {services}", pin_dir.display());
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
        Cmd::Services { json, skipped, healthz } => {
            let not_programmed = || -> Result<serde_json::Value> {
                agent_get(&healthz, proxy_agent::serve::metrics::NOT_PROGRAMMED_PATH)
                    .map(|(_, v)| v)
                    .with_context(|| format!("no agent answers at {healthz} (--healthz): what it could not program is known to it alone"))
            };
            if skipped {
                let list = not_programmed()?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&list)?);
                } else {
                    print!("{}", render_not_programmed(&list));
                }
                return Ok(());
            }
            let maps = KernelMaps::open(&pin_dir)?;
            let rows = view::services(&maps)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", view::render_services(&rows));
                match not_programmed() {
                    Ok(list) if list.as_array().is_some_and(|l| !l.is_empty()) => print!("\nnot programmed:\n{}", render_not_programmed(&list)),
                    Ok(_) => {}
                    Err(e) => println!("\n({e})"),
                }
            }
        }
        Cmd::Ipset { json, name } => {
            use proxy_agent::dataplane::ipvs::sets::SetMaps as _;
            let maps = proxy_agent::dataplane::ipvs::sets::KernelSetMaps::open(&pin_dir)?;
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
            let mut ipvs = proxy_agent::dataplane::ipvs::plane::connect_ipvs().context("reading IPVS (needs CAP_NET_ADMIN)")?;
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
            let maps = KernelMaps::open(&pin_dir)?;
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

/// `kpr run`: settings, host setup, the data plane, the servers, then the loop.
fn run(pin_dir: PathBuf, log_format: LogFormat, flags: &settings::Flags) -> Result<()> {
    let (s, notes) = read_settings(flags)?;
    init_logs(log_format, s.verbosity);
    for n in &notes {
        tracing::warn!("{n}");
    }
    host_setup(&s);
    let node_name = s.node_name.clone().unwrap_or_else(hostname);
    let cgroup = match &s.cgroup {
        settings::Cgroup::None => None,
        settings::Cgroup::Auto => Some(kernel::cgroup2_root().context("no cgroup v2 hierarchy found for --cgroup auto (use --cgroup none or a path)")?),
        settings::Cgroup::Path(p) => Some(p.clone()),
    };
    let stats: SharedStats = Arc::new(Mutex::new(Stats::new(s.sync_period * 2)));
    let (mode, plane) = dataplane::choose(
        s.mode,
        || Ok(Box::new(EbpfPlane::start(&s, pin_dir.clone(), cgroup.clone(), stats.clone())?) as Box<dyn Dataplane>),
        || Ok(Box::new(IpvsPlane::start(&s, pin_dir.clone(), cgroup.clone(), stats.clone())?) as Box<dyn Dataplane>),
    )
    .context("starting the data plane")?;
    tracing::info!(mode = mode.name(), requested = s.mode.name(), "data plane mode");

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match rt.block_on(metrics::serve(s.healthz_bind_address, s.metrics_bind_address, stats.clone(), pin_dir)) {
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
    match &s.manifests {
        Some(dir) => {
            let mut agent = Agent::new(cfg, DirSource::new(dir.clone()), plane, stats);
            agent.health_checks = Some(health_checks);
            agent.run();
        }
        None => {
            let client = rt.block_on(kube_client(s.kubeconfig.as_deref(), s.k8s_api_server.as_deref()))?;
            let shared = Arc::new(kube_source::Shared::default());
            rt.spawn(kube_source::run(client.clone(), node_name.clone(), shared.clone()));
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            rt.spawn(kube_source::publish_events(client, node_name, rx));
            let mut agent = Agent::new(cfg, KubeSource::new(shared), plane, stats);
            agent.health_checks = Some(health_checks);
            agent.events = Some(tx);
            agent.run();
        }
    }
    rt.shutdown_timeout(Duration::from_secs(1));
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
fn prepare_host(pin_dir: &std::path::Path, flags: &settings::Flags) -> Result<()> {
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
            let _ = std::fs::write("/sys/module/nf_conntrack/parameters/hashsize", (max / 4).to_string());
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

/// GET `path` from the agent at `addr`: (answered 200?, its JSON), or None when nothing
/// answers.
fn agent_get(addr: &str, path: &str) -> Option<(bool, serde_json::Value)> {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let (head, body) = resp.split_once("\r\n\r\n")?;
    Some((head.lines().next().unwrap_or("").contains(" 200"), serde_json::from_str(body).ok()?))
}

/// The agent's /healthz JSON (status 200 or 503), or None when nothing answers.
fn agent_health(addr: &str) -> Option<serde_json::Value> {
    let (ok, mut v) = agent_get(addr, "/healthz")?;
    v["healthy"] = serde_json::json!(ok);
    Some(v)
}

/// One line per object and field kpr could not program: reason, object, field, why.
fn render_not_programmed(list: &serde_json::Value) -> String {
    let field = |e: &serde_json::Value, k: &str| e[k].as_str().unwrap_or("").to_string();
    list.as_array()
        .into_iter()
        .flatten()
        .map(|e| format!("  {:<18} {} {}: {}\n", field(e, "reason"), field(e, "object"), field(e, "field"), field(e, "message")))
        .collect()
}

fn maps_len(maps: &KernelMaps) -> Result<usize> {
    use proxy_agent::dataplane::ebpf::maps::DatapathMaps;
    Ok(maps.services()?.len())
}
