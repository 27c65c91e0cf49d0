//! User-space helpers: the one place where byte order is converted.
use super::*;
use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

unsafe impl aya::Pod for ServiceKey {}
unsafe impl aya::Pod for ServiceValue {}
unsafe impl aya::Pod for SlotKey {}
unsafe impl aya::Pod for Backend {}
unsafe impl aya::Pod for CtKey {}
unsafe impl aya::Pod for CtValue {}
unsafe impl aya::Pod for CtKey6 {}
unsafe impl aya::Pod for CtValue6 {}
unsafe impl aya::Pod for AffinityKey {}
unsafe impl aya::Pod for AffinityValue {}
unsafe impl aya::Pod for SourceRangeKey {}
unsafe impl aya::Pod for DatapathConfig {}
unsafe impl aya::Pod for SockRevKey {}
unsafe impl aya::Pod for SockRevValue {}
unsafe impl aya::Pod for SetIpPort {}
unsafe impl aya::Pod for SetIpPortIp {}
unsafe impl aya::Pod for SetIpPortNet {}
unsafe impl aya::Pod for SetPort {}
unsafe impl aya::Pod for SetAddr {}
unsafe impl aya::Pod for IfaceInfo {}
/// Written by tests only (the data path keeps it).
unsafe impl aya::Pod for ClockCache {}

fn family(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        FAMILY_V4
    } else {
        FAMILY_V6
    }
}
fn family_addr(family: u8, w: [u32; 4]) -> IpAddr {
    if family == FAMILY_V6 {
        let mut o = [0u8; 16];
        for (i, word) in w.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(o))
    } else {
        IpAddr::V4(Ipv4Addr::from(w[0].to_ne_bytes()))
    }
}

impl SetIpPort {
    pub fn new(ip: IpAddr, port: u16, proto: u8) -> Self {
        SetIpPort { addr: addr_words(ip), port: port.to_be(), proto, family: family(ip) }
    }
    pub fn addr(&self) -> IpAddr {
        family_addr(self.family, self.addr)
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port)
    }
}
impl SetIpPortIp {
    /// `ip2` is of `ip`'s family (the sets never mix them).
    pub fn new(ip: IpAddr, port: u16, proto: u8, ip2: IpAddr) -> Self {
        SetIpPortIp { ip_port: SetIpPort::new(ip, port, proto), addr2: addr_words(ip2) }
    }
    pub fn addr2(&self) -> IpAddr {
        family_addr(self.ip_port.family, self.addr2)
    }
}
impl SetIpPortNet {
    pub fn new(ip: IpAddr, port: u16, proto: u8, net: IpAddr) -> Self {
        SetIpPortNet { ip_port: SetIpPort::new(ip, port, proto), net: addr_words(net) }
    }
    pub fn net(&self) -> IpAddr {
        family_addr(self.ip_port.family, self.net)
    }
}
impl SetPort {
    pub fn new(port: u16, proto: u8, v4: bool) -> Self {
        SetPort { port: port.to_be(), proto, family: if v4 { FAMILY_V4 } else { FAMILY_V6 } }
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port)
    }
}
impl SetAddr {
    pub fn new(ip: IpAddr) -> Self {
        SetAddr { addr: addr_words(ip), family: family(ip), _pad: [0; 3] }
    }
    pub fn ip(&self) -> IpAddr {
        family_addr(self.family, self.addr)
    }
}
/// A data-path IPv4 address (network-order u32 as it lies in memory).
pub fn v4_addr(w: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(w.to_ne_bytes()))
}

/// IP address to the wire-order words the data path compares.
pub fn addr_words(ip: IpAddr) -> [u32; 4] {
    match ip {
        IpAddr::V4(v4) => [u32::from_ne_bytes(v4.octets()), 0, 0, 0],
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let mut w = [0u32; 4];
            for (i, chunk) in o.chunks_exact(4).enumerate() {
                w[i] = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            }
            w
        }
    }
}

/// Whether `ip` reads back as itself from the wire form: not an IPv6 address whose last 96
/// bits are zero (a prefix's Subnet-Router anycast address, never a host's), which has an
/// IPv4 address's form. The agent programs no frontend or backend at such an address.
pub fn has_wire_form(ip: IpAddr) -> bool {
    words_addr(addr_words(ip)) == ip
}

/// Inverse of [`addr_words`]. IPv4 when words 1..3 are zero.
pub fn words_addr(w: [u32; 4]) -> IpAddr {
    if w[1] == 0 && w[2] == 0 && w[3] == 0 {
        IpAddr::V4(Ipv4Addr::from(w[0].to_ne_bytes()))
    } else {
        let mut o = [0u8; 16];
        for (i, word) in w.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(o))
    }
}

pub fn port_wire(port: u16) -> u16 {
    port.to_be()
}

pub fn port_host(wire: u16) -> u16 {
    u16::from_be(wire)
}

impl ServiceKey {
    pub fn new(addr: IpAddr, port: u16, proto: u8, scope: u8) -> Self {
        Self { addr: addr_words(addr), port: port_wire(port), proto, scope }
    }
    pub fn ip(&self) -> IpAddr {
        words_addr(self.addr)
    }
    pub fn port_host(&self) -> u16 {
        port_host(self.port)
    }
}

impl Backend {
    pub fn new(addr: IpAddr, port: u16, proto: u8) -> Self {
        Self { addr: addr_words(addr), port: port_wire(port), proto, flags: 0 }
    }
    pub fn ip(&self) -> IpAddr {
        words_addr(self.addr)
    }
    pub fn port_host(&self) -> u16 {
        port_host(self.port)
    }
}

impl SourceRangeKey {
    /// LPM key for `addr/prefix` of service `service_id`.
    pub fn lpm(service_id: u32, addr: IpAddr, prefix: u8) -> aya::maps::lpm_trie::Key<Self> {
        aya::maps::lpm_trie::Key::new(32 + u32::from(prefix), Self { service_id_be: service_id.to_be(), addr: addr_words(addr) })
    }
}

pub fn proto_name(proto: u8) -> &'static str {
    crate::Protocol::from_number(proto).map_or("?", crate::Protocol::name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_words_are_wire_order() {
        let w = addr_words("10.96.0.1".parse().unwrap());
        assert_eq!(w[0].to_ne_bytes(), [10, 96, 0, 1]);
        assert_eq!(words_addr(w), "10.96.0.1".parse::<IpAddr>().unwrap());
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(words_addr(addr_words(v6)), v6);
    }

    #[test]
    fn port_is_big_endian_in_key() {
        let k = ServiceKey::new("10.0.0.1".parse().unwrap(), 80, PROTO_TCP, SCOPE_INTERNAL);
        assert_eq!(k.port.to_ne_bytes(), [0, 80]);
        assert_eq!(k.port_host(), 80);
    }
}
