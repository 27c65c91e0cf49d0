//! kube-proxy's packet-flow tables (its nftables and iptables proxiers' tests) sent as real TCP
//! and UDP through kpr in eBPF mode, on a node rebuilt with the fake proxier's addresses. The
//! same suite runs in IPVS mode in the QEMU guest (`cargo xtask vm-test`). Prints the matrix,
//! and writes it where KPR_CONFORMANCE_OUT says; KPR_CONFORMANCE_ONLY=TEXT runs the tables
//! whose name contains TEXT.
use kpr_lab::conformance::{self, topology::ConformanceLab};

const MATRIX_HEAD: &str = "# Conformance matrix\n\nEvery row of kube-proxy's packet-flow tables, kube-proxy's answer and kpr's in each mode; how the rows are run and what the columns mean: [conformance.md](conformance.md). Written by `tests/tests/conformance.rs` (`KPR_CONFORMANCE_OUT`).\n\n";

#[test]
fn kube_proxy_packet_flow_tables_in_ebpf_mode() {
    let dir = conformance::data_dir();
    // KPR_CONFORMANCE_ONLY=TEXT: only the tables whose name contains TEXT.
    let only = std::env::var("KPR_CONFORMANCE_ONLY").unwrap_or_default();
    let runs: Vec<_> = conformance::suite(&dir).into_iter().filter(|r| r.table.contains(&only)).collect();
    let known = conformance::differences(&dir);
    let mut lab = ConformanceLab::build("kcf", &runs, &[]);
    let outcomes = lab.run_all(&runs, "ebpf", &known);
    let matrix = conformance::matrix("ebpf", &outcomes, &known);
    println!("{matrix}");
    if let Some(out) = std::env::var_os("KPR_CONFORMANCE_OUT") {
        std::fs::write(out, format!("{MATRIX_HEAD}{matrix}")).unwrap();
    }
    let mut failures = conformance::failures(&known, "ebpf", &outcomes);
    // The docs show the last full run's matrix: it must be this one.
    let doc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/conformance-matrix.md");
    let committed = std::fs::read_to_string(&doc).unwrap_or_default();
    if only.is_empty() && !committed.contains(&matrix) {
        failures.push(format!(
            "{} differs from this run's matrix: write it anew with KPR_CONFORMANCE_OUT=docs/conformance-matrix.md (as root: cargo test -p kpr-tests --test conformance)",
            doc.display()
        ));
    }
    assert!(failures.is_empty(), "{} rows fail:\n{}", failures.len(), failures.join("\n"));
}
