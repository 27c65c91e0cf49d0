//! Conntrack's shared types: the entries' keys and values of both families (their roles,
//! flags and directions), the embryonic tables' buckets, the data path's scratch space and
//! flow cache. Re-exported at the crate's root.
use bytemuck::{Pod, Zeroable};

use crate::limits;

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
/// A TCP reset passed the entry (CT_F_CLOSING is set with it). A masqueraded flow is closed
/// once either direction's entry has it, or both have CT_F_CLOSING (a FIN each way): a new flow
/// may then take its SNAT tuple at once, as netfilter's NAT reuses the tuple of a connection in
/// CLOSE or TIME_WAIT.
pub const CT_F_RESET: u16 = 1 << 7;
/// Reverse-SNAT entry of a masqueraded flow whose backend closed first with a FIN, before the
/// client's: the backend holds TIME_WAIT on the SNAT tuple (BACKEND_TIME_WAIT_S on Linux) and
/// takes a new SYN on it only when the SYN's timestamp is newer than the old connection's,
/// which another connection's is only by chance. So the tuple is taken over last, and kept past
/// the closing timeout for as long as that TIME_WAIT lasts. A reset either way ends it.
pub const CT_F_TIME_WAIT: u16 = 1 << 8;
/// How long a backend keeps TIME_WAIT after closing first (Linux's TCP_TIMEWAIT_LEN).
pub const BACKEND_TIME_WAIT_S: u32 = 60;

/// Source ports for masquerade and for moved ports when the agent sets none
/// (DatapathConfig::snat_port_min/max): below the NodePort range and the node's default
/// ephemeral range (32768-60999), which its own connections use.
pub const SNAT_PORT_MIN: u16 = 1024;
pub const SNAT_PORT_MAX: u16 = 29_999;

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
    /// bits of its hash. (The flow cache's single multiply needs a constant count of slots;
    /// this table's is the loader's.)
    #[inline(always)]
    pub fn bucket(&self, mask: u32) -> u32 {
        self.bucket_hash() as u32 & mask
    }

    /// MurmurHash3's 64-bit finalizer of the key, which every bit of the key reaches: its low
    /// bits pick the key's embryonic bucket, its top bits the key's hint bit there (CtHinted).
    #[inline(always)]
    fn bucket_hash(&self) -> u64 {
        let k = self.words();
        fmix64(k[0] ^ k[1].rotate_left(29))
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
    /// CLOCK_MONOTONIC ns of the last packet: the coarse clock's; at a flow's creation, its
    /// stamp (proxy-ebpf's conntrack::kpr_new_flow_stamp).
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
    /// As CtValue's: the coarse clock's, and at creation the flow's stamp.
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
        self.bucket_hash() as u32 & mask
    }

    /// As `CtKey::bucket_hash`.
    #[inline(always)]
    fn bucket_hash(&self) -> u64 {
        let w = self.words();
        fmix64(w[0] ^ w[1].rotate_left(13) ^ w[2].rotate_left(29) ^ w[3].rotate_left(43) ^ w[4].rotate_left(53))
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

/// The assured tables' hints: words in each bucket of the family's embryonic table (`hint` of
/// CtBucket and CtBucket6) that say which keys the assured table may hold, so that a new flow
/// skips the lookups of its tuple and its reply tuple there (two cold hash-bucket reads) when it
/// cannot. A key's bit is in its own embryonic bucket's lock line, which the flow's probe and
/// insert of that key read anyway: the hint costs no line of its own. The key has a bit in each
/// half of one word (`hint_slot`); a bit set in either half: the key may be there; clear in
/// both: it is not. Whatever puts a key into an assured table sets both bits, before the insert
/// (a reader never meets the key unhinted) and after it (see the collector's rebuild). Bits
/// are never cleared one by one: the agent's collector rebuilds one half at a time from a full
/// read of the table (cleared first, then each key read sets its bit), the other half answering
/// meanwhile, so bits of keys gone (deleted, or evicted by the LRU) go within two passes. A
/// load sets every bit: until two passes have run, every lookup happens, as without the hint.
pub trait CtHinted {
    /// The key's hint word, of a table of `mask + 1` buckets, counted across the buckets
    /// (bucket x CT_HINT_WORDS + the word in it), and its bit in the word's low half (the high
    /// half's is 32 above). The bucket is the key's own (`bucket`); the word and the bit come
    /// from the hash's top bits, which the bucket's index never uses.
    fn hint_slot(&self, mask: u32) -> (u32, u32);
}

/// The hint's words in each embryonic bucket: 128 bits a half (IPv4's default table, 32,768
/// buckets: 4,194,304 a half, about a ninth of them set with the default assured table of
/// 524,288 entries full; IPv6's 8,192 buckets against 65,536 entries, a sixteenth).
pub const CT_HINT_WORDS: usize = 4;

/// The two bits of a key's `hint_slot` bit, one a half.
#[inline(always)]
pub const fn hint_bits(bit: u32) -> u64 {
    (1 << bit) | (1 << (bit + 32))
}

/// The bits of a word's `half` (0: low, 1: high).
#[inline(always)]
pub const fn hint_half(half: u32) -> u64 {
    0xffff_ffff << (32 * (half & 1))
}

macro_rules! ct_hinted_impl {
    ($key:ty) => {
        impl CtHinted for $key {
            #[inline(always)]
            fn hint_slot(&self, mask: u32) -> (u32, u32) {
                let h = self.bucket_hash();
                ((h as u32 & mask) * CT_HINT_WORDS as u32 + (h >> 62) as u32, (h >> 57) as u32 & 31)
            }
        }
    };
}
ct_hinted_impl!(CtKey);
ct_hinted_impl!(CtKey6);
const _: () = assert!(CT_HINT_WORDS == 4, "hint_slot takes the word from the hash's top two bits");

/// A bucket of the IPv4 embryonic table (KPR_CT_NEW_V3), an array the data path probes without
/// a helper call: up to four entries whose keys hash to it (`CtKey::bucket`). The keys fill
/// the first cache line, so a probe reads one line; the lock the next, which the CPU fetches
/// with it; the values the two after. A writer (a CPU inserting or deleting, the agent through
/// its mapping of the array) holds `lock`; readers do not take it. A full bucket's insert
/// evicts the flow of its oldest entry. The lock's line also holds the assured table's hint
/// for the bucket's keys (`hint`, see CtHinted), changed only by atomic ORs and ANDs, without
/// the lock. (Padding before this layout: a load fills it, so the array's pin is kept.)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CtBucket {
    /// An empty way's key is zero (`CtKey::is_empty`).
    pub keys: [CtKey; CT_BUCKET_WAYS],
    /// 0: free; 1: held. 64 bits: the data path takes it with BPF's 64-bit compare-and-exchange.
    pub lock: u64,
    pub hint: [u64; CT_HINT_WORDS],
    pub _pad: [u64; 3],
    pub values: [CtValue; CT_BUCKET_WAYS],
}
const _: () = assert!(core::mem::size_of::<CtBucket>() == 256);
const _: () = assert!(core::mem::offset_of!(CtBucket, lock) == 64);
const _: () = assert!(core::mem::offset_of!(CtBucket, values) == 128);
const _: () = assert!(core::mem::offset_of!(CtBucket, hint) == 72);

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
    pub hint: [u64; CT_HINT_WORDS],
    pub _pad1: [u64; 3],
    pub values: [CtValue6; CT_BUCKET_WAYS],
    pub _pad2: [u64; 4],
}
const _: () = assert!(core::mem::size_of::<CtBucket6>() == 512);
const _: () = assert!(core::mem::offset_of!(CtBucket6, lock) == 192);
const _: () = assert!(core::mem::offset_of!(CtBucket6, values) == 256);
const _: () = assert!(core::mem::offset_of!(CtBucket6, hint) == 200);

/// What both families' embryonic buckets share (CtBucket, CtBucket6), for the code written once
/// for either table: proxy-ebpf's embryonic.rs and the agent's mapping of the arrays.
pub trait CtBuckets: Pod {
    type Key: Pod + PartialEq + Default + core::fmt::Debug + CtHinted;
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
    /// Hint word `w` (of CT_HINT_WORDS).
    fn hint(b: *mut Self, w: usize) -> *mut u64;
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
            #[inline(always)]
            fn hint(b: *mut Self, w: usize) -> *mut u64 {
                b.cast::<u8>().wrapping_add(core::mem::offset_of!($bucket, hint)).cast::<u64>().wrapping_add(w)
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

impl CtScratch {
    /// Whether an insert evicted an entry whose flow is still to be forgotten (a free slot's
    /// key is empty, as forget_pending reads it).
    #[inline(always)]
    pub fn any_pending(&self) -> bool {
        self.pending.iter().any(|e| !e.key.is_empty())
    }
}

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

impl CtScratch6 {
    /// Whether an insert evicted an entry whose flow is still to be forgotten (a free slot's
    /// key is empty, as forget_pending reads it).
    #[inline(always)]
    pub fn any_pending(&self) -> bool {
        self.pending.iter().any(|e| !e.key.is_empty())
    }
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
/// helper call is not) gives the same stamps for far less per packet. The data path's (tests
/// write it, to set a CPU's last stamp).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ClockCache {
    pub jiffies: u64,
    pub coarse_ns: u64,
    /// This CPU's last new flow's stamp (conntrack::kpr_new_flow_stamp): each later one is at
    /// least one more, so that a CPU's flows of one tick are stamped apart.
    pub last_stamp_ns: u64,
}
const _: () = assert!(core::mem::size_of::<ClockCache>() == 24);
