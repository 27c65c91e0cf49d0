//! The assured tables' hints (see proxy_common::CtHinted): a new flow's tuple and reply tuple
//! are looked up in the assured table only where the hint says it may hold them. Each such
//! lookup of a table of that size reads a cold hash bucket, the largest part of what a new flow
//! cost; a key's hint word is in its own embryonic bucket's lock line, which the flow's probe
//! and insert of the same key read anyway.
use core::intrinsics::{atomic_or, AtomicOrdering};

use aya_ebpf::maps::LruHashMap;
use proxy_common::{hint_bits, CtBucket, CtBucket6, CtBuckets, CtHinted, CtKey, CtKey6, CtValue, CtValue6, CT_HINT_WORDS};

use crate::{
    embryonic::Table,
    maps::{CONNTRACK, CONNTRACK6},
};

/// A family's key, with its assured table, the embryonic table whose buckets hold the hint, and
/// `may_hold` as the family's BPF global function.
pub(crate) trait Hinted: CtHinted + Sized + 'static {
    type Value: 'static;
    type Bucket: Table<Key = Self>;
    fn assured() -> &'static LruHashMap<Self, Self::Value>;
    fn may_hold_global(k: &Self) -> bool;
}

/// `k`'s hint word (in its embryonic bucket) and its two bits; None if the bucket cannot be
/// read.
#[inline(always)]
fn word<K: Hinted>(k: &K) -> Option<(*mut u64, u64)> {
    let (word, bit) = k.hint_slot(K::Bucket::mask());
    let b = K::Bucket::array().get_ptr_mut(word / CT_HINT_WORDS as u32)?;
    Some((K::Bucket::hint(b, word as usize % CT_HINT_WORDS), hint_bits(bit)))
}

/// Puts `k` into its assured table, its hint's bits set before the insert (a reader never
/// meets the key unhinted) and after it (a rebuild of the hint that cleared them meanwhile may
/// have read the table before the key was in; see proxy_common::CtHinted).
#[inline(always)]
pub(crate) fn insert_assured<K: Hinted>(k: &K, v: &K::Value, flags: u64) -> Result<(), i32> {
    note(k);
    let inserted = K::assured().insert(k, v, flags);
    note(k);
    inserted
}

/// `k`'s entry in its assured table, looked up only where the hint says it may be there (a new
/// flow's keys seldom are).
#[inline(always)]
pub(crate) fn assured<K: Hinted>(k: &K) -> Option<*mut K::Value> {
    if may_hold(k) {
        K::assured().get_ptr_mut(k)
    } else {
        None
    }
}

/// Whether the assured table may hold `k` (a word it cannot read: it may).
#[inline(always)]
pub(crate) fn may_hold<K: Hinted>(k: &K) -> bool {
    match word(k) {
        Some((w, bits)) => (unsafe { core::ptr::read_volatile(w) } & bits) != 0,
        None => true,
    }
}

/// Sets `k`'s bits, in both halves: around every insert into the assured table (see
/// CtHinted). A word whose bits are set already is left clean in the other CPUs' caches.
#[inline(always)]
pub(crate) fn note<K: Hinted>(k: &K) {
    if let Some((w, bits)) = word(k) {
        if (unsafe { core::ptr::read_volatile(w) } & bits) != bits {
            unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(w, bits) };
        }
    }
}

/// Whether the assured table holds `k`, its hint asked through the family's global function:
/// for new flows' claims of their reply tuples, where the hint's registers, inlined, grow
/// new_flow's frame past what Linux 6.1 allows the call chain (512 bytes).
#[inline(always)]
pub(crate) fn held_asking_globally<K: Hinted>(k: &K) -> bool {
    K::may_hold_global(k) && unsafe { K::assured().get(k) }.is_some()
}

/// Each family's `Hinted`, and its `may_hold` as a BPF global function (verified once, on its
/// own; 1: may hold, 0: does not).
macro_rules! hinted {
    ($key:ty, $value:ty, $bucket:ty, $assured:ident, $may_hold:ident) => {
        #[no_mangle]
        #[inline(never)]
        pub extern "C" fn $may_hold(k: *const $key) -> i64 {
            if k.is_null() {
                return 1;
            }
            i64::from(may_hold(unsafe { &*k }))
        }

        impl Hinted for $key {
            type Value = $value;
            type Bucket = $bucket;
            #[inline(always)]
            fn assured() -> &'static LruHashMap<$key, $value> {
                &$assured
            }
            #[inline(always)]
            fn may_hold_global(k: &$key) -> bool {
                $may_hold(k) != 0
            }
        }
    };
}

hinted!(CtKey, CtValue, CtBucket, CONNTRACK, kpr_ct_hint_may_hold);
hinted!(CtKey6, CtValue6, CtBucket6, CONNTRACK6, kpr_ct6_hint_may_hold);
