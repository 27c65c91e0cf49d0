//! kube-proxy's packet-flow tables (its nftables and iptables proxiers' tests) sent as real TCP
//! and UDP through kpr in eBPF mode, on a node rebuilt with the fake proxier's addresses. The
//! same suite runs in IPVS mode in the QEMU guest (`cargo xtask vm-test`). Prints the matrix,
//! and writes it where KPR_CONFORMANCE_OUT says; KPR_CONFORMANCE_ONLY=TEXT runs the tables
//! whose name contains TEXT.
use kpr_lab::conformance::{self, topology::ConformanceLab};

#[test]
fn kube_proxy_packet_flow_tables_in_ebpf_mode() {
    let dir = conformance::data_dir();
    // KPR_CONFORMANCE_ONLY=TEXT: only the tables whose name contains TEXT.
    let only = std::env::var("KPR_CONFORMANCE_ONLY").unwrap_or_default();
    let runs: Vec<_> = conformance::suite(&dir).into_iter().filter(|r| r.table.contains(&only)).collect();
    let known = conformance::differences(&dir);
    let mut lab = ConformanceLab::build("kcf", &runs, &[]);
    let outcomes = lab.run_all(&runs, "ebpf", &known);
    let matrix = conformance::matrix("eBPF", &outcomes);
    println!("{matrix}");
    if let Some(out) = std::env::var_os("KPR_CONFORMANCE_OUT") {
        std::fs::write(out, &matrix).unwrap();
    }
    let mut failures: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.failure().map(|why| format!("{} [{}] {:?}: {why}", o.row.table, o.row.case, o.row.flow.name)))
        .collect();
    failures.extend(conformance::stale(&known, "ebpf", &outcomes));
    assert!(failures.is_empty(), "{} rows fail:\n{}", failures.len(), failures.join("\n"));
}
