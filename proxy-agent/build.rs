//! Builds the eBPF object (or takes a prebuilt one from KPR_EBPF_OBJECT) and puts it in OUT_DIR
//! for `include_bytes_aligned!`.
#[path = "../xtask/src/ebpf_build.rs"]
mod ebpf_build;

use std::{env, path::PathBuf};

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest_dir.parent().unwrap().to_path_buf();
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("proxy-ebpf.o");
    println!("cargo:rerun-if-env-changed=KPR_EBPF_OBJECT");
    for p in ["proxy-ebpf/src", "proxy-ebpf/Cargo.toml", "proxy-common/src", "xtask/src/ebpf_build.rs"] {
        println!("cargo:rerun-if-changed={}", workspace.join(p).display());
    }
    let obj = match env::var_os("KPR_EBPF_OBJECT") {
        Some(p) => PathBuf::from(p),
        None => {
            let target_dir = workspace.join("target/ebpf");
            match ebpf_build::build(&workspace, &target_dir, true) {
                Ok(p) => p,
                Err(e) => panic!("\n\nkpr: cannot build the eBPF object: {e}\n\n"),
            }
        }
    };
    std::fs::copy(&obj, &out).unwrap_or_else(|e| panic!("copy {} -> {}: {e}", obj.display(), out.display()));
}
