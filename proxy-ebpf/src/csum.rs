//! Internet checksum arithmetic (RFC 1071/1624). Values are raw memory words: one's complement
//! sums are byte-order independent as long as every word is read the same way. A rewrite is
//! summed once into a difference (`diff4`, `diff2`) and applied to each checksum in one step.

#[inline(always)]
pub fn fold(mut sum: u64) -> u16 {
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// The partial sum that turns a sum over `from` into one over `to` (a 32-bit field).
#[inline(always)]
pub fn diff4(from: u32, to: u32) -> u32 {
    u32::from(!(from as u16)) + u32::from(!((from >> 16) as u16)) + u32::from(to as u16) + u32::from((to >> 16) as u16)
}

/// The same for an IPv6 address (four 32-bit words).
#[inline(always)]
pub fn diff16(from: &[u32; 4], to: &[u32; 4]) -> u32 {
    diff4(from[0], to[0]) + diff4(from[1], to[1]) + diff4(from[2], to[2]) + diff4(from[3], to[3])
}

/// The same for a 16-bit field.
#[inline(always)]
pub fn diff2(from: u16, to: u16) -> u32 {
    u32::from(!from) + u32::from(to)
}

/// RFC 1624 eqn. 3, HC' = ~(~HC + diff): a stored checksum after the change.
#[inline(always)]
pub fn apply(check: u16, diff: u32) -> u16 {
    !fold(u64::from(!check) + u64::from(diff))
}

/// `apply` for an L4 checksum: a UDP checksum that computes to zero is sent as 0xffff (zero
/// means "no checksum").
#[inline(always)]
pub fn apply_l4(check: u16, diff: u32, udp: bool) -> u16 {
    let new = apply(check, diff);
    if udp && new == 0 {
        0xffff
    } else {
        new
    }
}

/// A stored (uncomplemented) partial sum after the change: what the kernel keeps in the L4
/// checksum field of a CHECKSUM_PARTIAL packet (the pseudo-header sum).
#[inline(always)]
pub fn add(sum: u16, diff: u32) -> u16 {
    fold(u64::from(sum) + u64::from(diff))
}

/// Whether a difference changes no sum (0 and 0xffff are both zero in one's complement).
#[inline(always)]
pub fn is_zero(diff: u32) -> bool {
    let f = fold(u64::from(diff));
    f == 0 || f == 0xffff
}

/// Equality in one's complement: +0 (0x0000) and -0 (0xffff) are the same value.
#[inline(always)]
pub fn same(a: u16, b: u16) -> bool {
    a == b || (a == 0 && b == 0xffff) || (a == 0xffff && b == 0)
}

/// Checksum of `N` 16-bit words (a header built on the stack).
#[inline(always)]
#[allow(dead_code)]
pub fn of_words<const N: usize>(words: &[u16; N]) -> u16 {
    let mut sum: u64 = 0;
    let mut i = 0;
    while i < N {
        sum += u64::from(words[i]);
        i += 1;
    }
    !fold(sum)
}
