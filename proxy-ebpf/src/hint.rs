//! The assured tables' hints (CONNTRACK_HINT, CONNTRACK6_HINT; see proxy_common::CtHinted):
//! a new flow's tuple and reply tuple are probed in the assured table only where the hint says
//! it may hold them. Each such probe of a table of that size is a cold hash bucket, the largest
//! part of what a new flow costs; the hint's words are a few hundred KiB.
use core::intrinsics::{atomic_or, AtomicOrdering};

use aya_ebpf::maps::Array;
use proxy_common::{hint_bits, CtHinted, CtKey, CtKey6};

use crate::maps::{CONNTRACK6_HINT, CONNTRACK_HINT};

/// A family's key, with its hint.
pub(crate) trait Hinted: CtHinted {
    fn hint() -> &'static Array<u64>;
}

impl Hinted for CtKey {
    #[inline(always)]
    fn hint() -> &'static Array<u64> {
        &CONNTRACK_HINT
    }
}

impl Hinted for CtKey6 {
    #[inline(always)]
    fn hint() -> &'static Array<u64> {
        &CONNTRACK6_HINT
    }
}

/// Whether the assured table may hold `k` (a word it cannot read: it may).
#[inline(always)]
pub(crate) fn may_hold<K: Hinted>(k: &K) -> bool {
    let (word, bit) = k.hint_slot();
    match K::hint().get_ptr(word) {
        Some(w) => (unsafe { core::ptr::read_volatile(w) } & hint_bits(bit)) != 0,
        None => true,
    }
}

/// Sets `k`'s bits, in both halves: around every insert into the assured table (see
/// CtHinted). A word whose bits are set already is left clean in the other CPUs' caches.
#[inline(always)]
pub(crate) fn note<K: Hinted>(k: &K) {
    let (word, bit) = k.hint_slot();
    if let Some(w) = K::hint().get_ptr_mut(word) {
        let bits = hint_bits(bit);
        if (unsafe { core::ptr::read_volatile(w) } & bits) != bits {
            unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(w, bits) };
        }
    }
}

/// `may_hold` as BPF global functions (verified once, on their own), for new flows' claims of
/// their reply tuples: inlined there, the hint's registers grow new_flow's frame past what
/// Linux 6.1 allows the call chain (512 bytes). 1: may hold; 0: does not.
macro_rules! may_hold_global {
    ($name:ident, $key:ty) => {
        #[no_mangle]
        #[inline(never)]
        pub extern "C" fn $name(k: *const $key) -> i64 {
            if k.is_null() {
                return 1;
            }
            i64::from(may_hold(unsafe { &*k }))
        }
    };
}

may_hold_global!(kpr_ct_hint_may_hold, CtKey);
may_hold_global!(kpr_ct6_hint_may_hold, CtKey6);
