//! What a Service's annotations ask of kpr (scheduler, IPVS options), checked field by field.
use std::{collections::BTreeMap, net::IpAddr};

use crate::model::{
    errors::{err, unsupported, ObjectError},
    Scheduler,
};

pub const SCHEDULER_ANNOTATION: &str = "kpr.io/scheduler";
/// The fast path ends this Service's connections older than this (a duration: 300s, 1h, or
/// seconds), so long-lived clients re-balance after a scale-out (kubernetes#38456): TCP with a
/// reset, UDP by starting the flow over on a (maybe) other backend.
pub const MAX_CONNECTION_AGE_ANNOTATION: &str = "kpr.io/max-connection-age";
/// IPVS mode: the scheduler of this Service's virtual servers (rr, wrr, lc, ...).
pub const IPVS_SCHEDULER_ANNOTATION: &str = "kpr.io/ipvs-scheduler";
/// IPVS mode: nat (default), dr or tun.
pub const IPVS_FORWARD_ANNOTATION: &str = "kpr.io/ipvs-forward";
/// IPVS mode: per-endpoint weights, "10.244.1.5=3,10.244.2.7=1" (others get 1).
pub const IPVS_WEIGHTS_ANNOTATION: &str = "kpr.io/ipvs-weights";

/// How IPVS mode programs a frontend (annotations; the eBPF fast path ignores them).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct IpvsOptions {
    /// None: the configuration's ipvs.scheduler.
    pub scheduler: Option<String>,
    pub forward: IpvsForward,
    /// Endpoint address -> weight; absent ones weigh 1.
    pub weights: BTreeMap<IpAddr, u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, PartialOrd, Ord)]
pub enum IpvsForward {
    #[default]
    Nat,
    DirectRouting,
    Tunnel,
}

pub(crate) fn ipvs_options(annotations: Option<&BTreeMap<String, String>>, object: &str, errors: &mut Vec<ObjectError>) -> IpvsOptions {
    let mut o = IpvsOptions::default();
    let Some(a) = annotations else { return o };
    if let Some(s) = a.get(IPVS_SCHEDULER_ANNOTATION) {
        if proxy_common::IPVS_SCHEDULERS.contains(&s.as_str()) {
            o.scheduler = Some(s.clone());
        } else {
            let field = format!("metadata.annotations[{IPVS_SCHEDULER_ANNOTATION}]");
            err(
                errors,
                object,
                field,
                format!("unknown IPVS scheduler {s:?} (expected one of {}); using the configured one", proxy_common::IPVS_SCHEDULERS.join(", ")),
            );
        }
    }
    if let Some(f) = a.get(IPVS_FORWARD_ANNOTATION) {
        o.forward = match f.to_ascii_lowercase().as_str() {
            "nat" | "masq" => IpvsForward::Nat,
            "dr" | "route" | "gatewaying" => IpvsForward::DirectRouting,
            "tun" | "tunnel" | "ipip" => IpvsForward::Tunnel,
            _ => {
                err(errors, object, format!("metadata.annotations[{IPVS_FORWARD_ANNOTATION}]"), format!("{f:?} is not nat, dr or tun; using nat"));
                IpvsForward::Nat
            }
        };
    }
    if let Some(w) = a.get(IPVS_WEIGHTS_ANNOTATION) {
        for (i, item) in w.split(',').map(str::trim).filter(|s| !s.is_empty()).enumerate() {
            let parsed = item.split_once('=').and_then(|(ip, wt)| Some((ip.trim().parse::<IpAddr>().ok()?, wt.trim().parse::<u32>().ok()?)));
            match parsed {
                Some((ip, wt)) if wt <= 65_535 => {
                    o.weights.insert(ip, wt);
                }
                _ => err(
                    errors,
                    object,
                    format!("metadata.annotations[{IPVS_WEIGHTS_ANNOTATION}][{i}]"),
                    format!("{item:?} is not <endpoint IP>=<weight 0..65535>; entry ignored"),
                ),
            }
        }
    }
    o
}

/// The fast path leaves out, for new connections, a backend of this Service that refused or let
/// time out several new connections in a row ("true"; see dataplane/ebpf/outlier.rs).
pub const OUTLIER_EJECTION_ANNOTATION: &str = "kpr.io/outlier-ejection";

/// kpr.io/outlier-ejection: whether the Service opts in.
pub(crate) fn outlier_ejection(annotations: Option<&BTreeMap<String, String>>, supported: bool, object: &str, errors: &mut Vec<ObjectError>) -> bool {
    let Some(v) = annotations.and_then(|a| a.get(OUTLIER_EJECTION_ANNOTATION)) else { return false };
    let field = format!("metadata.annotations[{OUTLIER_EJECTION_ANNOTATION}]");
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "on" | "yes" if supported => true,
        "true" | "on" | "yes" => {
            unsupported(errors, object, field, "outlier ejection is done by the eBPF fast path only; not in IPVS mode");
            false
        }
        "false" | "off" | "no" | "" => false,
        _ => {
            err(errors, object, field, format!("{v:?} is neither true nor false; no outlier ejection"));
            false
        }
    }
}

/// Go's duration syntax (30s, 1m0s, 250ms), as kube-proxy's flags take them; a bare number is
/// seconds.
pub fn parse_duration(s: &str) -> Result<kube::core::Duration, String> {
    let d = match s.parse::<f64>() {
        // Checked: "inf" and "1e20" parse as numbers, and from_secs_f64 panics on them.
        Ok(secs) if secs >= 0.0 => {
            kube::core::Duration::from(std::time::Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is out of range for a duration"))?)
        }
        _ if too_long_for_kube(s) => return Err(format!("{s:?} is out of range for a duration")),
        _ => s.parse::<kube::core::Duration>().map_err(|e| format!("{s:?} is not a duration (e.g. 30s, 1m0s, 250ms): {e}"))?,
    };
    if d.is_negative() {
        return Err(format!("{s:?} is negative"));
    }
    Ok(d)
}

/// kube-core's Go-duration parser panics when the sum overflows std's Duration (its mul_f64 and
/// +=): at most 64 characters and 12 digits a number keep any sum far below (5 parts of 10^12
/// hours are 2 x 10^16 s of the 1.8 x 10^19 s a Duration holds).
fn too_long_for_kube(s: &str) -> bool {
    s.len() > 64 || s.split(|c: char| c.is_alphabetic()).any(|number| number.trim_start_matches(['+', '-']).len() > 12)
}

/// kpr.io/max-connection-age in whole seconds (0: none). A bad value is reported and ignored;
/// where the data plane cannot end connections (`supported` false) the annotation is reported
/// as not supported.
pub(crate) fn max_connection_age(annotations: Option<&BTreeMap<String, String>>, supported: bool, object: &str, errors: &mut Vec<ObjectError>) -> u32 {
    let Some(s) = annotations.and_then(|a| a.get(MAX_CONNECTION_AGE_ANNOTATION)) else { return 0 };
    let field = format!("metadata.annotations[{MAX_CONNECTION_AGE_ANNOTATION}]");
    if !supported {
        unsupported(errors, object, field, "connections are aged by the eBPF fast path only; not in IPVS mode");
        return 0;
    }
    match parse_duration(s.trim()).map(std::time::Duration::from) {
        Ok(d) if d.as_secs() >= 1 && d.as_secs() <= u64::from(u32::MAX) => d.as_secs() as u32,
        Ok(_) => {
            err(errors, object, field, format!("{s:?} is under a second (or absurdly long); no maximum age"));
            0
        }
        Err(e) => {
            err(errors, object, field, format!("{e}; no maximum age"));
            0
        }
    }
}

/// The fast path's scheduler: the annotation's, else the configured one (an unknown name is
/// reported and the configured one used).
pub(crate) fn scheduler(annotations: Option<&BTreeMap<String, String>>, default: Scheduler, object: &str, errors: &mut Vec<ObjectError>) -> Scheduler {
    match annotations.and_then(|a| a.get(SCHEDULER_ANNOTATION)) {
        None => default,
        Some(s) => s.parse().unwrap_or_else(|e: String| {
            err(errors, object, format!("metadata.annotations[{SCHEDULER_ANNOTATION}]"), format!("{e}; using {}", default.name()));
            default
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn age(v: &str) -> (u32, Vec<ObjectError>) {
        let a = BTreeMap::from([(MAX_CONNECTION_AGE_ANNOTATION.to_string(), v.to_string())]);
        let mut errors = Vec::new();
        (max_connection_age(Some(&a), true, "default/web", &mut errors), errors)
    }

    #[test]
    fn durations_out_of_range_are_errors_not_panics() {
        for v in ["inf", "1e20", "1e300", "NaN", "-inf", "-5", "9999999999999999999999h", &"1h".repeat(40)] {
            assert!(parse_duration(v).is_err(), "{v}");
        }
        // The longest accepted: parsed, no overflow.
        assert!(parse_duration("999999999999h999999999999h999999999999h").is_ok());
        assert_eq!(std::time::Duration::from(parse_duration("1.5").unwrap()), std::time::Duration::from_millis(1500));
        assert_eq!(std::time::Duration::from(parse_duration("1m30s").unwrap()), std::time::Duration::from_secs(90));
    }

    #[test]
    fn a_bad_maximum_age_is_reported_on_its_field_and_ignored() {
        assert_eq!(age("90s"), (90, vec![]));
        assert_eq!(age("3600").0, 3600);
        for v in ["inf", "1e20", "0.5", "soon"] {
            let (secs, errors) = age(v);
            assert_eq!(secs, 0, "{v}");
            assert_eq!(errors.len(), 1, "{v}: {errors:?}");
            assert_eq!((errors[0].object.as_str(), errors[0].field.as_str()), ("default/web", "metadata.annotations[kpr.io/max-connection-age]"), "{v}");
        }
    }
}
