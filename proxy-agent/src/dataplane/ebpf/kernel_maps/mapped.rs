//! A BPF array created with BPF_F_MMAPABLE, mapped shared into the agent: the embryonic
//! tables' buckets (buckets.rs) and the assured tables' hints (hint.rs) are read and written
//! in place, as the data path does, without a system call an entry.
//!
//! One mapping per array and process, shared by every opener (the syncer, the collectors,
//! the load's fill, each hint): the kernel maps all of an array's pages at mmap time, so
//! each mapping added the whole array to the agent's RSS again (five of IPv4's 8 MiB table
//! and three of IPv6's 4 MiB one: 55 MB of a 100,000-Service node's 300 MB).
use std::{
    collections::HashMap,
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
    sync::{Arc, Mutex, OnceLock, Weak},
};

use crate::dataplane::ebpf::maps::MapError;

/// The array's values, `count` of them (a power of two); the mapping goes with its last user.
pub struct Mapped<T> {
    pub map: &'static str,
    /// Held, not read: the mapping lives as long as any of its users.
    _region: Arc<Region>,
    base: NonNull<T>,
    pub count: u32,
}

// Shared memory: its users say how its writes are ordered (a bucket's lock, atomic words).
unsafe impl<T> Send for Mapped<T> {}
unsafe impl<T> Sync for Mapped<T> {}

/// One mmap of an array, unmapped when its last user drops it.
struct Region {
    base: NonNull<u8>,
    len: usize,
}

unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// The process's mappings by the kernel's map id. A live mapping keeps its map, so its id
/// names no other map meanwhile; a dead entry is replaced, or swept at the next mapping.
fn regions() -> &'static Mutex<HashMap<u32, Weak<Region>>> {
    static REGIONS: OnceLock<Mutex<HashMap<u32, Weak<Region>>>> = OnceLock::new();
    REGIONS.get_or_init(Default::default)
}

impl<T> Mapped<T> {
    /// Maps `data`, the array named `map` (the mapping keeps the map alive), or shares the
    /// process's mapping of it.
    pub fn map(map: &'static str, data: &aya::maps::MapData) -> Result<Self, MapError> {
        let info = data.info().map_err(|e| MapError::Other { map, message: e.to_string() })?;
        let count = info.max_entries();
        if info.value_size() as usize != size_of::<T>() || !count.is_power_of_two() {
            return Err(MapError::Other {
                map,
                message: format!("not an array of {} bytes a value ({count} values of {} bytes)", size_of::<T>(), info.value_size()),
            });
        }
        let mut regions = regions().lock().unwrap_or_else(|e| e.into_inner());
        let region = match regions.get(&info.id()).and_then(Weak::upgrade) {
            Some(r) => r,
            None => {
                let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
                let len = (count as usize * size_of::<T>()).div_ceil(page) * page;
                let fd = data.fd().as_fd().as_raw_fd();
                let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
                if ptr == libc::MAP_FAILED {
                    return Err(MapError::Op { map, op: "mmap", source: std::io::Error::last_os_error() });
                }
                let base = NonNull::new(ptr.cast()).ok_or(MapError::Other { map, message: "mmap gave no address".into() })?;
                let r = Arc::new(Region { base, len });
                regions.retain(|_, w| w.strong_count() > 0);
                regions.insert(info.id(), Arc::downgrade(&r));
                r
            }
        };
        Ok(Self { map, base: region.base.cast(), _region: region, count })
    }

    /// Maps the pinned array.
    pub fn open(pin_dir: &std::path::Path, map: &'static str) -> Result<Self, MapError> {
        let data = aya::maps::MapData::from_pin(pin_dir.join(map)).map_err(|e| MapError::Other { map, message: format!("cannot open its pin: {e}") })?;
        Self::map(map, &data)
    }

    /// Anonymous memory in place of an array, for unit tests (the kernel's array behaves the
    /// same way; the tests under tests/ run against it).
    #[cfg(test)]
    pub fn anonymous(count: u32) -> Self {
        let len = count as usize * size_of::<T>();
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(ptr, libc::MAP_FAILED);
        let region = Arc::new(Region { base: NonNull::new(ptr.cast()).unwrap(), len });
        Self { map: "test", base: region.base.cast(), _region: region, count }
    }

    /// Value `i`'s address.
    pub fn at(&self, i: u32) -> *mut T {
        debug_assert!(i < self.count);
        unsafe { self.base.as_ptr().add(i as usize) }
    }
}
