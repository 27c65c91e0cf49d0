//! Every map of the fast path. Each static is named by its role; its name in the object (and
//! its pin) is `proxy_common::map_name!(ROLE)`, the one list both sides read. Pinned by name, so
//! a restarted agent reuses them and forwarding never stops.
use aya_ebpf::{
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use proxy_common::{
    ct_buckets, ClockCache, CtBucket, CtBucket6, CtKey6, BPF_F_MMAPABLE, CtScratch, CtScratch6, CtValue6, FlowCacheEntry, IfaceInfo, SockRevKey, SockRevValue,
    limits::*, AffinityKey, AffinityValue, Backend, CtKey, CtValue, DatapathConfig, ServiceKey,
    ServiceValue, SetAddr, SetIpPort, SetIpPortIp, SetIpPortNet, SetPort, SlotKey, SourceRangeKey,
};

/// What aya's `#[map]` does, with the name from proxy-common's list.
macro_rules! map {
    ($(#[$doc:meta])* $role:ident: $ty:ty = $init:expr) => {
        $(#[$doc])*
        #[unsafe(link_section = "maps")]
        #[unsafe(export_name = proxy_common::map_name!($role))]
        pub static $role: $ty = $init;
    };
}

/// bpf_map_update_elem's flag: fail if the key is there (a new flow claims its reply tuple so).
pub const BPF_NOEXIST: u64 = aya_ebpf::bindings::BPF_NOEXIST as u64;
/// The errno, negated, that an update with BPF_NOEXIST returns for a key that is there (and an
/// embryonic bucket's insert, which always claims its key: embryonic.rs).
pub const EEXIST: i32 = 17;
/// The errno, negated, that an insert into a full embryonic bucket returns (as the kernel's
/// preallocated hash does when full).
pub const E2BIG: i32 = 7;

/// The control plane's hash maps allocate per entry (V2 map names: this flag changed).
const NO_PREALLOC: u32 = proxy_common::BPF_F_NO_PREALLOC;

map! {
    /// (VIP or node address, port, protocol, scope) -> frontend: service id, backend count, scheduler.
    SERVICES: HashMap<ServiceKey, ServiceValue> = HashMap::pinned(MAX_SERVICES, NO_PREALLOC)
}

map! {
    /// (service id, slot 1..=count) -> backend id; the random and round-robin schedulers index it.
    SLOTS: HashMap<SlotKey, u32> = HashMap::pinned(MAX_SLOTS, NO_PREALLOC)
}

map! {
    /// Flat Maglev tables: index row * MAGLEV_TABLE_SIZE + (flow hash % size) -> backend id.
    MAGLEV: Array<u32> = Array::pinned(MAGLEV_ROWS * MAGLEV_TABLE_SIZE, 0)
}

map! {
    /// Stable backend id -> backend address, target port, protocol; zeros where the id names
    /// none (Backend::is_present). An array (V3; a hash map before): the ids are dense, a new
    /// flow's lookup is inlined by the verifier, and the agent's writes allocate nothing.
    BACKENDS: Array<Backend> = Array::pinned(MAX_BACKENDS, 0)
}

map! {
    /// Assured flows (past TCP's handshake, or UDP's first exchange; see conntrack.rs): (5-tuple, hook) -> the 4-tuple to rewrite to,
    /// backend id, last seen. Up to four entries per flow (see proxy_common::CtKey).
    CONNTRACK: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(MAX_CONNTRACK, 0)
}

map! {
    /// Flows not yet assured (TCP and UDP), same entries, in a table of their own so a flood
    /// evicts only its kind: bucket (CtKey::bucket) -> up to four entries (CtBucket). An array,
    /// not a hash map: a new flow's operations on it (its tuple's probe, its reply tuple's
    /// claim, its inserts) read one bucket's lines, with no hash helper, chain walk or free-list
    /// element; each is a BPF global function (embryonic.rs). A full bucket evicts the flow of
    /// its oldest entry. Mmapable: the agent's collector deletes under the same bucket lock.
    /// Each bucket's lock line also holds CONNTRACK's hint for the bucket's keys (hint.rs): a
    /// new flow looks CONNTRACK up for a key only where its bit is set; the agent sets every bit
    /// at load and rebuilds a half of each word at a time. The agent sizes it (ct_buckets) and
    /// sets CT_NEW_BUCKET_MASK.
    CONNTRACK_NEW: Array<CtBucket> = Array::pinned(ct_buckets(MAX_CONNTRACK_NEW), BPF_F_MMAPABLE)
}

map! {
    /// index 0 -> this CPU's space for the keys of a flow being forgotten (conntrack::forget).
    CT_FORGET_KEYS: PerCpuArray<[CtKey; 2]> = PerCpuArray::with_max_entries(1, 0)
}

map! {
    /// index 0 -> this CPU's space for the reply key of an IPv6 flow being forgotten
    /// (conntrack6::forget_pending, in a call chain that Linux 6.1 counts against 512 bytes).
    CT_FORGET_KEYS6: PerCpuArray<CtKey6> = PerCpuArray::with_max_entries(1, 0)
}

map! {
    /// IPv6 flows from outside to the node's IPv6 NodePorts, externalIPs and LB IPs: (5-tuple,
    /// hook) -> the 4-tuple to rewrite to (see proxy_common::CtKey6). Assured flows (as IPv4's).
    CONNTRACK6: LruHashMap<CtKey6, CtValue6> = LruHashMap::pinned(MAX_CONNTRACK6, 0)
}

map! {
    /// IPv6 flows not yet assured (TCP and UDP), same entries, in a table of their own so that
    /// a flood from outside evicts only its kind: bucket (CtKey6::bucket) -> up to four entries
    /// (CtBucket6), as IPv4's CONNTRACK_NEW (embryonic.rs), with CONNTRACK6's hint; the agent's
    /// collector deletes idle flows. The agent sizes it (ct_buckets) and sets
    /// CT6_NEW_BUCKET_MASK.
    CONNTRACK6_NEW: Array<CtBucket6> = Array::pinned(ct_buckets(MAX_CONNTRACK6_NEW), BPF_F_MMAPABLE)
}

map! {
    /// Interface index -> IfaceInfo: the address masquerade gives flows leaving through it (like
    /// MASQUERADE's choice of the outgoing interface's address; absent: the node's SNAT address),
    /// and whether traffic arriving on it is local (detectLocalMode by interface).
    IFACES: HashMap<u32, IfaceInfo> = HashMap::pinned(MAX_IFACES, 0)
}

map! {
    /// (client address, service id) -> remembered backend id and last use (sessionAffinity ClientIP).
    AFFINITY: LruHashMap<AffinityKey, AffinityValue> = LruHashMap::pinned(MAX_AFFINITY, 0)
}

map! {
    /// LPM (service id, source CIDR) -> 1: loadBalancerSourceRanges allowed for that service.
    SOURCE_RANGES: LpmTrie<SourceRangeKey, u8> = LpmTrie::pinned(MAX_SOURCE_RANGES, 1)
}

map! {
    /// service id -> its round-robin cursor, shared by the CPUs (V2: per CPU before, which cost
    /// 1 MiB a CPU at the default capacity).
    RR_STATE: Array<u32> = Array::pinned(MAX_SERVICES, 0)
}

map! {
    /// index 0 -> DatapathConfig: SNAT address and ports, cluster CIDR, conntrack timeouts.
    CONFIG: Array<DatapathConfig> = Array::pinned(1, 0)
}

map! {
    /// counter index (proxy_common::counter) -> packets, per CPU. Slots past counter::COUNT are
    /// for counters to come.
    COUNTERS: PerCpuArray<u64> = PerCpuArray::pinned(proxy_common::counter::SLOTS, 0)
}

map! {
    /// index 0 -> this CPU's scratch space for building conntrack entries off the stack.
    CT_SCRATCH: PerCpuArray<CtScratch> = PerCpuArray::with_max_entries(1, 0)
}

map! {
    /// index 0 -> this CPU's scratch space for an IPv6 flow's conntrack entries.
    CT_SCRATCH6: PerCpuArray<CtScratch6> = PerCpuArray::with_max_entries(1, 0)
}

map! {
    /// per CPU: flow cache slot (hash of the 5-tuple) -> a copy of that flow's conntrack rewrite.
    FLOW_CACHE: PerCpuArray<FlowCacheEntry> = PerCpuArray::with_max_entries(FLOW_CACHE_SLOTS, 0)
}

map! {
    /// index 0 -> the flow cache generation; entries of another generation are stale.
    FLOW_CACHE_GEN: Array<u64> = Array::pinned(1, 0)
}

map! {
    /// index 0 -> this CPU's jiffy, the coarse clock read at it (conntrack::now_ns), and its
    /// last new flow's stamp (conntrack::kpr_new_flow_stamp).
    CLOCK: PerCpuArray<ClockCache> = PerCpuArray::with_max_entries(1, 0)
}

map! {
    /// LRU: (socket cookie, backend address, port) -> the service address that socket asked for.
    SOCK_REV: LruHashMap<SockRevKey, SockRevValue> = LruHashMap::pinned(MAX_CONNTRACK, 0)
}

map! {
    /// backend id -> new connections sent to it, added to atomically (V2: per CPU before, which
    /// cost 8 bytes a backend and CPU, and a start-up allocation per backend).
    BACKEND_NEW: Array<u64> = Array::pinned(MAX_BACKENDS, 0)
}

map! {
    /// backend id -> open flows (every service's): the collector's count at its last pass over
    /// conntrack, plus the flows opened since, less those whose client closed them (the next
    /// count replaces the sum, so flows that end otherwise need no decrement).
    BACKEND_ACTIVE: Array<u32> = Array::pinned(MAX_BACKENDS, 0)
}

map! {
    /// LRU: backend id -> new connections it refused in a row (a reset answering the SYN), until
    /// a handshake completes; the agent's outlier detection reads and clears it.
    BACKEND_FAIL: LruHashMap<u32, u32> = LruHashMap::pinned(16_384, 0)
}

// ---- IPVS mode: kube-proxy's ipsets (proxy_common::sets), one bit per set ----

map! {
    /// (address, port, proto, family) -> bits: CLUSTER-IP, EXTERNAL-IP(-LOCAL), LOAD-BALANCER(-LOCAL, -FW).
    SET_IP_PORT: HashMap<SetIpPort, u32> = HashMap::pinned(MAX_FRONTENDS, NO_PREALLOC)
}

map! {
    /// (address, port, proto, family, address2) -> bits: LOOP-BACK (endpoint twice), LOAD-BALANCER-SOURCE-IP.
    SET_IP_PORT_IP: HashMap<SetIpPortIp, u32> = HashMap::pinned(MAX_BACKENDS, NO_PREALLOC)
}

map! {
    /// LPM (address, port, proto, family, source CIDR) -> bits: LOAD-BALANCER-SOURCE-CIDR.
    SET_IP_PORT_NET: LpmTrie<SetIpPortNet, u32> = LpmTrie::pinned(MAX_SOURCE_RANGES, 1)
}

map! {
    /// (port, proto, family) -> bits: NODE-PORT-*, NODE-PORT-LOCAL-*, HEALTH-CHECK-NODE-PORT.
    SET_PORT: HashMap<SetPort, u32> = HashMap::pinned(65_536, NO_PREALLOC)
}

map! {
    /// (address, family) -> bits: IPVS-IPS (bound on kube-ipvs0), NODE-IPS (this node's own addresses).
    SET_IP: HashMap<SetAddr, u32> = HashMap::pinned(MAX_FRONTENDS, NO_PREALLOC)
}
