//! Kubernetes Events for what kpr could not program: the source's one write to the API.
use kube::Client;
use tracing::warn;

/// Publishes Kubernetes Events (events.k8s.io/v1, type Warning) for objects kpr could not
/// program, so `kubectl describe service` shows why: `qps` a second at most, `burst` at once
/// (a bad rollout of many Services must not become a burst of writes from every node). What
/// waits stays queued, in order.
pub async fn publish_events(
    client: Client,
    node_name: String,
    (qps, burst): (f64, u32),
    mut rx: tokio::sync::mpsc::UnboundedReceiver<crate::model::errors::ObjectError>,
) {
    use k8s_openapi::api::core::v1::ObjectReference;
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(client, Reporter { controller: "kpr".into(), instance: Some(node_name) });
    let mut pace = crate::limiter::Limiter::per_second(qps, burst, std::time::Instant::now());
    while let Some(e) = rx.recv().await {
        let Some((kind, rest)) = e.object.split_once(' ') else {
            continue;
        };
        let Some((ns, name)) = rest.split_once('/') else {
            continue;
        };
        let api_version = match kind {
            "Service" | "Node" => "v1",
            "EndpointSlice" => "discovery.k8s.io/v1",
            _ => continue,
        };
        let reference = ObjectReference {
            api_version: Some(api_version.into()),
            kind: Some(kind.into()),
            // A Node has none ("Node /name").
            namespace: (!ns.is_empty()).then(|| ns.into()),
            name: Some(name.into()),
            ..Default::default()
        };
        let ev = Event {
            type_: EventType::Warning,
            reason: e.reason.into(),
            note: Some(format!("field {}: {}", e.field, e.message)),
            action: "Programming".into(),
            secondary: None,
        };
        // Paced here, at the write: an error that names no object it could publish on takes no
        // turn.
        loop {
            let now = std::time::Instant::now();
            if pace.try_take(now) {
                break;
            }
            tokio::time::sleep(pace.wait(now)).await;
        }
        if let Err(err) = recorder.publish(&ev, &reference).await {
            warn!(error = %err, object = %e.object, "cannot publish event");
        }
    }
}
