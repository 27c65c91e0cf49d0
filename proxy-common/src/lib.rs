//! The kernel/user boundary of kpr.
//!
//! Every type here is shared byte for byte between `proxy-ebpf` (kernel) and `proxy-agent`
//! (user space): `#[repr(C)]`, explicit padding, `bytemuck::Pod`, and a compile-time size assert.
//!
//! Byte order: addresses and ports are stored in **network byte order**, exactly as they appear
//! in the packet, so the data path never converts. User space converts in one place only: the
//! `From`/`new` helpers in [`user`] (feature `user`). Ids, counts, timeouts and flags are host
//! order.
//!
//! IPv6: every address is `[u32; 4]`. IPv4 uses word 0 and leaves words 1..3 zero.
#![no_std]

use bytemuck::{Pod, Zeroable};

/// Project name: the bpffs pin directory is `/sys/fs/bpf/<PROJECT>` by default.
pub const PROJECT: &str = "kpr";

/// kube-proxy's masquerade mark (masqueradeBit 14).
pub const MARK_MASQ: u32 = 0x4000;

/// Every map's name, listed once: `map_name!(ROLE)` is a string literal, so proxy-ebpf gives its
/// statics these names (`#[export_name = map_name!(ROLE)]`) and user space reads the same ones
/// through `map_names`. The `_V<n>` suffix changes whenever the key or value layout of that map
/// changes, so an agent never reuses a pinned map of an older layout.
#[macro_export]
#[rustfmt::skip]
macro_rules! map_name {
    (SERVICES) => { "KPR_SVC_V2" };
    (SLOTS) => { "KPR_SLOT_V2" };
    (MAGLEV) => { "KPR_MAGLEV_V1" };
    // V3: an array indexed by backend id (a hash map before), see Backend::is_present.
    (BACKENDS) => { "KPR_BE_V3" };
    // V3: the key carries the hook direction, one flow has up to four entries.
    (CONNTRACK) => { "KPR_CT_V3" };
    // V3: an array of 4-way buckets (CtBucket), mmapable (a preallocated hash before, and an
    // LRU before that).
    (CONNTRACK_NEW) => { "KPR_CT_NEW_V3" };
    (CONNTRACK6) => { "KPR_CT6_V1" };
    // V3: an array of 4-way buckets (CtBucket6), as IPv4's (a preallocated hash before, and
    // an LRU before that).
    (CONNTRACK6_NEW) => { "KPR_CT6_NEW_V3" };
    (IFACES) => { "KPR_IFACE_V1" };
    (AFFINITY) => { "KPR_AFF_V1" };
    (SOURCE_RANGES) => { "KPR_SRCRNG_V1" };
    // V2: one cursor per service for all CPUs (an array, not a per-CPU array).
    (RR_STATE) => { "KPR_RR_V2" };
    // V3: the IPv6 cluster CIDR.
    (CONFIG) => { "KPR_CFG_V3" };
    // V7: counter::SLOTS entries, room for counters to come (adding one no longer needs a new
    // map); V6's counts are carried over.
    (COUNTERS) => { "KPR_CNT_V7" };
    (SOCK_REV) => { "KPR_SOCK_REV_V1" };
    // V2: one counter per backend for all CPUs (an array, not a per-CPU array).
    (BACKEND_NEW) => { "KPR_BE_NEW_V2" };
    (BACKEND_ACTIVE) => { "KPR_BE_ACTIVE_V1" };
    (BACKEND_FAIL) => { "KPR_BE_FAIL_V1" };
    (FLOW_CACHE_GEN) => { "KPR_FC_GEN_V1" };
    // V2: the address keys carry the family and IPv6 addresses.
    (SET_IP_PORT) => { "KPR_SET_IPP_V2" };
    (SET_IP_PORT_IP) => { "KPR_SET_IPPI_V2" };
    (SET_IP_PORT_NET) => { "KPR_SET_IPPN_V2" };
    (SET_PORT) => { "KPR_SET_PORT_V2" };
    (SET_IP) => { "KPR_SET_IP_V2" };
    // Per-CPU scratch space, never pinned.
    (CT_SCRATCH) => { "KPR_CT_SCRATCH" };
    (CT_SCRATCH6) => { "KPR_CT_SCRATCH6" };
    (FLOW_CACHE) => { "KPR_FLOW_CACHE" };
    (CLOCK) => { "KPR_CLOCK" };
    (CT_FORGET_KEYS) => { "KPR_CT_FORGET" };
    (CT_FORGET_KEYS6) => { "KPR_CT_FORGET6" };
}

/// The map names for user space (see `map_name!`).
pub mod map_names {
    pub const SERVICES: &str = map_name!(SERVICES);
    pub const SLOTS: &str = map_name!(SLOTS);
    pub const MAGLEV: &str = map_name!(MAGLEV);
    pub const BACKENDS: &str = map_name!(BACKENDS);
    /// Assured flows.
    pub const CONNTRACK: &str = map_name!(CONNTRACK);
    /// Flows not yet assured, in buckets (CtBucket): a flood of them cannot evict assured ones.
    pub const CONNTRACK_NEW: &str = map_name!(CONNTRACK_NEW);
    /// IPv6 flows through the packet path (NodePorts, externalIPs, LB IPs; see CtKey6).
    pub const CONNTRACK6: &str = map_name!(CONNTRACK6);
    /// IPv6 TCP flows whose handshake has not completed yet (as CONNTRACK_NEW for IPv4).
    pub const CONNTRACK6_NEW: &str = map_name!(CONNTRACK6_NEW);
    /// Interface index -> what the data path needs to know of it (IfaceInfo).
    pub const IFACES: &str = map_name!(IFACES);
    pub const AFFINITY: &str = map_name!(AFFINITY);
    pub const SOURCE_RANGES: &str = map_name!(SOURCE_RANGES);
    pub const RR_STATE: &str = map_name!(RR_STATE);
    pub const CONFIG: &str = map_name!(CONFIG);
    pub const COUNTERS: &str = map_name!(COUNTERS);
    pub const SOCK_REV: &str = map_name!(SOCK_REV);
    pub const BACKEND_NEW: &str = map_name!(BACKEND_NEW);
    pub const BACKEND_ACTIVE: &str = map_name!(BACKEND_ACTIVE);
    pub const BACKEND_FAIL: &str = map_name!(BACKEND_FAIL);
    /// The flow cache's generation (see `FlowCacheEntry`).
    pub const FLOW_CACHE_GEN: &str = map_name!(FLOW_CACHE_GEN);
    /// IPVS mode's ipset mirrors (see `sets`).
    pub const SET_IP_PORT: &str = map_name!(SET_IP_PORT);
    pub const SET_IP_PORT_IP: &str = map_name!(SET_IP_PORT_IP);
    pub const SET_IP_PORT_NET: &str = map_name!(SET_IP_PORT_NET);
    pub const SET_PORT: &str = map_name!(SET_PORT);
    pub const SET_IP: &str = map_name!(SET_IP);
    pub const SETS: [&str; 5] = [SET_IP_PORT, SET_IP_PORT_IP, SET_IP_PORT_NET, SET_PORT, SET_IP];
    /// Pins of earlier layouts: removed at load, so an upgrade does not keep them (and their
    /// memory) alive next to their successors.
    pub const RETIRED: [&str; 25] = [
        "KPR_SVC_V1",
        "KPR_SLOT_V1",
        "KPR_BE_V1",
        "KPR_CNT_V1",
        "KPR_CNT_V2",
        "KPR_CNT_V3",
        "KPR_CNT_V4",
        "KPR_CNT_V5",
        "KPR_CT_V1",
        "KPR_CT_V2",
        "KPR_CFG_V1",
        "KPR_CFG_V2",
        "KPR_SET_IPP_V1",
        "KPR_SET_IPPI_V1",
        "KPR_SET_IPPN_V1",
        "KPR_SET_PORT_V1",
        "KPR_SET_IP_V1",
        "KPR_RR_V1",
        "KPR_BE_NEW_V1",
        BACKENDS_V2,
        CONNTRACK_NEW_V1,
        COUNTERS_V6,
        CONNTRACK6_NEW_V1,
        CONNTRACK_NEW_V2,
        CONNTRACK6_NEW_V2,
    ];
    /// The backend map before it was an array (a hash map of the same entries): at load its
    /// entries are carried into KPR_BE_V3 with their ids, then its pin is removed.
    pub const BACKENDS_V2: &str = "KPR_BE_V2";
    /// The embryonic table when it was an LRU: at load its entries are carried into
    /// KPR_CT_NEW_V3's buckets, then its pin is removed.
    pub const CONNTRACK_NEW_V1: &str = "KPR_CT_NEW_V1";
    /// The embryonic table when it was a preallocated hash: at load its entries are carried
    /// into KPR_CT_NEW_V3's buckets, then its pin is removed.
    pub const CONNTRACK_NEW_V2: &str = "KPR_CT_NEW_V2";
    /// IPv6's embryonic table when it was an LRU: at load its entries are carried into
    /// KPR_CT6_NEW_V3's buckets, then its pin is removed.
    pub const CONNTRACK6_NEW_V1: &str = "KPR_CT6_NEW_V1";
    /// IPv6's embryonic table when it was a preallocated hash: at load its entries are carried
    /// into KPR_CT6_NEW_V3's buckets, then its pin is removed.
    pub const CONNTRACK6_NEW_V2: &str = "KPR_CT6_NEW_V2";
    /// The counters when the map held exactly the counters of its day: at load its counts are
    /// added into KPR_CNT_V7's, then its pin is removed.
    pub const COUNTERS_V6: &str = "KPR_CNT_V6";
    /// The retired maps whose entries a load carries over before it removes their pins.
    pub const CARRIED: [&str; 6] = [BACKENDS_V2, CONNTRACK_NEW_V1, COUNTERS_V6, CONNTRACK6_NEW_V1, CONNTRACK_NEW_V2, CONNTRACK6_NEW_V2];
    /// Every map the fast path pins.
    pub const ALL: [&str; 19] = [
        SERVICES,
        SLOTS,
        MAGLEV,
        BACKENDS,
        CONNTRACK,
        CONNTRACK_NEW,
        CONNTRACK6,
        CONNTRACK6_NEW,
        IFACES,
        AFFINITY,
        SOURCE_RANGES,
        RR_STATE,
        CONFIG,
        COUNTERS,
        SOCK_REV,
        BACKEND_NEW,
        BACKEND_ACTIVE,
        BACKEND_FAIL,
        FLOW_CACHE_GEN,
    ];
}

/// Every program's name, listed once (see `map_name!`): proxy-ebpf's `program!` exports each
/// program under it, and the agent finds it by it.
#[macro_export]
#[rustfmt::skip]
macro_rules! prog_name {
    (TC_INGRESS) => { "kpr_tc_ingress" };
    (TC_EGRESS) => { "kpr_tc_egress" };
    (TC_INGRESS6) => { "kpr_tc_ingress6" };
    (XDP_INGRESS) => { "kpr_xdp_ingress" };
    (TC_PASS) => { "kpr_tc_pass" };
    (XDP_PASS) => { "kpr_xdp_pass" };
    (CONNECT4) => { "kpr_connect4" };
    (SENDMSG4) => { "kpr_sendmsg4" };
    (RECVMSG4) => { "kpr_recvmsg4" };
    (GETPEERNAME4) => { "kpr_getpeername4" };
    (CONNECT6) => { "kpr_connect6" };
    (SENDMSG6) => { "kpr_sendmsg6" };
    (RECVMSG6) => { "kpr_recvmsg6" };
    (GETPEERNAME6) => { "kpr_getpeername6" };
    (CONNECT4_IPVS) => { "kpr_connect4_ipvs" };
    (SENDMSG4_IPVS) => { "kpr_sendmsg4_ipvs" };
    (CONNECT6_IPVS) => { "kpr_connect6_ipvs" };
    (SENDMSG6_IPVS) => { "kpr_sendmsg6_ipvs" };
    (TC_IPSET) => { "kpr_tc_ipset" };
    (LOOPBACK) => { "kpr_loopback" };
}

/// The program names for user space (see `prog_name!`).
pub mod prog_names {
    pub const TC_INGRESS: &str = prog_name!(TC_INGRESS);
    /// TC egress on the same interfaces: masquerade and the reply's reverse DNAT happen after
    /// the node's netfilter, as kube-proxy's POSTROUTING does.
    pub const TC_EGRESS: &str = prog_name!(TC_EGRESS);
    pub const XDP_INGRESS: &str = prog_name!(XDP_INGRESS);
    /// TC ingress on the uplinks, IPv6 only: traffic from outside to the node's IPv6 NodePorts,
    /// externalIPs and LB IPs (XDP passes IPv6 on; the masquerade mark needs an skb).
    pub const TC_INGRESS6: &str = prog_name!(TC_INGRESS6);
    pub const TC_PASS: &str = prog_name!(TC_PASS);
    pub const XDP_PASS: &str = prog_name!(XDP_PASS);
    pub const CONNECT4: &str = prog_name!(CONNECT4);
    pub const SENDMSG4: &str = prog_name!(SENDMSG4);
    pub const RECVMSG4: &str = prog_name!(RECVMSG4);
    pub const GETPEERNAME4: &str = prog_name!(GETPEERNAME4);
    /// IPv6 sockets: IPv6 Services (every socket of the node, pods' too: the TC fast path on
    /// pod interfaces is IPv4 only) and IPv4 Services through IPv4-mapped addresses (the node's
    /// sockets).
    pub const CONNECT6: &str = prog_name!(CONNECT6);
    pub const SENDMSG6: &str = prog_name!(SENDMSG6);
    pub const RECVMSG6: &str = prog_name!(RECVMSG6);
    pub const GETPEERNAME6: &str = prog_name!(GETPEERNAME6);
    /// The connect-time programs, in attach order.
    pub const SOCK: [&str; 8] = [CONNECT4, SENDMSG4, RECVMSG4, GETPEERNAME4, CONNECT6, SENDMSG6, RECVMSG6, GETPEERNAME6];
    /// IPVS mode: the node's own connections to a LoadBalancer IP whose source ranges exclude
    /// the node (kube-proxy's KUBE-IPVS-OUT-FILTER), refused at connect time.
    pub const CONNECT4_IPVS: &str = prog_name!(CONNECT4_IPVS);
    pub const SENDMSG4_IPVS: &str = prog_name!(SENDMSG4_IPVS);
    pub const CONNECT6_IPVS: &str = prog_name!(CONNECT6_IPVS);
    pub const SENDMSG6_IPVS: &str = prog_name!(SENDMSG6_IPVS);
    pub const SOCK_IPVS: [&str; 4] = [CONNECT4_IPVS, SENDMSG4_IPVS, CONNECT6_IPVS, SENDMSG6_IPVS];
    /// IPVS mode: kube-proxy's set matching at TC ingress (masquerade mark, firewall, filter).
    pub const TC_IPSET: &str = prog_name!(TC_IPSET);
    /// IPVS mode: KUBE-LOOP-BACK, an xt_bpf match in the fixed POSTROUTING rules.
    pub const LOOPBACK: &str = prog_name!(LOOPBACK);
}

/// kube-proxy's IPVS-mode ipsets, mirrored as bits in the values of the KPR_SET_* maps: one
/// lookup answers every set of a key type.
pub mod sets {
    /// KPR_SET_IPP_V2 (hash:ip,port: dst,dst).
    pub const CLUSTER_IP: u32 = 1 << 0;
    pub const EXTERNAL_IP: u32 = 1 << 1;
    pub const EXTERNAL_IP_LOCAL: u32 = 1 << 2;
    pub const LOAD_BALANCER: u32 = 1 << 3;
    pub const LOAD_BALANCER_LOCAL: u32 = 1 << 4;
    pub const LOAD_BALANCER_FW: u32 = 1 << 5;
    /// Not a kube-proxy set: a LoadBalancer IP whose source ranges contain no node address,
    /// which the node itself may not reach (kube-proxy's KUBE-IPVS-OUT-FILTER rules).
    pub const LOAD_BALANCER_NODE_DENY: u32 = 1 << 6;
    /// KPR_SET_IPPI_V2 (hash:ip,port,ip: dst,dst,src).
    pub const LOOP_BACK: u32 = 1 << 0;
    pub const LOAD_BALANCER_SOURCE_IP: u32 = 1 << 1;
    /// KPR_SET_IPPN_V2 (hash:ip,port,net: dst,dst,src).
    pub const LOAD_BALANCER_SOURCE_CIDR: u32 = 1 << 0;
    /// KPR_SET_PORT_V2 (bitmap:port, the protocol and family in the key).
    pub const NODE_PORT: u32 = 1 << 0;
    pub const NODE_PORT_LOCAL: u32 = 1 << 1;
    pub const HEALTH_CHECK_NODE_PORT: u32 = 1 << 2;
    /// KPR_SET_IP_V2 (hash:ip): addresses bound on kube-ipvs0 (KUBE-IPVS-IPS), and this
    /// node's own addresses (iptables' `-m addrtype --dst-type LOCAL` for NodePorts).
    pub const IPVS_IPS: u32 = 1 << 0;
    pub const NODE_IPS: u32 = 1 << 1;
}

/// Address family of a set key (`SetIpPort::family`, `SetAddr::family`): the same bits of an
/// IPv4 and an IPv6 address never meet.
pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// Key of KPR_SET_IPP_V2; address (IPv4 in word 0, the rest zero) and port in network order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SetIpPort {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub family: u8,
}
const _: () = assert!(core::mem::size_of::<SetIpPort>() == 20);

/// Key of KPR_SET_IPPI_V2: (address, port, protocol, second address of the same family).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SetIpPortIp {
    pub ip_port: SetIpPort,
    pub addr2: [u32; 4],
}
const _: () = assert!(core::mem::size_of::<SetIpPortIp>() == 36);

/// Data of the KPR_SET_IPPN_V2 LPM key: the prefix length is SET_IPPN_FIXED_BITS (ip, port,
/// proto, family: always whole) plus the source CIDR's length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SetIpPortNet {
    pub ip_port: SetIpPort,
    pub net: [u32; 4],
}
const _: () = assert!(core::mem::size_of::<SetIpPortNet>() == 36);
pub const SET_IPPN_FIXED_BITS: u32 = 8 * core::mem::size_of::<SetIpPort>() as u32;

/// Key of KPR_SET_IP_V2.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SetAddr {
    pub addr: [u32; 4],
    pub family: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<SetAddr>() == 20);

/// Key of KPR_SET_PORT_V2: each family has its own port sets, as kube-proxy's proxier per family.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SetPort {
    pub port: u16,
    pub proto: u8,
    pub family: u8,
}
const _: () = assert!(core::mem::size_of::<SetPort>() == 4);

/// Default capacities (the agent may override them at load time).
pub mod limits {
    pub const MAX_SERVICES: u32 = 131_072;
    pub const MAX_FRONTENDS: u32 = 262_144;
    pub const MAX_BACKENDS: u32 = 262_144;
    pub const MAX_SLOTS: u32 = 1_048_576;
    pub const MAX_CONNTRACK: u32 = 524_288;
    /// Flows not yet assured: TCP until its handshake completes, UDP until its client sends
    /// after an answer (see KPR_CT_NEW_V3): 32,768 buckets of four.
    pub const MAX_CONNTRACK_NEW: u32 = 131_072;
    /// IPv6 flows through the packet path (KPR_CT6_V1): two entries a flow.
    pub const MAX_CONNTRACK6: u32 = 65_536;
    /// IPv6 flows not yet assured (KPR_CT6_NEW_V3): two entries a flow, 8,192 buckets of four.
    pub const MAX_CONNTRACK6_NEW: u32 = 32_768;
    /// Interfaces with their own masquerade address (KPR_IFACE_V1).
    pub const MAX_IFACES: u32 = 4096;
    pub const MAX_AFFINITY: u32 = 131_072;
    pub const MAX_SOURCE_RANGES: u32 = 16_384;
    /// Rows of the Maglev table (services using the maglev scheduler at once).
    pub const MAGLEV_ROWS: u32 = 256;
    /// Maglev lookup table size per service: a prime, much larger than any backend count.
    pub const MAGLEV_TABLE_SIZE: u32 = 1021;
    /// Backends per service (slots) the data path accepts.
    pub const MAX_BACKENDS_PER_SERVICE: u32 = 65_535;
    /// Flow cache slots per CPU (a power of two): 96 KiB a CPU.
    pub const FLOW_CACHE_SLOTS: u32 = 2048;
    const _: () = assert!(FLOW_CACHE_SLOTS.is_power_of_two());
    /// A flow cache entry is re-checked against conntrack (and refreshes its timestamp there)
    /// at least every this many jiffies (25: 25 ms at HZ=1000, 100 ms at 250, 250 ms at 100),
    /// so conntrack's idle timeouts and garbage collection stay exact to that much. Jiffies,
    /// not ns: bpf_jiffies64 is inlined, the clock helper is a call.
    pub const FLOW_CACHE_REFRESH_JIFFIES: u64 = 25;
}

/// The transport protocols of Services: the one place their numbers and spellings live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Protocol {
    Tcp = 6,
    Udp = 17,
    Sctp = 132,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// The IP protocol number.
    pub const fn number(self) -> u8 {
        self as u8
    }
    pub const fn from_number(n: u8) -> Option<Self> {
        match n {
            PROTO_TCP => Some(Protocol::Tcp),
            PROTO_UDP => Some(Protocol::Udp),
            PROTO_SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }
    /// Kubernetes' spelling (a ServicePort's protocol), also ipvsadm's and kube-proxy's set
    /// suffixes: "TCP".
    pub const fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
    /// ipset's and conntrack's spelling: "tcp".
    pub const fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
    /// From Kubernetes' spelling (exact, as the API validates it).
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// The numbers as constants, for `match` in the data path.
pub const PROTO_TCP: u8 = Protocol::Tcp as u8;
pub const PROTO_UDP: u8 = Protocol::Udp as u8;
pub const PROTO_SCTP: u8 = Protocol::Sctp as u8;

/// Kubernetes' default NodePort range (--service-node-port-range).
pub const NODE_PORT_MIN: u16 = 30_000;
pub const NODE_PORT_MAX: u16 = 32_767;

/// IPVS mode's scheduler where neither the configuration nor the Service names one (kube-proxy's).
pub const IPVS_DEFAULT_SCHEDULER: &str = "rr";

/// The schedulers of Linux IPVS (ip_vs_<name>.ko), as kube-proxy's ipvs.scheduler names them.
pub const IPVS_SCHEDULERS: [&str; 13] = ["rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh", "fo", "ovf"];

/// Which hook looks the frontend up. The same VIP can have different backend sets for traffic
/// from inside the node (pods, node processes: TC) and from outside (the uplink: XDP), which is
/// how internal/externalTrafficPolicy differ. Every port has an internal entry; where the two
/// scopes differ it is marked SVC_F_SPLIT and an external entry exists beside it. A frontend
/// the same for both (every ClusterIP, and the rest under externalTrafficPolicy Cluster) is
/// only its internal entry: half the entries and slots, and the lookup of a packet to no
/// service stays one hash probe.
pub const SCOPE_INTERNAL: u8 = 0;
pub const SCOPE_EXTERNAL: u8 = 1;

/// Schedulers (ServiceValue::scheduler).
pub const SCHED_RANDOM: u8 = 0;
pub const SCHED_ROUND_ROBIN: u8 = 1;
pub const SCHED_MAGLEV: u8 = 2;
/// The backend with the fewest active flows (KPR_BE_ACTIVE_V1): an exact minimum over up to
/// LEAST_CONN_EXACT_MAX backends, the better of two random ones above.
pub const SCHED_LEAST_CONN: u8 = 3;
/// Power of two choices: the less loaded of two random backends, whatever their number.
pub const SCHED_P2C: u8 = 4;
/// Up to this many backends, least-connection compares them all (one lookup pair each).
pub const LEAST_CONN_EXACT_MAX: u32 = 8;

/// ServiceValue::flags.
/// Masquerade every packet of this frontend (NodePort/ExternalIP/LB with externalTrafficPolicy Cluster).
pub const SVC_F_MASQ: u8 = 1 << 0;
/// Keep the client address (externalTrafficPolicy Local): never masquerade for "off-cluster source".
pub const SVC_F_PRESERVE_SOURCE: u8 = 1 << 1;
/// loadBalancerSourceRanges apply: the source must match KPR_SRCRNG_V1 for this service id.
pub const SVC_F_SOURCE_RANGES: u8 = 1 << 2;
/// backend_count is 0 because the traffic policy is Local and no endpoint is on this node,
/// while the service has endpoints elsewhere: drop (kube-proxy's "has no local endpoints"),
/// not reject.
pub const SVC_F_NO_LOCAL_ENDPOINT: u8 = 1 << 3;
/// An internal entry whose port has an external entry of its own (the traffic policies make
/// the two scopes differ): the external lookup takes that one. Without it the internal entry
/// answers both scopes.
pub const SVC_F_SPLIT: u8 = 1 << 4;

/// BPF_F_NO_PREALLOC (a map's flags): the control plane's hash maps (services, slots, backends,
/// IPVS-mode sets) cost memory in proportion to their entries, not their capacity.
pub const BPF_F_NO_PREALLOC: u32 = 1;
/// BPF map flag: user space may mmap the array (KPR_CT_NEW_V3, whose buckets the agent's
/// collector locks as the data path does).
pub const BPF_F_MMAPABLE: u32 = 1 << 10;

/// DatapathConfig::flags.
pub const CFG_F_MASQUERADE_ALL: u32 = 1 << 0;
/// Every established packet probes conntrack (the benchmark's baseline; a troubleshooting aid).
pub const CFG_F_NO_FLOW_CACHE: u32 = 1 << 1;
/// detectLocalMode BridgeInterface / InterfaceNamePrefix: a client is local (a pod of this
/// node, not masqueraded) when its packet arrives on an interface flagged IFACE_F_LOCAL, not by
/// its address (ClusterCIDR / NodeCIDR use `cluster_cidr`).
pub const CFG_F_LOCAL_BY_IFACE: u32 = 1 << 2;
/// A switch to IPVS mode is draining the fast path: its flows are still served, no new one
/// starts. A packet no flow knows goes on to the next TC program (IPVS mode's set matching).
pub const CFG_F_NO_NEW_FLOWS: u32 = 1 << 3;
/// A switch from IPVS mode: a TCP packet without SYN that no flow knows is part of a
/// connection IPVS still serves, so it goes to the stack, not to a new flow.
pub const CFG_F_HANDOVER: u32 = 1 << 4;

/// IfaceInfo::flags: traffic arriving on this interface comes from local pods.
pub const IFACE_F_LOCAL: u32 = 1 << 0;

/// Value of KPR_IFACE_V1 (key: interface index).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct IfaceInfo {
    /// The address masquerade gives flows leaving through this interface (as MASQUERADE picks
    /// the outgoing interface's); 0: the node's SNAT address. Network order.
    pub snat_addr: u32,
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<IfaceInfo>() == 8);

/// CtKey::dir: the hook a conntrack entry is for. A packet crosses the node's ingress hook of
/// the interface it arrives on, then netfilter, then the egress hook of the interface it leaves
/// by; kpr translates at both, so netfilter sees client <-> backend in both directions (as with
/// kube-proxy, whose DNAT runs in PREROUTING and whose masquerade in POSTROUTING).
pub const CT_DIR_INGRESS: u8 = 0;
pub const CT_DIR_EGRESS: u8 = 1;

/// CtValue::flags.
/// The flow is masqueraded (its forward, SNAT and reverse-SNAT entries carry it).
pub const CT_F_SNAT: u16 = 1 << 0;
/// FIN or RST seen: idle after a short timeout; a new SYN on the tuple is a new flow.
pub const CT_F_CLOSING: u16 = 1 << 1;
/// The entry translates the reply direction (reverse DNAT or reverse SNAT).
pub const CT_F_REPLY: u16 = 1 << 2;
/// SNAT entry whose address and port are chosen at egress, where the interface is known.
pub const CT_F_SNAT_PENDING: u16 = 1 << 3;
/// Forward entry of a flow whose reply was seen (a TCP flow is assured at its next packet);
/// also the reverse-DNAT entry of a TCP flow in its handshake and of a UDP flow once its
/// backend replied (an ICMP error after that is no refusal).
pub const CT_F_SEEN_REPLY: u16 = 1 << 4;
/// Forward entry of a flow past its Service's maximum connection age (set by the agent's
/// collector): the next TCP packet is answered with a reset, a UDP flow starts over.
pub const CT_F_MAX_AGE: u16 = 1 << 5;
/// Forward entry of a new TCP flow its backend refused (a reset, or an ICMP destination
/// unreachable, answering the SYN): counted once as a refusal by the data path, so the
/// collector does not count it again as an unanswered SYN. On a UDP flow's reverse-DNAT entry:
/// an ICMP destination unreachable answered it before any reply (counted once).
pub const CT_F_REFUSED: u16 = 1 << 6;

/// Source ports for masquerade and for moved ports when the agent sets none
/// (DatapathConfig::snat_port_min/max): below the NodePort range and the node's default
/// ephemeral range (32768-60999), which its own connections use.
pub const SNAT_PORT_MIN: u16 = 1024;
pub const SNAT_PORT_MAX: u16 = 29_999;

/// Frontend key: (address, port, protocol, scope). Lookup is one hash probe (two for external
/// traffic to a port whose internal entry is SVC_F_SPLIT).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct ServiceKey {
    /// Network order.
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
}
const _: () = assert!(core::mem::size_of::<ServiceKey>() == 20);

/// Frontend value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ServiceValue {
    /// Index into the slot, round-robin, affinity and source-range maps. Never 0.
    pub service_id: u32,
    /// Slots 1..=backend_count exist in KPR_SLOT_V2. 0 means "no endpoints": reject.
    pub backend_count: u32,
    /// sessionAffinity ClientIP timeout; 0 means no affinity.
    pub affinity_timeout_s: u32,
    /// Row in KPR_MAGLEV_V1 when scheduler is SCHED_MAGLEV.
    pub maglev_row: u32,
    pub scheduler: u8,
    pub flags: u8,
    /// Changes whenever `service_id` is given to another frontend: sessionAffinity entries of
    /// an earlier owner of the id (AffinityValue::generation) are void.
    pub generation: u16,
}
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 20);

/// Key of KPR_SLOT_V2: (service id, slot 1..=backend_count).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SlotKey {
    pub service_id: u32,
    pub slot: u32,
}
const _: () = assert!(core::mem::size_of::<SlotKey>() == 8);

/// A backend (endpoint address and target port), keyed by a stable id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct Backend {
    /// Network order.
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<Backend>() == 20);

impl Backend {
    /// KPR_BE_V3 is an array: an id with no backend holds zeros. Every backend kpr programs has
    /// a protocol (TCP, UDP, SCTP), so protocol 0 is "no backend".
    #[inline(always)]
    pub const fn is_present(&self) -> bool {
        self.proto != 0
    }
}

/// Conntrack key: an IPv4 packet's 5-tuple as it is seen at one hook (CtKey::dir). A flow from
/// client C:c to frontend V:v, balanced to backend B:b with source port p (C's own unless that
/// would clash), has up to four entries, each the rewrite for one hook and direction:
///
/// | entry | key | rewrite to |
/// |---|---|---|
/// | forward (DNAT) | ingress C:c -> V:v | C:p -> B:b |
/// | reverse DNAT (reply) | egress B:b -> C:p | V:v -> C:c |
/// | SNAT (masquerade only) | egress C:p -> B:b | S:s -> B:b |
/// | reverse SNAT (reply, masquerade only) | ingress B:b -> S:s | B:b -> C:p |
///
/// S:s is chosen at egress (CT_F_SNAT_PENDING until then). Every entry can be derived from the
/// forward entry (and the SNAT entry's address), see [`CtKey::reversed_of`] and
/// [`CtKey::straight_of`]; the data path picks ports so that no two flows share a key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct CtKey {
    /// Network order.
    pub saddr: u32,
    /// Network order.
    pub daddr: u32,
    /// Network order.
    pub sport: u16,
    /// Network order.
    pub dport: u16,
    pub proto: u8,
    /// CT_DIR_INGRESS or CT_DIR_EGRESS.
    pub dir: u8,
    // A scalar, not a byte array: zeroing an array costs the data path a memset call.
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<CtKey>() == 16);

/// What an entry does, from its direction and flags (see [`CtKey`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CtRole {
    Forward,
    ReverseDnat,
    Snat,
    ReverseSnat,
}

impl CtKey {
    /// The key as two words (the flow cache compares and hashes these).
    #[inline(always)]
    pub fn words(&self) -> [u64; 2] {
        bytemuck::cast(*self)
    }

    /// The flow cache slot of this key (direct-mapped, FLOW_CACHE_SLOTS per CPU): the top bits
    /// of a Fibonacci multiply of the key, which every bit of the key reaches. (The product's
    /// middle bits, taken before, never saw the key's high bits, where a port in network order
    /// changes: one client's 2,000 connections to a service took 512 slots, four to a slot;
    /// now about 1,210, as a random spread would.) One multiply, as before: every established
    /// packet computes it.
    #[inline(always)]
    pub fn flow_cache_slot(&self) -> u32 {
        let k = self.words();
        let h = (k[0] ^ k[1].rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (h >> (64 - limits::FLOW_CACHE_SLOTS.trailing_zeros())) as u32
    }

    /// The key's bucket of the embryonic table (see CtBucket), of `mask + 1` buckets: the low
    /// bits of MurmurHash3's 64-bit finalizer, which every bit of the key reaches. (The flow
    /// cache's single multiply needs a constant count of slots; this table's is the loader's.)
    #[inline(always)]
    pub fn bucket(&self, mask: u32) -> u32 {
        let k = self.words();
        fmix64(k[0] ^ k[1].rotate_left(29)) as u32 & mask
    }

    /// An empty way of a CtBucket holds the zero key (no flow's protocol is 0).
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.words() == [0, 0]
    }

    /// The key of the packet a rewrite produces, travelling the other way: the rewrite's
    /// destination becomes the source (a forward entry's value gives its reverse-DNAT key, a
    /// reverse-DNAT entry's value its forward key, an SNAT entry's value its reverse-SNAT key).
    #[inline(always)]
    pub fn reversed_of(v: &CtValue, proto: u8, dir: u8) -> Self {
        Self { saddr: v.new_daddr, daddr: v.new_saddr, sport: v.new_dport, dport: v.new_sport, proto, dir, _pad: 0 }
    }
    /// The key of the packet a rewrite produces, at another hook (a forward entry's value gives
    /// its SNAT key, a reverse-SNAT entry's value its reverse-DNAT key).
    #[inline(always)]
    pub fn straight_of(v: &CtValue, proto: u8, dir: u8) -> Self {
        Self { saddr: v.new_saddr, daddr: v.new_daddr, sport: v.new_sport, dport: v.new_dport, proto, dir, _pad: 0 }
    }
    /// This tuple travelling the other way (an SNAT key gives its reverse-DNAT key).
    #[inline(always)]
    pub fn reversed(&self, dir: u8) -> Self {
        Self { saddr: self.daddr, daddr: self.saddr, sport: self.dport, dport: self.sport, proto: self.proto, dir, _pad: 0 }
    }
    #[inline(always)]
    pub fn role(&self, v: &CtValue) -> CtRole {
        match (self.dir == CT_DIR_EGRESS, v.flags & CT_F_REPLY != 0) {
            (false, false) => CtRole::Forward,
            (true, true) => CtRole::ReverseDnat,
            (true, false) => CtRole::Snat,
            (false, true) => CtRole::ReverseSnat,
        }
    }
}

/// Conntrack value: the 4-tuple the packet is rewritten to (see [`CtKey`]), the flow's backend
/// and service, and when the entry last saw a packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtValue {
    /// CLOCK_MONOTONIC ns of the last packet: the coarse clock's, but the fine one's at an
    /// IPv4 flow's creation (see proxy-ebpf's embryonic.rs).
    pub last_seen_ns: u64,
    /// Network order.
    pub new_saddr: u32,
    /// Network order.
    pub new_daddr: u32,
    /// Network order.
    pub new_sport: u16,
    /// Network order.
    pub new_dport: u16,
    pub backend_id: u32,
    pub service_id: u32,
    pub flags: u16,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<CtValue>() == 32);

impl CtValue {
    pub fn is_reply(&self) -> bool {
        self.flags & CT_F_REPLY != 0
    }
}

/// Conntrack key of an IPv6 flow through the packet path (KPR_CT6_V1): NodePorts on the node's
/// IPv6 addresses, externalIPs and LB IPs, from outside the node (IPv6 clusterIPs are balanced
/// at connect time and have no flow). The DNAT and the reply's reverse DNAT are kpr's; the
/// masquerade is netfilter's (kpr's ip6tables rule, by the 0x4000 mark the forward entry sets),
/// so a flow has two entries:
///
/// | entry | key | rewrite to |
/// |---|---|---|
/// | forward (DNAT) | ingress C:c -> V:v | C:p -> B:b (and the mark when CT_F_SNAT) |
/// | reverse DNAT (reply) | egress B:b -> C:p | V:v -> C:c |
///
/// The reply reaches egress after netfilter undid its masquerade, as B:b -> C:p.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct CtKey6 {
    /// Network order.
    pub saddr: [u32; 4],
    /// Network order.
    pub daddr: [u32; 4],
    /// Network order.
    pub sport: u16,
    /// Network order.
    pub dport: u16,
    pub proto: u8,
    /// CT_DIR_INGRESS or CT_DIR_EGRESS.
    pub dir: u8,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<CtKey6>() == 40);

/// Conntrack value of an IPv6 flow (see [`CtKey6`]); the flags are CtValue's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtValue6 {
    /// CLOCK_MONOTONIC (coarse) ns of the last packet.
    pub last_seen_ns: u64,
    /// Network order.
    pub new_saddr: [u32; 4],
    /// Network order.
    pub new_daddr: [u32; 4],
    /// Network order.
    pub new_sport: u16,
    /// Network order.
    pub new_dport: u16,
    pub backend_id: u32,
    pub service_id: u32,
    pub flags: u16,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<CtValue6>() == 56);

/// MurmurHash3's 64-bit finalizer: every input bit reaches every output bit.
#[inline(always)]
fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

impl CtKey6 {
    /// The key as five words.
    #[inline(always)]
    pub fn words(&self) -> [u64; 5] {
        bytemuck::cast(*self)
    }

    /// The key's bucket of IPv6's embryonic table (CtBucket6), as `CtKey::bucket`.
    #[inline(always)]
    pub fn bucket(&self, mask: u32) -> u32 {
        let w = self.words();
        fmix64(w[0] ^ w[1].rotate_left(13) ^ w[2].rotate_left(29) ^ w[3].rotate_left(43) ^ w[4].rotate_left(53)) as u32 & mask
    }

    /// An empty way of a CtBucket6 holds the zero key.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.words() == [0; 5]
    }

    /// The key of the packet a rewrite produces, travelling the other way (a forward entry's
    /// value gives its reverse-DNAT key).
    #[inline(always)]
    pub fn reversed_of(v: &CtValue6, proto: u8, dir: u8) -> Self {
        Self { saddr: v.new_daddr, daddr: v.new_saddr, sport: v.new_dport, dport: v.new_sport, proto, dir, _pad: 0 }
    }
    /// Whether this entry (`v` its value) is its flow's forward (DNAT) one, at ingress; the
    /// other is the reply's (see CtKey::role for IPv4's four).
    #[inline(always)]
    pub fn is_forward(&self, v: &CtValue6) -> bool {
        self.dir == CT_DIR_INGRESS && v.flags & CT_F_REPLY == 0
    }
}

/// CtScratch's pending evictions: one per embryonic insert a packet makes (at most three),
/// rounded up to a power of two, which the data path masks an index with.
pub const CT_PENDING_SLOTS: usize = 4;

/// The ways of a CtBucket (and a CtBucket6).
pub const CT_BUCKET_WAYS: usize = 4;

/// A bucket of the IPv4 embryonic table (KPR_CT_NEW_V3), an array the data path probes without
/// a helper call: up to four entries whose keys hash to it (`CtKey::bucket`). The keys fill
/// the first cache line, so a probe reads one line; the lock the next, which the CPU fetches
/// with it; the values the two after. A writer (a CPU inserting or deleting, the agent through
/// its mapping of the array) holds `lock`; readers do not take it. A full bucket's insert
/// evicts the flow of its oldest entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtBucket {
    /// An empty way's key is zero (`CtKey::is_empty`).
    pub keys: [CtKey; CT_BUCKET_WAYS],
    /// 0: free; 1: held. 64 bits: the data path takes it with BPF's 64-bit compare-and-exchange.
    pub lock: u64,
    pub _pad: [u64; 7],
    pub values: [CtValue; CT_BUCKET_WAYS],
}
const _: () = assert!(core::mem::size_of::<CtBucket>() == 256);
const _: () = assert!(core::mem::offset_of!(CtBucket, lock) == 64);
const _: () = assert!(core::mem::offset_of!(CtBucket, values) == 128);

/// A bucket of IPv6's embryonic table (KPR_CT6_NEW_V3), as CtBucket: the keys in the first
/// lines, the lock in a line of its own, the values after it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtBucket6 {
    /// An empty way's key is zero (`CtKey6::is_empty`).
    pub keys: [CtKey6; CT_BUCKET_WAYS],
    pub _pad0: [u64; 4],
    /// As CtBucket's.
    pub lock: u64,
    pub _pad1: [u64; 7],
    pub values: [CtValue6; CT_BUCKET_WAYS],
    pub _pad2: [u64; 4],
}
const _: () = assert!(core::mem::size_of::<CtBucket6>() == 512);
const _: () = assert!(core::mem::offset_of!(CtBucket6, lock) == 192);
const _: () = assert!(core::mem::offset_of!(CtBucket6, values) == 256);

/// What both families' embryonic buckets share (CtBucket, CtBucket6), for the code written once
/// for either table: proxy-ebpf's embryonic.rs and the agent's mapping of the arrays.
pub trait CtBuckets: Pod {
    type Key: Pod + PartialEq + Default + core::fmt::Debug;
    type Value: Pod + core::fmt::Debug;
    /// The key's bucket of `mask + 1`.
    fn bucket(k: &Self::Key, mask: u32) -> u32;
    /// An empty way's key.
    fn is_empty(k: &Self::Key) -> bool;
    fn last_seen(v: &Self::Value) -> u64;
    /// Way `w`'s key, value and the lock, as raw pointers into a bucket (computed, not read:
    /// no dereference).
    fn key(b: *mut Self, w: usize) -> *mut Self::Key;
    fn value(b: *mut Self, w: usize) -> *mut Self::Value;
    fn lock(b: *mut Self) -> *mut u64;
}

macro_rules! ct_buckets_impl {
    ($bucket:ty, $key:ty, $value:ty) => {
        impl CtBuckets for $bucket {
            type Key = $key;
            type Value = $value;
            #[inline(always)]
            fn bucket(k: &$key, mask: u32) -> u32 {
                k.bucket(mask)
            }
            #[inline(always)]
            fn is_empty(k: &$key) -> bool {
                k.is_empty()
            }
            #[inline(always)]
            fn last_seen(v: &$value) -> u64 {
                v.last_seen_ns
            }
            #[inline(always)]
            fn key(b: *mut Self, w: usize) -> *mut $key {
                b.cast::<u8>().wrapping_add(core::mem::offset_of!($bucket, keys)).cast::<$key>().wrapping_add(w)
            }
            #[inline(always)]
            fn value(b: *mut Self, w: usize) -> *mut $value {
                b.cast::<u8>().wrapping_add(core::mem::offset_of!($bucket, values)).cast::<$value>().wrapping_add(w)
            }
            #[inline(always)]
            fn lock(b: *mut Self) -> *mut u64 {
                b.cast::<u8>().wrapping_add(core::mem::offset_of!($bucket, lock)).cast::<u64>()
            }
        }
    };
}
ct_buckets_impl!(CtBucket, CtKey, CtValue);
ct_buckets_impl!(CtBucket6, CtKey6, CtValue6);

/// An embryonic table's buckets for a capacity in entries: a power of two, at least one.
pub const fn ct_buckets(entries: u32) -> u32 {
    let b = entries.div_ceil(CT_BUCKET_WAYS as u32);
    if b <= 1 {
        1
    } else {
        b.next_power_of_two()
    }
}

/// A conntrack entry, key and value. Kernel-only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtEntry {
    pub key: CtKey,
    pub value: CtValue,
}
const _: () = assert!(core::mem::size_of::<CtEntry>() == 48);

/// Per-CPU scratch space where the data path builds a flow's conntrack entries (the BPF stack
/// is 512 bytes). Kernel-only; user space never reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtScratch {
    pub keys: [CtKey; 3],
    pub values: [CtValue; 3],
    /// The entries evicted while this packet's flow was recorded, one slot per insert (a zero
    /// key: none): their flows are forgotten once, after the packet's own entries are in.
    pub pending: [CtEntry; CT_PENDING_SLOTS],
    /// The keys that forgetting an evicted flow builds.
    pub forget_keys: [CtKey; 2],
}
const _: () = assert!(core::mem::size_of::<CtScratch>() == 368);

/// CtEntry for IPv6. Kernel-only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtEntry6 {
    pub key: CtKey6,
    pub value: CtValue6,
}
const _: () = assert!(core::mem::size_of::<CtEntry6>() == 96);

/// `CtScratch` for an IPv6 flow's two entries, and the entries their inserts evicted (pending,
/// one slot per insert, a zero key: none). Kernel-only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtScratch6 {
    pub keys: [CtKey6; 2],
    pub values: [CtValue6; 2],
    pub pending: [CtEntry6; CT6_PENDING_SLOTS],
}

/// CtScratch6's pending evictions: one per embryonic insert an IPv6 packet makes.
pub const CT6_PENDING_SLOTS: usize = 2;
const _: () = assert!(core::mem::size_of::<CtScratch6>() == 384);

/// Flow cache entry: a per-CPU, direct-mapped copy of an established flow's conntrack rewrite,
/// in an array the verifier inlines (a hash-map probe is several calls). Valid while its
/// generation is current (conntrack bumps it when a tuple gets a new flow; user space when it
/// deletes flows) and for FLOW_CACHE_REFRESH_JIFFIES after it was checked against conntrack. TCP
/// packets with SYN, FIN or RST always take conntrack. Kernel-only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct FlowCacheEntry {
    pub key: CtKey,
    pub new_saddr: u32,
    pub new_daddr: u32,
    pub new_sport: u16,
    pub new_dport: u16,
    /// CtValue::flags of the entry copied.
    pub flags: u16,
    pub _pad: u16,
    pub generation: u64,
    /// bpf_jiffies64 when this entry was checked against conntrack.
    pub checked_jiffies: u64,
}
const _: () = assert!(core::mem::size_of::<FlowCacheEntry>() == 48);

/// Per-CPU clock cache: bpf_ktime_get_coarse_ns as of the jiffy `jiffies`. The coarse clock
/// only moves on a tick, so re-reading it once per jiffy (bpf_jiffies64 is inlined, the
/// helper call is not) gives the same stamps for far less per packet. Kernel-only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ClockCache {
    pub jiffies: u64,
    pub coarse_ns: u64,
}
const _: () = assert!(core::mem::size_of::<ClockCache>() == 16);

/// Key of KPR_SOCK_REV_V1: a socket (by cookie) and the backend it was pointed at.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SockRevKey {
    pub cookie: u64,
    /// Network order.
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<SockRevKey>() == 32);

/// The service address (VIP, port) the socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct SockRevValue {
    /// Network order.
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<SockRevValue>() == 24);

/// Key of KPR_AFF_V1: (client address, service id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct AffinityKey {
    /// Network order.
    pub client: [u32; 4],
    pub service_id: u32,
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 20);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AffinityValue {
    pub last_used_ns: u64,
    pub backend_id: u32,
    /// ServiceValue::generation when remembered: another generation's entry is void. (A backend
    /// that left the service but serves another is purged by the agent at once.)
    pub generation: u16,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<AffinityValue>() == 16);

/// Data of the KPR_SRCRNG_V1 LPM key. The prefix length covers `service_id` (always 32 bits)
/// plus the CIDR's own prefix length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Pod, Zeroable)]
pub struct SourceRangeKey {
    /// Big-endian, so that the LPM trie's byte-wise match sees it as a full-length prefix.
    pub service_id_be: u32,
    /// Network order.
    pub addr: [u32; 4],
}
const _: () = assert!(core::mem::size_of::<SourceRangeKey>() == 20);

/// The only entry (index 0) of KPR_CFG_V2.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DatapathConfig {
    /// Address that masqueraded traffic gets as its source. Network order.
    pub snat_addr: [u32; 4],
    /// Where local clients come from (detectLocalMode ClusterCIDR: the cluster CIDR; NodeCIDR:
    /// the node's pod CIDR), network order; `cluster_cidr_len == 0` means unset (nobody is
    /// masqueraded for being off-cluster). Unused with CFG_F_LOCAL_BY_IFACE.
    pub cluster_cidr: [u32; 4],
    pub cluster_cidr_len: u32,
    pub flags: u32,
    /// A forward conntrack entry idle longer than this is a new flow.
    pub ct_tcp_timeout_s: u32,
    pub ct_udp_timeout_s: u32,
    /// Masquerade (and moved) source ports, host order, inclusive: outside the node's own
    /// ephemeral range, or the node's connections to a backend could meet a masqueraded flow's
    /// reply tuple. 0: SNAT_PORT_MIN..=SNAT_PORT_MAX.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// The IPv6 local-client CIDR (as `cluster_cidr`, for IPv6 clients).
    pub cluster_cidr6_len: u32,
    pub cluster_cidr6: [u32; 4],
    /// The host network namespace's cookie: connect-time balancing applies to its sockets only
    /// (pods' packets are balanced per packet at their interface, with their own address for
    /// affinity and source ranges). 0: every namespace.
    pub host_netns_cookie: u64,
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 80);

/// Defines the counters once: their index constants, their names and how many there are.
macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident = $index:literal, $label:literal;)+) => {
        $($(#[$doc])* pub const $name: u32 = $index;)+
        /// Metric label and `kpr status` name of each counter, by index.
        pub const NAMES: &[&str] = &[$($label),+];
        pub const COUNT: u32 = NAMES.len() as u32;
        const _: () = { let mut i = 0; $(assert!($index == i, "counter indices must be 0, 1, 2, ..."); i += 1;)+ let _ = i; };
    };
}

/// Indices of the per-CPU counters in KPR_CNT_V7.
pub mod counter {
    counters! {
        NEW_FLOW = 0, "new_flow";
        /// Forward packets of a tracked flow (DNAT, SNAT).
        ESTABLISHED = 1, "established";
        /// Reply packets of a tracked flow (reverse DNAT, reverse SNAT).
        REVERSE_NAT = 2, "reverse_nat";
        /// New flows that are masqueraded.
        SNAT = 3, "snat";
        AFFINITY_HIT = 4, "affinity_hit";
        /// A service without any endpoint: ICMP port unreachable (kube-proxy's REJECT).
        REJECT_NO_BACKEND = 5, "reject_no_backend";
        DROP_SOURCE_RANGE = 6, "drop_source_range";
        MISS_BACKEND = 7, "miss_backend";
        MALFORMED = 8, "malformed";
        FRAGMENT = 9, "fragment";
        CT_INSERT_FAILED = 10, "ct_insert_failed";
        SNAT_PORT_COLLISION = 11, "snat_port_collision";
        REJECT_FAILED = 12, "reject_failed";
        /// IPVS mode's set-matching program.
        SET_MASQ_MARK = 13, "set_masq_mark";
        SET_DROP_FIREWALL = 14, "set_drop_firewall";
        /// IPVS mode: new connections to a VIP at a port no service uses, rejected.
        SET_REJECT_FILTER = 15, "set_reject_filter";
        /// Established or reply packets the flow cache did not answer (conntrack was probed).
        FLOW_CACHE_MISS = 16, "flow_cache_miss";
        /// ICMP errors about a tracked flow, translated like the flow's replies.
        ICMP_ERROR_NAT = 17, "icmp_error_nat";
        /// TCP flows whose handshake completed: moved from the embryonic to the assured table.
        FLOW_ASSURED = 18, "flow_assured";
        /// New flows dropped because no free source port was found for them.
        SNAT_NO_PORT = 19, "snat_no_port";
        /// A traffic policy Local frontend without a local endpoint: dropped, as kube-proxy does.
        DROP_NO_LOCAL_ENDPOINT = 20, "drop_no_local_endpoint";
        /// A TCP packet of a flow past its Service's maximum connection age, answered with a
        /// reset (UDP flows past it start over on another backend, counted as new flows).
        MAX_AGE_RESET = 21, "max_age_reset";
        /// After a switch from IPVS mode: TCP packets of connections IPVS still serves, passed
        /// to it (CFG_F_HANDOVER).
        HANDOVER_PASS = 22, "handover_pass";
        /// Embryonic flows forgotten to make room in a full bucket of an embryonic table (a SYN
        /// flood, or handshakes that never complete), one a flow: see proxy-ebpf's embryonic.rs.
        CT_EMBRYONIC_EVICTED = 23, "ct_embryonic_evicted";
    }

    /// The counters map's capacity: more than COUNT, so that a counter added later fits the map a
    /// node has pinned (a new map would mean a new name, and counts carried over).
    pub const SLOTS: u32 = 64;
    const _: () = assert!(COUNT <= SLOTS);
}

#[cfg(feature = "user")]
pub mod user {
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
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{collections::BTreeMap, vec::Vec};

    use super::*;

    /// The flow cache's slots spread one client's connections (ports in network order) and
    /// many clients' as a random function would (about 1,260 distinct slots of 2,048 for 2,000
    /// keys), a handful at most in one.
    #[test]
    fn flow_cache_slots_spread_ports_and_clients() {
        let key = |saddr: [u8; 4], sport: u16| CtKey {
            saddr: u32::from_ne_bytes(saddr),
            daddr: u32::from_ne_bytes([10, 96, 0, 10]),
            sport: sport.to_be(),
            dport: 80u16.to_be(),
            proto: PROTO_TCP,
            dir: CT_DIR_INGRESS,
            _pad: 0,
        };
        let spread = |keys: Vec<CtKey>| {
            let mut per_slot = BTreeMap::<u32, u32>::new();
            for k in &keys {
                *per_slot.entry(k.flow_cache_slot()).or_default() += 1;
            }
            (per_slot.len(), per_slot.values().copied().max().unwrap_or(0))
        };
        let one_client = spread((32768..34768).map(|p| key([10, 244, 1, 7], p)).collect());
        let clients = spread((0..2000u32).map(|i| key([10, 244, (i / 250) as u8, (i % 250 + 1) as u8], 40000)).collect());
        for (what, (slots, most)) in [("one client's ports", one_client), ("2,000 clients", clients)] {
            assert!(slots >= 1150 && most <= 8, "{what}: {slots} slots, up to {most} keys in one");
        }
    }
}
