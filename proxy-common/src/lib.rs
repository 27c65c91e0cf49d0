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

mod conntrack;
mod names;
pub use conntrack::*;
pub use names::{map_names, prog_names};

/// Project name: the bpffs pin directory is `/sys/fs/bpf/<PROJECT>` by default.
pub const PROJECT: &str = "kpr";

/// kube-proxy's masquerade mark (masqueradeBit 14).
pub const MARK_MASQ: u32 = 0x4000;

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
/// masqueradeAll, for IPVS mode's set matching (every packet to a ClusterIP is marked); the fast
/// path has it from its ClusterIP frontends' SVC_F_MASQ, as kube-proxy masquerades only traffic
/// to a ClusterIP.
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
/// No local-traffic detector (detectLocalMode ClusterCIDR without an IPv4 cluster CIDR, or
/// NodeCIDR without the Node's pod CIDR): as under kube-proxy's no-op detector, a pod's traffic
/// is external traffic like any other, so the pod interfaces' ingress takes a port's external
/// entry where its scopes differ (externalTrafficPolicy Local: this node's endpoints only).
pub const CFG_F_NO_LOCAL_DETECTOR: u32 = 1 << 5;

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
        /// TCP flows started by a packet other than a SYN (netfilter's loose pickup), IPv4 and
        /// IPv6: a connection older than the tables (a restart without pinned maps) or one
        /// whose entries were lost. It is balanced anew; a backend other than its own answers
        /// it with a reset.
        TCP_MIDSTREAM_PICKUP = 24, "tcp_midstream_pickup";
        /// Masqueraded flows that took the SNAT tuple of a closed flow (a reset either way, or a
        /// FIN each way) rather than wait for its closing timeout, as netfilter's NAT does.
        SNAT_PORT_REUSED = 25, "snat_port_reused";
    }

    /// The counters map's capacity: more than COUNT, so that a counter added later fits the map a
    /// node has pinned (a new map would mean a new name, and counts carried over).
    pub const SLOTS: u32 = 64;
    const _: () = assert!(COUNT <= SLOTS);
}

#[cfg(feature = "user")]
pub mod user;

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
