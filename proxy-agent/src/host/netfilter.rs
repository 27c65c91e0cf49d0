//! The node's netfilter (and ipset), written through a small trait: the real implementation
//! runs the node's iptables-save/-restore and ipset, as kube-proxy does; tests use a fake.
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
#[error("{cmd}: {message}")]
pub struct NetfilterError {
    pub cmd: String,
    pub message: String,
}

pub trait Netfilter {
    /// `iptables-save -t table` output of one backend ("iptables-legacy", "iptables-nft", ...).
    fn save(&self, backend: &str, table: &str) -> Result<String, NetfilterError>;
    /// Applies an iptables-restore input with --noflush.
    fn restore(&mut self, backend: &str, input: &str) -> Result<(), NetfilterError>;
    fn ipsets(&self) -> Result<Vec<String>, NetfilterError>;
    fn destroy_ipset(&mut self, name: &str) -> Result<(), NetfilterError>;
    /// nftables tables as (family, name); an error where `nft` is not installed.
    fn nft_tables(&self) -> Result<Vec<(String, String)>, NetfilterError>;
    fn delete_nft_table(&mut self, family: &str, name: &str) -> Result<(), NetfilterError>;
}

fn run(cmd: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetfilterError> {
    let mut c = Command::new(cmd);
    c.args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child = c.spawn().map_err(|e| NetfilterError { cmd: cmd.into(), message: e.to_string() })?;
    if let Some(input) = stdin {
        use std::io::Write;
        let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| NetfilterError { cmd: cmd.into(), message: e.to_string() })?;
    if !out.status.success() {
        return Err(NetfilterError { cmd: format!("{cmd} {}", args.join(" ")), message: String::from_utf8_lossy(&out.stderr).trim().to_string() });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub struct SystemNetfilter;

impl Netfilter for SystemNetfilter {
    fn save(&self, backend: &str, table: &str) -> Result<String, NetfilterError> {
        run(&format!("{backend}-save"), &["-t", table], None)
    }
    fn restore(&mut self, backend: &str, input: &str) -> Result<(), NetfilterError> {
        run(&format!("{backend}-restore"), &["--noflush"], Some(input)).map(|_| ())
    }
    fn ipsets(&self) -> Result<Vec<String>, NetfilterError> {
        Ok(run("ipset", &["list", "-n"], None)?.lines().map(str::to_string).collect())
    }
    fn destroy_ipset(&mut self, name: &str) -> Result<(), NetfilterError> {
        run("ipset", &["destroy", name], None).map(|_| ())
    }
    fn nft_tables(&self) -> Result<Vec<(String, String)>, NetfilterError> {
        Ok(run("nft", &["list", "tables"], None)?
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some("table")).then(|| (w.next().unwrap_or("").to_string(), w.next().unwrap_or("").to_string()))
            })
            .collect())
    }
    fn delete_nft_table(&mut self, family: &str, name: &str) -> Result<(), NetfilterError> {
        run("nft", &["delete", "table", family, name], None).map(|_| ())
    }
}

/// The iptables front ends, IPv4's and IPv6's (the node's alternatives choose legacy or nft for
/// each, as kube-proxy's does).
pub const IPTABLES: &str = "iptables";
pub const IP6TABLES: &str = "ip6tables";

/// A chain kpr owns and the jump to it from a built-in chain: (table, hook, chain).
pub type OwnedChain = (&'static str, &'static str, &'static str);

/// Whether `saved` (iptables-save of one table) declares `chain`.
pub fn has_chain(saved: &str, chain: &str) -> bool {
    saved.lines().any(|l| l.starts_with(&format!(":{chain} ")))
}

fn has_jump(saved: &str, hook: &str, chain: &str) -> bool {
    saved.lines().any(|l| l.starts_with(&format!("-A {hook} ")) && l.ends_with(&format!("-j {chain}")))
}

/// Applies `input` (an iptables-restore input that declares `chains`, so applying it again
/// flushes and refills them) in `backend`, then adds each chain's jump where it is missing.
pub fn install_chains(nf: &mut dyn Netfilter, backend: &str, input: &str, chains: &[OwnedChain]) -> Result<(), NetfilterError> {
    nf.restore(backend, input)?;
    let mut jumps = String::new();
    for (table, hook, chain) in chains {
        if !has_jump(&nf.save(backend, table)?, hook, chain) {
            jumps += &format!("*{table}\n-I {hook} -j {chain}\nCOMMIT\n");
        }
    }
    if !jumps.is_empty() {
        nf.restore(backend, &jumps)?;
    }
    Ok(())
}

/// Removes the jumps to `chains` and the chains themselves from `backend`; idempotent. Returns
/// what went.
pub fn remove_chains(nf: &mut dyn Netfilter, backend: &str, chains: &[OwnedChain]) -> Result<Vec<String>, NetfilterError> {
    let mut done = Vec::new();
    for (table, hook, chain) in chains {
        let saved = nf.save(backend, table)?;
        let mut input = format!("*{table}\n");
        let n = saved.lines().filter(|l| l.starts_with(&format!("-A {hook} ")) && l.ends_with(&format!("-j {chain}"))).count();
        for _ in 0..n {
            input += &format!("-D {hook} -j {chain}\n");
        }
        let exists = has_chain(&saved, chain);
        if exists {
            input += &format!("-F {chain}\n-X {chain}\n");
        }
        if n > 0 || exists {
            nf.restore(backend, &format!("{input}COMMIT\n"))?;
            done.push(format!("removed {backend} {table} chain {chain}"));
        }
    }
    Ok(done)
}

/// Netfilter in memory for tests: `save` answers from `saved` (backend, table), every restore
/// input is recorded.
#[derive(Debug, Default)]
pub struct FakeNetfilter {
    pub saved: std::collections::BTreeMap<(String, String), String>,
    pub restored: Vec<(String, String)>,
}

impl Netfilter for FakeNetfilter {
    fn save(&self, backend: &str, table: &str) -> Result<String, NetfilterError> {
        Ok(self.saved.get(&(backend.to_string(), table.to_string())).cloned().unwrap_or_default())
    }
    fn restore(&mut self, backend: &str, input: &str) -> Result<(), NetfilterError> {
        self.restored.push((backend.into(), input.into()));
        Ok(())
    }
    fn ipsets(&self) -> Result<Vec<String>, NetfilterError> {
        Ok(Vec::new())
    }
    fn destroy_ipset(&mut self, _name: &str) -> Result<(), NetfilterError> {
        Ok(())
    }
    fn nft_tables(&self) -> Result<Vec<(String, String)>, NetfilterError> {
        Ok(Vec::new())
    }
    fn delete_nft_table(&mut self, _family: &str, _name: &str) -> Result<(), NetfilterError> {
        Ok(())
    }
}
