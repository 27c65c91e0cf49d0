//! What a Service's annotations ask of kpr (scheduler, IPVS options), checked field by field.
use std::{collections::BTreeMap, net::IpAddr};

use crate::model::{
    objects::{err, ObjectError},
    Scheduler,
};

pub const SCHEDULER_ANNOTATION: &str = "kpr.io/scheduler";
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
