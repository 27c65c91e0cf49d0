//! IPv4's embryonic table (CONNTRACK_NEW): 4-way buckets in an array (proxy_common::CtBucket).
//! A probe reads its bucket's line of keys, without a helper call. Writers (an insert, an
//! eviction or a delete here, the agent's collector through its mapping of the array) hold the
//! bucket's lock; readers never take it. A full bucket gives up its oldest entry, and the caller
//! then forgets the rest of that flow (conntrack::forget_pending): a flood evicts only flows not
//! yet assured, the oldest first, as netfilter's early drop does.
//!
//! Each operation is a BPF global function (`kpr_ct_new_*`, exported by name): the verifier
//! checks it once, on its own, and at each call site sees one call that returns a number. As
//! inlined code, the lock, the way search and the pointer per way multiplied the paths it
//! walked at every one of the dozen sites: more than 1,000,000 instructions on Linux 6.1.
//! Their pointer arguments must name structs of plain numbers (CtKey, CtValue, CtEntry), and
//! the kernel may pass NULL, which each checks.
//!
//! A writer stores a way's value before its key, so a reader that finds the key finds its
//! value: x86 keeps stores in order. (A weakly ordered CPU may show a reader a new key with
//! the way's previous value for an instant, as a reused element of the kernel's preallocated
//! hash could.)
use core::intrinsics::{atomic_cxchg, atomic_xchg, AtomicOrdering};

use proxy_common::{CtBucket, CtEntry, CtKey, CtValue, CT_BUCKET_WAYS};

use crate::maps::{CONNTRACK_NEW, E2BIG, EEXIST};

/// The table's buckets less one (their count is a power of two): the agent sets it at load
/// from the array's size (a pinned array keeps its size).
#[no_mangle]
static CT_NEW_BUCKET_MASK: u32 = 0;

/// `kpr_ct_new_insert`'s answer when it took a full bucket's oldest way (the evicted entry is
/// in the pending slot that the caller named).
pub const EVICTED: i64 = 1;
/// The errno, negated, of an insert that found its bucket's lock held throughout.
const EBUSY: i32 = 16;

#[inline(always)]
fn bucket(k: &CtKey) -> Option<*mut CtBucket> {
    // Volatile: the value is the loader's, not the constant the compiler sees.
    let mask = unsafe { core::ptr::read_volatile(&CT_NEW_BUCKET_MASK) };
    CONNTRACK_NEW.get_ptr_mut(k.bucket(mask))
}

/// Way `w`'s key as two words, read as such (a bucket is 8-byte aligned; a CtKey elsewhere,
/// such as on the stack, may not be, so `CtKey::words` reads it by halves).
#[inline(always)]
fn key_words(b: *mut CtBucket, w: usize) -> [u64; 2] {
    unsafe { *(&raw const (*b).keys[w]).cast::<[u64; 2]>() }
}

/// The slot (bucket x ways + way) of `k`'s entry, or -1. A global function: the verifier
/// checks it once, on its own, and its caller sees one answer, a number, whatever the way.
#[no_mangle]
#[inline(never)]
pub extern "C" fn kpr_ct_new_find(k: *const CtKey) -> i64 {
    if k.is_null() {
        return -1;
    }
    let k = unsafe { &*k };
    let mask = unsafe { core::ptr::read_volatile(&CT_NEW_BUCKET_MASK) };
    let index = k.bucket(mask);
    let Some(b) = CONNTRACK_NEW.get_ptr_mut(index) else { return -1 };
    let want = k.words();
    for w in 0..CT_BUCKET_WAYS {
        if key_words(b, w) == want {
            return i64::from(index) * CT_BUCKET_WAYS as i64 + w as i64;
        }
    }
    -1
}

/// The entry of `k`, if any.
#[inline(always)]
pub fn get(k: &CtKey) -> Option<*mut CtValue> {
    let slot = kpr_ct_new_find(k);
    if slot < 0 {
        return None;
    }
    let b = CONNTRACK_NEW.get_ptr_mut((slot as u64 / CT_BUCKET_WAYS as u64) as u32)?;
    let way = slot as usize % CT_BUCKET_WAYS;
    Some(unsafe { (&raw mut (*b).values).cast::<CtValue>().add(way) })
}

/// Copies `src` to `dst`, which never overlap, inline: an assignment through raw pointers
/// may become a call to memmove, a subprogram with a frame of its own in the call chains that
/// Linux 6.1 counts against 512 bytes.
#[inline(always)]
pub fn copy<T>(src: *const T, dst: *mut T) {
    unsafe { core::ptr::copy_nonoverlapping(src, dst, 1) };
}

/// Zeroes a key (an empty way, or a free pending slot) with four stores, for the reason of `copy`
/// (memset).
#[inline(always)]
pub fn clear(k: *mut CtKey) {
    let words = k.cast::<u32>();
    for i in 0..4 {
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
    }
}

#[inline(always)]
fn lock(b: *mut CtBucket) -> bool {
    unsafe { atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(&raw mut (*b).lock, 0, 1) }.1
}

#[inline(always)]
fn unlock(b: *mut CtBucket) {
    unsafe { atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(&raw mut (*b).lock, 0) };
}

/// Inserts `k` -> `v` into a free way of its bucket, or fails: -EEXIST if `k` has an entry (as
/// BPF_NOEXIST: a new flow claims its tuples, it never replaces an entry), -E2BIG if the bucket
/// is full (the caller may `kpr_ct_new_evict` and try again), -EBUSY if its lock stayed held.
///
/// A global function, as `kpr_ct_new_find`. Its frame ends new_flow's call chain, which leaves
/// it 32 of Linux 6.1's 512 bytes: little is live across its one helper call.
#[no_mangle]
#[inline(never)]
pub extern "C" fn kpr_ct_new_insert(k: *const CtKey, v: *const CtValue) -> i64 {
    if k.is_null() || v.is_null() {
        return -i64::from(E2BIG);
    }
    let Some(b) = bucket(unsafe { &*k }) else { return -i64::from(E2BIG) };
    if !lock(b) {
        return -i64::from(EBUSY);
    }
    let want = unsafe { &*k }.words();
    let mut way = CT_BUCKET_WAYS;
    for w in 0..CT_BUCKET_WAYS {
        let have = key_words(b, w);
        if have == want {
            unlock(b);
            return -i64::from(EEXIST);
        }
        if way == CT_BUCKET_WAYS && have == [0, 0] {
            way = w;
        }
    }
    if way >= CT_BUCKET_WAYS {
        unlock(b);
        return -i64::from(E2BIG);
    }
    unsafe {
        copy(v, &raw mut (*b).values[way]);
        copy(k, &raw mut (*b).keys[way]);
    }
    unlock(b);
    0
}

/// Makes room in `k`'s full bucket: takes out its oldest entry older than `v` (a way stamped as
/// recently may be this flow's other entry) and puts it in `evicted` (a pending slot of
/// CT_SCRATCH), whose flow the caller forgets later. EVICTED, or -E2BIG: the bucket holds only
/// entries as recent as `v`; -EBUSY: its lock stayed held. A global function, as
/// `kpr_ct_new_insert`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn kpr_ct_new_evict(k: *const CtKey, v: *const CtValue, evicted: *mut CtEntry) -> i64 {
    if k.is_null() || v.is_null() || evicted.is_null() {
        return -i64::from(E2BIG);
    }
    let Some(b) = bucket(unsafe { &*k }) else { return -i64::from(E2BIG) };
    if !lock(b) {
        return -i64::from(EBUSY);
    }
    let mut oldest = unsafe { (*v).last_seen_ns };
    let mut way = CT_BUCKET_WAYS;
    for w in 0..CT_BUCKET_WAYS {
        let seen = unsafe { (*b).values[w].last_seen_ns };
        if seen < oldest && !unsafe { (*b).keys[w] }.is_empty() {
            oldest = seen;
            way = w;
        }
    }
    if way >= CT_BUCKET_WAYS {
        unlock(b);
        return -i64::from(E2BIG);
    }
    unsafe {
        copy(&raw const (*b).keys[way], &raw mut (*evicted).key);
        copy(&raw const (*b).values[way], &raw mut (*evicted).value);
        clear(&raw mut (*b).keys[way]);
    }
    unlock(b);
    EVICTED
}

/// Deletes `k`'s entry; 0 if there is none (or the bucket's lock was held), 1 if it was.
#[no_mangle]
#[inline(never)]
pub extern "C" fn kpr_ct_new_remove(k: *const CtKey) -> i64 {
    if k.is_null() {
        return 0;
    }
    let k = unsafe { &*k };
    let Some(b) = bucket(k) else { return 0 };
    if !lock(b) {
        return 0;
    }
    let want = k.words();
    let mut found = false;
    for w in 0..CT_BUCKET_WAYS {
        if key_words(b, w) == want {
            clear(unsafe { &raw mut (*b).keys[w] });
            found = true;
            break;
        }
    }
    unlock(b);
    i64::from(found)
}
