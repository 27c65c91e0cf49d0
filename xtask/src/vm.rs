//! `cargo xtask vm-test`: the host kernel has no IPVS (no modules at all), so this boots Debian's
//! 6.1 kernel under QEMU on the host's own root file system (read-only 9p) and runs a command in it.
//! Recipe: ../shared/ENVIRONMENT.md, "A real IPVS kernel".
use std::{
    fs,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

pub const DEBIAN_PACKAGES: &[&str] = &["qemu-system-x86", "linux-image-amd64", "ipvsadm", "busybox-static", "kmod"];

/// What the initramfs needs to mount the 9p share, in load order (virtio_ring before virtio).
const MODULES: &[&str] =
    &["virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci", "netfs", "fscache", "9pnet", "9pnet_virtio", "9p"];

/// The init prints this just before running the command: the host times the boot with it.
const BOOTED: &str = "kpr-vm: booted";

/// /init, run by busybox. Mount failures power off without an exit_code, which the host reports.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
die() { echo "kpr-vm: $*"; echo o > /proc/sysrq-trigger; sleep 10; poweroff -f; }
mount -t proc proc /proc
for m in $(cat /modules/order); do insmod /modules/$m.ko || die "insmod $m failed"; done
h=/host
mount -t 9p -o trans=virtio,version=9p2000.L,ro host $h || die "mounting the host's root failed"
mount -t proc proc $h/proc && mount -t sysfs sys $h/sys && mount -t devtmpfs dev $h/dev || die "proc/sys/dev"
mount -t tmpfs -o mode=1777 tmp $h/tmp && mount -t tmpfs -o mode=755 run $h/run || die "tmpfs"
# Debian's /var/run is a symlink to /run; anything else gets its own tmpfs.
[ -L $h/var/run ] || mount -t tmpfs run $h/var/run
# After the tmpfs /run, so it is not hidden by it.
mkdir -p $h/run/kpr-vm && mount -t 9p -o trans=virtio,version=9p2000.L out $h/run/kpr-vm || die "output share"
# The repository may live under /tmp or /run (a CI clone), hidden by the tmpfs above: its own
# share, mounted again at its own path.
r=$(cat /repo_path)
mkdir -p $h$r && mount -t 9p -o trans=virtio,version=9p2000.L,ro repo $h$r || die "repository share $r"
mount -t bpf bpf $h/sys/fs/bpf && mount -t cgroup2 none $h/sys/fs/cgroup || die "bpffs/cgroup2"
mkdir -p $h/dev/shm $h/dev/pts && mount -t tmpfs -o mode=1777 shm $h/dev/shm && mount -t devpts devpts $h/dev/pts
ip link set lo up
echo "kpr-vm: booted $(uname -r), running the command"
# exec: PID 1 itself changes root, and the kernel's threads share its root, so the kernel's own
# module requests (e.g. ipvsadm's scheduler ip_vs_rr) run the host's /sbin/modprobe too.
exec chroot $h /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root KPR_VM_OUT=/run/kpr-vm /bin/sh -c \
  '/bin/sh /run/kpr-vm/guest.sh; echo $? > /run/kpr-vm/exit_code; sync; echo o > /proc/sysrq-trigger; sleep 10'
"#;

/// Boots the guest, runs `command` (default: kpr-vm-tests `args`), fails unless it exits 0.
pub fn vm_test(command: Option<String>, timeout: Duration, args: &[String]) -> Result<()> {
    let root = crate::root();
    let missing: Vec<&str> = DEBIAN_PACKAGES.iter().copied().filter(|p| !deb_installed(p)).collect();
    if !missing.is_empty() {
        crate::apt_install(&missing, &format!("vm-test needs, as root: apt-get install -y {}", DEBIAN_PACKAGES.join(" ")))?;
    }
    let (kernel, version) = guest_kernel()?;
    // A command of the caller's runs what target/release holds too: build first, or the guest
    // runs a kpr older than the tree.
    build_vm_tests()?;
    let command = command.unwrap_or_else(|| r#"exec ./target/release/kpr-vm-tests "$@""#.to_string());

    let vm_dir = root.join("target/vm");
    let out = vm_dir.join("out");
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("cleaning {}", out.display()))?;
    }
    fs::create_dir_all(&out)?;
    fs::write(out.join("guest.sh"), guest_script(&root, &command, args))?;
    let initrd = vm_dir.join("initramfs.cpio");
    fs::write(&initrd, initramfs(&version, &root)?).with_context(|| format!("writing {}", initrd.display()))?;

    let mut qemu = Command::new("qemu-system-x86_64");
    // Nested KVM hangs at boot on these machines: software emulation only.
    qemu.args(["-accel", "tcg,thread=multi", "-cpu", "max", "-m", "3072", "-smp", "2", "-nic", "none"])
        .args(["-nographic", "-no-reboot", "-append", "console=ttyS0 quiet panic=-1"])
        // qboot instead of SeaBIOS: SeaBIOS resets and clears the host terminal over the serial line.
        .args(["-bios", "qboot.rom"])
        .arg("-kernel")
        .arg(&kernel)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-virtfs", "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap"])
        .arg("-virtfs")
        .arg(format!("local,path={},mount_tag=out,security_model=none,multidevs=remap", out.display().to_string().replace(',', ",,")))
        .arg("-virtfs")
        .arg(format!("local,path={},mount_tag=repo,security_model=none,readonly=on,multidevs=remap", root.display().to_string().replace(',', ",,")))
        // No stdin: -nographic would otherwise put the terminal in raw mode and read the monitor escape from it.
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    eprintln!("xtask: booting {} (QEMU, software emulation; timeout {}s)", kernel.display(), timeout.as_secs());
    let start = Instant::now();
    let mut child = qemu.spawn().context("starting qemu-system-x86_64")?;
    // Stream the serial console live, and note when the init says it has booted.
    let stdout = child.stdout.take().unwrap();
    let console = thread::spawn(move || {
        let (mut r, mut booted) = (BufReader::new(stdout), None);
        let mut line = Vec::new();
        while r.read_until(b'\n', &mut line).map(|n| n > 0).unwrap_or(false) {
            if booted.is_none() && String::from_utf8_lossy(&line).contains(BOOTED) {
                booted = Some(start.elapsed());
            }
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(&line).and_then(|_| o.flush());
            line.clear();
        }
        booted
    });
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the guest ran past --timeout-secs {}: killed QEMU", timeout.as_secs());
        }
        thread::sleep(Duration::from_millis(200));
    };
    let booted = console.join().ok().flatten();
    let total = start.elapsed();
    match booted {
        Some(b) => eprintln!("xtask: guest booted in {:.1}s, command + shutdown took {:.1}s", b.as_secs_f64(), (total - b).as_secs_f64()),
        None => eprintln!("xtask: the guest never reached the command ({:.1}s, QEMU {status})", total.as_secs_f64()),
    }
    let code = fs::read_to_string(out.join("exit_code")).context("the guest wrote no exit_code (boot or init failed: see the console above)")?;
    match code.trim() {
        "0" => Ok(()),
        c => bail!("the guest command exited with status {c}"),
    }
}

fn deb_installed(pkg: &str) -> bool {
    Command::new("dpkg-query").args(["-W", "-f", "${db:Status-Status}", pkg]).output().map(|o| o.stdout == b"installed").unwrap_or(false)
}

/// The newest /boot/vmlinuz-<ver> whose modules include IPVS (the host's own kernel has none).
fn guest_kernel() -> Result<(PathBuf, String)> {
    let mut found: Vec<(PathBuf, String)> = fs::read_dir("/boot")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let ver = e.file_name().to_str()?.strip_prefix("vmlinuz-")?.to_string();
            Path::new("/lib/modules").join(&ver).join("kernel/net/netfilter/ipvs").is_dir().then(|| (e.path(), ver))
        })
        .collect();
    found.sort_by(|a, b| a.1.cmp(&b.1));
    found.pop().with_context(|| format!("no /boot/vmlinuz-* with IPVS modules in /lib/modules/<version>: apt-get install -y {}", DEBIAN_PACKAGES.join(" ")))
}

fn build_vm_tests() -> Result<()> {
    crate::ensure_toolchain()?;
    let mut b = crate::cargo();
    // kpr is proxy-agent's binary, so both packages are selected.
    b.args(["build", "--release", "-p", "kpr-tests", "-p", "kpr-lab", "-p", "proxy-agent", "--bin", "kpr-vm-tests", "--bin", "kpr", "--bin", "kpr-lab-peer"]);
    crate::run(b, "building kpr-vm-tests and kpr")
}

/// The command, in the repository root, with the trailing args as its "$@".
fn guest_script(root: &Path, command: &str, args: &[String]) -> String {
    let q = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut s = format!("set -- {}\n", args.iter().map(|a| q(a)).collect::<Vec<_>>().join(" "));
    for var in ["RUST_LOG", "RUST_BACKTRACE"] {
        if let Ok(v) = std::env::var(var) {
            s += &format!("export {var}={}\n", q(&v));
        }
    }
    s + &format!("cd {} || exit 125\n{command}\n", q(&root.display().to_string()))
}

/// busybox-static, the 9p modules and /init as an uncompressed cpio (the kernel takes it as is).
fn initramfs(version: &str, repo: &Path) -> Result<Vec<u8>> {
    let moddir = Path::new("/lib/modules").join(version);
    let dep = fs::read_to_string(moddir.join("modules.dep")).context("reading modules.dep")?;
    let builtin = fs::read_to_string(moddir.join("modules.builtin")).unwrap_or_default();
    let mut c = Cpio::default();
    for d in ["bin", "dev", "proc", "host", "modules"] {
        c.entry(d, 0o040755, 0, &[]);
    }
    c.entry("dev/console", 0o020600, 5 << 8 | 1, &[]); // the kernel opens it for init's stdio
    c.entry("bin/busybox", 0o100755, 0, &fs::read("/bin/busybox").context("reading /bin/busybox (busybox-static)")?);
    c.entry("init", 0o100755, 0, INIT.as_bytes());
    c.entry("repo_path", 0o100644, 0, repo.display().to_string().as_bytes());
    let mut order = Vec::new();
    for m in MODULES {
        let is = |path: &str| module_name(path) == m.replace('-', "_");
        if let Some(rel) = dep.lines().filter_map(|l| l.split(':').next()).find(|p| is(p)) {
            c.entry(&format!("modules/{m}.ko"), 0o100644, 0, &read_module(&moddir.join(rel))?);
            order.push(*m);
        } else if !builtin.lines().any(is) {
            bail!("module {m} is neither in {}/modules.dep nor built in", moddir.display());
        }
    }
    c.entry("modules/order", 0o100644, 0, order.join("\n").as_bytes());
    Ok(c.finish())
}

fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// busybox's insmod may not decompress: compressed modules go into the initramfs decompressed.
fn read_module(path: &Path) -> Result<Vec<u8>> {
    let tool = match path.extension().and_then(|e| e.to_str()) {
        Some("ko") => return fs::read(path).with_context(|| format!("reading {}", path.display())),
        Some("xz") => "xz",
        Some("zst") => "zstd",
        Some("gz") => "gzip",
        _ => bail!("unknown module format: {}", path.display()),
    };
    let o = Command::new(tool).arg("-dc").arg(path).output().with_context(|| format!("running {tool}"))?;
    if !o.status.success() {
        bail!("{tool} -dc {} failed", path.display());
    }
    Ok(o.stdout)
}

/// A cpio archive in the "newc" format, the one the kernel unpacks as an initramfs.
#[derive(Default)]
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    /// `rdev` is major << 8 | minor, for device nodes.
    fn entry(&mut self, name: &str, mode: u32, rdev: u32, data: &[u8]) {
        self.ino += 1;
        let fields = [self.ino, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, rdev >> 8, rdev & 0xff, name.len() as u32 + 1, 0];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.buf.len() & 3 != 0 {
            self.buf.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, &[]);
        self.buf
    }
}
