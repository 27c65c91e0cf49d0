//! Netlink attributes (type-length-value), decoded from raw bytes with bounds checks: shared by
//! the IPVS and ctnetlink clients.

/// NLA_F_NESTED | NLA_F_NET_BYTEORDER live in the top bits of the type.
const NLA_TYPE_MASK: u16 = 0x3fff;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{ctx}: attribute header truncated ({left} bytes left)")]
    TruncatedHeader { ctx: &'static str, left: usize },
    #[error("{ctx}: attribute {ty} claims {len} bytes, {left} left")]
    BadLength { ctx: &'static str, ty: u16, len: usize, left: usize },
    #[error("{ctx}: unknown attribute {ty}")]
    Unknown { ctx: &'static str, ty: u16 },
    #[error("{ctx}: attribute {ty} has {len} bytes, expected {expected}")]
    BadSize { ctx: &'static str, ty: u16, len: usize, expected: &'static str },
    #[error("{ctx}: missing attribute {what}")]
    Missing { ctx: &'static str, what: &'static str },
    #[error("{ctx}: {what}")]
    Invalid { ctx: &'static str, what: String },
    #[error("generic netlink header truncated")]
    ShortHeader,
    #[error("unexpected reply command {0}")]
    UnexpectedCommand(u8),
}

/// Iterates the type-length-value netlink attributes of `buf` (bounds-checked).
pub fn attrs<'a>(ctx: &'static str, buf: &'a [u8]) -> impl Iterator<Item = Result<(u16, &'a [u8]), DecodeError>> + 'a {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        if rest.len() < 4 {
            let left = rest.len();
            rest = &[];
            return Some(Err(DecodeError::TruncatedHeader { ctx, left }));
        }
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let ty = u16::from_ne_bytes([rest[2], rest[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > rest.len() {
            let left = rest.len();
            rest = &[];
            return Some(Err(DecodeError::BadLength { ctx, ty, len, left }));
        }
        let payload = &rest[4..len];
        let padded = (len + 3) & !3;
        rest = rest.get(padded..).unwrap_or(&[]);
        Some(Ok((ty, payload)))
    })
}
