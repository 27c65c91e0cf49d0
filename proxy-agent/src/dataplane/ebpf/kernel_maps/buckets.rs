//! An embryonic table (IPv4's KPR_CT_NEW_V3, IPv6's KPR_CT6_NEW_V3: arrays of
//! proxy_common::CtBucket and CtBucket6, one code for both through CtBuckets) mapped into the
//! agent. A read
//! copies ways without the lock, as the data path's probes do (a way caught mid-write is checked
//! again under the lock before anything is deleted). A write (the collector's deletes and
//! flags, an upgrade's carry-over) holds the bucket's lock, which the data path's writers take
//! with BPF's compare-and-exchange on the same word.
use std::sync::atomic::{AtomicU64, Ordering};

use proxy_common::{CtBuckets, CT_BUCKET_WAYS};

use super::mapped::Mapped;
use crate::dataplane::ebpf::{bpf_batch::Batch, maps::MapError};

/// How long a writer spins for a bucket's lock before it gives up (the data path holds it for a
/// few stores, and cannot be preempted meanwhile).
const LOCK_SPINS: u32 = 100_000;

/// The table's array, mapped shared.
pub struct Buckets<B: CtBuckets>(Mapped<B>);

/// What `update` does with the entry it found.
enum Change<V> {
    Keep,
    Delete,
    Write(V),
}

impl<B: CtBuckets> Buckets<B> {
    /// Maps `data`, the array named `map` (the mapping keeps the map alive).
    pub fn map(map: &'static str, data: &aya::maps::MapData) -> Result<Self, MapError> {
        Mapped::map(map, data).map(Self)
    }

    /// Maps the pinned array.
    pub fn open(pin_dir: &std::path::Path, map: &'static str) -> Result<Self, MapError> {
        Mapped::open(pin_dir, map).map(Self)
    }

    /// How many buckets the array has (a power of two): a key's bucket is
    /// `CtBuckets::bucket(key, buckets - 1)`.
    pub fn buckets(&self) -> u32 {
        self.0.count
    }

    fn bucket(&self, i: u32) -> *mut B {
        self.0.at(i)
    }

    fn bucket_of(&self, key: &B::Key) -> *mut B {
        self.bucket(B::bucket(key, self.0.count - 1))
    }

    /// Way `w`'s entry, None if empty. Unlocked: a way being written may read torn.
    fn way(b: *mut B, w: usize) -> Option<(B::Key, B::Value)> {
        let key = unsafe { std::ptr::read_volatile(B::key(b, w)) };
        (!B::is_empty(&key)).then(|| (key, unsafe { std::ptr::read_volatile(B::value(b, w)) }))
    }

    /// The entries of the `max / CT_BUCKET_WAYS` buckets from bucket `cursor` on (so at most
    /// `max`), and the bucket to go on from (None: that was the last). Bounded by buckets, not
    /// by the entries found: a round over a sparse table read every bucket, 8 ms for IPv4's
    /// default table and 3 ms for IPv6's every 250 ms on the AMD EPYC VM (a bucket's keys are a
    /// cache line, a miss each).
    pub fn read_batch(&self, cursor: Option<u32>, max: usize) -> Batch<B::Key, B::Value> {
        let start = cursor.unwrap_or(0).min(self.0.count);
        let buckets = u32::try_from(max.div_ceil(CT_BUCKET_WAYS).max(1)).unwrap_or(u32::MAX);
        let end = start.saturating_add(buckets).min(self.0.count);
        let out = (start..end).flat_map(|i| {
            let b = self.bucket(i);
            (0..CT_BUCKET_WAYS).filter_map(move |w| Self::way(b, w))
        });
        (out.collect(), (end < self.0.count).then_some(end))
    }

    /// Every entry: one batch of them all.
    pub fn read_all(&self) -> Vec<(B::Key, B::Value)> {
        self.read_batch(None, usize::MAX).0
    }

    pub fn get(&self, key: &B::Key) -> Option<B::Value> {
        let b = self.bucket_of(key);
        (0..CT_BUCKET_WAYS).filter_map(|w| Self::way(b, w)).find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Runs `change` on `key`'s entry under its bucket's lock. Ok(false): no such entry, or
    /// `change` kept it, or the lock stayed held (the collector tries again next round).
    fn update(&self, key: &B::Key, change: impl FnOnce(&B::Value) -> Change<B::Value>) -> Result<bool, MapError> {
        let b = self.bucket_of(key);
        let Some(_held) = Lock::take(b) else {
            tracing::debug!(map = self.0.map, "a bucket's lock stayed held: the entry is left for the next round");
            return Ok(false);
        };
        for w in 0..CT_BUCKET_WAYS {
            match Self::way(b, w) {
                Some((k, v)) if k == *key => {
                    match change(&v) {
                        Change::Keep => return Ok(false),
                        Change::Delete => unsafe { std::ptr::write_volatile(B::key(b, w), B::Key::default()) },
                        Change::Write(v) => unsafe { std::ptr::write_volatile(B::value(b, w), v) },
                    }
                    return Ok(true);
                }
                _ => {}
            }
        }
        Ok(false)
    }

    /// Deletes `key`'s entry if `delete` holds for it.
    pub fn delete_if(&self, key: &B::Key, delete: impl FnOnce(&B::Value) -> bool) -> Result<bool, MapError> {
        self.update(key, |v| if delete(v) { Change::Delete } else { Change::Keep })
    }

    /// Replaces `key`'s entry by what `change` makes of it, if anything.
    pub fn change_if(&self, key: &B::Key, change: impl FnOnce(&B::Value) -> Option<B::Value>) -> Result<bool, MapError> {
        self.update(key, |v| change(v).map_or(Change::Keep, Change::Write))
    }

    /// Inserts `key` -> `value` into a free way of its bucket (an upgrade's carry-over). False:
    /// the key is there, its bucket is full, or its lock stayed held.
    pub fn insert(&self, key: &B::Key, value: &B::Value) -> bool {
        let b = self.bucket_of(key);
        let Some(_held) = Lock::take(b) else { return false };
        let ways: Vec<_> = (0..CT_BUCKET_WAYS).map(|w| Self::way(b, w)).collect();
        if ways.iter().flatten().any(|(k, _)| k == key) {
            return false;
        }
        let Some(w) = ways.iter().position(Option::is_none) else { return false };
        // The value first, as the data path writes it: a reader that finds the key finds it.
        unsafe {
            std::ptr::write_volatile(B::value(b, w), *value);
            std::sync::atomic::fence(Ordering::Release);
            std::ptr::write_volatile(B::key(b, w), *key);
        }
        true
    }
}

/// A bucket's lock (its word), held until dropped.
struct Lock(*mut u64);

impl Lock {
    fn take<B: CtBuckets>(b: *mut B) -> Option<Self> {
        let word = unsafe { AtomicU64::from_ptr(B::lock(b)) };
        for _ in 0..LOCK_SPINS {
            if word.compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return Some(Self(B::lock(b)));
            }
            std::hint::spin_loop();
        }
        None
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        unsafe { AtomicU64::from_ptr(self.0) }.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::{CtBucket, CtBucket6, CtKey, CtKey6, CtValue, CtValue6};

    /// A Buckets over anonymous memory (tests/fixtures.rs runs these operations against the
    /// kernel's array).
    fn anonymous<B: CtBuckets>(count: u32) -> Buckets<B> {
        Buckets(Mapped::anonymous(count))
    }

    fn key(port: u16) -> CtKey {
        CtKey { saddr: 1, daddr: 2, sport: port, dport: 80, proto: 6, dir: 0, _pad: 0 }
    }

    #[test]
    fn insert_read_change_delete() {
        let t = anonymous::<CtBucket>(4);
        let v = CtValue { last_seen_ns: 7, backend_id: 3, ..Default::default() };
        assert!(t.insert(&key(1), &v));
        assert!(!t.insert(&key(1), &v), "a key is inserted once");
        assert_eq!(t.get(&key(1)), Some(v));
        assert_eq!(t.get(&key(2)), None);
        assert!(t.change_if(&key(1), |v| Some(CtValue { flags: 4, ..*v })).unwrap());
        assert_eq!(t.get(&key(1)).unwrap().flags, 4);
        assert!(!t.delete_if(&key(1), |v| v.backend_id == 9).unwrap(), "kept: not what the caller read");
        assert!(t.delete_if(&key(1), |v| v.backend_id == 3).unwrap());
        assert_eq!(t.get(&key(1)), None);
        assert!(!t.delete_if(&key(1), |_| true).unwrap(), "a second delete finds nothing");
    }

    #[test]
    fn a_bucket_holds_four_and_batches_cover_every_entry() {
        let t = anonymous::<CtBucket>(2);
        let mut held = Vec::new();
        for port in 1..=64u16 {
            if t.insert(&key(port), &CtValue { last_seen_ns: u64::from(port), ..Default::default() }) {
                held.push(port);
            }
        }
        assert_eq!(held.len(), 8, "two buckets of four: {held:?}");
        let mut read = Vec::new();
        let mut cursor = None;
        loop {
            let (batch, next) = t.read_batch(cursor, 1);
            read.extend(batch.into_iter().map(|(k, _)| k.sport));
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        let mut want: Vec<u16> = held.clone();
        want.sort();
        read.sort();
        assert_eq!(read, want);
    }

    /// However sparse the table, a batch reads `max / 4` buckets: a pass over 16 buckets in
    /// batches of up to 8 entries takes 8 rounds, and finds the one entry once.
    #[test]
    fn a_batch_reads_a_bounded_number_of_buckets_however_sparse() {
        let t = anonymous::<CtBucket>(16);
        assert!(t.insert(&key(7), &CtValue::default()));
        let (mut cursor, mut rounds, mut found) = (None, 0, 0);
        loop {
            let (batch, next) = t.read_batch(cursor, 8);
            rounds += 1;
            found += batch.len();
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        assert_eq!((rounds, found), (8, 1));
        assert_eq!(t.read_all().len(), 1, "every bucket at once");
    }

    #[test]
    fn a_held_lock_keeps_writers_out() {
        let t = anonymous::<CtBucket>(1);
        let held = Lock::take(t.bucket(0)).unwrap();
        assert!(!t.insert(&key(1), &CtValue::default()), "the data path holds the bucket");
        drop(held);
        assert!(t.insert(&key(1), &CtValue::default()));
    }

    #[test]
    fn ipv6_buckets_hold_four_and_find_their_keys() {
        let t = anonymous::<CtBucket6>(2);
        let key = |port: u16| CtKey6 { saddr: [1, 2, 3, 4], daddr: [5, 6, 7, 8], sport: port, dport: 80, proto: 17, dir: 0, _pad: 0 };
        let held: Vec<u16> = (1..=64u16).filter(|&p| t.insert(&key(p), &CtValue6 { last_seen_ns: u64::from(p), ..Default::default() })).collect();
        assert_eq!(held.len(), 8, "two buckets of four: {held:?}");
        for &p in &held {
            assert_eq!(t.get(&key(p)).map(|v| v.last_seen_ns), Some(u64::from(p)));
        }
        assert!(t.delete_if(&key(held[0]), |_| true).unwrap());
        assert_eq!(t.get(&key(held[0])), None);
        assert!(t.insert(&key(held[0]), &CtValue6::default()), "a deleted way takes a key again");
    }
}
