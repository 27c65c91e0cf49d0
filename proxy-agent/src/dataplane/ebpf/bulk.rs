//! Held puts of a sync that fits (`DatapathMaps::begin_bulk`): the service, slot and backend
//! entries are gathered and written map by map with BPF_MAP_UPDATE_BATCH, on two threads of
//! their own (backends and some slots; then the other slots and services), while the sync goes
//! on computing the next ones: the initial sync of a large cluster pays a few system calls
//! instead of one per entry, and its kernel time overlaps its own.
//!
//! Order: a batch writes its backends, then its slots, then its services, and batches are
//! written in the order they were made (each stage takes them in order, and the second takes a
//! batch only once the first wrote its part). So no entry is ever written before one it points
//! to: a slot's backend is in an earlier map of its batch or in an earlier batch.
//!
//! The slots (a million at 100,000 Services, each a hash insert) are the most work: the first
//! stage writes the slots of even service ids after its backends (an array's writes, cheap), the
//! second those of odd ones, then the services, once both parts are in. Split by service id, so
//! one slot key is always written by one stage, in the order of its puts (two frontends that
//! share a service key put the same slots twice in one sync).
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
    /// By the parity of the service id: the first stage's, then the second's.
    slots: [(Vec<SlotKey>, Vec<u32>); 2],
    services: (Vec<ServiceKey>, Vec<ServiceValue>),
}

impl Batch {
    fn len(&self) -> usize {
        self.backends.0.len() + self.slots[0].0.len() + self.slots[1].0.len() + self.services.0.len()
    }
}

fn write_map<K: bytemuck::Pod, V: bytemuck::Pod>(fd: BorrowedFd, name: &'static str, keys: &[K], values: &[V]) -> Result<(), MapError> {
    bpf_batch::update_batch(fd, keys, values).map_err(|(_, source)| MapError::update_failed(name, "update batch", source))
}

enum ToWriter {
    Batch(Batch),
    /// Everything sent before is written (or failed): answer.
    Fence(mpsc::Sender<()>),
}

/// The writer threads, and the first error (later batches are dropped after one).
struct Writer {
    tx: mpsc::SyncSender<ToWriter>,
    threads: [thread::JoinHandle<()>; 2],
    error: Arc<Mutex<Option<MapError>>>,
}

/// One stage of the writer: writes its part of each batch and hands the batch on. After a
/// failure it hands on nothing but fences, so no later stage writes an entry whose target the
/// failed batch held.
fn stage(
    name: &str,
    rx: mpsc::Receiver<ToWriter>,
    next: Option<mpsc::SyncSender<ToWriter>>,
    error: Arc<Mutex<Option<MapError>>>,
    write: impl Fn(&Batch) -> Result<(), MapError> + Send + 'static,
) -> Option<thread::JoinHandle<()>> {
    let spawned = thread::Builder::new().name(name.into()).spawn(move || {
        let mut failed = false;
        for msg in rx {
            match msg {
                ToWriter::Batch(b) if !failed => match write(&b) {
                    Ok(()) => {
                        if let Some(next) = &next {
                            let _ = next.send(ToWriter::Batch(b));
                        }
                    }
                    Err(e) => {
                        failed = true;
                        error.lock().unwrap().get_or_insert(e);
                    }
                },
                ToWriter::Batch(_) => {}
                ToWriter::Fence(done) => match &next {
                    Some(next) => {
                        let _ = next.send(ToWriter::Fence(done));
                    }
                    None => {
                        let _ = done.send(());
                    }
                },
            }
        }
    });
    spawned.ok()
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
        // The writer threads' own descriptors of the three maps.
        let own = |fd: BorrowedFd| -> Option<OwnedFd> { fd.try_clone_to_owned().ok() };
        let (backends, slots, services) = (own(backends)?, own(slots)?, own(services)?);
        // Two stages, each on a thread: the backends and the slots of even service ids, then
        // the odd ones' and the services, so the kernel's inserts run on two cores beside the
        // sync's own.
        // One batch queued before each: at most five in memory.
        let (tx, rx) = mpsc::sync_channel::<ToWriter>(1);
        let (to_second, second_rx) = mpsc::sync_channel::<ToWriter>(1);
        let error: Arc<Mutex<Option<MapError>>> = Arc::default();
        let slots_second = slots.try_clone().ok()?;
        let second = stage("kpr-bulk", second_rx, None, Arc::clone(&error), move |b| {
            write_map(slots_second.as_fd(), map_names::SLOTS, &b.slots[1].0, &b.slots[1].1)?;
            write_map(services.as_fd(), map_names::SERVICES, &b.services.0, &b.services.1)
        })?;
        let first = stage("kpr-bulk-be", rx, Some(to_second), Arc::clone(&error), move |b| {
            write_map(backends.as_fd(), map_names::BACKENDS, &b.backends.0, &b.backends.1)?;
            write_map(slots.as_fd(), map_names::SLOTS, &b.slots[0].0, &b.slots[0].1)
        })?;
        Some(Bulk { current: Batch::default(), unfenced: 0, writer: Writer { tx, threads: [first, second], error }, failed: false })
    }

    pub fn put_backend(&mut self, id: u32, b: Backend) -> Result<(), MapError> {
        self.current.backends.0.push(id);
        self.current.backends.1.push(b);
        self.send_if_full()
    }

    pub fn put_slot(&mut self, k: SlotKey, backend_id: u32) -> Result<(), MapError> {
        let part = &mut self.current.slots[(k.service_id & 1) as usize];
        part.0.push(k);
        part.1.push(backend_id);
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
        let Writer { tx, threads, .. } = self.writer;
        // The first stage ends when its sender is gone, and so drops the second's.
        drop(tx);
        for t in threads {
            let _ = t.join();
        }
        written
    }
}

fn writer_gone() -> MapError {
    MapError::Other { map: map_names::SLOTS, message: "the bulk writer thread ended".into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch whose only backend id is `id`.
    fn batch(id: u32) -> Batch {
        let mut b = Batch::default();
        b.backends.0.push(id);
        b.backends.1.push(Backend::default());
        b.slots[1].0.push(SlotKey { service_id: id, slot: 1 });
        b.slots[1].1.push(id);
        b
    }

    #[test]
    fn after_a_failed_first_stage_the_second_writes_nothing_more_and_fences_still_answer() {
        let error: Arc<Mutex<Option<MapError>>> = Arc::default();
        let second_wrote: Arc<Mutex<Vec<u32>>> = Arc::default();
        let (tx, rx) = mpsc::sync_channel(1);
        let (to_second, second_rx) = mpsc::sync_channel(1);
        let wrote = Arc::clone(&second_wrote);
        let second = stage("t-second", second_rx, None, Arc::clone(&error), move |b| {
            wrote.lock().unwrap().push(b.slots[1].1[0]);
            Ok(())
        })
        .unwrap();
        let first = stage("t-first", rx, Some(to_second), Arc::clone(&error), |b| match b.backends.0[0] {
            2 => Err(MapError::Full { map: map_names::BACKENDS }),
            _ => Ok(()),
        })
        .unwrap();
        for id in [1, 2, 3] {
            tx.send(ToWriter::Batch(batch(id))).unwrap();
        }
        let (done_tx, done_rx) = mpsc::channel();
        tx.send(ToWriter::Fence(done_tx)).unwrap();
        done_rx.recv().expect("the fence passes both stages");
        assert_eq!(*second_wrote.lock().unwrap(), vec![1], "batch 2's backends failed: neither it nor batch 3 reaches the slots");
        assert_eq!(error.lock().unwrap().as_ref().and_then(MapError::full_map), Some(map_names::BACKENDS));
        drop(tx);
        first.join().unwrap();
        second.join().unwrap();
    }
}
