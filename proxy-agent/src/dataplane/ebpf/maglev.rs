//! Maglev lookup tables (Eisenbud et al., NSDI 2016). A backend's permutation depends only on
//! its own identity, so adding or removing one backend moves few entries of the others.
use proxy_common::limits::MAGLEV_TABLE_SIZE;

fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Final avalanche: FNV alone mixes the last bytes poorly.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// Builds a table of `MAGLEV_TABLE_SIZE` entries. `backends` are (identity bytes, backend id).
pub fn table(backends: &[(Vec<u8>, u32)]) -> Vec<u32> {
    let m = MAGLEV_TABLE_SIZE as u64;
    let mut table = vec![0u32; MAGLEV_TABLE_SIZE as usize];
    if backends.is_empty() {
        return table;
    }
    let perms: Vec<(u64, u64)> = backends.iter().map(|(ident, _)| (fnv1a(0x5bd1_e995, ident) % m, fnv1a(0x1b87_3593, ident) % (m - 1) + 1)).collect();
    let mut next = vec![0u64; backends.len()];
    let mut filled = 0u64;
    'outer: loop {
        for (i, (offset, skip)) in perms.iter().enumerate() {
            loop {
                let c = (offset + next[i] * skip) % m;
                next[i] += 1;
                if table[c as usize] == 0 {
                    table[c as usize] = backends[i].1;
                    filled += 1;
                    break;
                }
            }
            if filled == m {
                break 'outer;
            }
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bes(n: u32) -> Vec<(Vec<u8>, u32)> {
        (1..=n).map(|i| (format!("10.0.0.{i}:80").into_bytes(), i)).collect()
    }

    #[test]
    fn balanced_and_minimal_disruption() {
        let t = table(&bes(5));
        let mut counts = [0usize; 6];
        for id in &t {
            counts[*id as usize] += 1;
        }
        let avg = t.len() / 5;
        for c in &counts[1..] {
            assert!((*c as f64 - avg as f64).abs() / (avg as f64) < 0.1, "{counts:?}");
        }
        // Removing backend 5 must not move entries between the survivors much.
        let t2 = table(&bes(4));
        let moved = t.iter().zip(&t2).filter(|(a, b)| **a != 5 && a != b).count();
        assert!(moved < t.len() / 10, "moved {moved}");
    }
}
