//! Internet checksum arithmetic (RFC 1071/1624). Values are raw memory words: one's complement
//! sums are byte-order independent as long as every word is read the same way.

#[inline(always)]
pub fn fold(mut sum: u64) -> u16 {
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m') for a 32-bit field change.
#[inline(always)]
pub fn replace4(check: u16, from: u32, to: u32) -> u16 {
    let sum = u64::from(!check)
        + u64::from(!(from as u16))
        + u64::from(!((from >> 16) as u16))
        + u64::from(to as u16)
        + u64::from((to >> 16) as u16);
    !fold(sum)
}

/// RFC 1624 eqn. 3 for a 16-bit field change.
#[inline(always)]
pub fn replace2(check: u16, from: u16, to: u16) -> u16 {
    let sum = u64::from(!check) + u64::from(!from) + u64::from(to);
    !fold(sum)
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
