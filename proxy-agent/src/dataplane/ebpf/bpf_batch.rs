//! The bpf(2) operations aya 0.14 lacks, as raw calls: BPF_MAP_LOOKUP_BATCH (read many
//! entries in one call, resumable), BPF_MAP_UPDATE_BATCH (write many in one call),
//! BPF_MAP_LOOKUP_AND_DELETE_ELEM (take an entry out atomically; hash maps only), and
//! BPF_LINK_DETACH of a pinned link.
use std::{
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd},
};

use bytemuck::Pod;

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
/// BPF_NOEXIST: create only.
pub const NOEXIST: u64 = 1;
/// BPF_EXIST: update only.
pub const EXIST: u64 = 2;

/// `union bpf_attr`'s element-operation member.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `union bpf_attr`'s batch member.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// bpf(2) with `attr` as the command's member of `union bpf_attr` (a `#[repr(C)]` struct with no
/// implicit padding: the kernel rejects nonzero bytes it does not know). Ok holds the call's
/// result: a new file descriptor for the commands that make one, else 0.
pub fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Entries read in one batch, and the cursor to go on from (None: that was the end).
pub type Batch<K, V> = (Vec<(K, V)>, Option<u32>);

/// One batch of a hash map or an array: entries from the bucket `cursor` on (array: after the
/// index `cursor`; None: from the first), at most `max`. `K` and `V` must be the map's key and
/// value sizes (the kernel writes that much an entry). Returns them and the cursor to go on from, None when the map has no more. Entries
/// change while we read (the data path writes all the time): each is read atomically, the batch
/// as a whole is not a snapshot.
pub fn lookup_batch<K: Pod, V: Pod>(fd: impl AsFd, cursor: Option<u32>, max: usize) -> io::Result<Batch<K, V>> {
    let mut keys: Vec<K> = vec![K::zeroed(); max];
    let mut values: Vec<V> = vec![V::zeroed(); max];
    let in_batch = cursor.unwrap_or(0);
    let mut out_batch: u32 = 0;
    let mut attr = BatchAttr {
        in_batch: if cursor.is_some() { &in_batch as *const u32 as u64 } else { 0 },
        out_batch: &mut out_batch as *mut u32 as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: max as u32,
        map_fd: fd.as_fd().as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    let done = match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
        Ok(_) => false,
        // The end of the map; `count` entries were still returned.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
        Err(e) => return Err(e),
    };
    let n = attr.count as usize;
    keys.truncate(n);
    values.truncate(n);
    Ok((keys.into_iter().zip(values).collect(), (!done).then_some(out_batch)))
}

/// Entries per BPF_MAP_UPDATE_BATCH call: each call stays short (the kernel copies and inserts
/// entry by entry), the per-call cost (fd lookup, checks, buffers) is spread thin.
const UPDATE_BATCH_MAX: usize = 65_536;

/// Writes `keys[i]` = `values[i]` in order, many per call (BPF_MAP_UPDATE_BATCH): the same
/// inserts as one BPF_MAP_UPDATE_ELEM each, without a system call's fixed cost per entry. On an
/// error, the entries before the one that failed are written; Err gives its index.
pub fn update_batch<K: Pod, V: Pod>(fd: impl AsFd, keys: &[K], values: &[V]) -> Result<(), (usize, io::Error)> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    let mut done = 0;
    while done < keys.len() {
        let n = (keys.len() - done).min(UPDATE_BATCH_MAX);
        let mut attr = BatchAttr {
            keys: keys[done..].as_ptr() as u64,
            values: values[done..].as_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_fd().as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        match bpf(BPF_MAP_UPDATE_BATCH, &mut attr) {
            Ok(_) => done += n,
            // `count` says how many went in before the failure.
            Err(e) => return Err((done + attr.count as usize, e)),
        }
    }
    Ok(())
}

/// Takes `key`'s entry out of the map atomically; None when there is none.
pub fn lookup_and_delete<K: Pod, V: Pod>(fd: impl AsFd, key: &K) -> io::Result<Option<V>> {
    let mut v = V::zeroed();
    let mut attr = ElemAttr { map_fd: fd.as_fd().as_raw_fd() as u32, key: key as *const K as u64, value: &mut v as *mut V as u64, ..ElemAttr::default() };
    match bpf(BPF_MAP_LOOKUP_AND_DELETE_ELEM, &mut attr) {
        Ok(_) => Ok(Some(v)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Inserts `key` only if absent (BPF_NOEXIST); false when another entry holds it already.
pub fn insert_new<K: Pod, V: Pod>(fd: impl AsFd, key: &K, value: &V) -> io::Result<bool> {
    let mut attr =
        ElemAttr { map_fd: fd.as_fd().as_raw_fd() as u32, key: key as *const K as u64, value: value as *const V as u64, flags: NOEXIST, ..ElemAttr::default() };
    match bpf(BPF_MAP_UPDATE_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Replaces `key`'s value only if the key exists (BPF_EXIST); false when it is gone.
pub fn update_existing<K: Pod, V: Pod>(fd: impl AsFd, key: &K, value: &V) -> io::Result<bool> {
    let mut attr =
        ElemAttr { map_fd: fd.as_fd().as_raw_fd() as u32, key: key as *const K as u64, value: value as *const V as u64, flags: EXIST, ..ElemAttr::default() };
    match bpf(BPF_MAP_UPDATE_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `union bpf_attr`'s object-pinning member.
#[repr(C)]
#[derive(Default)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _pad: u32,
}

/// Detaches the link pinned at `path` now (BPF_LINK_DETACH). Unpinning alone releases it only
/// when the kernel frees the bpffs inode, after an RCU grace period that lazy RCU can stretch
/// to seconds, during which the program keeps running.
pub fn detach_pinned_link(path: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut get = ObjAttr { pathname: c.as_ptr() as u64, ..Default::default() };
    let link = unsafe { std::os::fd::OwnedFd::from_raw_fd(bpf(BPF_OBJ_GET, &mut get)? as i32) };
    let mut attr: [u32; 4] = [link.as_raw_fd() as u32, 0, 0, 0];
    match bpf(BPF_LINK_DETACH, &mut attr) {
        Ok(_) => Ok(()),
        // Links of kinds without detach (and kernels before 5.9) go with their last reference.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => Ok(()),
        Err(e) => Err(e),
    }
}
