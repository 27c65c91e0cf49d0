//! A re-list's objects as they arrive, held apart until InitDone swaps them in. The watch task
//! decodes the list pages on one core; the slices' conversion to what the model reads (each
//! address parsed, nodes and zones interned: a third of that task's time at 100,000 slices)
//! runs on a thread of its own meanwhile, batch by batch, in arrival order.
use std::{
    sync::mpsc,
    thread::{self, JoinHandle},
};

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;

use super::decoded::Undecodable;
use crate::model::{
    objects::{ObjectName, ServiceObject},
    slice_object::SliceObject,
    slice_wire::SliceWire,
};

/// Slices handed to the converter at a time: a list page's worth.
const BATCH: usize = 500;

/// A watch's buffer for its re-lists (Init .. InitDone), applied atomically at InitDone.
#[derive(Default)]
pub(super) struct Relist {
    /// The API server lists in key order: kept in a vector, the cache is built in one pass.
    pub services: Option<Vec<(ObjectName, ServiceObject)>>,
    pub slices: Option<SliceConversion>,
    pub node: Option<Option<Node>>,
    /// The re-list's objects that did not decode (see `super::decoded`).
    pub undecodable: Vec<(ObjectName, Undecodable)>,
}

/// The slices of one re-list, converted on the converter thread (inline if it cannot start).
pub(super) struct SliceConversion {
    batch: Vec<SliceWire>,
    /// Two batches queued at most: with the one being filled and the one being converted,
    /// about four pages of decoded slices wait in memory, no more.
    tx: Option<mpsc::SyncSender<Vec<SliceWire>>>,
    converter: Option<JoinHandle<Vec<(ObjectName, SliceObject)>>>,
    /// Converted here, when the thread could not start.
    converted: Vec<(ObjectName, SliceObject)>,
}

fn convert(batch: Vec<SliceWire>, into: &mut Vec<(ObjectName, SliceObject)>) {
    into.extend(batch.into_iter().map(|o| ((o.namespace().unwrap_or_default(), o.name_any()), SliceObject::from(o))));
}

impl SliceConversion {
    pub fn start() -> Self {
        let (tx, rx) = mpsc::sync_channel::<Vec<SliceWire>>(2);
        let converter = thread::Builder::new()
            .name("kpr-slices".into())
            .spawn(move || {
                let mut out = Vec::new();
                for batch in rx {
                    convert(batch, &mut out);
                }
                out
            })
            .ok();
        Self { batch: Vec::with_capacity(BATCH), tx: converter.as_ref().map(|_| tx), converter, converted: Vec::new() }
    }

    pub fn push(&mut self, o: SliceWire) {
        self.batch.push(o);
        if self.batch.len() >= BATCH {
            self.hand_on();
        }
    }

    fn hand_on(&mut self) {
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
        match &self.tx {
            Some(tx) => {
                if tx.send(batch).is_err() {
                    // The converter is gone: it panicked.
                    self.rethrow();
                }
            }
            None => convert(batch, &mut self.converted),
        }
    }

    /// The converter's panic, here: a partial list must never replace the cache (every slice
    /// left out would be taken as deleted). The watch task fails as loudly as it would have
    /// had the conversion panicked in it.
    fn rethrow(&mut self) -> ! {
        self.tx = None;
        match self.converter.take().map(JoinHandle::join) {
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            _ => panic!("the slice converter ended before its list did"),
        }
    }

    /// Every slice pushed, converted, in the order pushed.
    pub fn finish(mut self) -> Vec<(ObjectName, SliceObject)> {
        self.hand_on();
        self.tx = None;
        match self.converter.take().map(JoinHandle::join) {
            Some(Ok(out)) => out,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            // No thread: converted here.
            None => std::mem::take(&mut self.converted),
        }
    }
}

impl Drop for SliceConversion {
    fn drop(&mut self) {
        // A re-list started over: the converter ends with the channel, its work dropped.
        self.tx = None;
        if let Some(t) = self.converter.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn slice(i: usize) -> SliceWire {
        SliceWire {
            metadata: ObjectMeta { namespace: Some("ns".into()), name: Some(format!("s-{i:05}")), resource_version: Some(i.to_string()), ..Default::default() },
            address_type: "IPv4".into(),
            ..Default::default()
        }
    }

    #[test]
    fn every_slice_comes_back_converted_in_the_order_pushed() {
        let mut c = SliceConversion::start();
        let n = 3 * BATCH + 7;
        for i in 0..n {
            c.push(slice(i));
        }
        let out = c.finish();
        assert_eq!(out.len(), n);
        for (i, ((ns, name), o)) in out.iter().enumerate() {
            assert_eq!((ns.as_str(), name.as_str(), o.resource_version.as_deref()), ("ns", format!("s-{i:05}").as_str(), Some(i.to_string().as_str())));
        }
    }
}
