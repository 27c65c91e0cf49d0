//! Interfaces and addresses of the agent's network namespace (through libc's netlink-backed
//! calls, never /sys, which may belong to another namespace).
use std::{ffi::CStr, net::IpAddr};

pub fn interfaces() -> Vec<String> {
    let mut out = Vec::new();
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return out;
        }
        let mut p = list;
        while (*p).if_index != 0 && !(*p).if_name.is_null() {
            out.push(CStr::from_ptr((*p).if_name).to_string_lossy().into_owned());
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    out
}

/// The interface's index, None when there is no such interface.
pub fn index(iface: &str) -> Option<u32> {
    let name = std::ffi::CString::new(iface).ok()?;
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (i != 0).then_some(i)
}

/// IPv4 addresses of `iface`.
pub fn ipv4_addresses(iface: &str) -> Vec<IpAddr> {
    addresses(iface).into_iter().filter(IpAddr::is_ipv4).collect()
}

/// Addresses of `iface` a client can reach from elsewhere: IPv4, and IPv6 but link-local.
pub fn addresses(iface: &str) -> Vec<IpAddr> {
    let mut out = Vec::new();
    unsafe {
        let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut ifa) != 0 {
            return out;
        }
        let mut p = ifa;
        while !p.is_null() {
            let a = &*p;
            if !a.ifa_addr.is_null() && CStr::from_ptr(a.ifa_name).to_string_lossy() == iface {
                match i32::from((*a.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(a.ifa_addr as *const libc::sockaddr_in);
                        out.push(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(a.ifa_addr as *const libc::sockaddr_in6);
                        let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                        if !ip.is_unicast_link_local() {
                            out.push(IpAddr::V6(ip));
                        }
                    }
                    _ => {}
                }
            }
            p = a.ifa_next;
        }
        libc::freeifaddrs(ifa);
    }
    out
}

/// The host-side pod interfaces of the common CNIs, by name prefix: Calico (`cali`), Cilium
/// (`lxc`), the bridge, ptp and flannel CNIs and kindnet (`veth`), the AWS VPC CNI (`eni`), Azure
/// CNI (`azv`), GKE (`gke`); and the Ethernet-framed tunnels pods' traffic arrives by (flannel's
/// VXLAN `flannel.1`, Calico's `vxlan.calico`).
pub const KNOWN_POD_IFACE_PREFIXES: [&str; 8] = ["cali", "lxc", "veth", "eni", "azv", "gke", "flannel.", "vxlan.calico"];

/// The interfaces of this namespace's default routes, IPv4's first (what a node's uplinks are
/// where none is named), from /proc/net (this namespace's view).
pub fn default_route_interfaces() -> Vec<String> {
    let v4 = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
    let v6 = std::fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default();
    default_routes_in(&v4, &v6)
}

/// `default_route_interfaces` of /proc/net/route's and /proc/net/ipv6_route's text.
pub fn default_routes_in(route: &str, ipv6_route: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut add = |iface: &str| {
        if iface != "lo" && !out.iter().any(|o| o == iface) {
            out.push(iface.to_string());
        }
    };
    // Iface Destination Gateway Flags RefCnt Use Metric Mask ...: destination and mask 0.
    for l in route.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() >= 8 && f[1] == "00000000" && f[7] == "00000000" {
            add(f[0]);
        }
    }
    // Destination, prefix length, source, its length, next hop, metric, refcnt, use, flags, iface.
    // The unreachable default of a namespace without IPv6 routes is on lo.
    for l in ipv6_route.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() >= 10 && f[0].bytes().all(|b| b == b'0') && f[1] == "00" {
            add(f[9]);
        }
    }
    out
}

/// Moves the calling thread into the named network namespace (/var/run/netns/NAME), before
/// any other thread exists. bpffs stays the host's, unlike under `ip netns exec`.
pub fn enter_netns(name: &str) -> std::io::Result<()> {
    let path = if name.contains('/') { name.to_string() } else { format!("/var/run/netns/{name}") };
    let f = std::fs::File::open(&path)?;
    use std::os::fd::AsRawFd;
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The cookie of the calling thread's network namespace (SO_NETNS_COOKIE, Linux 5.14+); None
/// where the kernel has no such option.
pub fn netns_cookie() -> Option<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        let rc = libc::getsockopt(fd, libc::SOL_SOCKET, SO_NETNS_COOKIE, (&mut cookie as *mut u64).cast(), &mut len);
        libc::close(fd);
        (rc == 0 && cookie != 0).then_some(cookie)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_routes_name_the_uplinks() {
        let route = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
eth0\t00000000\t0102A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n\
eth0\t0002A8C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0\n\
cali1\t0200000A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0\n\
bond1\t00000000\t0102A8C1\t0003\t0\t0\t200\t00000000\t0\t0\t0\n";
        let v6 = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 00000400 00000001 00000000 00000003     eth1\n\
20010db8000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth1\n\
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo\n";
        assert_eq!(default_routes_in(route, v6), ["eth0", "bond1", "eth1"]);
        assert!(default_routes_in("Iface\tDestination\n", "").is_empty());
    }
}
