//! The collector's rebuild of the assured tables' hints (see proxy_common::CtHinted; the words
//! are in the embryonic tables' buckets, kernel_maps/hint.rs): a pass
//! over a table, in bounded batches a round, clears one half of every word first, then sets
//! the bit of each key it reads; the next pass rebuilds the other half. The half not being
//! rebuilt answers meanwhile, and the data path sets both halves around each insert, so a key
//! in the table always has a bit set; a key gone loses its bits within two passes. The pass is
//! the rebuild's own reads (`round`: IPv6's table) or the conntrack collector's, which it
//! follows (`follow`: IPv4's, read by that collector every round anyway). Once the hint was
//! rebuilt whole, clears are spaced (`Rebuild::resting`): a clear's cost is the table's
//! buckets, not its keys.
use proxy_common::CtHinted;

use crate::dataplane::ebpf::{bpf_batch::Batch, maps::MapError};

/// A hint's words (kernel_maps/hint.rs, and a fake below).
pub trait HintWords<K> {
    fn clear_half(&mut self, half: u32);
    fn note_in_half(&mut self, key: &K, half: u32);
}

/// An assured table, read in batches for its hint.
pub trait AssuredKeys<K, V> {
    /// Up to `max` entries from `cursor` on (None: the start), and the cursor to go on from
    /// (None: that was the end).
    fn read_batch(&self, cursor: Option<u32>, max: usize) -> Result<Batch<K, V>, MapError>;
}

/// One batch of a pass over an assured table that another reader made (the conntrack
/// collector's over IPv4's, `Gc::round`): its keys, and where it fell in that pass. The rebuild
/// follows that pass rather than read the table a second time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassBatch<K> {
    pub keys: Vec<K>,
    /// The pass's first batch.
    pub first: bool,
    /// Its last.
    pub last: bool,
}

/// One family's rebuild: which half, and where its pass is. It reads the table itself
/// (`round`), or follows another reader's passes (`follow`).
#[derive(Debug, Default)]
pub struct Rebuild {
    /// Rounds that must pass between two clears once the hint was rebuilt whole (two passes):
    /// a clear writes every bucket's lock line whatever the table holds (32,768 lines for
    /// IPv4's default table), and a small table's pass takes one round. 0: none (tests).
    rest: u32,
    /// Rounds since the last clear.
    since_clear: u32,
    half: u32,
    /// Its own pass's next batch (None: a pass starts next round).
    cursor: Option<u32>,
    /// `half` was cleared before the batches now read were read: a pass may start.
    cleared: bool,
    /// A pass is noting its keys into `half`.
    in_pass: bool,
    /// Passes completed.
    pub passes: u64,
}

impl Rebuild {
    /// A rebuild that clears at most once every `rest` rounds after its first two passes.
    pub fn resting(rest: u32) -> Self {
        Self { rest, ..Self::default() }
    }

    /// One round: a pass's next batch of `table`, up to `batch` entries (a new pass clears its
    /// half first). Returns the half rebuilt when the pass ended.
    pub fn round<K: CtHinted, V>(&mut self, table: &dyn AssuredKeys<K, V>, hint: &mut dyn HintWords<K>, batch: usize) -> Result<Option<u32>, MapError> {
        self.since_clear = self.since_clear.saturating_add(1);
        self.clear_ahead(hint);
        if !self.cleared {
            // Resting between passes: nothing to read for.
            return Ok(None);
        }
        // A failed read leaves the pass where it was: the other half keeps answering, and the
        // next round reads the same batch again.
        let (entries, next) = table.read_batch(self.cursor, batch)?;
        let first = self.cursor.is_none();
        self.cursor = next;
        Ok(self.take(hint, entries.iter().map(|(k, _)| k), first, next.is_none()))
    }

    /// A batch of another reader's pass (None: that reader's round failed, and what it read
    /// is lost to the hint). The half a pass rebuilds must be cleared before the pass's first
    /// read, so the rebuild clears the next half as soon as a pass ends and its rest is over
    /// (and when it starts following), and takes up the first pass that starts after that.
    /// Returns the half rebuilt when the pass ended.
    pub fn follow<K: CtHinted>(&mut self, hint: &mut dyn HintWords<K>, batch: Option<&PassBatch<K>>) -> Option<u32> {
        self.since_clear = self.since_clear.saturating_add(1);
        let rebuilt = match batch {
            Some(b) => self.take(hint, b.keys.iter(), b.first, b.last),
            None => {
                // A batch missed: this pass cannot complete the half. The next one starts over
                // (the half stays cleared; what was noted meanwhile is only extra bits).
                self.in_pass = false;
                None
            }
        };
        self.clear_ahead(hint);
        rebuilt
    }

    /// Clears `half` for the pass to come, once, and after the rest once the hint was rebuilt
    /// whole.
    fn clear_ahead<K>(&mut self, hint: &mut dyn HintWords<K>) {
        if !self.cleared && (self.passes < 2 || self.since_clear >= self.rest) {
            hint.clear_half(self.half);
            self.cleared = true;
            self.since_clear = 0;
        }
    }

    /// Notes a batch's keys into the half being rebuilt; at a pass's end, the half answers and
    /// the other is rebuilt next.
    fn take<'a, K: 'a>(&mut self, hint: &mut dyn HintWords<K>, keys: impl Iterator<Item = &'a K>, first: bool, last: bool) -> Option<u32> {
        if first && self.cleared {
            self.in_pass = true;
        }
        if !self.in_pass {
            return None;
        }
        for key in keys {
            hint.note_in_half(key, self.half);
        }
        if !last {
            return None;
        }
        let rebuilt = self.half;
        self.half ^= 1;
        self.cleared = false;
        self.in_pass = false;
        self.passes += 1;
        Some(rebuilt)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proxy_common::{hint_bits, hint_half, CtKey, CtValue, CT_DIR_INGRESS, CT_HINT_WORDS, PROTO_TCP};

    use super::*;

    /// The hint's words in memory (those of 1,024 buckets, counted across them), with the data
    /// path's `note` (both halves).
    struct FakeHint(Vec<u64>, Vec<CtKey>);

    const MASK: u32 = 1023;

    impl FakeHint {
        fn filled() -> Self {
            Self(vec![u64::MAX; (MASK as usize + 1) * CT_HINT_WORDS], Vec::new())
        }
        fn may_hold(&self, k: &CtKey) -> bool {
            let (w, bit) = k.hint_slot(MASK);
            self.0[w as usize] & hint_bits(bit) != 0
        }
        fn note(&mut self, k: &CtKey) {
            let (w, bit) = k.hint_slot(MASK);
            self.0[w as usize] |= hint_bits(bit);
        }
    }

    impl HintWords<CtKey> for FakeHint {
        /// Also checks, right after the clear, that the keys the test says are in the table
        /// (`.1`) still have a bit (the data path may look at any moment).
        fn clear_half(&mut self, half: u32) {
            self.0.iter_mut().for_each(|w| *w &= !hint_half(half));
            let lost: Vec<&CtKey> = self.1.iter().filter(|k| !self.may_hold(k)).collect();
            assert!(lost.is_empty(), "keys in the table unhinted after clearing half {half}: {lost:?}");
        }
        fn note_in_half(&mut self, key: &CtKey, half: u32) {
            let (w, bit) = key.hint_slot(MASK);
            self.0[w as usize] |= hint_bits(bit) & hint_half(half);
        }
    }

    /// An assured table whose batches go by client port, as the kernel's go by hash bucket: a
    /// key inserted or deleted elsewhere moves no other key from one batch to another.
    struct FakeTable(BTreeMap<CtKey, CtValue>);

    impl AssuredKeys<CtKey, CtValue> for FakeTable {
        fn read_batch(&self, cursor: Option<u32>, max: usize) -> Result<Batch<CtKey, CtValue>, MapError> {
            let port = |k: &CtKey| u32::from(u16::from_be(k.sport));
            let mut rest: Vec<(CtKey, CtValue)> = self.0.iter().filter(|(k, _)| port(k) >= cursor.unwrap_or(0)).map(|(k, v)| (*k, *v)).collect();
            rest.sort_by_key(|(k, _)| port(k));
            let more = rest.len() > max;
            rest.truncate(max);
            let next = rest.last().map(|(k, _)| port(k) + 1).filter(|_| more);
            Ok((rest, next))
        }
    }

    fn key(port: u16) -> CtKey {
        CtKey { saddr: 0x0a00_0001, daddr: 0x0a60_000a, sport: port.to_be(), dport: 80u16.to_be(), proto: PROTO_TCP, dir: CT_DIR_INGRESS, _pad: 0 }
    }

    /// Runs passes until `n` more have ended, `between` run after every round (the data path
    /// meanwhile).
    fn passes(r: &mut Rebuild, t: &mut FakeTable, h: &mut FakeHint, n: u64, mut between: impl FnMut(&mut FakeTable, &mut FakeHint)) {
        let until = r.passes + n;
        while r.passes < until {
            r.round(&*t, h, 3).unwrap();
            between(t, h);
        }
    }

    #[test]
    fn a_key_in_the_table_keeps_a_bit_and_a_key_gone_loses_its_own_within_two_passes() {
        let mut t = FakeTable((1000..1010).map(|p| (key(p), CtValue::default())).collect());
        let mut h = FakeHint::filled();
        let mut r = Rebuild::default();
        let absent: Vec<CtKey> = (2000..2100).map(key).collect();
        assert!(absent.iter().all(|k| h.may_hold(k)), "filled at load: every probe happens");
        // Rounds of 3 of 10 entries: 4 rounds a pass. After every round, every key in the table
        // may be there (the checks run between rounds, as the data path's probes do).
        passes(&mut r, &mut t, &mut h, 2, |t, h| assert!(t.0.keys().all(|k| h.may_hold(k))));
        assert!(absent.iter().all(|k| !h.may_hold(k)), "two passes: no bit of a key never there stays set");
        // Keys come (the data path notes them around its insert) and go mid-pass.
        let (come, gone) = (key(3000), key(1004));
        let mut round = 0;
        passes(&mut r, &mut t, &mut h, 1, |t, h| {
            round += 1;
            if round == 1 {
                h.note(&come);
                t.0.insert(come, CtValue::default());
                h.note(&come);
                t.0.remove(&gone);
            }
            assert!(t.0.keys().all(|k| h.may_hold(k)));
        });
        passes(&mut r, &mut t, &mut h, 2, |t, h| assert!(t.0.keys().all(|k| h.may_hold(k))));
        assert!(h.may_hold(&come));
        assert!(!h.may_hold(&gone), "a key deleted loses its bits within two passes");
    }

    #[test]
    fn a_key_inserted_into_a_batch_already_read_keeps_the_bit_its_insert_set() {
        // The rebuild has read the batch where the key goes, and cleared its half before; the
        // data path's note after the insert is what keeps it.
        let mut t = FakeTable((1000..1006).map(|p| (key(p), CtValue::default())).collect());
        let mut h = FakeHint::filled();
        let mut r = Rebuild::default();
        passes(&mut r, &mut t, &mut h, 2, |_, _| {});
        let k = key(999);
        assert!(!h.may_hold(&k));
        r.round(&t, &mut h, 3).unwrap();
        h.note(&k);
        t.0.insert(k, CtValue::default());
        h.note(&k);
        passes(&mut r, &mut t, &mut h, 3, |t, h| assert!(t.0.keys().all(|k| h.may_hold(k))));
    }

    /// After its first two passes, a rebuild clears at most once every `rest` rounds, reading
    /// nothing meanwhile; following another reader, it takes up the first pass after its clear.
    /// Every key in the table keeps a bit throughout.
    #[test]
    fn after_two_passes_a_clear_waits_for_the_rest_whether_reading_or_following() {
        let t = FakeTable((1000..1003).map(|p| (key(p), CtValue::default())).collect());
        let (mut h, mut r) = (FakeHint::filled(), Rebuild::resting(5));
        h.1 = t.0.keys().copied().collect();
        // One batch a pass: a pass a round, until the rest spaces them.
        let ended: Vec<usize> = (0..30).filter(|_| r.round(&t, &mut h, 3).unwrap().is_some()).collect();
        assert_eq!(ended, [0, 1, 6, 11, 16, 21, 26]);
        assert!(t.0.keys().all(|k| h.may_hold(k)));
        let (mut h, mut r, mut reader) = (FakeHint::filled(), Rebuild::resting(5), Reader(None));
        h.1 = t.0.keys().copied().collect();
        let ended: Vec<usize> = (0..30).filter(|_| r.follow(&mut h, Some(&reader.next(&t, 3))).is_some()).collect();
        // The first clear comes after the reader's first batch: its pass is not taken up.
        assert_eq!(ended, [1, 2, 7, 12, 17, 22, 27]);
        assert!(t.0.keys().all(|k| h.may_hold(k)));
    }

    /// Another reader's pass over the table (the conntrack collector's), with its own cursor.
    struct Reader(Option<u32>);

    impl Reader {
        fn next(&mut self, t: &FakeTable, max: usize) -> PassBatch<CtKey> {
            let first = self.0.is_none();
            let (entries, next) = t.read_batch(self.0, max).unwrap();
            self.0 = next;
            PassBatch { keys: entries.into_iter().map(|(k, _)| k).collect(), first, last: next.is_none() }
        }
    }

    #[test]
    fn following_another_readers_passes_keeps_every_key_hinted_and_drops_keys_gone() {
        let mut t = FakeTable((1000..1010).map(|p| (key(p), CtValue::default())).collect());
        let mut h = FakeHint::filled();
        let mut r = Rebuild::default();
        let mut reader = Reader(None);
        // Following starts with the reader mid-pass: that pass is not taken up.
        reader.next(&t, 3);
        let absent: Vec<CtKey> = (2000..2100).map(key).collect();
        let late = key(999);
        let mut passes_seen_first = 0;
        for round in 0..40 {
            let b = reader.next(&t, 3);
            // A key put in right after the reader read a pass's first batch, into that batch's
            // span (port 999 reads first): this pass never reads it, so its own bits (set
            // around its insert, after the half was cleared) must carry it.
            if b.first {
                passes_seen_first += 1;
                if passes_seen_first == 2 {
                    h.note(&late);
                    t.0.insert(late, CtValue::default());
                    h.note(&late);
                }
            }
            h.1 = t.0.keys().copied().collect();
            let ended = r.follow(&mut h, Some(&b));
            assert!(t.0.keys().all(|k| h.may_hold(k)), "round {round}");
            assert_eq!(ended.is_some(), b.last && passes_seen_first > 0, "a pass the rebuild followed from its start ends with it");
        }
        assert!(r.passes >= 8, "{} passes", r.passes);
        assert!(absent.iter().all(|k| !h.may_hold(k)), "keys never there lose the load's bits");
        assert!(h.may_hold(&late));
    }

    #[test]
    fn a_batch_the_rebuild_missed_abandons_its_pass() {
        let t = FakeTable((1000..1010).map(|p| (key(p), CtValue::default())).collect());
        let mut h = FakeHint::filled();
        let mut r = Rebuild::default();
        let mut reader = Reader(None);
        h.1 = t.0.keys().copied().collect();
        // 4 batches a pass. The first pass is not followed: its first batch was read before
        // the rebuild cleared a half. In the second, the collector's round failed after it
        // read the second batch: that pass can no longer complete a half, and ends without a
        // flip; the third does.
        let mut ended = Vec::new();
        for round in 0..12 {
            let b = reader.next(&t, 3);
            ended.push(r.follow(&mut h, (round != 5).then_some(&b)).is_some());
        }
        assert_eq!(ended.iter().enumerate().filter(|(_, e)| **e).map(|(i, _)| i).collect::<Vec<_>>(), [11]);
        assert_eq!(r.passes, 1);
        assert!(t.0.keys().all(|k| h.may_hold(k)));
    }
}
