//! What is wrong with one object, as kpr reports it: the object, the field, the message, and the
//! reason its Event carries.
use std::fmt;

/// A problem with one object: where it came from, which object, which field, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectError {
    pub source: String,
    pub object: String,
    pub field: String,
    pub message: String,
    /// The Event's reason.
    pub reason: &'static str,
}

/// A field kpr cannot program (the object is wrong, or kpr does not support it).
pub const FIELD_NOT_PROGRAMMED: &str = "FieldNotProgrammed";
/// A map had no room for the object's frontends or endpoints.
pub const MAP_FULL: &str = "MapFull";
/// A valid part kpr does not program yet (IPv6, SCTP).
pub const NOT_SUPPORTED: &str = "NotSupported";
/// A backend left out of a Service for now: it refused or let time out new connections.
pub const OUTLIER_EJECTED: &str = "OutlierEjected";
/// A kernel write for a Service failed (the other Services were programmed).
pub const WRITE_FAILED: &str = "WriteFailed";
/// Every reason an object is not (wholly) programmed, each a label of kpr_not_programmed.
pub const REASONS: [&str; 5] = [FIELD_NOT_PROGRAMMED, NOT_SUPPORTED, MAP_FULL, OUTLIER_EJECTED, WRITE_FAILED];
/// The data path dropped new masqueraded connections: no SNAT port towards their backend was
/// free (the Node's Event; the connections are counted as snat_no_port).
pub const SNAT_PORTS_EXHAUSTED: &str = "SnatPortsExhausted";

/// The Node's Event for `dropped` new connections that found no free SNAT port since the last
/// sync.
pub fn snat_ports_exhausted(node_name: &str, dropped: u64) -> ObjectError {
    ObjectError {
        source: "kpr".into(),
        object: format!("Node /{node_name}"),
        field: "status.addresses".into(),
        message: format!(
            "{dropped} new masqueraded connections dropped since the last sync: every SNAT port of this node's address towards their backend is held by an open flow (kpr_datapath_packets_total{{reason=\"snat_no_port\"}}); spread the load over more backends, or give the node more SNAT room (docs/datapath.md)"
        ),
        reason: SNAT_PORTS_EXHAUSTED,
    }
}

impl fmt::Display for ObjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: field {}: {}", self.source, self.object, self.field, self.message)
    }
}

/// A problem with one port of a Service as a data plane meets it: the port named as the data
/// planes name their frontends, "namespace/name:port".
pub fn service_port_error(service_port: &str, message: impl Into<String>, reason: &'static str) -> ObjectError {
    let (name, port) = service_port.rsplit_once(':').unwrap_or((service_port, ""));
    ObjectError { source: "kpr".into(), object: format!("Service {name}"), field: format!("spec.ports[{port}]"), message: message.into(), reason }
}

/// One error per object, field and reason, in the order first met: a Service port's frontends
/// (ClusterIP, NodePorts, each family) and writes (a virtual server and each of its
/// destinations) fail alike, and their Service gets one Event. Other messages than the
/// first are counted in it. Not for errors that each name a part of the field (an ejected
/// endpoint of a port).
pub fn one_per_field(errors: impl IntoIterator<Item = ObjectError>) -> Vec<ObjectError> {
    use std::collections::hash_map::Entry;
    let mut out: Vec<(ObjectError, usize)> = Vec::new();
    let mut at: std::collections::HashMap<(String, String, &str), usize> = std::collections::HashMap::new();
    for e in errors {
        match at.entry((e.object.clone(), e.field.clone(), e.reason)) {
            Entry::Occupied(i) => {
                let (first, more) = &mut out[*i.get()];
                if first.message != e.message {
                    *more += 1;
                }
            }
            Entry::Vacant(slot) => {
                slot.insert(out.len());
                out.push((e, 0));
            }
        }
    }
    out.into_iter()
        .map(|(mut e, more)| {
            if more > 0 {
                e.message = format!("{} (and {more} more failures of this field)", e.message);
            }
            e
        })
        .collect()
}

/// A valid part of an object that kpr does not program yet (reported, never skipped in silence).
pub(crate) fn unsupported(errors: &mut Vec<ObjectError>, object: &str, field: impl Into<String>, message: impl Into<String>) {
    errors.push(ObjectError { source: "model".into(), object: object.into(), field: field.into(), message: message.into(), reason: NOT_SUPPORTED });
}

pub(crate) fn err(errors: &mut Vec<ObjectError>, object: &str, field: impl Into<String>, message: impl Into<String>) {
    errors.push(ObjectError { source: "model".into(), object: object.into(), field: field.into(), message: message.into(), reason: FIELD_NOT_PROGRAMMED });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fields_failures_are_one_error_counting_the_other_messages() {
        let e = |service: &str, message: &str, reason| service_port_error(service, message, reason);
        let merged = one_per_field([
            e("demo/web:http", "add service: EINVAL", WRITE_FAILED),
            e("demo/web:http", "add destination 10.244.1.2:80: ESRCH", WRITE_FAILED),
            e("demo/web:http", "add destination 10.244.1.3:80: ESRCH", WRITE_FAILED),
            e("demo/web:http", "add service: EINVAL", WRITE_FAILED),
            e("demo/web:http", "map full", MAP_FULL),
            e("demo/web:dns", "map full", MAP_FULL),
            e("demo/web:http", "map full", MAP_FULL),
        ]);
        let shown: Vec<(&str, &str, &str)> = merged.iter().map(|e| (e.field.as_str(), e.reason, e.message.as_str())).collect();
        assert_eq!(
            shown,
            [
                ("spec.ports[http]", WRITE_FAILED, "add service: EINVAL (and 2 more failures of this field)"),
                ("spec.ports[http]", MAP_FULL, "map full"),
                ("spec.ports[dns]", MAP_FULL, "map full"),
            ]
        );
    }
}
