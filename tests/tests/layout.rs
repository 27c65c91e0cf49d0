//! The architecture's one rule the compiler does not check: no module imports a module that
//! imports it, in the agent (per file and per folder) and in the eBPF programs. Reads the
//! sources' `crate::` and `super::` paths; needs no root.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

/// Module path ("dataplane::ebpf::sync") -> source, main.rs, lib.rs and src/bin excluded.
fn modules(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                // src/bin: the binaries, crates of their own.
                if p != root.join("bin") {
                    stack.push(p);
                }
                continue;
            }
            let rel = p.strip_prefix(root).unwrap().with_extension("");
            let mut name: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if name.last().map(String::as_str) == Some("mod") {
                name.pop();
            }
            let name = name.join("::");
            if p.extension().is_some_and(|x| x == "rs") && name != "main" && name != "lib" {
                let text = std::fs::read_to_string(&p).unwrap();
                // Unit tests may import anything.
                let text = match text.find("#[cfg(test)]\nmod tests") {
                    Some(i) => text[..i].to_string(),
                    None => text,
                };
                out.insert(name, text);
            }
        }
    }
    out
}

fn ident_end(s: &str) -> usize {
    s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len())
}

/// The paths written after `prefix::` at the start of `s`: `a::b`, or a `{...}` group.
fn paths_after(s: &str) -> Vec<String> {
    if let Some(rest) = s.strip_prefix('{') {
        let mut depth = 1;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let body = &rest[..end];
        let (mut items, mut depth, mut start) = (Vec::new(), 0, 0);
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&body[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        items.push(&body[start..]);
        return items.into_iter().map(str::trim).filter(|i| !i.is_empty()).flat_map(|i| paths_after(i).into_iter()).collect();
    }
    let mut segs = Vec::new();
    let mut rest = s;
    loop {
        let n = ident_end(rest);
        if n == 0 {
            break;
        }
        segs.push(&rest[..n]);
        rest = &rest[n..];
        match rest.strip_prefix("::") {
            Some(r) if r.starts_with('{') => {
                let base = segs.join("::");
                return paths_after(r).into_iter().map(|p| format!("{base}::{p}")).collect();
            }
            Some(r) => rest = r,
            None => break,
        }
    }
    vec![segs.join("::")]
}

/// Module -> the modules it imports (the longest module prefix of each path).
fn graph(mods: &BTreeMap<String, String>, depth: usize) -> BTreeMap<String, BTreeSet<String>> {
    let resolve = |path: &str| -> Option<String> {
        let segs: Vec<&str> = path.split("::").collect();
        (1..=segs.len()).rev().map(|k| segs[..k].join("::")).find(|c| mods.contains_key(c))
    };
    let cut = |m: &str| m.split("::").take(depth).collect::<Vec<_>>().join("::");
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, text) in mods {
        let parent = m.rsplit_once("::").map(|(p, _)| p.to_string()).unwrap_or_default();
        let mut deps = BTreeSet::new();
        for (kw, base) in [("crate::", String::new()), ("super::", parent.clone())] {
            for (i, _) in text.match_indices(kw) {
                if text[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                    continue;
                }
                for p in paths_after(&text[i + kw.len()..]) {
                    let full = if base.is_empty() { p } else { format!("{base}::{p}") };
                    if let Some(r) = resolve(&full) {
                        deps.insert(r);
                    }
                }
            }
        }
        let me = cut(m);
        let entry = g.entry(me.clone()).or_default();
        for d in deps.iter().map(|d| cut(d)) {
            if d != me && !me.starts_with(&format!("{d}::")) && !d.starts_with(&format!("{me}::")) {
                entry.insert(d);
            }
        }
    }
    g
}

fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<(String, String)> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.to_string()];
        while let Some(x) = stack.pop() {
            for y in g.get(&x).into_iter().flatten() {
                if seen.insert(y.clone()) {
                    stack.push(y.clone());
                }
            }
        }
        seen
    };
    let mut out = Vec::new();
    for (a, deps) in g {
        for b in deps {
            if reach(b).contains(a) {
                out.push((a.clone(), b.clone()));
            }
        }
    }
    out
}

fn root(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

#[test]
fn no_module_imports_a_module_that_imports_it() {
    for (src, depths) in [("proxy-agent/src", &[1usize, 2, 99][..]), ("proxy-ebpf/src", &[99][..])] {
        let mods = modules(&root(src));
        assert!(mods.len() > 10, "{src}: read {} modules", mods.len());
        for &depth in depths {
            let g = graph(&mods, depth);
            assert!(cycles(&g).is_empty(), "{src} (depth {depth}): import cycles {:?}", cycles(&g));
        }
    }
}

#[test]
fn the_reader_finds_imports_and_cycles() {
    let mods: BTreeMap<String, String> = [
        ("a".to_string(), "use crate::{b::X, c::{self, Y}};".to_string()),
        ("b".to_string(), "use super::a::Z;".to_string()),
        ("c".to_string(), "fn f() { crate::d::g() }".to_string()),
        ("d".to_string(), String::new()),
    ]
    .into();
    let g = graph(&mods, 99);
    assert_eq!(g["a"], ["b", "c"].iter().map(|s| s.to_string()).collect());
    assert_eq!(g["c"], ["d"].iter().map(|s| s.to_string()).collect());
    assert_eq!(cycles(&g), vec![("a".to_string(), "b".to_string()), ("b".to_string(), "a".to_string())]);
}
