//! Held puts of a sync that fits (`DatapathMaps::begin_bulk`): the service, slot and backend
//! entries are gathered and written map by map with BPF_MAP_UPDATE_BATCH, on a thread of their
//! own, while the sync goes on computing the next ones: the initial sync of a large cluster pays
//! a few system calls instead of one per entry, and its kernel time overlaps its own.
//!
//! Order: a batch writes its backends, then its slots, then its services, and batches are
//! written in the order they were made. So no entry is ever written before one it points to: a
//! slot's backend is in an earlier map of its batch or in an earlier batch.
use std::{
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    sync::{mpsc, Arc, Mutex},
    thread,
};

use proxy_common::{map_names, Backend, ServiceKey, ServiceValue, SlotKey};

use crate::dataplane::ebpf::{bpf_batch, maps::MapError};

/// A batch is handed to the writer once it holds this many puts: the buffers stay small (about
/// 0.3 MiB: three are alive at most), the calls few.
const BATCH: usize = 16_384;

/// Puts, per map, in the order they were made.
#[derive(Default)]
struct Batch {
    backends: (Vec<u32>, Vec<Backend>),
    slots: (Vec<SlotKey>, Vec<u32>),
    services: (Vec<ServiceKey>, Vec<ServiceValue>),
}

impl Batch {
    fn len(&self) -> usize {
        self.backends.0.len() + self.slots.0.len() + self.services.0.len()
    }
}

/// The three maps, by descriptors of their own (the writer thread's).
struct Fds {
    backends: OwnedFd,
    slots: OwnedFd,
    services: OwnedFd,
}

impl Fds {
    fn write(&self, b: &Batch) -> Result<(), MapError> {
        write_map(self.backends.as_fd(), map_names::BACKENDS, &b.backends)?;
        write_map(self.slots.as_fd(), map_names::SLOTS, &b.slots)?;
        write_map(self.services.as_fd(), map_names::SERVICES, &b.services)
    }
}

fn write_map<K: bytemuck::Pod, V: bytemuck::Pod>(fd: BorrowedFd, name: &'static str, puts: &(Vec<K>, Vec<V>)) -> Result<(), MapError> {
    bpf_batch::update_batch(fd, &puts.0, &puts.1).map_err(|(_, source)| MapError::update_failed(name, "update batch", source))
}

enum ToWriter {
    Batch(Batch),
    /// Everything sent before is written (or failed): answer.
    Fence(mpsc::Sender<()>),
}

/// The writer thread, and its first error (later batches are dropped after one).
struct Writer {
    tx: mpsc::SyncSender<ToWriter>,
    thread: thread::JoinHandle<()>,
    error: Arc<Mutex<Option<MapError>>>,
}

/// One sync's held puts.
pub(crate) struct Bulk {
    current: Batch,
    /// Batches sent since the last fence.
    unfenced: usize,
    writer: Writer,
    /// A batch failed (reported once): what came after it was dropped.
    failed: bool,
}

impl Bulk {
    /// Holds puts for these maps; `None` without descriptors or a thread of its own: the caller
    /// writes entry by entry.
    pub fn start(backends: BorrowedFd, slots: BorrowedFd, services: BorrowedFd) -> Option<Self> {
        let fds = Fds { backends: backends.try_clone_to_owned().ok()?, slots: slots.try_clone_to_owned().ok()?, services: services.try_clone_to_owned().ok()? };
        // One batch queued while one is written: at most three in memory.
        let (tx, rx) = mpsc::sync_channel::<ToWriter>(1);
        let error: Arc<Mutex<Option<MapError>>> = Arc::default();
        let first_error = Arc::clone(&error);
        let spawned = thread::Builder::new().name("kpr-bulk".into()).spawn(move || {
            let mut failed = false;
            for msg in rx {
                match msg {
                    ToWriter::Batch(b) if !failed => {
                        if let Err(e) = fds.write(&b) {
                            failed = true;
                            *first_error.lock().unwrap() = Some(e);
                        }
                    }
                    ToWriter::Batch(_) => {}
                    ToWriter::Fence(done) => {
                        let _ = done.send(());
                    }
                }
            }
        });
        let thread = spawned.ok()?;
        Some(Bulk { current: Batch::default(), unfenced: 0, writer: Writer { tx, thread, error }, failed: false })
    }

    pub fn put_backend(&mut self, id: u32, b: Backend) -> Result<(), MapError> {
        self.current.backends.0.push(id);
        self.current.backends.1.push(b);
        self.send_if_full()
    }

    pub fn put_slot(&mut self, k: SlotKey, backend_id: u32) -> Result<(), MapError> {
        self.current.slots.0.push(k);
        self.current.slots.1.push(backend_id);
        self.send_if_full()
    }

    pub fn put_service(&mut self, k: ServiceKey, v: ServiceValue) -> Result<(), MapError> {
        self.current.services.0.push(k);
        self.current.services.1.push(v);
        self.send_if_full()
    }

    fn send_if_full(&mut self) -> Result<(), MapError> {
        if self.current.len() < BATCH {
            return Ok(());
        }
        self.send()
    }

    /// Hands the current batch to the writer.
    fn send(&mut self) -> Result<(), MapError> {
        let b = std::mem::take(&mut self.current);
        if b.len() == 0 {
            return Ok(());
        }
        self.unfenced += 1;
        self.writer.tx.send(ToWriter::Batch(b)).map_err(|_| writer_gone())
    }

    /// Everything held so far is in the maps (a delete from them may follow), or the first
    /// error writing it.
    pub fn barrier(&mut self) -> Result<(), MapError> {
        if self.failed {
            return Err(MapError::Other { map: map_names::SLOTS, message: "an earlier batch of held writes failed".into() });
        }
        self.send()?;
        let w = &self.writer;
        if self.unfenced > 0 {
            let (done_tx, done_rx) = mpsc::channel();
            w.tx.send(ToWriter::Fence(done_tx)).map_err(|_| writer_gone())?;
            done_rx.recv().map_err(|_| writer_gone())?;
            self.unfenced = 0;
        }
        match w.error.lock().unwrap().take() {
            Some(e) => {
                self.failed = true;
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Writes what is left and ends the writer.
    pub fn finish(mut self) -> Result<(), MapError> {
        let written = self.barrier();
        let Writer { tx, thread, .. } = self.writer;
        drop(tx);
        let _ = thread.join();
        written
    }
}

fn writer_gone() -> MapError {
    MapError::Other { map: map_names::SLOTS, message: "the bulk writer thread ended".into() }
}
