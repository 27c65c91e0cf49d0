//! What the conntrack collector's passes learn of the flows they keep (see conntrack.rs): open
//! flows per backend (least-connection, P2C), live flows (a mode switch's drain), flows past
//! their Service's maximum age (marked), and SYNs left unanswered (outlier detection).
use std::collections::HashMap;

use proxy_common::{CtKey, CtValue, CT_F_CLOSING, CT_F_MAX_AGE, CT_F_REFUSED, CT_F_SEEN_REPLY, PROTO_TCP};

use crate::dataplane::ebpf::maps::{ConntrackTables, MapError, Table};

/// What a kept flow told this pass.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Finding {
    /// Marked as past its Service's maximum connection age now.
    pub aged: bool,
    /// Its SYN went unanswered for `outlier::SYN_TIMEOUT`: this backend id (once per flow).
    pub syn_timeout: Option<u32>,
}

/// Forward keys the collector saw in a table, from when it first saw each flow on them (a flow
/// is told by its ids `I`), with what it keeps of each (`D`): a key a whole pass over the table
/// did not see is forgotten.
#[derive(Debug)]
struct Sightings<I, D> {
    /// Key -> (first seen, the pass that last saw it, the flow's ids, its data).
    seen: HashMap<CtKey, (u64, u64, I, D)>,
    pass: u64,
}

impl<I, D> Default for Sightings<I, D> {
    fn default() -> Self {
        Self { seen: HashMap::new(), pass: 0 }
    }
}

impl<I: PartialEq + Copy, D: Default> Sightings<I, D> {
    /// The key seen now, carrying the flow `ids` (another flow on the tuple counts from now):
    /// when its flow was first seen, and its data.
    fn see(&mut self, k: CtKey, ids: I, now_ns: u64) -> (u64, &mut D) {
        let pass = self.pass;
        let e = self.seen.entry(k).or_insert_with(|| (now_ns, pass, ids, D::default()));
        if e.2 != ids {
            *e = (now_ns, pass, ids, D::default());
        }
        e.1 = pass;
        (e.0, &mut e.3)
    }

    fn end_pass(&mut self) {
        let pass = self.pass;
        self.seen.retain(|_, e| e.1 == pass);
        self.pass += 1;
    }
}

/// The passes' findings, per table: the pass under way and the last whole one.
#[derive(Debug, Default)]
pub struct Observations {
    /// Maximum connection age (ns) by service id: the Services that ask for one
    /// (kpr.io/max-connection-age).
    max_age: HashMap<u32, u64>,
    /// Those Services' flows, by (service id, backend id): a flow's age counts from the
    /// collector's first sight (so it ends within a pass over the table after its maximum).
    /// Per table, as each has its own passes.
    born: HashMap<Table, Sightings<(u32, u32), ()>>,
    /// Open (not closing) flows by backend id.
    counting: HashMap<Table, HashMap<u32, u32>>,
    counted: HashMap<Table, HashMap<u32, u32>>,
    /// Flows kept, closing ones too, by their forward entries (an entry whose forward one is
    /// gone counts once it has been quiet for its shortest timeout: before, it is not looked at).
    live_counting: HashMap<Table, usize>,
    live_counted: HashMap<Table, usize>,
    /// Embryonic flows waiting for their SYN's answer, by backend id: reported yet?
    waiting: Sightings<u32, bool>,
}

impl Observations {
    /// A flow the pass keeps (not idle), by its forward entry if it has one: counted, aged,
    /// its SYN watched.
    pub fn kept(&mut self, t: &mut dyn ConntrackTables, table: Table, forward: Option<(CtKey, CtValue)>, now_ns: u64) -> Result<Finding, MapError> {
        *self.live_counting.entry(table).or_default() += 1;
        let mut found = Finding::default();
        let Some((k, v)) = forward else { return Ok(found) };
        if v.flags & CT_F_CLOSING == 0 {
            *self.counting.entry(table).or_default().entry(v.backend_id).or_default() += 1;
        }
        // A UDP flow may never leave the embryonic table (one that is never answered, or
        // whose client never sends after a reply): its age counts there too.
        let ages = table == Table::Assured || k.proto != PROTO_TCP;
        if ages && !self.max_age.is_empty() {
            found.aged = self.age(t, table, k, v, now_ns)?;
        }
        if table == Table::Embryonic {
            found.syn_timeout = self.unanswered(k, v, now_ns);
        }
        Ok(found)
    }

    /// A whole pass over `table` is done: its counts become the last whole pass's.
    pub fn end_pass(&mut self, table: Table) {
        let counts = self.counting.remove(&table).unwrap_or_default();
        self.counted.insert(table, counts);
        let live = self.live_counting.remove(&table).unwrap_or_default();
        self.live_counted.insert(table, live);
        self.born.entry(table).or_default().end_pass();
        if table == Table::Embryonic {
            self.waiting.end_pass();
        }
    }

    /// An embryonic flow whose SYN got no answer yet: reported once when it waited too long.
    fn unanswered(&mut self, k: CtKey, v: CtValue, now_ns: u64) -> Option<u32> {
        // Answered, or refused (the data path counted that refusal already).
        if k.proto != PROTO_TCP || v.flags & (CT_F_SEEN_REPLY | CT_F_REFUSED) != 0 {
            return None;
        }
        let (first_seen_ns, reported) = self.waiting.see(k, v.backend_id, now_ns);
        if !*reported && now_ns.saturating_sub(first_seen_ns) >= crate::dataplane::ebpf::outlier::SYN_TIMEOUT.as_nanos() as u64 {
            *reported = true;
            return Some(v.backend_id);
        }
        None
    }

    /// Open flows by backend id at the last whole pass over each table (what least-connection
    /// and P2C compare).
    pub fn active_flows(&self) -> HashMap<u32, u32> {
        let mut out: HashMap<u32, u32> = HashMap::new();
        for (id, n) in self.counted.values().flatten() {
            *out.entry(*id).or_default() += n;
        }
        out
    }

    /// Flows in both tables at their last whole pass (closing ones too); None before a whole
    /// pass over each.
    pub fn live_flows(&self) -> Option<usize> {
        Table::ALL.iter().map(|t| self.live_counted.get(t).copied()).sum()
    }

    /// The Services with a maximum connection age, by service id (seconds).
    pub fn set_max_ages(&mut self, ages: HashMap<u32, u32>) {
        self.max_age = ages.into_iter().map(|(id, s)| (id, u64::from(s) * 1_000_000_000)).collect();
        let max_age = &self.max_age;
        for born in self.born.values_mut() {
            born.seen.retain(|_, (_, _, (service_id, _), _)| max_age.contains_key(service_id));
        }
    }

    /// Marks a flow past its Service's maximum connection age (true: now); remembers when it
    /// was first seen.
    fn age(&mut self, t: &mut dyn ConntrackTables, table: Table, k: CtKey, v: CtValue, now_ns: u64) -> Result<bool, MapError> {
        let Some(max) = self.max_age.get(&v.service_id).copied() else { return Ok(false) };
        let born = self.born.entry(table).or_default();
        let (first_seen_ns, _) = born.see(k, (v.service_id, v.backend_id), now_ns);
        if v.flags & CT_F_MAX_AGE == 0 && now_ns.saturating_sub(first_seen_ns) > max && t.set_flags_if(table, &k, &v, CT_F_MAX_AGE)? {
            born.seen.remove(&k);
            return Ok(true);
        }
        Ok(false)
    }
}
