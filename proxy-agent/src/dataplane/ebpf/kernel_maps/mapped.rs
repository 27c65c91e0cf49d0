//! A BPF array created with BPF_F_MMAPABLE, mapped shared into the agent: the embryonic
//! tables' buckets (buckets.rs) and the assured tables' hints (hint.rs) are read and written
//! in place, as the data path does, without a system call an entry.
use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
};

use crate::dataplane::ebpf::maps::MapError;

/// The array's values, `count` of them (a power of two), unmapped when dropped.
pub struct Mapped<T> {
    pub map: &'static str,
    base: NonNull<T>,
    pub count: u32,
    len: usize,
}

// Shared memory: its users say how its writes are ordered (a bucket's lock, atomic words).
unsafe impl<T> Send for Mapped<T> {}
unsafe impl<T> Sync for Mapped<T> {}

impl<T> Mapped<T> {
    /// Maps `data`, the array named `map` (the mapping keeps the map alive); `what` names the
    /// kind of array expected, for the error.
    pub fn map(map: &'static str, data: &aya::maps::MapData, what: &str) -> Result<Self, MapError> {
        let info = data.info().map_err(|e| MapError::Other { map, message: e.to_string() })?;
        let fd = data.fd().as_fd();
        let count = info.max_entries();
        if info.value_size() as usize != size_of::<T>() || !count.is_power_of_two() {
            return Err(MapError::Other { map, message: format!("not {what} ({count} values of {} bytes)", info.value_size()) });
        }
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let len = (count as usize * size_of::<T>()).div_ceil(page) * page;
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(MapError::Op { map, op: "mmap", source: std::io::Error::last_os_error() });
        }
        let base = NonNull::new(ptr.cast()).ok_or(MapError::Other { map, message: "mmap gave no address".into() })?;
        Ok(Self { map, base, count, len })
    }

    /// Maps the pinned array.
    pub fn open(pin_dir: &std::path::Path, map: &'static str, what: &str) -> Result<Self, MapError> {
        let data = aya::maps::MapData::from_pin(pin_dir.join(map)).map_err(|e| MapError::Other { map, message: format!("cannot open its pin: {e}") })?;
        Self::map(map, &data, what)
    }

    /// Anonymous memory in place of an array, for unit tests (the kernel's array behaves the
    /// same way; the tests under tests/ run against it).
    #[cfg(test)]
    pub fn anonymous(count: u32) -> Self {
        let len = count as usize * size_of::<T>();
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(ptr, libc::MAP_FAILED);
        Self { map: "test", base: NonNull::new(ptr.cast()).unwrap(), count, len }
    }

    /// Value `i`'s address.
    pub fn at(&self, i: u32) -> *mut T {
        debug_assert!(i < self.count);
        unsafe { self.base.as_ptr().add(i as usize) }
    }
}

impl<T> Drop for Mapped<T> {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
