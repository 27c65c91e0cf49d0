//! Per-CPU counters instead of logging on the hot path.
use crate::maps::{KPR_BE_NEW_V1, KPR_CNT_V4};

#[inline(always)]
pub fn bump(index: u32) {
    if let Some(p) = KPR_CNT_V4.get_ptr_mut(index) {
        // Per-CPU slot: no other writer.
        unsafe { *p += 1 };
    }
}

/// One more new connection for this backend.
#[inline(always)]
pub fn backend_new(backend_id: u32) {
    if let Some(p) = KPR_BE_NEW_V1.get_ptr_mut(backend_id) {
        unsafe { *p += 1 };
    }
}
