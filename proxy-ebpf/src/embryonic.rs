//! The embryonic tables (CONNTRACK_NEW, CONNTRACK6_NEW): 4-way buckets in an array
//! (proxy_common::CtBucket, CtBucket6), the code written once for both (CtBuckets).
//! A probe reads its bucket's line of keys, without a helper call. Writers (an insert, an
//! eviction or a delete here, the agent's collector through its mapping of the array) hold the
//! bucket's lock; readers never take it. A full bucket gives up its oldest entry, and the caller
//! then forgets the rest of that flow (conntrack::forget_pending): a flood evicts only flows not
//! yet assured, the oldest first, as netfilter's early drop does.
//!
//! Each operation is a BPF global function (`kpr_ct_new_*`, `kpr_ct6_new_*`, exported by name,
//! each the generic operation for its family's table): the verifier
//! checks it once, on its own, and at each call site sees one call that returns a number. As
//! inlined code, the lock, the way search and the pointer per way multiplied the paths it
//! walked at every one of the dozen sites: more than 1,000,000 instructions on Linux 6.1.
//! Their pointer arguments must name structs of plain numbers (CtKey, CtValue, CtEntry and
//! IPv6's), and
//! the kernel may pass NULL, which each checks.
//!
//! A writer stores a way's value before its key, so a reader that finds the key finds its
//! value: x86 keeps stores in order. (A weakly ordered CPU may show a reader a new key with
//! the way's previous value for an instant, as a reused element of the kernel's preallocated
//! hash could.)
use core::intrinsics::{atomic_cxchg, atomic_xchg, AtomicOrdering};

use aya_ebpf::maps::Array;
use proxy_common::{CtBucket, CtBucket6, CtBuckets, CtEntry, CtEntry6, CtKey, CtKey6, CtValue, CtValue6, CT_BUCKET_WAYS};

use crate::maps::{CONNTRACK6_NEW, CONNTRACK_NEW, E2BIG, EEXIST};

/// IPv4's table's buckets less one (their count is a power of two): the agent sets it at load
/// from the array's size (a pinned array keeps its size).
#[no_mangle]
static CT_NEW_BUCKET_MASK: u32 = 0;

/// IPv6's, as CT_NEW_BUCKET_MASK.
#[no_mangle]
static CT6_NEW_BUCKET_MASK: u32 = 0;

/// `evict`'s answer when it took a full bucket's oldest way (the evicted entry is in the
/// pending slot that the caller named).
const EVICTED: i64 = 1;
/// The errno, negated, of an insert that found its bucket's lock held.
const EBUSY: i32 = 16;

/// A family's table: its array, its mask, and how a way's key is compared, in few registers (a
/// spill grows the frame at the end of new_flow's call chain).
pub(crate) trait Table: CtBuckets {
    fn array() -> &'static Array<Self>;
    fn mask() -> u32;
    /// What a key is compared by.
    type Want: Copy;
    fn want(k: *const Self::Key) -> Self::Want;
    /// Whether way `w` holds the key.
    fn holds(b: *mut Self, w: usize, want: Self::Want) -> bool;
    /// Whether way `w` is empty.
    fn empty(b: *mut Self, w: usize) -> bool;
}

/// IPv4's key is two words, held in registers.
impl Table for CtBucket {
    type Want = [u64; 2];
    #[inline(always)]
    fn want(k: *const CtKey) -> [u64; 2] {
        unsafe { &*k }.words()
    }
    #[inline(always)]
    fn holds(b: *mut Self, w: usize, want: [u64; 2]) -> bool {
        way_words(b, w) == want
    }
    #[inline(always)]
    fn empty(b: *mut Self, w: usize) -> bool {
        way_words(b, w) == [0, 0]
    }
    #[inline(always)]
    fn array() -> &'static Array<Self> {
        &CONNTRACK_NEW
    }
    #[inline(always)]
    fn mask() -> u32 {
        // Volatile: the value is the loader's, not the constant the compiler sees.
        unsafe { core::ptr::read_volatile(&CT_NEW_BUCKET_MASK) }
    }
}

/// IPv6's is ten words, compared from memory one way at a time (held in registers, they would
/// spill), the ports' word first: keys of one client's flows differ there.
impl Table for CtBucket6 {
    type Want = *const CtKey6;
    #[inline(always)]
    fn want(k: *const CtKey6) -> *const CtKey6 {
        k
    }
    #[inline(always)]
    fn holds(b: *mut Self, w: usize, want: *const CtKey6) -> bool {
        let (a, b) = (want.cast::<u32>(), Self::key(b, w).cast::<u32>());
        // Word by word, leaving at the first difference: few values live at once.
        for i in (0..size_of::<CtKey6>() / 4).rev() {
            if unsafe { *a.add(i) != *b.add(i) } {
                return false;
            }
        }
        true
    }
    #[inline(always)]
    fn empty(b: *mut Self, w: usize) -> bool {
        // No flow's protocol is 0.
        unsafe { core::ptr::read_volatile(&raw const (*Self::key(b, w)).proto) == 0 }
    }
    #[inline(always)]
    fn array() -> &'static Array<Self> {
        &CONNTRACK6_NEW
    }
    #[inline(always)]
    fn mask() -> u32 {
        unsafe { core::ptr::read_volatile(&CT6_NEW_BUCKET_MASK) }
    }
}

#[inline(always)]
fn bucket<B: Table>(k: &B::Key) -> Option<*mut B> {
    B::array().get_ptr_mut(B::bucket(k, B::mask()))
}

/// IPv4's way `w`'s key as two words, read as such (a bucket is 8-byte aligned; a key
/// elsewhere, such as on the stack, may not be, so `CtKey::words` reads it by halves).
#[inline(always)]
fn way_words(b: *mut CtBucket, w: usize) -> [u64; 2] {
    unsafe { *CtBucket::key(b, w).cast::<[u64; 2]>() }
}

/// Copies `src` to `dst`, which never overlap, inline: an assignment through raw pointers
/// may become a call to memmove, a subprogram with a frame of its own in the call chains that
/// Linux 6.1 counts against 512 bytes.
#[inline(always)]
pub fn copy<T>(src: *const T, dst: *mut T) {
    unsafe { core::ptr::copy_nonoverlapping(src, dst, 1) };
}

/// Zeroes a key (an empty way, or a free pending slot) with word stores, for the reason of
/// `copy` (memset).
#[inline(always)]
pub fn clear<K>(k: *mut K) {
    let words = k.cast::<u32>();
    for i in 0..size_of::<K>() / 4 {
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
    }
}

#[inline(always)]
fn lock<B: Table>(b: *mut B) -> bool {
    unsafe { atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(B::lock(b), 0, 1) }.1
}

#[inline(always)]
fn unlock<B: Table>(b: *mut B) {
    unsafe { atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(B::lock(b), 0) };
}

/// The slot (bucket x ways + way) of `k`'s entry, or -1.
#[inline(always)]
fn find<B: Table>(k: *const B::Key) -> i64 {
    if k.is_null() {
        return -1;
    }
    let k = unsafe { &*k };
    let index = B::bucket(k, B::mask());
    let Some(b) = B::array().get_ptr_mut(index) else { return -1 };
    let want = B::want(k);
    for w in 0..CT_BUCKET_WAYS {
        if B::holds(b, w, want) {
            return i64::from(index) * CT_BUCKET_WAYS as i64 + w as i64;
        }
    }
    -1
}

/// The entry of `slot` (`find`'s answer), if any.
#[inline(always)]
fn value_of<B: Table>(slot: i64) -> Option<*mut B::Value> {
    if slot < 0 {
        return None;
    }
    let b = B::array().get_ptr_mut((slot as u64 / CT_BUCKET_WAYS as u64) as u32)?;
    Some(B::value(b, slot as usize % CT_BUCKET_WAYS))
}

/// Inserts `k` -> `v` into a free way of its bucket, or fails: -EEXIST if `k` has an entry (as
/// BPF_NOEXIST: a new flow claims its tuples, it never replaces an entry), -E2BIG if the bucket
/// is full (the caller may `evict` and try again), -EBUSY if its lock was held.
#[inline(always)]
fn insert<B: Table>(k: *const B::Key, v: *const B::Value) -> i64 {
    if k.is_null() || v.is_null() {
        return -i64::from(E2BIG);
    }
    let Some(b) = bucket::<B>(unsafe { &*k }) else { return -i64::from(E2BIG) };
    if !lock(b) {
        return -i64::from(EBUSY);
    }
    let want = B::want(k);
    let mut way = CT_BUCKET_WAYS;
    for w in 0..CT_BUCKET_WAYS {
        if B::holds(b, w, want) {
            unlock(b);
            return -i64::from(EEXIST);
        }
        if way == CT_BUCKET_WAYS && B::empty(b, w) {
            way = w;
        }
    }
    if way >= CT_BUCKET_WAYS {
        unlock(b);
        return -i64::from(E2BIG);
    }
    copy(v, B::value(b, way));
    copy(k, B::key(b, way));
    unlock(b);
    0
}

/// Makes room in `k`'s full bucket: takes out its oldest entry not stamped as `v` (a way
/// stamped so is this flow's other entry: conntrack::kpr_new_flow_stamp stamps a CPU's flows
/// apart) and puts it in `evicted_key` and `evicted_value` (a pending slot of the scratch
/// entry), whose flow the caller forgets later. The oldest, even if stamped later than `v`:
/// another CPU's flows of this tick may be, and a bucket full of them (a flood there) must
/// still give way. EVICTED, or -E2BIG: the bucket holds only entries stamped as `v`; -EBUSY:
/// its lock was held.
#[inline(always)]
fn evict<B: Table>(k: *const B::Key, v: *const B::Value, evicted_key: *mut B::Key, evicted_value: *mut B::Value) -> i64 {
    if k.is_null() || v.is_null() || evicted_key.is_null() || evicted_value.is_null() {
        return -i64::from(E2BIG);
    }
    let Some(b) = bucket::<B>(unsafe { &*k }) else { return -i64::from(E2BIG) };
    if !lock(b) {
        return -i64::from(EBUSY);
    }
    let own = B::last_seen(unsafe { &*v });
    let mut oldest = u64::MAX;
    let mut way = CT_BUCKET_WAYS;
    for w in 0..CT_BUCKET_WAYS {
        let seen = B::last_seen(unsafe { &*B::value(b, w) });
        if seen != own && seen <= oldest && !B::empty(b, w) {
            oldest = seen;
            way = w;
        }
    }
    if way >= CT_BUCKET_WAYS {
        unlock(b);
        return -i64::from(E2BIG);
    }
    copy(B::key(b, way), evicted_key);
    copy(B::value(b, way), evicted_value);
    clear(B::key(b, way));
    unlock(b);
    EVICTED
}

/// Deletes `k`'s entry; 0 if there is none (or the bucket's lock was held), 1 if it was.
#[inline(always)]
fn remove<B: Table>(k: *const B::Key) -> i64 {
    if k.is_null() {
        return 0;
    }
    let k = unsafe { &*k };
    let Some(b) = bucket::<B>(k) else { return 0 };
    if !lock(b) {
        return 0;
    }
    let want = B::want(k);
    let mut found = false;
    for w in 0..CT_BUCKET_WAYS {
        if B::holds(b, w, want) {
            clear(B::key(b, w));
            found = true;
            break;
        }
    }
    unlock(b);
    i64::from(found)
}

// The global functions, each family's: the same four, named by family. Their frames end call
// chains that Linux 6.1 counts against 512 bytes (IPv4's insert: new_flow's, which leaves it
// 32): little is live across their one helper call.
/// A family's insert and evict, as its global functions.
pub(crate) trait Globals: Table {
    /// Its entry (CtEntry, CtEntry6).
    type Entry;
    fn insert_global(k: *const Self::Key, v: *const Self::Value) -> i64;
    fn evict_global(k: *const Self::Key, v: *const Self::Value, evicted: *mut Self::Entry) -> i64;
}

macro_rules! global_functions {
    ($bucket:ty, $key:ty, $value:ty, $entry:ty, $find:ident, $insert:ident, $evict:ident, $remove:ident) => {
        /// `find` in this family's table.
        #[no_mangle]
        #[inline(never)]
        pub extern "C" fn $find(k: *const $key) -> i64 {
            find::<$bucket>(k)
        }

        /// `insert` into this family's table.
        #[no_mangle]
        #[inline(never)]
        pub extern "C" fn $insert(k: *const $key, v: *const $value) -> i64 {
            insert::<$bucket>(k, v)
        }

        /// `evict` from this family's table, to `evicted`.
        #[no_mangle]
        #[inline(never)]
        pub extern "C" fn $evict(k: *const $key, v: *const $value, evicted: *mut $entry) -> i64 {
            if evicted.is_null() {
                return -i64::from(E2BIG);
            }
            evict::<$bucket>(k, v, unsafe { &raw mut (*evicted).key }, unsafe { &raw mut (*evicted).value })
        }

        /// `remove` from this family's table.
        #[no_mangle]
        #[inline(never)]
        pub extern "C" fn $remove(k: *const $key) -> i64 {
            remove::<$bucket>(k)
        }

        impl Globals for $bucket {
            type Entry = $entry;
            #[inline(always)]
            fn insert_global(k: *const $key, v: *const $value) -> i64 {
                $insert(k, v)
            }
            #[inline(always)]
            fn evict_global(k: *const $key, v: *const $value, evicted: *mut $entry) -> i64 {
                $evict(k, v, evicted)
            }
        }
    };
}

global_functions!(CtBucket, CtKey, CtValue, CtEntry, kpr_ct_new_find, kpr_ct_new_insert, kpr_ct_new_evict, kpr_ct_new_remove);
global_functions!(CtBucket6, CtKey6, CtValue6, CtEntry6, kpr_ct6_new_find, kpr_ct6_new_insert, kpr_ct6_new_evict, kpr_ct6_new_remove);

/// Inserts `k` -> `v` into a family's table; at a full bucket, evicts its oldest entry to
/// `evicted` (a pending slot: the caller forgets that flow once the packet's entries are in)
/// and inserts again. The errno, negated, of what failed.
#[inline(always)]
pub(crate) fn insert_evicting<B: Globals>(k: *const B::Key, v: *const B::Value, evicted: *mut B::Entry) -> Result<(), i32> {
    match B::insert_global(k, v) {
        0 => Ok(()),
        e if e == -i64::from(E2BIG) && B::evict_global(k, v, evicted) == EVICTED => match B::insert_global(k, v) {
            0 => Ok(()),
            e => Err(e as i32),
        },
        e => Err(e as i32),
    }
}

/// IPv4's entry of `k`, if any.
#[inline(always)]
pub fn get(k: &CtKey) -> Option<*mut CtValue> {
    value_of::<CtBucket>(kpr_ct_new_find(k))
}

/// IPv6's entry of `k`, if any.
#[inline(always)]
pub fn get6(k: &CtKey6) -> Option<*mut CtValue6> {
    value_of::<CtBucket6>(kpr_ct6_new_find(k))
}
