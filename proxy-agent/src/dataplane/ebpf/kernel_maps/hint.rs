//! An assured table's hint (see proxy_common::CtHinted), in the lock lines of its family's
//! embryonic table (IPv4's KPR_CT_NEW_V3, IPv6's KPR_CT6_NEW_V3), mapped into the agent. Its
//! words are changed only by atomic ORs and ANDs, as the data path's: set whole at load, a
//! key's bits set around every insert the agent makes into the assured table, a half rebuilt
//! by the collector (dataplane/ebpf/hint.rs).
use std::sync::atomic::{AtomicU64, Ordering};

use proxy_common::{hint_bits, hint_half, map_names, CtBucket, CtBucket6, CtBuckets, CtHinted, CtValue, CtValue6, CT_HINT_WORDS};

use super::{mapped::Mapped, KernelAssured};
use crate::dataplane::ebpf::{
    hint::{HintWords, Rebuild},
    maps::MapError,
};

/// A family's embryonic table, whose buckets hold its assured table's hint: the pair, named
/// once for everything that opens a hint.
pub trait HintedFamily: CtBuckets<Key: aya::Pod> {
    /// The family's metric label.
    const FAMILY: &'static str;
    /// The embryonic table, whose buckets hold the words.
    const EMBRYONIC: &'static str;
    /// The assured table they hint, and its value.
    const ASSURED: &'static str;
    type AssuredValue: aya::Pod + bytemuck::Pod;
}

impl HintedFamily for CtBucket {
    const FAMILY: &'static str = "ipv4";
    const EMBRYONIC: &'static str = map_names::CONNTRACK_NEW;
    const ASSURED: &'static str = map_names::CONNTRACK;
    type AssuredValue = CtValue;
}

impl HintedFamily for CtBucket6 {
    const FAMILY: &'static str = "ipv6";
    const EMBRYONIC: &'static str = map_names::CONNTRACK6_NEW;
    const ASSURED: &'static str = map_names::CONNTRACK6;
    type AssuredValue = CtValue6;
}

/// The hint words of an embryonic table's buckets (`B`), for the keys of its family's assured
/// table.
pub struct Hint<B: CtBuckets> {
    buckets: Mapped<B>,
}

impl<B: HintedFamily> Hint<B> {
    /// Maps the family's pinned embryonic table for its hint words.
    pub fn open(pin_dir: &std::path::Path) -> Result<Self, MapError> {
        Mapped::open(pin_dir, B::EMBRYONIC).map(|buckets| Self { buckets })
    }
}

impl<B: CtBuckets> Hint<B> {
    /// The words, counted across the buckets.
    fn words(&self) -> u32 {
        self.buckets.count * CT_HINT_WORDS as u32
    }

    fn word(&self, i: u32) -> &AtomicU64 {
        let b = self.buckets.at(i / CT_HINT_WORDS as u32);
        unsafe { AtomicU64::from_ptr(B::hint(b, i as usize % CT_HINT_WORDS)) }
    }

    fn slot(&self, key: &B::Key) -> (u32, u32) {
        key.hint_slot(self.buckets.count - 1)
    }

    /// Sets every bit: every probe happens until the collector has rebuilt both halves. At
    /// each load (an earlier release's programs may have filled the table unhinted).
    pub fn fill(&self) {
        (0..self.words()).for_each(|i| {
            self.word(i).fetch_or(u64::MAX, Ordering::SeqCst);
        });
    }

    /// Sets `key`'s bits in both halves.
    fn note(&self, key: &B::Key) {
        let (w, bit) = self.slot(key);
        self.word(w).fetch_or(hint_bits(bit), Ordering::SeqCst);
    }

    /// Runs `insert`, which puts `key` into the assured table, with the key's bits set before
    /// it and after it, as the data path's inserts set them (see CtHinted): every writer of an
    /// assured table in user space goes through this.
    pub fn noting<R>(&self, key: &B::Key, insert: impl FnOnce() -> R) -> R {
        self.note(key);
        let inserted = insert();
        self.note(key);
        inserted
    }

    /// The share of `half`'s bits that are set.
    pub fn share_set(&self, half: u32) -> f64 {
        let ones: u64 = (0..self.words()).map(|i| u64::from((self.word(i).load(Ordering::Relaxed) & hint_half(half)).count_ones())).sum();
        ones as f64 / (f64::from(self.words()) * 32.0)
    }

    /// Whether the data path would probe the assured table for `key`.
    pub fn may_hold(&self, key: &B::Key) -> bool {
        let (w, bit) = self.slot(key);
        self.word(w).load(Ordering::SeqCst) & hint_bits(bit) != 0
    }
}

impl<B: CtBuckets> HintWords<B::Key> for Hint<B> {
    fn clear_half(&mut self, half: u32) {
        (0..self.words()).for_each(|i| {
            self.word(i).fetch_and(!hint_half(half), Ordering::SeqCst);
        });
    }
    fn note_in_half(&mut self, key: &B::Key, half: u32) {
        let (w, bit) = self.slot(key);
        self.word(w).fetch_or(hint_bits(bit) & hint_half(half), Ordering::SeqCst);
    }
}

/// Both families' hints rebuilt from their assured tables now: two passes each, as the
/// collector's rounds make within seconds of a load. For the tests and the benchmark, which
/// run no collector.
pub fn rebuild_hints_now(pin_dir: &std::path::Path) -> Result<(), MapError> {
    fn rebuild<B: HintedFamily>(pin_dir: &std::path::Path) -> Result<(), MapError> {
        let (table, mut hint) = (KernelAssured::<B::Key, B::AssuredValue>::open(pin_dir, B::ASSURED)?, Hint::<B>::open(pin_dir)?);
        let mut r = Rebuild::default();
        while r.passes < 2 {
            r.round(&table, &mut hint, 16_384)?;
        }
        Ok(())
    }
    rebuild::<CtBucket>(pin_dir)?;
    rebuild::<CtBucket6>(pin_dir)
}
