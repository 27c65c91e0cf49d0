//! A frontend's backend list, packed where it is IPv4's (`Backends`).
use std::{net::IpAddr, sync::Arc};

use super::{BackendKey, Protocol};

/// A frontend's backends, in the order given (sorted and deduplicated where the model makes
/// them), shared by a port's frontends. Packed where every one is IPv4, as a frontend's are
/// unless it is IPv6's: 8 bytes a backend against a `BackendKey`'s 20 (a million backends in
/// the desired state at 100,000 Services took 22 MB).
#[derive(Clone, PartialEq, Eq)]
pub enum Backends {
    V4(Arc<[BackendV4]>),
    Any(Arc<[BackendKey]>),
}

/// An IPv4 backend of `Backends::V4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendV4 {
    ip: [u8; 4],
    port: u16,
    proto: Protocol,
}

impl BackendV4 {
    fn of(b: &BackendKey) -> Option<Self> {
        match b.ip {
            IpAddr::V4(ip) => Some(BackendV4 { ip: ip.octets(), port: b.port, proto: b.proto }),
            IpAddr::V6(_) => None,
        }
    }

    fn key(self) -> BackendKey {
        BackendKey { ip: IpAddr::from(self.ip), port: self.port, proto: self.proto }
    }
}

impl Backends {
    pub fn len(&self) -> usize {
        match self {
            Backends::V4(v) => v.len(),
            Backends::Any(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = BackendKey> + Clone + '_ {
        let (v4, any): (&[BackendV4], &[BackendKey]) = match self {
            Backends::V4(v) => (v, &[]),
            Backends::Any(v) => (&[], v),
        };
        // One of the two is empty: a chain of both would not know its exact length.
        BackendIter { v4: v4.iter(), any: any.iter() }
    }

    pub fn to_vec(&self) -> Vec<BackendKey> {
        self.iter().collect()
    }

    /// The list's identity: equal for the frontends that share it.
    pub fn shared_id(&self) -> usize {
        match self {
            Backends::V4(v) => Arc::as_ptr(v) as *const u8 as usize,
            Backends::Any(v) => Arc::as_ptr(v) as *const u8 as usize,
        }
    }

    /// Whether both are the one list (a port's frontends share theirs).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        a.shared_id() == b.shared_id()
    }
}

#[derive(Clone)]
struct BackendIter<'a> {
    v4: std::slice::Iter<'a, BackendV4>,
    any: std::slice::Iter<'a, BackendKey>,
}

impl Iterator for BackendIter<'_> {
    type Item = BackendKey;
    fn next(&mut self) -> Option<BackendKey> {
        self.v4.next().map(|b| b.key()).or_else(|| self.any.next().copied())
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.v4.len() + self.any.len();
        (n, Some(n))
    }
}

impl ExactSizeIterator for BackendIter<'_> {}

impl FromIterator<BackendKey> for Backends {
    fn from_iter<I: IntoIterator<Item = BackendKey>>(iter: I) -> Self {
        Vec::from_iter(iter).into()
    }
}

impl From<Vec<BackendKey>> for Backends {
    fn from(v: Vec<BackendKey>) -> Self {
        match v.iter().map(BackendV4::of).collect::<Option<Arc<[BackendV4]>>>() {
            Some(v4) => Backends::V4(v4),
            None => Backends::Any(v.into()),
        }
    }
}

impl Default for Backends {
    fn default() -> Self {
        Backends::V4(Arc::new([]))
    }
}

impl std::fmt::Debug for Backends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ip: &str, port: u16) -> BackendKey {
        BackendKey { ip: ip.parse().unwrap(), port, proto: Protocol::Tcp }
    }

    /// An IPv4 list is packed, any other kept as keys; both give back what they were given, in
    /// its order.
    #[test]
    fn a_list_gives_back_its_backends_in_order_packed_where_all_are_ipv4() {
        let v4 = vec![key("10.0.0.2", 80), key("10.0.0.1", 8080), BackendKey { proto: Protocol::Sctp, ..key("10.0.0.3", 9) }];
        let mixed = vec![key("10.0.0.2", 80), key("fd00::1", 80)];
        let (a, b): (Backends, Backends) = (v4.clone().into(), mixed.iter().copied().collect());
        assert!(matches!(a, Backends::V4(_)) && matches!(b, Backends::Any(_)));
        assert_eq!((a.to_vec(), a.len(), a.iter().len()), (v4.clone(), 3, 3));
        assert_eq!((b.to_vec(), b.len()), (mixed.clone(), 2));
        assert!(a.to_vec().contains(&key("10.0.0.1", 8080)) && !a.to_vec().contains(&key("10.0.0.1", 80)) && b.to_vec().contains(&key("fd00::1", 80)));
        assert_eq!(a, Backends::from(v4), "equal by content");
        let shared = a.clone();
        assert!(Backends::ptr_eq(&a, &shared) && a.shared_id() == shared.shared_id());
        assert!(!Backends::ptr_eq(&a, &Backends::from(a.to_vec())));
        assert!(Backends::default().is_empty() && Backends::from(Vec::new()) == Backends::default());
    }
}
