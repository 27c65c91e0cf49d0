//! Service lookup and backend choice: random, round-robin, Maglev, least-connection and power
//! of two choices; ClientIP affinity on top.
use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    counter, limits::MAGLEV_TABLE_SIZE, AffinityKey, AffinityValue, Backend, ServiceKey,
    ServiceValue, SlotKey, LEAST_CONN_EXACT_MAX, SCHED_LEAST_CONN, SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_F_SPLIT, SCHED_MAGLEV, SCHED_P2C, SCHED_ROUND_ROBIN,
};

use crate::{
    counters::bump,
    maps::{AFFINITY, BACKENDS, BACKEND_ACTIVE, MAGLEV, RR_STATE, SLOTS, SERVICES},
    parse::Flow,
};

/// The frontend for `scope`'s traffic: the port's internal entry, or for external traffic to a
/// port whose scopes differ (SVC_F_SPLIT) its external entry. A packet to no service costs one
/// probe on every hook.
#[inline(always)]
pub fn lookup_service(f: &Flow, scope: u8) -> Option<ServiceValue> {
    lookup([f.daddr, 0, 0, 0], f.dport, f.proto, scope)
}

/// `lookup_service` by address (either family), port and protocol.
#[inline(always)]
pub fn lookup(addr: [u32; 4], port: u16, proto: u8, scope: u8) -> Option<ServiceValue> {
    let mut key = ServiceKey { addr, port, proto, scope: SCOPE_INTERNAL };
    // Map value pointers, copied once at the end: a copy held across the second lookup grew
    // XDP's frame past what Linux 6.1 allows beside new_flow's.
    let internal = unsafe { SERVICES.get(&key) }?;
    if scope == SCOPE_INTERNAL || internal.flags & SVC_F_SPLIT == 0 {
        return Some(*internal);
    }
    key.scope = SCOPE_EXTERNAL;
    // Between the agent's writes of a port's two entries (a traffic policy just changed) the
    // external one may not be there yet: the internal entry answers meanwhile.
    Some(*unsafe { SERVICES.get(&key) }.unwrap_or(internal))
}

/// An IPv6 address folded to the 32 bits the flow hash takes (it hashes an IPv4-shaped Flow).
#[inline(always)]
pub fn fold(a: &[u32; 4]) -> u32 {
    a[0] ^ a[1] ^ a[2] ^ a[3]
}

/// Murmur3-style mixing of the 5-tuple: the Maglev flow hash.
#[inline(always)]
fn mix(h: u32, v: u32) -> u32 {
    let k = v.wrapping_mul(0xcc9e_2d51).rotate_left(15).wrapping_mul(0x1b87_3593);
    (h ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64)
}

#[inline(always)]
pub fn flow_hash(f: &Flow) -> u32 {
    let mut h = mix(0x9747_b28c, f.saddr);
    h = mix(h, f.daddr);
    h = mix(h, u32::from(f.sport) | (u32::from(f.dport) << 16));
    h = mix(h, u32::from(f.proto));
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// How a flow's backend is picked.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// By the service's scheduler.
    Scheduler,
    /// By the flow hash whatever the scheduler (Maglev: its table), so that the datagrams of
    /// one unconnected UDP socket, each balanced on its own at sendmsg, keep one backend while
    /// the service's backends stay.
    Hash,
}

#[inline(always)]
fn schedule(svc: &ServiceValue, f: &Flow, pick: Pick) -> Option<u32> {
    let count = svc.backend_count;
    let slot = if svc.scheduler == SCHED_MAGLEV {
        let idx = svc.maglev_row * MAGLEV_TABLE_SIZE + flow_hash(f) % MAGLEV_TABLE_SIZE;
        return MAGLEV.get(idx).copied().filter(|id| *id != 0);
    } else if pick == Pick::Hash {
        flow_hash(f) % count + 1
    } else if svc.scheduler == SCHED_LEAST_CONN || svc.scheduler == SCHED_P2C {
        return least_loaded(svc);
    } else if svc.scheduler == SCHED_ROUND_ROBIN {
        let cursor = RR_STATE.get_ptr_mut(svc.service_id)?;
        // One cursor per service for every CPU, as IPVS's rr: the rotation is the service's, not
        // each CPU's. Not atomic (the BPF target has no atomic add in Rust): two CPUs stepping
        // at once send two flows to one backend and the rotation goes on from there.
        unsafe {
            let next = *cursor % count + 1;
            *cursor = next;
            next
        }
    } else {
        (unsafe { bpf_get_prandom_u32() }) % count + 1
    };
    unsafe { SLOTS.get(&SlotKey { service_id: svc.service_id, slot }) }.copied()
}

/// The backend an id names, if any (see proxy_common::Backend::is_present).
#[inline(always)]
pub fn backend(id: u32) -> Option<&'static Backend> {
    BACKENDS.get(id).filter(|b| b.is_present())
}

#[inline(always)]
fn slot_backend(service_id: u32, slot: u32) -> Option<u32> {
    unsafe { SLOTS.get(&SlotKey { service_id, slot }) }.copied()
}

#[inline(always)]
fn active(backend_id: u32) -> u32 {
    BACKEND_ACTIVE.get(backend_id).copied().unwrap_or(0)
}

/// Least-connection (every backend compared, from a random start so ties spread, while there are
/// at most LEAST_CONN_EXACT_MAX) or power of two choices (the less loaded of two distinct random
/// backends). Inlined: as a subprogram its frame would push the new-flow path's call chain
/// past the 512-byte stack.
#[inline(always)]
fn least_loaded(svc: &ServiceValue) -> Option<u32> {
    let count = svc.backend_count;
    let r = unsafe { bpf_get_prandom_u32() };
    if count == 0 {
        return None;
    }
    if svc.scheduler == SCHED_LEAST_CONN && count <= LEAST_CONN_EXACT_MAX {
        let start = r % count;
        // Two scalars, not an Option of a pair: LLVM packs a pair into one 64-bit register
        // with shifts, which the verifier refuses once a pointer shares the stack slot.
        let (mut best_id, mut best_load) = (0u32, u32::MAX);
        for i in 0..LEAST_CONN_EXACT_MAX {
            if i >= count {
                break;
            }
            let Some(id) = slot_backend(svc.service_id, (start + i) % count + 1) else { continue };
            let load = active(id);
            if best_id == 0 || load < best_load {
                best_id = id;
                best_load = load;
            }
        }
        return (best_id != 0).then_some(best_id);
    }
    let a = r % count;
    let b = if count > 1 { (a + 1 + (r >> 16) % (count - 1)) % count } else { a };
    let (ida, idb) = (slot_backend(svc.service_id, a + 1)?, slot_backend(svc.service_id, b + 1)?);
    Some(if active(idb) < active(ida) { idb } else { ida })
}

/// Picks the backend of a new flow. The remembered ClientIP backend wins inside the timeout
/// (and its timestamp is refreshed); otherwise the scheduler picks and the choice is remembered.
#[inline(always)]
pub fn select_backend(svc: &ServiceValue, f: &Flow, now: u64, pick: Pick) -> Option<(u32, Backend)> {
    select_backend_for([f.saddr, 0, 0, 0], svc, f, now, pick)
}

/// `select_backend` for a client whose address is not the flow's (an IPv6 one: the flow carries
/// a fold of it for the hash).
#[inline(always)]
pub fn select_backend_for(client: [u32; 4], svc: &ServiceValue, f: &Flow, now: u64, pick: Pick) -> Option<(u32, Backend)> {
    let affinity_ns = u64::from(svc.affinity_timeout_s) * 1_000_000_000;
    let aff_key = AffinityKey { client, service_id: svc.service_id };
    if affinity_ns != 0 {
        if let Some(a) = AFFINITY.get_ptr_mut(&aff_key) {
            let a = unsafe { &mut *a };
            // Saturating: another CPU's stamp may be a little ahead of our clock reading.
            // Another generation: the service id's earlier owner remembered it.
            if now.saturating_sub(a.last_used_ns) <= affinity_ns && a.generation == svc.generation {
                if let Some(be) = backend(a.backend_id) {
                    if now > a.last_used_ns {
                        a.last_used_ns = now;
                    }
                    bump(counter::AFFINITY_HIT);
                    return Some((a.backend_id, *be));
                }
            }
        }
    }
    let id = schedule(svc, f, pick)?;
    let be = *backend(id)?;
    if affinity_ns != 0 {
        let v = AffinityValue { last_used_ns: now, backend_id: id, generation: svc.generation, _pad: 0 };
        let _ = AFFINITY.insert(&aff_key, &v, 0);
    }
    Some((id, be))
}
