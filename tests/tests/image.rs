//! kpr's image, built as `cargo xtask image` builds it (deploy/image/rootfs.sh, then buildah and
//! deploy/Containerfile), runs in the lab with exactly the DaemonSet's privileges: its own root
//! file system, read-only, with CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON only, a bpffs of its own;
//! and forwards real traffic (root).
//!
//! The container runtime itself is not used: `podman run` cannot start containers on this
//! machine (crun: "cgroups in hybrid mode not supported"; runc: setrlimit EPERM), so the test
//! runs the image's root file system (buildah's mount of it) under chroot in a private mount
//! namespace, which is what the runtime would set up.
use std::{path::PathBuf, process::Command, time::Duration};

use kpr_lab::{
    lab::{errors, per_backend, Lab},
    must, sh,
};

/// Removes the image and its working container, also when the test fails.
struct Image {
    tag: String,
    container: String,
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = sh(&format!("buildah umount {0}; buildah rm {0}; buildah rmi -f {1}", self.container, self.tag));
    }
}

#[test]
fn the_image_runs_with_the_daemonsets_privileges_and_forwards() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let work = std::env::temp_dir().join(format!("kpr-image-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let out = must(&format!("{} {} {}", repo.join("deploy/image/rootfs.sh").display(), work.join("rootfs").display(), kpr_lab::sibling_bin("kpr").display()));
    assert!(out.contains("rootfs:"), "{out}");
    let tag = format!("localhost/kpr-test:{}", std::process::id());
    must(&format!("buildah bud --layers=false -q -f {} -t {tag} {}", repo.join("deploy/Containerfile").display(), work.display()));
    let container = must(&format!("buildah from {tag}")).trim().to_string();
    let image = Image { tag, container };
    let root = PathBuf::from(must(&format!("buildah mount {}", image.container)).trim());
    assert!(root.join("usr/local/bin/kpr").exists() && !root.join("usr/bin/apt-get").exists(), "a minimal root file system");
    // The image's own tools work from its root (what IPVS mode and the init container call).
    for cmd in [
        "/usr/local/bin/kpr --version",
        "/usr/sbin/iptables-nft -V",
        "/usr/sbin/iptables-legacy -V",
        "/usr/sbin/ipset -v",
        "/usr/sbin/nft -v",
        "/sbin/modprobe -V",
        "/bin/sh -c true",
    ] {
        must(&format!("chroot {} {cmd}", root.display()));
    }
    // The test's launcher only (not part of the image): setpriv and what it loads.
    must(&format!(
        "for f in /usr/bin/setpriv $(ldd /usr/bin/setpriv | awk '$3 ~ /^\\// {{print $3}}'); do mkdir -p {0}$(dirname $f); cp -L $f {0}$f; done",
        root.display()
    ));
    let manifests = root.join("etc/kpr/manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    for e in std::fs::read_dir(repo.join("deploy/examples")).unwrap().flatten() {
        std::fs::copy(e.path(), manifests.join(e.file_name())).unwrap();
    }

    let empty = work.join("lab");
    std::fs::create_dir_all(&empty).unwrap();
    let mut lab = Lab::build("kpe9", &empty);
    let r = root.display();
    // What the runtime sets up: a private mount namespace, the image's root read-only, /proc,
    // /sys and a bpffs of the pod's own; then the DaemonSet's capability set.
    let script = format!(
        "set -e; mount --make-rprivate /; mount --bind {r} {r}; mount -t proc proc {r}/proc; mount -t sysfs sysfs {r}/sys; \
         mount -t bpf bpf {r}/sys/fs/bpf; mount -o remount,bind,ro {r}; \
         exec chroot {r} /usr/bin/setpriv --bounding-set=-all,+bpf,+net_admin,+perfmon --inh-caps=-all \
         /usr/local/bin/kpr --pin-dir /sys/fs/bpf/kpr run --manifests /etc/kpr/manifests --uplink up0 --pod-iface-prefix {} \
         --node-name node-a --cluster-cidr 10.244.0.0/16 --cgroup none --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address ''",
        lab.spec.cni.prefix()
    );
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.ns("node"), "unshare", "-m", "sh", "-c", &script]);
    lab.start_agent_command(cmd);
    // Ready once its health endpoint reports a sync.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let o = Command::new("ip")
            .args(["netns", "exec", &lab.ns("node")])
            .arg(kpr_lab::sibling_bin("kpr-lab-peer"))
            .args(["get", "127.0.0.1:10256", "/healthz"])
            .output()
            .unwrap();
        let body = String::from_utf8_lossy(&o.stdout).to_string();
        if body.contains(" 200") && body.contains("\"lastUpdated\":\"20") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the image's agent did not sync: {body}\n{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
    let v = lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "60"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "{v}");
    let v = lab.peer("cl", &["burst", "198.18.0.1:30080", "tcp", "60"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "outside: {v}");
    // No ANSI colour codes in a log that is not a terminal.
    assert!(!lab.agent_log().contains('\u{1b}'), "{}", lab.agent_log());
    lab.kill_agent();
    drop(lab);
    drop(image);
    let _ = std::fs::remove_dir_all(&work);
}
