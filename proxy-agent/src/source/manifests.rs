//! The directory source: Service and EndpointSlice manifests (YAML, multi-document YAML, JSON,
//! `kind: List`) read into the real k8s-openapi types. A bad document is reported with its file,
//! object and field; every other document is still used.
use std::{
    path::{Path, PathBuf},
    time::SystemTime,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::model::{errors::ObjectError, objects::Objects};
use serde::de::DeserializeOwned;

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("cannot read manifest directory {dir}: {err}")]
    ReadDir { dir: PathBuf, err: std::io::Error },
}

#[derive(Debug, Default)]
pub struct LoadReport {
    pub objects: Objects,
    pub errors: Vec<ObjectError>,
}

fn is_manifest(p: &Path) -> bool {
    matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json"))
}

fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>, SourceError> {
    let rd = std::fs::read_dir(dir).map_err(|err| SourceError::ReadDir { dir: dir.into(), err })?;
    let mut files: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_file() && is_manifest(p)).collect();
    files.sort();
    Ok(files)
}

/// Names, sizes and modification times of the manifests: changes when any manifest changes.
pub fn fingerprint(dir: &Path) -> Result<Vec<(PathBuf, u64, Option<SystemTime>)>, SourceError> {
    Ok(manifest_files(dir)?
        .into_iter()
        .map(|p| {
            let md = std::fs::metadata(&p).ok();
            let len = md.as_ref().map(|m| m.len()).unwrap_or(0);
            let mtime = md.and_then(|m| m.modified().ok());
            (p, len, mtime)
        })
        .collect())
}

pub fn load_dir(dir: &Path) -> Result<LoadReport, SourceError> {
    let mut report = LoadReport::default();
    for file in manifest_files(dir)? {
        let source = file.display().to_string();
        match std::fs::read_to_string(&file) {
            Ok(text) => load_text(&source, &text, &mut report),
            Err(e) => report.errors.push(ObjectError {
                source,
                object: "-".into(),
                field: "-".into(),
                message: format!("cannot read: {e}"),
                reason: crate::model::errors::FIELD_NOT_PROGRAMMED,
            }),
        }
    }
    Ok(report)
}

/// Parses every document of one file into `report`.
pub fn load_text(source: &str, text: &str, report: &mut LoadReport) {
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = match serde_yaml::Value::deserialize_from(doc) {
            Ok(v) => v,
            Err(e) => {
                report.errors.push(ObjectError {
                    source: source.into(),
                    object: format!("document {}", i + 1),
                    field: "-".into(),
                    message: format!("not YAML/JSON: {e}"),
                    reason: crate::model::errors::FIELD_NOT_PROGRAMMED,
                });
                // The rest of the stream cannot be resynchronised.
                return;
            }
        };
        if value.is_null() {
            continue;
        }
        add_value(source, value, report);
    }
}

trait DeserializeFrom: Sized {
    fn deserialize_from(d: serde_yaml::Deserializer<'_>) -> Result<Self, serde_yaml::Error>;
}
impl DeserializeFrom for serde_yaml::Value {
    fn deserialize_from(d: serde_yaml::Deserializer<'_>) -> Result<Self, serde_yaml::Error> {
        serde::Deserialize::deserialize(d)
    }
}

fn str_at<'a>(v: &'a serde_yaml::Value, path: &[&str]) -> Option<&'a str> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p)?;
    }
    cur.as_str()
}

fn add_value(source: &str, value: serde_yaml::Value, report: &mut LoadReport) {
    let kind = str_at(&value, &["kind"]).unwrap_or("").to_string();
    let ns = str_at(&value, &["metadata", "namespace"]).unwrap_or("default").to_string();
    let name = str_at(&value, &["metadata", "name"]).unwrap_or("").to_string();
    let object = format!("{kind} {ns}/{name}");
    match kind.as_str() {
        "List" => {
            if let Some(serde_yaml::Value::Sequence(items)) = value.get("items").cloned() {
                for item in items {
                    add_value(source, item, report);
                }
            }
        }
        "Service" => {
            if let Some(svc) = typed::<Service>(source, &object, value, report) {
                report.objects.services.insert((ns, name), svc.into());
            }
        }
        "EndpointSlice" => {
            if let Some(slice) = typed::<EndpointSlice>(source, &object, value, report) {
                report.objects.slices.insert((ns, name), slice.into());
            }
        }
        // Other kinds (Deployments, ...) may live beside them; they are not ours.
        _ => {}
    }
}

fn typed<T: DeserializeOwned>(source: &str, object: &str, value: serde_yaml::Value, report: &mut LoadReport) -> Option<T> {
    if str_at(&value, &["metadata", "name"]).unwrap_or("").is_empty() {
        report.errors.push(ObjectError {
            source: source.into(),
            object: object.into(),
            field: "metadata.name".into(),
            message: "missing".into(),
            reason: crate::model::errors::FIELD_NOT_PROGRAMMED,
        });
        return None;
    }
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(v) => Some(v),
        Err(e) => {
            report.errors.push(ObjectError {
                source: source.into(),
                object: object.into(),
                field: e.path().to_string(),
                message: e.inner().to_string(),
                reason: crate::model::errors::FIELD_NOT_PROGRAMMED,
            });
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_field_is_named_and_others_survive() {
        let text = r#"
apiVersion: v1
kind: Service
metadata: {name: good, namespace: ns}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: ns}
spec: {clusterIP: 10.96.0.2, ports: [{port: "eighty"}]}
"#;
        let mut r = LoadReport::default();
        load_text("f.yaml", text, &mut r);
        assert_eq!(r.objects.services.len(), 1);
        assert!(r.objects.services.contains_key(&("ns".into(), "good".into())));
        assert_eq!(r.errors.len(), 1);
        assert_eq!(r.errors[0].object, "Service ns/bad");
        assert_eq!(r.errors[0].field, "spec.ports[0].port");
    }
}
