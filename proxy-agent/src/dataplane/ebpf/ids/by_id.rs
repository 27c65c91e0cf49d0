//! Tables indexed by backend id, for the syncer's id tables: a set of ids as bits (`IdSet`),
//! small values by id (`ById`), and backends by id, packed (`BackendsById`).
use foldhash::HashMap;

use proxy_common::Backend;

/// A set of backend ids, one bit each (a hash set of a million ids took 10 MB); ids past 2^24
/// (a slot or entry written by hand) in a hash set, so one cannot cost 512 MiB of bits.
#[derive(Debug, Default, Clone)]
pub(crate) struct IdSet {
    words: Vec<u64>,
    far: foldhash::HashSet<u32>,
    len: usize,
}

const ID_SET_BITS: u32 = 1 << 24;

impl IdSet {
    pub fn insert(&mut self, id: u32) {
        if id >= ID_SET_BITS {
            self.len += usize::from(self.far.insert(id));
            return;
        }
        let (w, bit) = (id as usize / 64, 1u64 << (id % 64));
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        if self.words[w] & bit == 0 {
            self.words[w] |= bit;
            self.len += 1;
        }
    }

    pub fn contains(&self, id: u32) -> bool {
        if id >= ID_SET_BITS {
            return self.far.contains(&id);
        }
        self.words.get(id as usize / 64).is_some_and(|w| w & (1u64 << (id % 64)) != 0)
    }

    pub fn remove(&mut self, id: u32) {
        if id >= ID_SET_BITS {
            self.len -= usize::from(self.far.remove(&id));
        } else if let Some(w) = self.words.get_mut(id as usize / 64) {
            let bit = 1u64 << (id % 64);
            if *w & bit != 0 {
                *w &= !bit;
                self.len -= 1;
            }
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let near = self.words.iter().enumerate().flat_map(|(i, w)| {
            let base = i as u32 * 64;
            (0..64).filter(move |b| w & (1u64 << b) != 0).map(move |b| base + b)
        });
        near.chain(self.far.iter().copied())
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

impl Extend<u32> for IdSet {
    fn extend<I: IntoIterator<Item = u32>>(&mut self, iter: I) {
        for id in iter {
            self.insert(id);
        }
    }
}

impl FromIterator<u32> for IdSet {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        let mut s = IdSet::default();
        s.extend(iter);
        s
    }
}

/// Makes room for index `id` in an array of at most `limit` entries: doubling, but never past
/// the limit (an array that doubled from 750,000 to 1.5 million entries would hold 40% slack
/// where the limit is 1 million), nor past room already reserved where `id` fits in it (a
/// million backends reserved for, then doubled from 524,288 to 1,048,576, moved the array for
/// 48,575 entries nobody asked for).
fn grow<T: Copy + Default>(v: &mut Vec<T>, id: u32, limit: u32) {
    let mut len = (v.len() * 2).max(id as usize + 1).min(limit.max(id + 1) as usize);
    if (id as usize) < v.capacity() {
        len = len.min(v.capacity());
    }
    v.reserve_exact(len - v.len());
    v.resize(len, T::default());
}

/// Backends by id, 8 bytes an id where `Backend` takes 20: an IPv4 backend (what nearly every
/// id holds) packed whole; any other kept apart, its slot marked. A million backends: 8 MB, not
/// 21 MB.
#[derive(Debug, Default)]
pub(super) struct BackendsById {
    slots: Vec<Packed>,
    pub(super) wide: HashMap<u32, Backend>,
}

/// A backend whose address is IPv4's (the rest of `Backend::addr` zero), or `WIDE`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Packed {
    addr: u32,
    port: u16,
    proto: u8,
    flags: u8,
}

impl Packed {
    /// In `proto`: the backend is in `BackendsById::wide` (255 is reserved: no backend has it).
    const WIDE: Packed = Packed { addr: 0, port: 0, proto: u8::MAX, flags: 0 };

    /// `b` packed, or `WIDE` where it does not fit; `Packed::default()` (protocol 0) is a
    /// free slot, as `Backend::default()` is no backend.
    pub(super) fn of(b: &Backend) -> Packed {
        match b.addr {
            [addr, 0, 0, 0] if b.proto != u8::MAX => Packed { addr, port: b.port, proto: b.proto, flags: b.flags },
            _ => Self::WIDE,
        }
    }

    fn unpack(self) -> Backend {
        Backend { addr: [self.addr, 0, 0, 0], port: self.port, proto: self.proto, flags: self.flags }
    }
}

impl BackendsById {
    /// One past the highest id with a slot.
    pub(super) fn len(&self) -> u32 {
        self.slots.len() as u32
    }

    pub(super) fn in_use(&self, id: u32) -> bool {
        self.slots.get(id as usize).is_some_and(|p| *p != Packed::default())
    }

    pub(super) fn get(&self, id: u32) -> Option<Backend> {
        match *self.slots.get(id as usize)? {
            p if p == Packed::default() => None,
            p if p == Packed::WIDE => self.wide.get(&id).copied(),
            p => Some(p.unpack()),
        }
    }

    /// The backend of an id in use (the hash index names only those).
    pub(super) fn expect(&self, id: u32) -> Backend {
        self.get(id).unwrap_or_default()
    }

    /// Whether `id` holds `b`, packed as `want` (`Packed::of(b)`, made once a search).
    pub(super) fn holds(&self, id: u32, want: Packed, b: &Backend) -> bool {
        let have = self.slots[id as usize];
        have == want && (want != Packed::WIDE || self.wide.get(&id) == Some(b))
    }

    pub(super) fn set(&mut self, id: u32, b: Backend, limit: u32) {
        if self.slots.len() <= id as usize {
            grow(&mut self.slots, id, limit);
        }
        let p = Packed::of(&b);
        self.slots[id as usize] = p;
        if p == Packed::WIDE {
            self.wide.insert(id, b);
        } else {
            self.wide.remove(&id);
        }
    }

    /// Frees `id`, handing back its backend if it had one.
    pub(super) fn take(&mut self, id: u32) -> Option<Backend> {
        let b = self.get(id)?;
        self.slots[id as usize] = Packed::default();
        self.wide.remove(&id);
        Some(b)
    }

    /// Room for ids below `ids`, at once.
    pub(super) fn reserve_up_to(&mut self, ids: usize) {
        self.slots.reserve_exact(ids.saturating_sub(self.slots.len()));
    }
}

/// Small values by backend id: an array below the id limit (the ids kpr gives out), a hash map
/// above it (ids an agent before the limit gave out, until the full sync has re-ided them).
/// `T::default()` is "none".
#[derive(Debug, Default)]
pub(crate) struct ById<T> {
    dense: Vec<T>,
    sparse: HashMap<u32, T>,
    limit: u32,
}

impl<T: Copy + Default + PartialEq> ById<T> {
    pub fn new(limit: u32) -> Self {
        Self { dense: Vec::new(), sparse: HashMap::default(), limit }
    }

    pub fn get(&self, id: u32) -> Option<T> {
        let v = if id < self.limit { self.dense.get(id as usize).copied() } else { self.sparse.get(&id).copied() };
        v.filter(|v| *v != T::default())
    }

    /// Sets `id`'s value (`T::default()` removes it); returns the one it had.
    pub fn set(&mut self, id: u32, v: T) -> Option<T> {
        if id < self.limit {
            if self.dense.len() <= id as usize {
                if v == T::default() {
                    return None;
                }
                grow(&mut self.dense, id, self.limit);
            }
            Some(std::mem::replace(&mut self.dense[id as usize], v)).filter(|o| *o != T::default())
        } else if v == T::default() {
            self.sparse.remove(&id)
        } else {
            self.sparse.insert(id, v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_id_finds_on_both_sides_of_the_limit() {
        let mut m: ById<u32> = ById::new(4);
        assert_eq!((m.set(2, 7), m.set(9, 8), m.set(2, 5)), (None, None, Some(7)));
        assert_eq!((m.get(2), m.get(9), m.get(3), m.get(100)), (Some(5), Some(8), None, None));
        assert_eq!((m.set(9, 0), m.set(9, 0), m.set(3, 0), m.get(9)), (Some(8), None, None, None));
    }

    #[test]
    fn id_set_counts_each_id_once() {
        let mut s: IdSet = [3, 64, 3].into_iter().collect();
        s.insert(1_000_000);
        assert_eq!((s.len(), s.iter().collect::<Vec<_>>()), (3, vec![3, 64, 1_000_000]));
        s.insert(u32::MAX);
        assert!(s.contains(u32::MAX) && s.words.len() < 20_000, "far ids are not bits");
        s.remove(u32::MAX);
        assert!(s.contains(3) && s.contains(64) && s.contains(1_000_000) && !s.contains(63) && !s.contains(2_000_000));
        s.remove(64);
        s.remove(64);
        s.remove(5_000_000);
        assert_eq!((s.len(), s.contains(64)), (2, false));
    }
}
