//! The product speaks of the product: its files name versions, map layouts and Kubernetes
//! versions, never the development log's sessions, issues or goals by number. The README and the
//! performance page stay short enough to read. Needs no root.
use std::path::{Path, PathBuf};

/// The files a user or a newcomer reads: the README, the changelog, docs/, the deploy manifests,
/// and every Rust source (its comments and what the binaries print).
fn product_files(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    let mut stack: Vec<PathBuf> = ["docs", "deploy", "proxy-agent", "proxy-common", "proxy-ebpf", "xtask", "lab", "bench", "tests"].iter().map(|d| root.join(d)).collect();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                // Build output, and the fuzzer's generated corpus.
                if name != "target" && name != "corpus" && name != "artifacts" {
                    stack.push(p);
                }
            } else if ["rs", "md", "yaml", "toml", "sh"].iter().any(|x| name.ends_with(&format!(".{x}"))) {
                out.push(p);
            }
        }
    }
    out
}

/// "session 12", "issue 16's", "goal 3", "issue #4": a number of the development log.
fn log_numbers(text: &str) -> Vec<String> {
    let lower = text.to_lowercase();
    let mut hits = Vec::new();
    for word in ["session", "sessions", "issue", "issues", "goal", "goals"] {
        let mut from = 0;
        while let Some(i) = lower[from..].find(word).map(|i| i + from) {
            from = i + word.len();
            let before_ok = i == 0 || !lower.as_bytes()[i - 1].is_ascii_alphanumeric();
            let rest = lower[from..].strip_prefix(' ').unwrap_or("");
            let rest = rest.strip_prefix('#').unwrap_or(rest);
            // A number, not a value ("goal 1.3×", "goals 0.9× and 5×").
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let after = rest[digits..].chars().next();
            let a_number = digits > 0 && !matches!(after, Some('.' | '×' | '%' | 'x' | 'µ'));
            if before_ok && lower[from..].starts_with(' ') && a_number {
                let end = (from + 12).min(lower.len());
                hits.push(text[i..end].to_string());
            }
        }
    }
    hits
}

#[test]
fn product_files_name_no_session_issue_or_goal_numbers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let me = Path::new(file!()).file_name().unwrap().to_owned();
    let mut found = Vec::new();
    for p in product_files(root) {
        if p.file_name() == Some(&me) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&p) else { continue };
        for (n, line) in text.lines().enumerate() {
            for hit in log_numbers(line) {
                found.push(format!("{}:{}: {hit:?}", p.strip_prefix(root).unwrap().display(), n + 1));
            }
        }
    }
    assert!(found.is_empty(), "the development log's numbers in product files (say what changed, or key it to a version or map layout):\n{}", found.join("\n"));
}

#[test]
fn the_readme_and_the_performance_page_stay_short() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for (file, most) in [("README.md", 150), ("docs/performance.md", 300)] {
        let lines = std::fs::read_to_string(root.join(file)).unwrap().lines().count();
        assert!(lines <= most, "{file} has {lines} lines; at most {most}");
    }
}

#[test]
fn the_log_number_check_sees_what_it_must() {
    assert_eq!(log_numbers("since session 28's release").len(), 1);
    assert_eq!(log_numbers("Issue 16's goal 3").len(), 2);
    assert_eq!(log_numbers("see issue #4").len(), 1);
    assert!(log_numbers("a session's cookie, goals: met, goal 1.3×, goals 0.9× and 5×, sessionAffinity 10800").is_empty());
}
