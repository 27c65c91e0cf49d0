//! The flow cache: a per-CPU, direct-mapped copy of established flows' rewrites in front of
//! the conntrack map (see proxy_common::FlowCacheEntry). An array lookup with a constant-time
//! index is inlined by the verifier; the conntrack probe it saves costs several calls (hash,
//! bucket walk, key compare), each expensive on CPUs with return-thunk mitigations.
use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    limits::FLOW_CACHE_REFRESH_JIFFIES,
    CtKey,
};

use crate::{
    maps::{FLOW_CACHE_GEN, FLOW_CACHE},
    rewrite::Rewrite,
};

/// The current generation.
#[inline(always)]
pub fn generation() -> u64 {
    FLOW_CACHE_GEN.get(0).copied().unwrap_or(0)
}

/// Makes every CPU's entries stale: a tuple now means another flow. The BPF target has no
/// atomic add here, so two CPUs may race; a random step (not +1) keeps the loser's write from
/// bringing back a value that entries were filled with.
#[inline(always)]
pub fn invalidate() {
    if let Some(g) = FLOW_CACHE_GEN.get_ptr_mut(0) {
        let step = u64::from(unsafe { bpf_get_prandom_u32() }) | 1;
        unsafe { *g = (*g).wrapping_add(step) };
    }
}

#[inline(always)]
pub fn lookup(key: &CtKey, generation: u64, jiffies: u64) -> Option<Rewrite> {
    let k = key.words();
    let e = FLOW_CACHE.get(key.flow_cache_slot())?;
    if e.key.words() != k || e.generation != generation || jiffies.wrapping_sub(e.checked_jiffies) > FLOW_CACHE_REFRESH_JIFFIES {
        return None;
    }
    Some(Rewrite { saddr: e.new_saddr, daddr: e.new_daddr, sport: e.new_sport, dport: e.new_dport, flags: e.flags })
}

/// Remembers the rewrite conntrack just gave for `key`.
#[inline(always)]
pub fn fill(key: &CtKey, rw: &Rewrite, generation: u64, jiffies: u64) {
    let Some(e) = FLOW_CACHE.get_ptr_mut(key.flow_cache_slot()) else {
        return;
    };
    // Per-CPU slot: no other writer.
    let e = unsafe { &mut *e };
    e.key = *key;
    e.new_saddr = rw.saddr;
    e.new_daddr = rw.daddr;
    e.new_sport = rw.sport;
    e.new_dport = rw.dport;
    e.flags = rw.flags;
    e.generation = generation;
    e.checked_jiffies = jiffies;
}
