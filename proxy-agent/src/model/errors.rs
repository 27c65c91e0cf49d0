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
/// Every reason kpr gives an Event.
pub const REASONS: [&str; 5] = [FIELD_NOT_PROGRAMMED, NOT_SUPPORTED, MAP_FULL, OUTLIER_EJECTED, WRITE_FAILED];

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

/// A valid part of an object that kpr does not program yet (reported, never skipped in silence).
pub(crate) fn unsupported(errors: &mut Vec<ObjectError>, object: &str, field: impl Into<String>, message: impl Into<String>) {
    errors.push(ObjectError { source: "model".into(), object: object.into(), field: field.into(), message: message.into(), reason: NOT_SUPPORTED });
}

pub(crate) fn err(errors: &mut Vec<ObjectError>, object: &str, field: impl Into<String>, message: impl Into<String>) {
    errors.push(ObjectError { source: "model".into(), object: object.into(), field: field.into(), message: message.into(), reason: FIELD_NOT_PROGRAMMED });
}
