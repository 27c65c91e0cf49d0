//! An assured table's hint (IPv4's KPR_CT_HINT_V1, IPv6's KPR_CT6_HINT_V1; see
//! proxy_common::CtHinted) mapped into the agent. Its words are changed only by atomic ORs and
//! ANDs, as the data path's: set whole at load, a key's bits set around every insert the agent
//! makes into the assured table, a half rebuilt by the collector (dataplane/ebpf/hint.rs).
use std::{
    marker::PhantomData,
    sync::atomic::{AtomicU64, Ordering},
};

use proxy_common::{hint_bits, hint_half, map_names, CtHinted, CtKey, CtKey6, CtValue, CtValue6};

use super::{mapped::Mapped, KernelAssured};
use crate::dataplane::ebpf::{
    hint::{HintWords, Rebuild},
    maps::MapError,
};

pub struct Hint<K: CtHinted> {
    words: Mapped<u64>,
    key: PhantomData<K>,
}

impl<K: CtHinted> Hint<K> {
    /// Maps the pinned hint.
    pub fn open(pin_dir: &std::path::Path, map: &'static str) -> Result<Self, MapError> {
        let words = Mapped::open(pin_dir, map, "a hint")?;
        if words.count != K::HINT_WORDS {
            return Err(MapError::Other { map, message: format!("{} words, not {}", words.count, K::HINT_WORDS) });
        }
        Ok(Self { words, key: PhantomData })
    }

    fn word(&self, i: u32) -> &AtomicU64 {
        unsafe { AtomicU64::from_ptr(self.words.at(i)) }
    }

    /// Sets every bit: every probe happens until the collector has rebuilt both halves. At
    /// each load (an earlier release's programs may have filled the table unhinted).
    pub fn fill(&self) {
        (0..K::HINT_WORDS).for_each(|i| {
            self.word(i).fetch_or(u64::MAX, Ordering::SeqCst);
        });
    }

    /// Sets `key`'s bits in both halves.
    fn note(&self, key: &K) {
        let (w, bit) = key.hint_slot();
        self.word(w).fetch_or(hint_bits(bit), Ordering::SeqCst);
    }

    /// Runs `insert`, which puts `key` into the assured table, with the key's bits set before
    /// it and after it, as the data path's inserts set them (see CtHinted): every writer of an
    /// assured table in user space goes through this.
    pub fn noting<R>(&self, key: &K, insert: impl FnOnce() -> R) -> R {
        self.note(key);
        let inserted = insert();
        self.note(key);
        inserted
    }

    /// The share of `half`'s bits that are set.
    pub fn share_set(&self, half: u32) -> f64 {
        let ones: u32 = (0..K::HINT_WORDS).map(|i| (self.word(i).load(Ordering::Relaxed) & hint_half(half)).count_ones()).sum();
        f64::from(ones) / (f64::from(K::HINT_WORDS) * 32.0)
    }

    /// Whether the data path would probe the assured table for `key`.
    pub fn may_hold(&self, key: &K) -> bool {
        let (w, bit) = key.hint_slot();
        self.word(w).load(Ordering::SeqCst) & hint_bits(bit) != 0
    }
}

impl<K: CtHinted> HintWords<K> for Hint<K> {
    fn clear_half(&mut self, half: u32) {
        (0..K::HINT_WORDS).for_each(|i| {
            self.word(i).fetch_and(!hint_half(half), Ordering::SeqCst);
        });
    }
    fn note_in_half(&mut self, key: &K, half: u32) {
        let (w, bit) = key.hint_slot();
        self.word(w).fetch_or(hint_bits(bit) & hint_half(half), Ordering::SeqCst);
    }
}

/// Both families' hints rebuilt from their assured tables now: two passes each, as the
/// collector's rounds make within seconds of a load. For the tests and the benchmark, which
/// run no collector.
pub fn rebuild_hints_now(pin_dir: &std::path::Path) -> Result<(), MapError> {
    fn rebuild<K: CtHinted + aya::Pod + bytemuck::Pod, V: aya::Pod + bytemuck::Pod>(
        pin_dir: &std::path::Path,
        table: &'static str,
        hint: &'static str,
    ) -> Result<(), MapError> {
        let (table, mut hint) = (KernelAssured::<K, V>::open(pin_dir, table)?, Hint::<K>::open(pin_dir, hint)?);
        let mut r = Rebuild::default();
        while r.passes < 2 {
            r.round(&table, &mut hint, 16_384)?;
        }
        Ok(())
    }
    rebuild::<CtKey, CtValue>(pin_dir, map_names::CONNTRACK, map_names::CONNTRACK_HINT)?;
    rebuild::<CtKey6, CtValue6>(pin_dir, map_names::CONNTRACK6, map_names::CONNTRACK6_HINT)
}
