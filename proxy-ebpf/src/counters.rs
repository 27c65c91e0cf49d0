//! Per-CPU counters instead of logging on the hot path.
use crate::maps::{BACKEND_NEW, COUNTERS};

#[inline(always)]
pub fn bump(index: u32) {
    if let Some(p) = COUNTERS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer.
        unsafe { *p += 1 };
    }
}

/// One more new connection for this backend.
#[inline(always)]
pub fn backend_new(backend_id: u32) {
    if let Some(p) = BACKEND_NEW.get_ptr_mut(backend_id) {
        unsafe { *p += 1 };
    }
}
