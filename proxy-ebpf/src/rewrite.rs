//! The rewrite a conntrack entry, or its flow cache copy, prescribes for a packet.
use proxy_common::{CtValue, CT_F_REPLY};

/// The 4-tuple a packet is rewritten to (network order), with its entry's CtValue flags.
#[derive(Clone, Copy, Default)]
pub struct Rewrite {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub flags: u16,
}

impl Rewrite {
    #[inline(always)]
    pub fn of(v: &CtValue) -> Self {
        Self { saddr: v.new_saddr, daddr: v.new_daddr, sport: v.new_sport, dport: v.new_dport, flags: v.flags }
    }
    /// A reply entry's rewrite (reverse DNAT or reverse SNAT).
    #[inline(always)]
    pub fn reply(&self) -> bool {
        self.flags & CT_F_REPLY != 0
    }
}
