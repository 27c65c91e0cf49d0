//! Where Services, EndpointSlices and the Node come from.
pub mod kube;
pub mod manifests;
