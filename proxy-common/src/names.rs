//! Every map's and program's name, listed once for the kernel (the `map_name!` and
//! `prog_name!` macros) and for user space (`map_names`, `prog_names`).

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
    // LRU before that). Its lock line's padding became the assured table's hint (CtHinted): a
    // load fills it, an earlier release ignores it, so the layout keeps its name.
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
    pub const RETIRED: [&str; 27] = [
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
        // The assured tables' hints as arrays of their own: now in the embryonic buckets.
        "KPR_CT_HINT_V1",
        "KPR_CT6_HINT_V1",
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
    (TC_UPLINK) => { "kpr_tc_uplink" };
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
    /// XDP_INGRESS's work at TC ingress, for uplinks where XDP would cost more than it saves
    /// (a veth's XDP copies every frame the stack sends through it; generic XDP reallocates
    /// most heads). What it passes goes on to the hook's next program, as after XDP.
    pub const TC_UPLINK: &str = prog_name!(TC_UPLINK);
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
