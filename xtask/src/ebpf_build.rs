//! Builds proxy-ebpf for bpfel-unknown-none. Shared, by `#[path]`, between xtask
//! (`cargo xtask build-ebpf`) and proxy-agent's build script, so there is one recipe.
//!
//! Two toolchains work:
//! - Debian: rustc-web + libstd-rust-web-dev-bpf (prebuilt core for the bpf target) and a
//!   bpf-linker built against llvm-22 (see ../shared/ENVIRONMENT.md).
//! - rustup nightly with rust-src (`-Z build-std=core`) and bpf-linker.
#![allow(dead_code)]

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

pub const TARGET: &str = "bpfel-unknown-none";

pub const DEBIAN_PACKAGES: &[&str] = &["rustc-web", "cargo-web", "libstd-rust-web-dev-bpf", "llvm-22-dev", "libpolly-22-dev"];

pub const DEBIAN_INSTALL: &str = "apt-get install -y rustc-web cargo-web libstd-rust-web-dev-bpf llvm-22-dev libpolly-22-dev && LLVM_PREFIX=/usr/lib/llvm-22 cargo install bpf-linker --no-default-features --features llvm-22";

fn home_cargo_bin() -> PathBuf {
    env::var_os("CARGO_HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env::var_os("HOME").unwrap_or_default()).join(".cargo")).join("bin")
}

pub fn bpf_linker_found() -> bool {
    if home_cargo_bin().join("bpf-linker").exists() {
        return true;
    }
    env::var_os("PATH").map(|p| env::split_paths(&p).any(|d| d.join("bpf-linker").exists())).unwrap_or(false)
}

pub fn debian_toolchain() -> bool {
    Path::new("/usr/bin/rustc").exists() && Path::new("/usr/bin/cargo").exists() && Path::new("/usr/lib/rustlib").join(TARGET).exists()
}

pub fn nightly_with_rust_src() -> bool {
    Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", "nightly"])
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("rust-src"))
        .unwrap_or(false)
}

/// Builds the object and returns its path. `workspace` is the repository root.
pub fn build(workspace: &Path, target_dir: &Path, release: bool) -> Result<PathBuf, String> {
    let manifest = workspace.join("proxy-ebpf/Cargo.toml");
    if !bpf_linker_found() {
        return Err(format!("bpf-linker not found. On Debian: {DEBIAN_INSTALL}"));
    }
    let mut cmd;
    if debian_toolchain() {
        cmd = Command::new("/usr/bin/cargo");
        let path = env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![PathBuf::from("/usr/bin"), home_cargo_bin()];
        dirs.extend(env::split_paths(&path));
        cmd.env("PATH", env::join_paths(dirs).unwrap()).env("RUSTC", "/usr/bin/rustc").env("RUSTC_BOOTSTRAP", "1").arg("build");
    } else if nightly_with_rust_src() {
        cmd = Command::new("rustup");
        cmd.args(["run", "nightly", "cargo", "build", "-Z", "build-std=core"]);
    } else {
        return Err(format!(
            "no toolchain for the {TARGET} target. On Debian: {DEBIAN_INSTALL}\n\
             Elsewhere: rustup toolchain install nightly --component rust-src && cargo install bpf-linker"
        ));
    }
    // Variables of the outer cargo would leak into the inner build.
    for (k, _) in env::vars_os() {
        let k = k.to_string_lossy().to_string();
        if (k.starts_with("CARGO_") && k != "CARGO_HOME") || k == "RUSTC_WRAPPER" || k == "RUSTC_WORKSPACE_WRAPPER" || k == "RUSTFLAGS" || k == "RUSTDOC" {
            cmd.env_remove(&k);
        }
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", "-C\u{1f}debuginfo=2\u{1f}-C\u{1f}link-arg=--btf")
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target")
        .arg(TARGET)
        .arg("--target-dir")
        .arg(target_dir);
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().map_err(|e| format!("cannot run cargo for the eBPF build: {e}"))?;
    if !status.success() {
        return Err(format!("eBPF build failed ({status})"));
    }
    let profile = if release { "release" } else { "debug" };
    Ok(target_dir.join(TARGET).join(profile).join("proxy-ebpf"))
}
