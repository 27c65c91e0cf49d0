//! The agent needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON and nothing else (the DaemonSet's
//! stated set): here it runs with exactly those, on its own bpffs and cgroup2 mounts (as in a
//! pod), and forwards real traffic from a pod and from a node process.
use std::{path::PathBuf, process::Command};

use kpr_lab::{
    lab::{errors, per_backend, Lab},
    must, sh,
};

/// Unmounts and removes the scratch mounts, also when the test fails.
struct Mounts(PathBuf);

impl Drop for Mounts {
    fn drop(&mut self) {
        let _ = sh(&format!("umount {0}/bpf; umount {0}/cg; rm -rf {0}", self.0.display()));
    }
}

fn cap_eff(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status.lines().find(|l| l.starts_with("CapEff:")).unwrap().split_whitespace().nth(1).unwrap().to_string();
    u64::from_str_radix(&hex, 16).unwrap()
}

#[test]
fn agent_runs_with_bpf_net_admin_perfmon_only() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let m = std::env::temp_dir().join(format!("kpr-lp-manifests-{}", std::process::id()));
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
    }
    // Declared before the lab, so dropped after it (the lab empties the cgroup first).
    let root = PathBuf::from(format!("/run/kpr-lp-{}", std::process::id()));
    let _mounts = Mounts(root.clone());
    must(&format!("mkdir -p {0}/bpf {0}/cg && mount -t bpf bpf {0}/bpf && mount -t cgroup2 none {0}/cg && mkdir -p {0}/cg/kpr-kpe6-node", root.display()));
    let mut lab = Lab::build("kpe6", &m);
    lab.use_pins(root.join("bpf/kpr"));
    let _ = std::fs::remove_dir(&lab.cgroup);
    lab.cgroup = root.join("cg/kpr-kpe6-node");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.ns("node"), "setpriv", "--bounding-set=-all,+bpf,+net_admin,+perfmon", "--inh-caps=-all"])
        .arg(&lab.kpr)
        .arg("--pin-dir")
        .arg(root.join("bpf/kpr"))
        .args(["run", "--manifests"])
        .arg(&m)
        .args(["--uplink", "up0", "--pod-iface-prefix", lab.spec.cni.prefix(), "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16"])
        .arg("--cgroup")
        .arg(&lab.cgroup)
        .args(["--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", ""]);
    lab.start_agent_command(cmd);
    lab.wait_backends("10.96.0.10:80", 3);

    // The agent holds exactly the three capabilities.
    let pid = lab.agent_pid().unwrap();
    let kpr_pid = sh(&format!("pgrep -P {pid} kpr || echo {pid}")).stdout;
    let kpr_pid: u32 = String::from_utf8_lossy(&kpr_pid).trim().lines().last().unwrap().parse().unwrap();
    let want = (1u64 << 12) | (1u64 << 38) | (1u64 << 39); // NET_ADMIN, PERFMON, BPF
    assert_eq!(cap_eff(kpr_pid), want, "agent pid {kpr_pid} effective capabilities");

    let v = lab.peer("pod", &["burst", "10.96.0.10:80", "tcp", "60"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "{v}");
    let v = lab.peer("host", &["burst", "10.96.0.10:80", "tcp", "60"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "node process: {v}");
    let v = lab.peer("cl", &["burst", "198.18.0.1:30080", "tcp", "60"]);
    assert_eq!((errors(&v), per_backend(&v).len()), (0, 3), "outside: {v}");
    lab.kill_agent();
    let _ = std::fs::remove_dir_all(&m);
}
