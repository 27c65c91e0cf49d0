//! kube-proxy's packet-flow tables as kpr's conformance suite.
//!
//! `tests/conformance/nftables.yaml` and `iptables.yaml` hold the tables of kube-proxy's proxier
//! tests as data: the Services and EndpointSlices each table runs against, the proxier's
//! settings, and every row: a packet from a source to a destination, and the answer kube-proxy
//! must give (the endpoints it may reach, DROP, REJECT, or "" for untouched) with its masquerade
//! bit. `topology` rebuilds the fake proxier's node with real namespaces and sends every row as
//! real TCP or UDP through kpr; this module turns what each probe met into the same answer and
//! compares. Where the iptables and nftables proxiers answer a row differently, kpr follows
//! nftables and the matrix shows both. A row that disagrees fails the suite unless
//! `differences.yaml` lists it for that mode with its reason; an entry no row answers as it says
//! fails too, so the list stays true.
pub mod probe;
pub mod topology;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use serde::Deserialize;

/// One table (or one variant of a table) of a proxier test.
#[derive(Debug, Clone, Deserialize)]
pub struct Table {
    pub table: String,
    #[serde(default)]
    pub case: String,
    #[serde(default)]
    pub settings: Settings,
    pub objects: String,
    pub flows: Vec<Flow>,
}

/// The fake proxier's settings a table changes.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    #[serde(default)]
    pub masquerade_all: bool,
    /// "none": kube-proxy's no-op local detector (no cluster CIDR).
    #[serde(default)]
    pub local_detector: Option<String>,
    #[serde(default)]
    pub node_port_addresses: Option<Vec<String>>,
    #[serde(default)]
    pub localhost_node_ports: Option<bool>,
}

/// One row.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Flow {
    pub name: String,
    pub source: Ipv4Addr,
    #[serde(default = "tcp")]
    pub protocol: String,
    pub destination: Ipv4Addr,
    pub port: u16,
    pub output: String,
    pub masq: bool,
}

fn tcp() -> String {
    "TCP".into()
}

/// The answer to a row: where the packets went, and whether the endpoint saw a masqueraded
/// source (None: not observable, a client on the node whose address is a node address anyway).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub output: Output,
    pub masq: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Output {
    /// Reached these endpoints (ip:port).
    Endpoints(BTreeSet<String>),
    /// Delivered untranslated: the node's own socket, or routed on to its destination.
    Untouched,
    Drop,
    Reject,
    /// Anything else (an error, or answers mixed with failures): never agrees.
    Other(String),
}

impl Output {
    /// kube-proxy's notation: "10.180.0.1:80, 10.180.2.1:80", "", "DROP", "REJECT", and
    /// "ACCEPT" (the filter rule that lets a health-check node port reach the node: untouched).
    pub fn parse(s: &str) -> Self {
        match s.trim() {
            "" | "ACCEPT" => Output::Untouched,
            "DROP" => Output::Drop,
            "REJECT" => Output::Reject,
            list => Output::Endpoints(list.split(',').map(|e| e.trim().to_string()).collect()),
        }
    }
}

impl std::fmt::Display for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Output::Endpoints(s) => write!(f, "{}", s.iter().cloned().collect::<Vec<_>>().join(", ")),
            Output::Untouched => write!(f, "untouched"),
            Output::Drop => write!(f, "DROP"),
            Output::Reject => write!(f, "REJECT"),
            Output::Other(e) => write!(f, "{e}"),
        }
    }
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.output)?;
        match (&self.output, self.masq) {
            (Output::Endpoints(_), Some(true)) => write!(f, " (masq)"),
            _ => Ok(()),
        }
    }
}

/// What a probe's report (see `probe::probe`) says, for a row sent from `source`;
/// `masq_observable` is false for a client on the node.
pub fn answer_of(report: &serde_json::Value, source: Ipv4Addr, masq_observable: bool) -> Answer {
    let answers = report["answers"].as_object().cloned().unwrap_or_default();
    let failures = report["failures"].as_object().cloned().unwrap_or_default();
    let mut endpoints = BTreeSet::new();
    let (mut untouched, mut masq) = (false, false);
    for line in answers.keys() {
        let mut w = line.split_whitespace();
        let (name, local, peer) = (w.next().unwrap_or(""), w.next().unwrap_or(""), w.next().unwrap_or(""));
        match name {
            "endpoint" => {
                endpoints.insert(local.to_string());
            }
            _ => untouched = true,
        }
        masq |= peer != source.to_string();
    }
    let output = match (endpoints.is_empty(), untouched, failures.len()) {
        (false, false, 0) => Output::Endpoints(endpoints),
        (true, true, 0) => Output::Untouched,
        (true, false, 1) if failures.contains_key("refused") => Output::Reject,
        (true, false, 1) if failures.contains_key("silence") => Output::Drop,
        _ => Output::Other(format!("answers {answers:?}, failures {failures:?}").replace('"', "")),
    };
    Answer { output, masq: masq_observable.then_some(masq) }
}

/// Whether `got` is kube-proxy's `want` (with its masquerade bit). With ClientIP affinity every
/// connection of one client goes to one endpoint: any one of the expected ones agrees.
pub fn agrees(want: &Flow, got: &Answer, affinity: bool) -> bool {
    let expected = Output::parse(&want.output);
    let output_ok = match (&expected, &got.output) {
        (Output::Endpoints(e), Output::Endpoints(g)) if affinity => g.len() == 1 && g.is_subset(e),
        (e, g) => e == g,
    };
    // The bit only means something where an endpoint answered.
    let masq_ok = !matches!(got.output, Output::Endpoints(_)) || got.masq.is_none_or(|m| m == want.masq);
    output_ok && masq_ok
}

/// A row of the suite: a table's row, kube-proxy's answer in the nftables proxier's tests and,
/// where it differs or only the iptables proxier's tests have the row, in the iptables one's.
#[derive(Debug, Clone)]
pub struct Row {
    pub table: String,
    pub case: String,
    pub flow: Flow,
    /// The expectation kpr is held to: nftables' where the nftables tests have the row.
    pub follows: &'static str,
    /// The other proxier's different expectation, shown beside.
    pub other: Option<(&'static str, Flow)>,
}

/// A table to run: its state, settings and rows.
#[derive(Debug, Clone)]
pub struct Run {
    pub table: String,
    pub case: String,
    pub settings: Settings,
    pub objects: String,
    pub rows: Vec<Row>,
}

/// The suite's data directory.
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/conformance")
}

fn load(path: &Path) -> Vec<Table> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The two proxiers' tables merged. The iptables proxier's tests run the same tables as the
/// nftables one's with a fake that serves NodePorts on every node address, not the primary
/// alone: a row both have, to a destination both settings treat alike, runs once, with iptables'
/// answer beside where it differs. The other rows of the iptables tables run under their own
/// settings.
pub fn suite(dir: &Path) -> Vec<Run> {
    let nft = load(&dir.join("nftables.yaml"));
    let ipt = load(&dir.join("iptables.yaml"));
    let row = |t: &Table, f: &Flow, follows| Row { table: t.table.clone(), case: t.case.clone(), flow: f.clone(), follows, other: None };
    let mut runs: Vec<Run> = nft
        .iter()
        .map(|t| Run {
            rows: t.flows.iter().map(|f| row(t, f, "nftables")).collect(),
            table: t.table.clone(),
            case: t.case.clone(),
            settings: with_defaults(t.settings.clone(), NFTABLES_NODE_PORTS),
            objects: t.objects.clone(),
        })
        .collect();
    for t in &ipt {
        let settings = with_defaults(t.settings.clone(), IPTABLES_NODE_PORTS);
        let mut own = Vec::new();
        let twin_run = runs.iter().position(|r| {
            r.table == t.table && r.case == t.case && same_but_node_ports(&r.settings, &settings) && same_objects(&r.objects, &t.objects)
        });
        for f in &t.flows {
            let merged = twin_run.and_then(|i| {
                let run = &mut runs[i];
                if node_port_on(&run.settings, f.destination) != node_port_on(&settings, f.destination) {
                    return None;
                }
                let twin = run.rows.iter_mut().find(|r| r.flow.name == f.name && r.flow.source == f.source && r.flow.destination == f.destination && r.flow.port == f.port)?;
                if twin.flow.output != f.output || twin.flow.masq != f.masq {
                    twin.other = Some(("iptables", f.clone()));
                }
                Some(())
            });
            if merged.is_none() {
                own.push(row(t, f, "iptables"));
            }
        }
        if !own.is_empty() {
            runs.push(Run { rows: own, table: t.table.clone(), case: t.case.clone(), settings, objects: t.objects.clone() });
        }
    }
    runs
}

fn same_but_node_ports(a: &Settings, b: &Settings) -> bool {
    Settings { node_port_addresses: None, ..a.clone() } == Settings { node_port_addresses: None, ..b.clone() }
}

/// Whether the settings serve NodePorts on `addr` (no list: every address of the node).
fn node_port_on(s: &Settings, addr: Ipv4Addr) -> bool {
    let node = topology::NODE_IPS.contains(&addr.to_string().as_str()) || addr.is_loopback();
    match &s.node_port_addresses {
        None => node,
        Some(cidrs) => node && cidrs.iter().filter_map(|c| c.trim().parse::<ipnet::Ipv4Net>().ok()).any(|n| n.contains(&addr)),
    }
}

/// The nftables fake proxier serves NodePorts on its primary address only.
const NFTABLES_NODE_PORTS: &[&str] = &["192.168.0.2/32"];
/// The iptables fake proxier: every address of the node.
const IPTABLES_NODE_PORTS: &[&str] = &[];

fn with_defaults(mut s: Settings, node_ports: &[&str]) -> Settings {
    if s.node_port_addresses.is_none() && !node_ports.is_empty() {
        s.node_port_addresses = Some(node_ports.iter().map(|c| c.to_string()).collect());
    }
    s.local_detector.get_or_insert_with(|| "cidr".into());
    s
}

fn same_objects(a: &str, b: &str) -> bool {
    documents(a) == documents(b)
}

/// A table's objects, a YAML value each.
pub(crate) fn documents(objects: &str) -> Vec<serde_yaml::Value> {
    serde_yaml::Deserializer::from_str(objects).filter_map(|d| serde_yaml::Value::deserialize(d).ok()).collect()
}

/// A known difference: a row whose answer in `modes` is `observed`, not kube-proxy's, and why.
/// Without a case it stands for the row in every case of its table.
#[derive(Debug, Clone, Deserialize)]
pub struct Difference {
    pub table: String,
    #[serde(default)]
    pub case: Option<String>,
    pub row: String,
    pub modes: Vec<String>,
    pub observed: String,
    pub reason: String,
}

pub fn differences(dir: &Path) -> Vec<Difference> {
    let path = dir.join("differences.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    serde_yaml::from_str::<Option<Vec<Difference>>>(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())).unwrap_or_default()
}

/// One row's result.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub row: Row,
    pub got: Answer,
    pub agrees: bool,
    /// The listed difference's reason, where one matched.
    pub documented: Option<String>,
}

impl Outcome {
    /// Fails the suite: a disagreement nobody documented.
    pub fn failure(&self) -> Option<String> {
        (!self.agrees && self.documented.is_none()).then(|| format!("disagrees: expected {}, got {}", expected_text(&self.row.flow), self.got))
    }
}

/// Entries of the list for `mode` that no disagreeing row of the tables run used: the row agrees
/// now, or answers otherwise than the entry says.
fn stale(list: &[Difference], mode: &str, outcomes: &[Outcome]) -> Vec<String> {
    list.iter()
        .filter(|d| d.modes.iter().any(|m| m == mode) && outcomes.iter().any(|o| o.row.table == d.table))
        .filter(|d| !outcomes.iter().any(|o| !o.agrees && matches(d, &o.row, mode, &o.got)))
        .map(|d| format!("{} [{}] {:?}: listed as {:?} in differences.yaml, but no row of it answers so: remove or correct it", d.table, d.case.as_deref().unwrap_or("*"), d.row, d.observed))
        .collect()
}

fn expected_text(f: &Flow) -> String {
    let o = Output::parse(&f.output);
    match o {
        Output::Endpoints(_) if f.masq => format!("{o} (masq)"),
        _ => o.to_string(),
    }
}

/// Whether the entry is about this row in `mode`, whatever it observed.
fn stands_for(d: &Difference, row: &Row, mode: &str) -> bool {
    d.modes.iter().any(|m| m == mode) && d.table == row.table && d.case.as_ref().is_none_or(|c| *c == row.case) && d.row == row.flow.name
}

fn matches(d: &Difference, row: &Row, mode: &str, got: &Answer) -> bool {
    stands_for(d, row, mode) && d.observed == got.to_string()
}

/// What fails the suite in `mode`: each row that disagrees undocumented, and each stale entry.
pub fn failures(known: &[Difference], mode: &str, outcomes: &[Outcome]) -> Vec<String> {
    let mut out: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.failure().map(|why| format!("{} [{}] {:?}: {why}", o.row.table, o.row.case, o.row.flow.name)))
        .collect();
    out.extend(stale(known, mode, outcomes));
    out
}

/// Looks up the reason for a row that disagrees in `mode`; the entry must also name what was
/// observed.
pub fn documented(list: &[Difference], row: &Row, mode: &str, got: &Answer) -> Option<String> {
    list.iter().find(|d| matches(d, row, mode, got)).map(|d| d.reason.clone())
}

/// The modes, in the matrix's column order.
pub const MODES: [(&str, &str); 2] = [("ebpf", "eBPF"), ("ipvs", "IPVS")];

/// The matrix as Markdown: every row with kube-proxy's answer (the other proxier's beside where
/// it differs) and kpr's in each mode: `measured` from this run's outcomes, the other mode as
/// `differences.yaml` says its run answers (its own run checks that). A difference's cell holds
/// the answer and a note number; the notes follow the table.
pub fn matrix(measured: &str, outcomes: &[Outcome], known: &[Difference]) -> String {
    let mut notes: Vec<String> = Vec::new();
    let mut note = |reason: &str| -> usize {
        match notes.iter().position(|n| n == reason) {
            Some(i) => i + 1,
            None => {
                notes.push(reason.to_string());
                notes.len()
            }
        }
    };
    let mut s = String::from("| table | case | row | packet | kube-proxy | kpr eBPF | kpr IPVS |\n|---|---|---|---|---|---|---|\n");
    let mut tally: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
    for o in outcomes {
        let f = &o.row.flow;
        let mut want = format!("{} ({})", expected_text(f), o.row.follows);
        if let Some((name, other)) = &o.row.other {
            want += &format!("; {name}: {}", expected_text(other));
        }
        let mut cells = Vec::new();
        for (mode, _) in MODES {
            // (the answer where it is not kube-proxy's, and the reason where one is listed)
            let cell: Option<(String, Option<&str>)> = if mode == measured {
                (!o.agrees).then(|| (o.got.to_string(), o.documented.as_deref()))
            } else {
                // A listed answer that is kube-proxy's is this row's other copy agreeing.
                let expected = Output::parse(&f.output).to_string();
                known.iter().find(|d| stands_for(d, &o.row, mode)).filter(|d| d.observed != expected).map(|d| (d.observed.clone(), Some(d.reason.as_str())))
            };
            let t = tally.entry(mode).or_default();
            t.0 += 1;
            cells.push(match cell {
                None => {
                    t.1 += 1;
                    "agrees".to_string()
                }
                Some((got, Some(reason))) => {
                    t.2 += 1;
                    format!("{got} [{}]", note(reason))
                }
                Some((got, None)) => format!("**{got}: FAILS**"),
            });
        }
        s += &format!("| {} | {} | {} | {} {} → {}:{} | {} | {} | {} |\n", o.row.table, o.row.case, f.name, f.protocol, f.source, f.destination, f.port, want, cells[0], cells[1]);
    }
    s += "\n";
    for (mode, title) in MODES {
        let (n, agree, differ) = tally.get(mode).copied().unwrap_or_default();
        s += &format!("- {title}: {agree} of {n} rows agree, {differ} differ as noted{}.\n", if mode == measured { " (measured by this run)" } else { " (as its own run checks)" });
    }
    s += "\nNotes:\n\n";
    for (i, n) in notes.iter().enumerate() {
        s += &format!("{}. {n}\n", i + 1);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tables_load_and_every_difference_names_a_row() {
        let dir = data_dir();
        let runs = suite(&dir);
        let rows: Vec<&Row> = runs.iter().flat_map(|r| &r.rows).collect();
        assert!(runs.len() > 30 && rows.len() > 250, "{} tables, {} rows", runs.len(), rows.len());
        for r in &rows {
            let ok = matches!(Output::parse(&r.flow.output), Output::Untouched | Output::Drop | Output::Reject)
                || matches!(Output::parse(&r.flow.output), Output::Endpoints(e) if e.iter().all(|a| a.parse::<std::net::SocketAddrV4>().is_ok()));
            assert!(ok, "{} {:?}: output {:?}", r.table, r.flow.name, r.flow.output);
        }
        for d in differences(&dir) {
            let named = rows.iter().any(|r| r.table == d.table && d.case.as_ref().is_none_or(|c| *c == r.case) && r.flow.name == d.row);
            assert!(named, "differences.yaml names no row: {d:?}");
            assert!(d.modes.iter().all(|m| m == "ebpf" || m == "ipvs"), "{d:?}");
        }
    }

    #[test]
    fn the_two_proxiers_rows_merge_once_with_both_answers() {
        let runs = suite(&data_dir());
        // The same table, state and settings in both files run once, iptables' answer beside.
        let general: Vec<&Row> = runs.iter().filter(|r| r.table == "TestClusterIPGeneral").flat_map(|r| &r.rows).collect();
        let wrong_port: Vec<&&Row> = general.iter().filter(|r| r.flow.name == "svc1 does not accept svc2's ports").collect();
        assert_eq!(wrong_port.len(), 1, "run once");
        match (wrong_port[0].follows, &wrong_port[0].other) {
            ("nftables", Some(("iptables", other))) => assert_eq!((wrong_port[0].flow.output.as_str(), other.output.as_str()), ("REJECT", "")),
            other => panic!("{other:?}"),
        }
        // A NodePort on the secondary address is the iptables fake's alone: its row runs apart.
        let secondary: Vec<&Row> = runs.iter().flat_map(|r| &r.rows).filter(|r| r.flow.destination.to_string() == "192.168.1.2" && r.follows == "iptables").collect();
        assert!(!secondary.is_empty());
    }

    fn flow(output: &str, masq: bool) -> Flow {
        Flow { name: "r".into(), source: "10.0.0.2".parse().unwrap(), protocol: "TCP".into(), destination: "172.30.0.41".parse().unwrap(), port: 80, output: output.into(), masq }
    }

    #[test]
    fn a_probe_report_reads_as_kube_proxys_answer() {
        let src: Ipv4Addr = "10.0.0.2".parse().unwrap();
        let report = |answers: serde_json::Value, failures: serde_json::Value| serde_json::json!({"answers": answers, "failures": failures});
        let two = report(serde_json::json!({"endpoint 10.180.0.1:80 10.0.0.2": 5, "endpoint 10.180.2.1:80 10.0.0.2": 7}), serde_json::json!({}));
        let a = answer_of(&two, src, true);
        assert_eq!(a.masq, Some(false));
        assert!(agrees(&flow("10.180.0.1:80, 10.180.2.1:80", false), &a, false));
        assert!(!agrees(&flow("10.180.0.1:80, 10.180.2.1:80", true), &a, false), "the masquerade bit counts");
        assert!(!agrees(&flow("10.180.0.1:80", false), &a, false), "an endpoint too many");
        let one = answer_of(&report(serde_json::json!({"endpoint 10.180.0.1:80 192.168.0.2": 4}), serde_json::json!({})), src, true);
        assert!(!agrees(&flow("10.180.0.1:80, 10.180.2.1:80", true), &one, false), "an endpoint missing");
        assert!(agrees(&flow("10.180.0.1:80, 10.180.2.1:80", true), &one, true), "with ClientIP affinity one endpoint is the answer");
        // From the node the bit is not observable.
        assert_eq!(answer_of(&two, "192.168.0.2".parse().unwrap(), false).masq, None);
        let silence = answer_of(&report(serde_json::json!({}), serde_json::json!({"silence": 2})), src, true);
        assert_eq!(silence.output, Output::Drop);
        let refused = answer_of(&report(serde_json::json!({}), serde_json::json!({"refused": 2})), src, true);
        assert!(agrees(&flow("REJECT", false), &refused, false));
        let node = answer_of(&report(serde_json::json!({"node 192.168.0.2:3001 10.0.0.2": 1}), serde_json::json!({})), src, true);
        assert!(agrees(&flow("", false), &node, false) && agrees(&flow("ACCEPT", false), &node, false));
        let mixed = answer_of(&report(serde_json::json!({"endpoint 10.180.0.1:80 10.0.0.2": 1}), serde_json::json!({"silence": 1})), src, true);
        assert!(matches!(mixed.output, Output::Other(_)), "answers and drops mixed never agree");
    }
}
