//! IPv6's embryonic table's ring. That table is a preallocated hash, which never evicts by
//! itself: each CPU remembers the forward keys of the last flows it opened in its part of a
//! ring, and an insert into the full table forgets the oldest of them still embryonic
//! (conntrack6::make_room). (IPv4's table evicts per bucket, embryonic.rs.) Generic over the
//! key.
use aya_ebpf::{helpers::bpf_get_smp_processor_id, maps::Array};
use proxy_common::{
    limits::CT6_NEW_RING_SLOTS,
    CtKey6,
};

use crate::maps::{RingPos, CT6_NEW_RING, CT6_NEW_RING_BUSY, CT6_NEW_RING_POS};

/// A CPU whose part holds at least this many keys says so in the ring's `busy` word (checked
/// every this many keys: the shared word is seldom written).
const RING_BUSY: u32 = 256;

/// One family's ring: CPU c's part is `slots` keys from c x `slots` (see RingPos).
pub struct Ring<K: 'static> {
    keys: &'static Array<K>,
    pos: &'static Array<RingPos>,
    /// Index 0: the CPU that last had many keys (where a CPU with none of its own takes one).
    busy: &'static Array<u32>,
    /// A power of two.
    slots: u32,
}

/// IPv6's (CONNTRACK6_NEW's flows).
#[inline(always)]
pub fn ipv6() -> Ring<CtKey6> {
    Ring { keys: &CT6_NEW_RING, pos: &CT6_NEW_RING_POS, busy: &CT6_NEW_RING_BUSY, slots: CT6_NEW_RING_SLOTS }
}

impl<K: Copy + 'static> Ring<K> {
    /// Records a new embryonic flow's forward key in this CPU's part, overwriting its oldest.
    #[inline(always)]
    pub fn remember(&self, k: &K) {
        let cpu = unsafe { bpf_get_smp_processor_id() };
        let Some(pos) = self.pos.get_ptr_mut(cpu) else {
            return;
        };
        let pos = unsafe { &mut *pos };
        if let Some(slot) = self.keys.get_ptr_mut(cpu.wrapping_mul(self.slots) + (pos.head & (self.slots - 1))) {
            unsafe { *slot = *k };
        }
        pos.head = pos.head.wrapping_add(1);
        let held = pos.head.wrapping_sub(pos.tail);
        if held > self.slots {
            pos.tail = pos.head.wrapping_sub(self.slots);
        }
        if pos.head % RING_BUSY == 0 && held >= RING_BUSY {
            if let Some(busy) = self.busy.get_ptr_mut(0) {
                if unsafe { *busy } != cpu {
                    unsafe { *busy = cpu };
                }
            }
        }
    }

    /// Offers `evict` the oldest keys not yet taken, up to 8: of this CPU's part, then of the
    /// busy CPU's (a flood on one CPU must not keep the others from opening flows). A key's
    /// flow may have completed or expired since: `evict` says whether it evicted one. False:
    /// none did.
    #[inline(always)]
    pub fn evict_oldest(&self, mut evict: impl FnMut(&'static K) -> bool) -> bool {
        let cpu = unsafe { bpf_get_smp_processor_id() };
        let busy = self.busy.get(0).copied().unwrap_or(cpu);
        let mut tries = 0;
        while tries < 8 {
            let part = if tries < 4 { cpu } else { busy };
            tries += 1;
            if let Some(k) = self.take_oldest(part) {
                if evict(k) {
                    return true;
                }
            }
        }
        false
    }

    /// Takes `part`'s oldest key not yet taken (None: the part has none).
    #[inline(always)]
    fn take_oldest(&self, part: u32) -> Option<&'static K> {
        let pos = unsafe { &mut *self.pos.get_ptr_mut(part)? };
        if pos.tail == pos.head {
            return None;
        }
        let slot = self.keys.get_ptr_mut(part.wrapping_mul(self.slots) + (pos.tail & (self.slots - 1)))?;
        pos.tail = pos.tail.wrapping_add(1);
        Some(unsafe { &*slot })
    }
}
