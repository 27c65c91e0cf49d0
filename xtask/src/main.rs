//! Developer tasks: `cargo xtask build-ebpf | lab | test | bench | vm-test | fuzz`.
mod ebpf_build;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "kpr developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the eBPF object (proxy-ebpf) for bpfel-unknown-none and print its path.
    BuildEbpf {
        /// Unoptimised build (the verifier usually rejects it; for debugging the build only).
        #[arg(long)]
        debug: bool,
    },
    /// The README's main command: namespace lab + kpr on deploy/examples + traffic (root).
    Lab {
        /// Arguments for kpr-lab (--connections N, --keep SECONDS, --manifests DIR).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build everything and run every test: unit, packet fixtures, namespace end to end (root).
    Test {
        /// Extra arguments for `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Per-packet cost vs. the pass-only floor at several service counts (kpr-bench), the
    /// control plane at scale (kpr-scale), the A/B against kube-proxy's iptables rules (kpr-ab),
    /// short connections on the users' paths against the same rules (kpr-churn), and the IPVS sides in the QEMU guest (kpr-vm-bench) (root). Results: target/bench/.
    Bench {
        /// Small sizes and counts: proves the harness runs (what CI runs).
        #[arg(long)]
        smoke: bool,
        /// Which parts: packet, scale, ab, churn, vm (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "packet,scale,ab,churn,vm")]
        parts: Vec<String>,
        /// A/B sizes (services) for kpr-ab [default: 100,1000,10000,30000].
        #[arg(long)]
        ab_sizes: Option<String>,
        /// Guest control-plane sizes (services × 10 endpoints) [default: 1000,10000,30000].
        #[arg(long)]
        vm_cp_sizes: Option<String>,
        /// Guest traffic sizes [default: 100,10000]; "" skips the traffic part.
        #[arg(long)]
        vm_traffic_sizes: Option<String>,
        /// Arguments for kpr-bench (--sizes, --repeat, --new-flows, --runs, --json).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Boot Debian's 6.1 kernel (which has IPVS) under QEMU on the host's root file system and run
    /// the VM tests (kpr-vm-tests) or --command in it (root).
    VmTest {
        /// Shell command to run in the guest instead of kpr-vm-tests (cwd: the repository root;
        /// the trailing arguments are its "$@"; $KPR_VM_OUT is a directory shared with the host).
        #[arg(long)]
        command: Option<String>,
        /// Kill the guest after this many seconds.
        #[arg(long, default_value_t = 1500)]
        timeout_secs: u64,
        /// Arguments for kpr-vm-tests (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build kpr's container image from a minimal root file system (deploy/image/rootfs.sh:
    /// the agent, busybox, modprobe, iptables, ipset, nft, ipvsadm and their libraries) with
    /// buildah and deploy/Containerfile (root). The root file system stays in target/image/.
    Image {
        /// The image's name and tag.
        #[arg(long, default_value = concat!("kpr:", env!("CARGO_PKG_VERSION")))]
        tag: String,
    },
    /// Fuzz the IPVS netlink reply decoder (proxy-agent/fuzz) with cargo-fuzz and rustup's
    /// nightly, installing either where missing.
    Fuzz {
        /// How long libFuzzer runs.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut c: Command, what: &str) -> Result<()> {
    eprintln!("xtask: {what}");
    let st = c.status().with_context(|| format!("running {what}"))?;
    if !st.success() {
        bail!("{what} failed ({st})");
    }
    Ok(())
}

fn require_root(what: &str) -> Result<()> {
    if unsafe { libc_geteuid() } != 0 {
        bail!("{what} loads BPF programs and creates network namespaces: run it as root (e.g. `sudo -E cargo xtask {what}`)");
    }
    Ok(())
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

fn mount_bpffs() {
    let mounted = Command::new("mountpoint").args(["-q", "/sys/fs/bpf"]).status().map(|s| s.success()).unwrap_or(false);
    if !mounted {
        let _ = Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]).status();
    }
}

/// Installs what the eBPF build needs on Debian (as root), or says exactly what is missing.
fn ensure_toolchain() -> Result<()> {
    let have_toolchain = ebpf_build::debian_toolchain() || ebpf_build::nightly_with_rust_src();
    let mut missing_tools: Vec<&str> = Vec::new();
    // (a shell test, the package that makes it pass): the lab's tools, and what the image test
    // builds kpr's image from (busybox must be the static one: the image has no libc of its own
    // for it).
    for (check, pkg) in [
        ("command -v ip", "iproute2"),
        ("command -v mountpoint && command -v setpriv && command -v taskset", "util-linux"),
        ("command -v pgrep", "procps"),
        ("command -v iptables", "iptables"),
        ("command -v ipset", "ipset"),
        ("command -v conntrack", "conntrack"),
        ("command -v nft", "nftables"),
        ("command -v ipvsadm", "ipvsadm"),
        ("command -v kmod", "kmod"),
        ("command -v buildah", "buildah"),
        ("command -v bpftool", "bpftool"),
        // The deploy test renders the kustomizations.
        ("command -v kubectl", "kubernetes-client"),
        ("ldd /bin/busybox 2>&1 | grep -q 'not a dynamic'", "busybox-static"),
    ] {
        if !Command::new("sh").arg("-c").arg(format!("{check} >/dev/null 2>&1")).status().map(|s| s.success()).unwrap_or(false) {
            missing_tools.push(pkg);
        }
    }
    if have_toolchain && ebpf_build::bpf_linker_found() && missing_tools.is_empty() {
        return Ok(());
    }
    let mut pkgs: Vec<&str> = missing_tools;
    if !have_toolchain {
        pkgs.extend(ebpf_build::DEBIAN_PACKAGES);
    }
    apt_install(&pkgs, &format!("the eBPF toolchain is missing. On Debian, as root: {}", ebpf_build::DEBIAN_INSTALL))?;
    if !ebpf_build::bpf_linker_found() {
        let mut c = Command::new("cargo");
        c.env("LLVM_PREFIX", "/usr/lib/llvm-22").args(["install", "--locked", "bpf-linker", "--no-default-features", "--features", "llvm-22"]);
        run(c, "installing bpf-linker (about 2 minutes)")?;
    }
    Ok(())
}

/// Installs Debian packages with apt-get; fails with `hint` where it cannot (no apt-get, not root).
fn apt_install(pkgs: &[&str], hint: &str) -> Result<()> {
    if !Path::new("/usr/bin/apt-get").exists() || unsafe { libc_geteuid() } != 0 {
        bail!("{hint}");
    }
    if pkgs.is_empty() {
        return Ok(());
    }
    let mut update = Command::new("apt-get");
    update.args(["update", "-qq"]);
    run(update, "apt-get update")?;
    let mut c = Command::new("apt-get");
    c.env("DEBIAN_FRONTEND", "noninteractive").args(["install", "-y", "-qq", "--no-install-recommends"]).args(pkgs);
    run(c, &format!("installing {}", pkgs.join(" ")))
}

/// `cargo +nightly` through rustup's proxy: `$CARGO` is the stable toolchain's own cargo.
fn rustup_cargo() -> Command {
    let mut c = Command::new("cargo");
    c.env_remove("RUSTUP_TOOLCHAIN");
    c
}

/// cargo-fuzz needs nightly (-Zsanitizer); the run writes new inputs to an ignored working
/// corpus and only reads the committed seeds.
fn fuzz(seconds: u64) -> Result<()> {
    let toolchains = Command::new("rustup").args(["toolchain", "list"]).output();
    let toolchains = toolchains.context("cargo fuzz needs rustup's nightly toolchain, and rustup is not installed")?;
    if !String::from_utf8_lossy(&toolchains.stdout).lines().any(|l| l.starts_with("nightly")) {
        let mut c = Command::new("rustup");
        c.args(["toolchain", "install", "nightly", "--profile", "minimal"]);
        run(c, "installing rustup's nightly toolchain (cargo fuzz needs it)")
            .context("no nightly toolchain and none could be installed: run `rustup toolchain install nightly --profile minimal` where the network allows")?;
    }
    if !rustup_cargo().args(["fuzz", "--version"]).output().map(|o| o.status.success()).unwrap_or(false) {
        let mut c = rustup_cargo();
        c.args(["install", "cargo-fuzz", "--locked"]);
        run(c, "installing cargo-fuzz (a few minutes)")?;
    }
    let dir = root().join("proxy-agent/fuzz");
    let work = dir.join("target/corpus/ipvs_decode");
    std::fs::create_dir_all(&work)?;
    let mut c = rustup_cargo();
    // libFuzzer adds new inputs to the first corpus directory only.
    c.current_dir(&dir).args(["+nightly", "fuzz", "run", "ipvs_decode"]).arg(&work).arg("corpus/ipvs_decode");
    c.arg("--").arg(format!("-max_total_time={seconds}"));
    run(c, &format!("fuzzing the IPVS reply decoder for {seconds}s (the first build takes a few minutes)"))
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::BuildEbpf { debug } => {
            ensure_toolchain()?;
            let obj = ebpf_build::build(&root(), &root().join("target/ebpf"), !debug).map_err(anyhow::Error::msg)?;
            println!("{}", obj.display());
        }
        Cmd::Lab { args } => {
            require_root("lab")?;
            ensure_toolchain()?;
            mount_bpffs();
            let mut b = cargo();
            b.args(["build", "--release", "-p", "proxy-agent", "-p", "kpr-lab", "--bins"]);
            run(b, "building kpr and the lab tools (the first build takes a few minutes)")?;
            let mut c = Command::new(root().join("target/release/kpr-lab"));
            c.current_dir(root()).args(&args);
            run(c, "running the lab")?;
        }
        Cmd::Test { args } => {
            require_root("test")?;
            ensure_toolchain()?;
            mount_bpffs();
            let mut b = cargo();
            b.args(["build", "--workspace", "--bins", "--tests"]);
            run(b, "building the workspace and its tests")?;
            let mut t = cargo();
            t.args(["test", "--workspace"]).args(&args);
            run(t, "running the tests")?;
        }
        Cmd::Bench { smoke, parts, ab_sizes, vm_cp_sizes, vm_traffic_sizes, args } => {
            require_root("bench")?;
            ensure_toolchain()?;
            mount_bpffs();
            let part = |p: &str| parts.iter().any(|x| x == p);
            if let Some(unknown) = parts.iter().find(|p| !["packet", "scale", "ab", "churn", "vm"].contains(&p.as_str())) {
                bail!("unknown bench part {unknown:?} (packet, scale, ab, churn, vm)");
            }
            let mut b = cargo();
            b.args(["build", "--release", "-p", "kpr-bench", "-p", "kpr-lab", "-p", "proxy-agent", "--bins"]);
            run(b, "building kpr and the benchmarks")?;
            let out = root().join("target/bench");
            std::fs::create_dir_all(&out)?;
            if part("packet") {
                let mut c = Command::new(root().join("target/release/kpr-bench"));
                c.current_dir(root()).arg("--json").arg(out.join("packet.json"));
                if smoke {
                    // As many new flows as the full run: 200 are mostly the first ones after
                    // other work, which run cold (performance.md, cold and warm); 2,000 take a
                    // fraction of a second.
                    c.args(["--sizes", "1,1000", "--repeat", "20000", "--new-flows", "2000", "--runs", "3"]);
                }
                c.args(&args);
                run(c, "data plane: per-packet cost")?;
            }
            if part("scale") {
                // The control plane's goals name both sizes; the smoke size only shows it runs.
                let sizes: &[&str] = if smoke { &["500"] } else { &["10000", "100000"] };
                for n in sizes {
                    let mut s = Command::new(root().join("target/release/kpr-scale"));
                    s.current_dir(root()).args(["--services", n]);
                    if smoke {
                        s.args(["--changes", "10"]);
                    }
                    run(s, "control plane: N services through the whole pipeline")?;
                }
            }
            if part("ab") {
                let mut ab = Command::new(root().join("target/release/kpr-ab"));
                ab.current_dir(root()).arg("--json").arg(out.join("ab.json")).arg("--svg").arg(out.join("ab.svg"));
                match (&ab_sizes, smoke) {
                    (Some(s), _) => ab.args(["--sizes", s]),
                    (None, true) => ab.args(["--sizes", "100", "--seconds", "1"]),
                    (None, false) => &mut ab,
                };
                run(ab, "A/B: eBPF vs kube-proxy's iptables rules vs direct, in the namespace lab")?;
            }
            if part("churn") {
                let mut c = Command::new(root().join("target/release/kpr-churn"));
                c.current_dir(root()).arg("--json").arg(out.join("churn.json"));
                if smoke {
                    c.args(["--sizes", "1", "--seconds", "1"]);
                }
                run(c, "short connections on the users' paths: direct vs kube-proxy's iptables rules vs kpr, in the namespace lab")?;
            }
            if part("vm") {
                let (cp, tr, rest) = if smoke {
                    ("100".to_string(), "100".to_string(), "--seconds 1 --runs 1")
                } else {
                    (
                        // 30,000: the IPVS programming goal, under 60 s (several minutes in the
                        // emulated guest).
                        vm_cp_sizes.clone().unwrap_or_else(|| "1000,10000,30000".into()),
                        vm_traffic_sizes.clone().unwrap_or_else(|| "100,10000".into()),
                        "--seconds 3 --runs 3",
                    )
                };
                eprintln!("xtask: IPVS sides in the QEMU guest (control plane {cp}; traffic {tr})");
                let cmd = format!(
                    "./target/release/kpr-vm-bench --cp-sizes '{cp}' --traffic-sizes '{tr}' {rest} --json \"$KPR_VM_OUT/vm.json\" --svg \"$KPR_VM_OUT/vm.svg\""
                );
                vm::vm_test(Some(cmd), Duration::from_secs(3600), &[])?;
                for f in ["vm.json", "vm.svg"] {
                    std::fs::copy(root().join("target/vm/out").join(f), out.join(f))?;
                }
            }
            eprintln!("xtask: results in {}", out.display());
        }
        Cmd::VmTest { command, timeout_secs, args } => {
            if unsafe { libc_geteuid() } != 0 {
                bail!("vm-test reads /boot/vmlinuz-* and shares / with the guest: run it as root");
            }
            vm::vm_test(command, Duration::from_secs(timeout_secs), &args)?;
        }
        Cmd::Fuzz { seconds } => fuzz(seconds)?,
        Cmd::Image { tag } => {
            require_root("image")?;
            ensure_toolchain()?;
            let mut b = cargo();
            b.args(["build", "--release", "-p", "proxy-agent", "--bin", "kpr"]);
            run(b, "building kpr")?;
            let dir = root().join("target/image");
            let mut r = Command::new(root().join("deploy/image/rootfs.sh"));
            r.arg(dir.join("rootfs")).arg(root().join("target/release/kpr"));
            run(r, "assembling the root file system")?;
            let mut bud = Command::new("buildah");
            bud.args(["bud", "--layers=false", "-f"]).arg(root().join("deploy/Containerfile")).args(["-t", &tag]).arg(&dir);
            run(bud, "building the image")?;
            println!("built {tag} (buildah images; export: podman save -o kpr.tar {tag})");
        }
    }
    Ok(())
}
