//! `kpr`: the node agent and its operator commands.
use std::{net::IpAddr, path::PathBuf, sync::atomic::Ordering, time::Duration};

use anyhow::{Context, Result};
use aya::programs::XdpMode;
use clap::{Parser, Subcommand, ValueEnum};
use proxy_agent::{
    agent::{Agent, AgentConfig, STOP},
    kernel::{self, KernelMaps},
    model::Scheduler,
    netif, view,
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
    Cleanup,
    /// Programs attached and the data path's counters.
    Status {
        #[arg(long)]
        json: bool,
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
}

#[derive(clap::Args)]
struct RunArgs {
    /// Directory of Service and EndpointSlice manifests (YAML or JSON), watched for changes.
    #[arg(long, default_value = "deploy/examples")]
    manifests: PathBuf,
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
    /// NodePort addresses (default: the uplinks' IPv4 addresses).
    #[arg(long = "node-ip")]
    node_ips: Vec<IpAddr>,
    /// Source address for masqueraded traffic (default: the first NodePort address).
    #[arg(long)]
    snat_ip: Option<IpAddr>,
    /// Pod CIDR; traffic from outside it to a ClusterIP is masqueraded, as kube-proxy does.
    #[arg(long)]
    cluster_cidr: Option<ipnet::IpNet>,
    #[arg(long)]
    masquerade_all: bool,
    /// Default scheduler (per Service: annotation kpr.io/scheduler).
    #[arg(long, default_value = "random")]
    scheduler: String,
    #[arg(long, value_enum, default_value_t = XdpModeArg::Auto)]
    xdp_mode: XdpModeArg,
    /// Full resync period, seconds.
    #[arg(long, default_value_t = 30)]
    sync_period: u64,
    /// Sync once and exit (programs and maps stay).
    #[arg(long)]
    once: bool,
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KPR_LOG").unwrap_or_else(|_| "info".into());
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Human => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Before any thread exists: setns applies to the calling thread only.
    if let Some(ns) = &cli.netns {
        netif::enter_netns(ns).with_context(|| format!("cannot enter network namespace {ns} (needs CAP_SYS_ADMIN)"))?;
    }
    init_logs(cli.log_format);
    match cli.cmd {
        Cmd::Run(a) => {
            let cgroup = match a.cgroup.as_str() {
                "none" => None,
                "auto" => Some(kernel::cgroup2_root().context("no cgroup v2 hierarchy found for --cgroup auto (use --cgroup none or a path)")?),
                p => Some(PathBuf::from(p)),
            };
            let cfg = AgentConfig {
                cgroup,
                manifests: a.manifests,
                pin_dir: cli.pin_dir,
                uplinks: a.uplinks,
                pod_ifaces: a.pod_ifaces,
                pod_iface_prefixes: a.pod_iface_prefixes,
                node_name: a.node_name,
                nodeport_addresses: a.node_ips,
                snat_ip: a.snat_ip,
                cluster_cidr: a.cluster_cidr,
                masquerade_all: a.masquerade_all,
                scheduler: a.scheduler.parse::<Scheduler>().map_err(anyhow::Error::msg).context("--scheduler")?,
                xdp_mode: match a.xdp_mode {
                    XdpModeArg::Auto => XdpMode::Default,
                    XdpModeArg::Native => XdpMode::Driver,
                    XdpModeArg::Generic => XdpMode::Skb,
                },
                sync_period: Duration::from_secs(a.sync_period),
                once: a.once,
                ..AgentConfig::default()
            };
            unsafe {
                libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
                libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
            }
            let mut agent = Agent::new(cfg).context("starting the agent")?;
            agent.attach_interfaces();
            agent.run();
        }
        Cmd::Cleanup => {
            let removed = kernel::cleanup(&cli.pin_dir).with_context(|| format!("cleaning {}", cli.pin_dir.display()))?;
            println!("removed {} pinned objects under {}", removed.len(), cli.pin_dir.display());
        }
        Cmd::Status { json } => {
            let maps = KernelMaps::open(&cli.pin_dir)?;
            let links = kernel::attached_links(&cli.pin_dir);
            let counters = view::counters(&maps)?;
            let services = maps_len(&maps)?;
            if json {
                let v = serde_json::json!({
                    "mode": "ebpf",
                    "pin_dir": cli.pin_dir,
                    "links": links.iter().map(|(i, h)| serde_json::json!({"iface": i, "hook": format!("{h:?}")})).collect::<Vec<_>>(),
                    "frontends": services,
                    "counters": counters.iter().map(|(k, v)| (k.to_string(), *v)).collect::<std::collections::BTreeMap<_, _>>(),
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("mode: ebpf   pins: {}   frontends: {services}", cli.pin_dir.display());
                for (i, h) in &links {
                    println!("attached: {h:?} on {i}");
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

fn maps_len(maps: &KernelMaps) -> Result<usize> {
    use proxy_agent::maps::DatapathMaps;
    Ok(maps.services()?.len())
}
