//! Sysctl writes go through a trait: the real one writes /proc/sys (of the agent's network
//! namespace), the fake records.
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
#[error("sysctl {key}: {err}")]
pub struct SysctlError {
    pub key: String,
    pub err: std::io::Error,
}

pub trait Sysctls {
    fn get(&self, key: &str) -> Result<String, SysctlError>;
    fn set(&mut self, key: &str, value: &str) -> Result<(), SysctlError>;
}

pub struct ProcSysctls;

fn path(key: &str) -> String {
    format!("/proc/sys/{}", key.replace('.', "/"))
}

impl Sysctls for ProcSysctls {
    fn get(&self, key: &str) -> Result<String, SysctlError> {
        std::fs::read_to_string(path(key)).map(|s| s.trim().to_string()).map_err(|err| SysctlError { key: key.into(), err })
    }
    fn set(&mut self, key: &str, value: &str) -> Result<(), SysctlError> {
        if self.get(key).ok().as_deref() == Some(value) {
            return Ok(());
        }
        std::fs::write(path(key), value).map_err(|err| SysctlError { key: key.into(), err })
    }
}

#[derive(Default, Debug)]
pub struct FakeSysctls(pub BTreeMap<String, String>);

impl Sysctls for FakeSysctls {
    fn get(&self, key: &str) -> Result<String, SysctlError> {
        self.0.get(key).cloned().ok_or_else(|| SysctlError { key: key.into(), err: std::io::ErrorKind::NotFound.into() })
    }
    fn set(&mut self, key: &str, value: &str) -> Result<(), SysctlError> {
        self.0.insert(key.into(), value.into());
        Ok(())
    }
}

/// What the fast path needs on the node. Interface names may contain dots; sysctl paths use
/// '/' so they are written through the path, not the dotted key.
pub fn fast_path_sysctls(ifaces: &[String]) -> Vec<(String, &'static str)> {
    let mut v = vec![("net.ipv4.ip_forward".to_string(), "1")];
    for i in ifaces {
        // Masqueraded packets carry the node's own address as source: accept them.
        v.push((format!("net.ipv4.conf.{i}.accept_local"), "1"));
    }
    v
}
