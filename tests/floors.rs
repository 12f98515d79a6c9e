//! The library's floors (`docs/architecture.md`, "Floors") hold: every module of `src/` imports
//! only from its own floor and the floors listed before it in that table, so no import climbs a
//! floor and no two floors import each other; and no modules of one floor import each other
//! round a cycle. The table is the rule's one statement; this reads it, and each `crate::` and
//! `super::` path in the source.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The floors in the order of the architecture table, lowest first: a row may name several
/// (`tokenizer/`, `preprocess/`), which share its rank.
fn floors_from_the_table(doc: &str) -> HashMap<String, usize> {
    let section = doc
        .split("\n## Floors")
        .nth(1)
        .expect("docs/architecture.md has a Floors section");
    let mut floors = HashMap::new();
    let rows = section
        .lines()
        .take_while(|line| !line.starts_with("## "))
        .filter(|line| line.starts_with("| `"));
    for (rank, row) in rows.enumerate() {
        let first_cell = row.split('|').nth(1).unwrap();
        for name in first_cell.split('`').skip(1).step_by(2) {
            floors.insert(name.trim_end_matches('/').to_owned(), rank);
        }
    }
    floors
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of `file` under `src/`: `src/model/fused/mod.rs` is `["model", "fused"]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_owned());
    }
    parts
}

/// The first segment of each item of a `{...}` group (`{a::X, b::{C, D}}`: `a`, `b`).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let (mut depth, mut item_start) = (0, true);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => item_start = true,
            c if item_start && (c.is_alphabetic() || c == '_') => {
                heads.push(ident_at(&group[i..]));
                item_start = false;
            }
            _ => {}
        }
    }
    heads
}

/// The identifier `text` starts with.
fn ident_at(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The path `prefix` continued by `after` (`a::b::C`: its first two segments; `{a::X, b}`:
/// one path per item).
fn continued(prefix: &[String], after: &str) -> Vec<Vec<String>> {
    let with = |tail: &[String]| [prefix, tail].concat();
    if let Some(group) = after.strip_prefix('{') {
        return group_heads(group)
            .iter()
            .map(|h| with(std::slice::from_ref(h)))
            .collect();
    }
    let first = ident_at(after);
    if first.is_empty() {
        return Vec::new();
    }
    let second = after[first.len()..]
        .strip_prefix("::")
        .map(ident_at)
        .filter(|s| !s.is_empty());
    vec![with(
        &[Some(first), second]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>(),
    )]
}

/// The crate paths `line` (code, its comment cut off) names from module `module`, from the
/// crate's root: `crate::a::b` and `super::`… resolved (an inline `mod` block is not followed:
/// it only nests deeper, so its `super::` is read one level short, never leaving a floor).
fn paths_named(line: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut named = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        named.extend(continued(&[], rest));
    }
    let mut rest = line;
    while let Some(at) = rest.find("super::") {
        let mut tail = &rest[at..];
        let mut supers = 0;
        while let Some(after) = tail.strip_prefix("super::") {
            supers += 1;
            tail = after;
        }
        let base = &module[..module.len().saturating_sub(supers)];
        named.extend(continued(base, tail));
        rest = tail;
    }
    named
}

/// A cycle among `edges` (module → modules it imports), if any, as the modules around it.
fn a_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        at: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(from) = stack.iter().position(|m| m == at) {
            let mut cycle = stack[from..].to_vec();
            cycle.push(at.to_owned());
            return Some(cycle);
        }
        if !done.insert(at.to_owned()) {
            return None;
        }
        stack.push(at.to_owned());
        for next in edges.get(at).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, done, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|start| visit(start, edges, &mut done, &mut Vec::new()))
}

#[test]
fn no_module_imports_from_a_floor_above_its_own_or_in_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let floors = floors_from_the_table(&doc);
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let modules: Vec<Vec<String>> = files.iter().map(|f| module_path(&src, f)).collect();
    // The modules one level into a floor (`checkpoint::load`), between which no cycle may run;
    // a floor's own `mod.rs` re-exports its children and is left out.
    let second_level: BTreeSet<String> = modules
        .iter()
        .filter(|m| m.len() >= 2)
        .map(|m| m[..2].join("::"))
        .collect();
    let (mut climbs, mut edges) = (Vec::new(), BTreeMap::<String, BTreeSet<String>>::new());
    for (file, module) in files.iter().zip(&modules) {
        let Some(own) = module.first() else {
            continue; // lib.rs: the crate's root names every floor
        };
        let own_rank = *floors.get(own).unwrap_or_else(|| {
            panic!(
                "src/{own}: a floor docs/architecture.md's Floors table does not list; \
                 add its row where it sits"
            )
        });
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            for path in paths_named(code, module) {
                let Some(&rank) = floors.get(&path[0]) else {
                    continue; // an item of the crate's root, not a floor
                };
                if rank > own_rank {
                    climbs.push(format!(
                        "{}:{}: {own}/ imports crate::{} from a floor above it",
                        file.strip_prefix(root).unwrap().display(),
                        n + 1,
                        path[0]
                    ));
                }
                if module.len() >= 2 && path.len() >= 2 && path[0] == *own {
                    let (from, to) = (module[..2].join("::"), path[..2].join("::"));
                    if from != to && second_level.contains(&to) {
                        edges.entry(from).or_default().insert(to);
                    }
                }
            }
        }
    }
    assert!(climbs.is_empty(), "{}", climbs.join("\n"));
    if let Some(cycle) = a_cycle(&edges) {
        panic!("modules import each other: {}", cycle.join(" -> "));
    }
    // The check sees what it is meant to: climbs and cycles named in any of the ways Rust
    // allows are found.
    let gpt = ["model".to_owned(), "gpt".to_owned()];
    let paths = |line: &str| paths_named(line, &gpt);
    assert_eq!(paths("use crate::training::X;"), [["training", "X"]]);
    assert_eq!(
        paths("use crate::{util::A, training::{B, C}};"),
        [["util"], ["training"]]
    );
    assert_eq!(paths("use super::super::training::X;"), [["training", "X"]]);
    assert_eq!(
        paths("use super::{attention::X, Y};"),
        [["model", "attention"], ["model", "Y"]]
    );
    let two_way = BTreeMap::from([
        ("a::x".to_owned(), BTreeSet::from(["a::y".to_owned()])),
        ("a::y".to_owned(), BTreeSet::from(["a::x".to_owned()])),
    ]);
    assert_eq!(a_cycle(&two_way).unwrap(), ["a::x", "a::y", "a::x"]);
    assert!(floors["util"] < floors["model"] && floors["model"] < floors["training"]);
}
