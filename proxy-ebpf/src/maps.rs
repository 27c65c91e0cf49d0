//! Every map of the fast path. Names are the `proxy_common::map_names` constants; all are pinned
//! by name so that a restarted agent reuses them and forwarding never stops.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use proxy_common::{
    ClockCache, CtScratch, FlowCacheEntry, IfaceInfo, SockRevKey, SockRevValue,
    limits::*, AffinityKey, AffinityValue, Backend, CtKey, CtValue, DatapathConfig, ServiceKey,
    ServiceValue, SetIpPort, SetIpPortIp, SetIpPortNet, SetPort, SlotKey, SourceRangeKey,
};

/// BPF_F_NO_PREALLOC: the control plane's hash maps (services, slots, backends, IPVS-mode sets)
/// cost memory in proportion to their entries, not their capacity (V2: this flag changed).
const NO_PREALLOC: u32 = 1;

/// (VIP or node address, port, protocol, scope) -> frontend: service id, backend count, scheduler.
#[map]
pub static KPR_SVC_V2: HashMap<ServiceKey, ServiceValue> = HashMap::pinned(MAX_FRONTENDS, NO_PREALLOC);

/// (service id, slot 1..=count) -> backend id; the random and round-robin schedulers index it.
#[map]
pub static KPR_SLOT_V2: HashMap<SlotKey, u32> = HashMap::pinned(MAX_SLOTS, NO_PREALLOC);

/// Flat Maglev tables: index row * MAGLEV_TABLE_SIZE + (flow hash % size) -> backend id.
#[map]
pub static KPR_MAGLEV_V1: Array<u32> = Array::pinned(MAGLEV_ROWS * MAGLEV_TABLE_SIZE, 0);

/// Stable backend id -> backend address, target port, protocol.
#[map]
pub static KPR_BE_V2: HashMap<u32, Backend> = HashMap::pinned(MAX_BACKENDS, NO_PREALLOC);

/// Assured flows (UDP; TCP past its handshake): (5-tuple, hook) -> the 4-tuple to rewrite to,
/// backend id, last seen. Up to four entries per flow (see proxy_common::CtKey).
#[map]
pub static KPR_CT_V3: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(MAX_CONNTRACK, 0);

/// Embryonic TCP flows, same layout: their own LRU, so a SYN flood evicts only its kind.
#[map]
pub static KPR_CT_NEW_V1: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(MAX_CONNTRACK_NEW, 0);

/// Interface index -> IfaceInfo: the address masquerade gives flows leaving through it (like
/// MASQUERADE's choice of the outgoing interface's address; absent: the node's SNAT address),
/// and whether traffic arriving on it is local (detectLocalMode by interface).
#[map]
pub static KPR_IFACE_V1: HashMap<u32, IfaceInfo> = HashMap::pinned(MAX_IFACES, 0);

/// (client address, service id) -> remembered backend id and last use (sessionAffinity ClientIP).
#[map]
pub static KPR_AFF_V1: LruHashMap<AffinityKey, AffinityValue> = LruHashMap::pinned(MAX_AFFINITY, 0);

/// LPM (service id, source CIDR) -> 1: loadBalancerSourceRanges allowed for that service.
#[map]
pub static KPR_SRCRNG_V1: LpmTrie<SourceRangeKey, u8> = LpmTrie::pinned(MAX_SOURCE_RANGES, 1);

/// service id -> this CPU's round-robin cursor (per CPU: no atomics on the hot path).
#[map]
pub static KPR_RR_V1: PerCpuArray<u32> = PerCpuArray::pinned(MAX_SERVICES, 0);

/// index 0 -> DatapathConfig: SNAT address and ports, cluster CIDR, conntrack timeouts.
#[map]
pub static KPR_CFG_V2: Array<DatapathConfig> = Array::pinned(1, 0);

/// counter index (proxy_common::counter) -> packets, per CPU.
#[map]
pub static KPR_CNT_V4: PerCpuArray<u64> = PerCpuArray::pinned(proxy_common::counter::COUNT, 0);

/// index 0 -> this CPU's scratch space for building conntrack entries off the stack.
#[map]
pub static KPR_CT_SCRATCH: PerCpuArray<CtScratch> = PerCpuArray::with_max_entries(1, 0);

/// per CPU: flow cache slot (hash of the 5-tuple) -> a copy of that flow's conntrack rewrite.
#[map]
pub static KPR_FLOW_CACHE: PerCpuArray<FlowCacheEntry> = PerCpuArray::with_max_entries(FLOW_CACHE_SLOTS, 0);

/// index 0 -> the flow cache generation; entries of another generation are stale.
#[map]
pub static KPR_FC_GEN_V1: Array<u64> = Array::pinned(1, 0);

/// index 0 -> this CPU's jiffy and the coarse clock read at it (conntrack::now_ns).
#[map]
pub static KPR_CLOCK: PerCpuArray<ClockCache> = PerCpuArray::with_max_entries(1, 0);

/// LRU: (socket cookie, backend address, port) -> the service address that socket asked for.
#[map]
pub static KPR_SOCK_REV_V1: LruHashMap<SockRevKey, SockRevValue> = LruHashMap::pinned(MAX_CONNTRACK, 0);

/// per CPU: backend id -> new connections sent to it (ids are below MAX_BACKENDS).
#[map]
pub static KPR_BE_NEW_V1: PerCpuArray<u64> = PerCpuArray::pinned(MAX_BACKENDS, 0);

// ---- IPVS mode: kube-proxy's ipsets (proxy_common::sets), one bit per set ----

/// (address, port, proto) -> bits: CLUSTER-IP, EXTERNAL-IP(-LOCAL), LOAD-BALANCER(-LOCAL, -FW).
#[map]
pub static KPR_SET_IPP_V1: HashMap<SetIpPort, u32> = HashMap::pinned(MAX_FRONTENDS, NO_PREALLOC);

/// (address, port, proto, address2) -> bits: LOOP-BACK (endpoint twice), LOAD-BALANCER-SOURCE-IP.
#[map]
pub static KPR_SET_IPPI_V1: HashMap<SetIpPortIp, u32> = HashMap::pinned(MAX_BACKENDS, NO_PREALLOC);

/// LPM (address, port, proto, source CIDR) -> bits: LOAD-BALANCER-SOURCE-CIDR.
#[map]
pub static KPR_SET_IPPN_V1: LpmTrie<SetIpPortNet, u32> = LpmTrie::pinned(MAX_SOURCE_RANGES, 1);

/// (port, proto) -> bits: NODE-PORT-*, NODE-PORT-LOCAL-*, HEALTH-CHECK-NODE-PORT.
#[map]
pub static KPR_SET_PORT_V1: HashMap<SetPort, u32> = HashMap::pinned(65_536, NO_PREALLOC);

/// address -> bits: IPVS-IPS (bound on kube-ipvs0), NODE-IPS (this node's own addresses).
#[map]
pub static KPR_SET_IP_V1: HashMap<u32, u32> = HashMap::pinned(MAX_FRONTENDS, NO_PREALLOC);
