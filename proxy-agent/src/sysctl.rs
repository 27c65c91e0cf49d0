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

/// What the fast path needs on the node: forwarding, and accepting packets whose source is the
/// node's own address (masqueraded traffic; `all` covers every interface, present and future).
/// In a cluster the DaemonSet's init container sets them, since /proc/sys is read-only in an
/// unprivileged container; the agent sets them itself where it can.
pub const FAST_PATH_SYSCTLS: [(&str, &str); 2] = [("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.accept_local", "1")];
