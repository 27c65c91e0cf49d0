//! `kpr`: the node agent and its operator commands. The commands' work is in their modules:
//! `run` (the agent and the host's preparation), `cleanup`, `inspect` (the views).
mod cleanup;
mod inspect;
mod run;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use proxy_agent::{host::netif, serve::metrics, settings};

/// jemalloc: see the dependency's comment in Cargo.toml.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (`_RJEM_MALLOC_CONF` in the environment still overrides them): freed
/// pages go back to the kernel after 100 ms, by a background thread, not the 10 s default.
/// The initial list and sync of a large cluster free as much as stays, and what was freed in
/// the last decay period is still in the peak (kpr-scale at 100,000 Services: peak RSS 393 MiB
/// with the defaults, 351 MiB at 1 s; later, 261–267 MB at 1 s against 250–251 MB at 100 ms,
/// the initial sync 0.1–0.2 s slower, 2.5–2.7 s against 2.7–3.0 s).
/// One arena, not four per CPU: the few threads that allocate much (the watches, the model's
/// compute, the writers) otherwise leave what stays spread over arenas that each keep free
/// pages around it; each thread's cache still spares them the arena's lock (kpr-scale at
/// 100,000: 246–253 MiB with the default on two CPUs, 228–232 MiB with one, as fast).
#[cfg(feature = "jemalloc")]
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: Option<&'static std::ffi::c_char> = Some(unsafe { &*c"background_thread:true,dirty_decay_ms:100,muzzy_decay_ms:0,narenas:1".as_ptr() });

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
        Cmd::Run(flags) => run::run(pin_dir, log_format, &flags),
        Cmd::PrepareHost(flags) => run::prepare_host(&pin_dir, &flags),
        Cmd::Cleanup { kube_proxy, keep_kpr } => cleanup::cleanup(&pin_dir, kube_proxy, keep_kpr),
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "kpr", &mut std::io::stdout());
            Ok(())
        }
        Cmd::Status { json, healthz } => inspect::status(&pin_dir, json, &healthz),
        Cmd::Services { json, skipped, healthz } => inspect::services(&pin_dir, json, skipped, &healthz),
        Cmd::Ipset { json, name } => inspect::ipset(&pin_dir, json, name.as_deref()),
        Cmd::Ipvs { json, stats } => inspect::ipvs(json, stats),
        Cmd::Conntrack { json } => inspect::conntrack(&pin_dir, json),
    }
}
