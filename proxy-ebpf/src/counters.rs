//! Per-CPU counters instead of logging on the hot path.
use core::intrinsics::{atomic_xadd, AtomicOrdering};

use crate::maps::{BACKEND_ACTIVE, BACKEND_FAIL, BACKEND_NEW, COUNTERS};

#[inline(always)]
pub fn bump(index: u32) {
    if let Some(p) = COUNTERS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer.
        unsafe { *p += 1 };
    }
}

/// One more new connection for this backend: an atomic add on the slot every CPU shares.
#[inline(always)]
pub fn backend_new(backend_id: u32) {
    if let Some(p) = BACKEND_NEW.get_ptr_mut(backend_id) {
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, 1) };
    }
}

/// One more open flow on this backend: an atomic add on the slot every CPU shares.
#[inline(always)]
pub fn backend_active(backend_id: u32) {
    if let Some(p) = BACKEND_ACTIVE.get_ptr_mut(backend_id) {
        unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(p, 1) };
    }
}

/// One open flow fewer (its client closed it), never below zero. Not atomic (a compare and
/// exchange loop would be): one lost to a race is corrected by the collector's next count.
#[inline(always)]
pub fn backend_closed(backend_id: u32) {
    if let Some(p) = BACKEND_ACTIVE.get_ptr_mut(backend_id) {
        unsafe { *p = (*p).saturating_sub(1) };
    }
}

/// The backend answered a new connection with a reset: one more refusal in a row.
#[inline(always)]
pub fn backend_refused(backend_id: u32) {
    match BACKEND_FAIL.get_ptr_mut(&backend_id) {
        Some(p) => unsafe { *p = (*p).saturating_add(1) },
        None => {
            let _ = BACKEND_FAIL.insert(&backend_id, &1, 0);
        }
    }
}

/// A handshake completed: the backend's refusals are no longer in a row.
#[inline(always)]
pub fn backend_answered(backend_id: u32) {
    if unsafe { BACKEND_FAIL.get(&backend_id) }.is_some() {
        let _ = BACKEND_FAIL.remove(&backend_id);
    }
}
