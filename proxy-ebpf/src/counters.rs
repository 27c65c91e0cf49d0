//! Per-CPU counters instead of logging on the hot path.
use crate::maps::KPR_CNT_V1;

#[inline(always)]
pub fn bump(index: u32) {
    if let Some(p) = KPR_CNT_V1.get_ptr_mut(index) {
        // Per-CPU slot: no other writer.
        unsafe { *p += 1 };
    }
}
