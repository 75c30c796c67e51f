//! No module of a workspace crate imports in a circle (issue 14): for every crate's library and
//! binary roots, the modules (one a file; inline modules belong to their file, test modules are
//! left out) and what each refers to (`use` trees and `crate::` / `super::` / `self::` / child
//! module paths, followed through `pub use` re-exports) form a graph that must have no cycle.
//!
//! `cargo test -p xtask --test module_cycles -- --nocapture` prints every crate's cycles with the
//! references behind each edge.

use kvroute_testkit::paths::workspace;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use syn::visit::Visit;

/// A module path from the crate root (`[]` is the root).
type ModPath = Vec<String>;

/// One file module of a crate.
struct Module {
    file: PathBuf,
    /// Every module path declared in this file (the file's own and its inline, non-test modules).
    inline: BTreeSet<ModPath>,
    /// References found in the file: (module the reference sits in, path as written, line).
    refs: Vec<(ModPath, Vec<String>, usize)>,
    /// Names bound by `use` (public or not): (module, name) -> the path as written.
    bindings: BTreeMap<(ModPath, String), Vec<String>>,
    /// `#[macro_export]` macros defined here (Rust places them at the crate root).
    exported_macros: BTreeSet<String>,
}

/// `#[cfg(test)]` on an item.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .map(|m| m.path().is_ident("test"))
                .unwrap_or(false)
    })
}

/// Expands a use tree into its paths (a glob stays the path of its module) and the names they
/// bind (`None` for globs).
fn expand(
    tree: &syn::UseTree,
    prefix: &mut Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            expand(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            if name == "self" {
                out.push((prefix.clone(), prefix.last().cloned()));
            } else {
                let mut p = prefix.clone();
                p.push(name.clone());
                out.push((p, Some(name)));
            }
        }
        syn::UseTree::Rename(r) => {
            let mut p = prefix.clone();
            let name = r.ident.to_string();
            if name != "self" {
                p.push(name);
            }
            out.push((p, Some(r.rename.to_string())));
        }
        syn::UseTree::Glob(_) => out.push((prefix.clone(), None)),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                expand(t, prefix, out);
            }
        }
    }
}

/// Collects the references and re-exports of one file.
struct Collector<'a> {
    module: &'a mut Module,
    stack: ModPath,
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if is_test(&m.attrs) {
            return;
        }
        if let Some((_, items)) = &m.content {
            self.stack.push(m.ident.to_string());
            self.module.inline.insert(self.stack.clone());
            for item in items {
                self.visit_item(item);
            }
            self.stack.pop();
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_test(&f.attrs) {
            syn::visit::visit_item_fn(self, f);
        }
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        if !is_test(&i.attrs) {
            syn::visit::visit_item_impl(self, i);
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if is_test(&u.attrs) {
            return;
        }
        let line = u.use_token.span.start().line;
        let mut paths = Vec::new();
        expand(&u.tree, &mut Vec::new(), &mut paths);
        for (path, name) in paths {
            if let Some(name) = name {
                self.module
                    .bindings
                    .insert((self.stack.clone(), name), path.clone());
            }
            self.module.refs.push((self.stack.clone(), path, line));
        }
    }

    fn visit_item_macro(&mut self, m: &'ast syn::ItemMacro) {
        if let Some(name) = &m.ident {
            if m.attrs.iter().any(|a| a.path().is_ident("macro_export")) {
                self.module.exported_macros.insert(name.to_string());
            }
        }
        syn::visit::visit_item_macro(self, m);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.segments.len() > 1 && p.leading_colon.is_none() {
            let line = p.segments[0].ident.span().start().line;
            let path = p.segments.iter().map(|s| s.ident.to_string()).collect();
            self.module.refs.push((self.stack.clone(), path, line));
        }
        syn::visit::visit_path(self, p);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        // Paths inside macro calls (`format!`, `matches!`, ...) parse as expressions when they can.
        if let Ok(args) = m.parse_body_with(
            syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated,
        ) {
            for e in &args {
                self.visit_expr(e);
            }
        }
        syn::visit::visit_macro(self, m);
    }
}

/// Every file module reachable from `root` (declared with `mod x;`, test modules left out).
fn load(root: &Path) -> BTreeMap<ModPath, Module> {
    let mut out = BTreeMap::new();
    let mut todo = vec![(Vec::<String>::new(), root.to_path_buf())];
    while let Some((path, file)) = todo.pop() {
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let name = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let dir = if path.is_empty() || name == "mod" {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        for item in &ast.items {
            if let syn::Item::Mod(m) = item {
                if m.content.is_none() && !is_test(&m.attrs) {
                    let ident = m.ident.to_string();
                    let flat = dir.join(format!("{ident}.rs"));
                    let nested = dir.join(&ident).join("mod.rs");
                    let child = if flat.exists() { flat } else { nested };
                    let mut p = path.clone();
                    p.push(ident);
                    todo.push((p, child));
                }
            }
        }
        let mut module = Module {
            file: file.clone(),
            inline: BTreeSet::from([path.clone()]),
            refs: Vec::new(),
            bindings: BTreeMap::new(),
            exported_macros: BTreeSet::new(),
        };
        Collector {
            module: &mut module,
            stack: path.clone(),
        }
        .visit_file(&ast);
        out.insert(path, module);
    }
    out
}

/// The file module that owns module path `p` (the longest declared prefix), with the rest.
fn owner<'a>(mods: &BTreeMap<ModPath, Module>, p: &'a [String]) -> Option<(ModPath, &'a [String])> {
    (0..=p.len()).rev().find_map(|n| {
        let prefix = &p[..n];
        mods.iter()
            .find(|(_, m)| m.inline.contains(prefix))
            .map(|(k, _)| (k.clone(), &p[n..]))
    })
}

/// The absolute form of `path` written in module `at`, or `None` when it does not start inside
/// the crate.
fn absolute(
    mods: &BTreeMap<ModPath, Module>,
    at: &ModPath,
    path: &[String],
) -> Option<Vec<String>> {
    let first = path.first()?;
    let mut base = at.clone();
    let mut rest = path;
    match first.as_str() {
        "crate" => {
            base.clear();
            rest = &path[1..];
        }
        "self" => rest = &path[1..],
        "super" => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        name => {
            // A child module of `at` named without `self::`.
            let mut child = at.clone();
            child.push(name.to_string());
            if !mods.values().any(|m| m.inline.contains(&child)) {
                return None;
            }
        }
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The file module `path` (absolute) lands in, following names bound by `use` (`None` when it
/// leads out of the crate, e.g. a `use` of another crate's module).
fn resolve(mods: &BTreeMap<ModPath, Module>, path: Vec<String>, depth: usize) -> Option<ModPath> {
    let (file_mod, rest) = owner(mods, &path)?;
    // `crate::m!` names a `#[macro_export]` macro: it lives in the file that defines it.
    if let (true, Some(name)) = (file_mod.is_empty(), rest.first()) {
        if let Some((k, _)) = mods.iter().find(|(_, m)| m.exported_macros.contains(name)) {
            return Some(k.clone());
        }
    }
    if depth < 8 {
        if let Some(name) = rest.first() {
            let module_path = path[..path.len() - rest.len()].to_vec();
            if let Some(target) = mods[&file_mod]
                .bindings
                .get(&(module_path.clone(), name.clone()))
            {
                let mut abs = absolute(mods, &module_path, target)?;
                abs.extend(rest[1..].iter().cloned());
                return resolve(mods, abs, depth + 1);
            }
        }
    }
    Some(file_mod)
}

/// Tarjan's strongly connected components of size > 1.
fn cycles(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct T<'a> {
        edges: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on: BTreeSet<&'a ModPath>,
        out: Vec<Vec<ModPath>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a ModPath) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    scc.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out
}

fn name(p: &ModPath) -> String {
    if p.is_empty() {
        "crate".into()
    } else {
        p.join("::")
    }
}

/// The cycles of the crate rooted at `root`, one line per cycle and one per edge inside it.
fn report(root: &Path) -> Vec<String> {
    let mods = load(root);
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    let mut why: BTreeMap<(ModPath, ModPath), Vec<String>> = BTreeMap::new();
    for (from, m) in &mods {
        for (at, path, line) in &m.refs {
            let Some(abs) = absolute(&mods, at, path) else {
                continue;
            };
            let Some(to) = resolve(&mods, abs, 0) else {
                continue;
            };
            if &to != from {
                edges.entry(from.clone()).or_default().insert(to.clone());
                let file = m.file.strip_prefix(workspace()).unwrap_or(&m.file);
                why.entry((from.clone(), to)).or_default().push(format!(
                    "{}:{line} {}",
                    file.display(),
                    path.join("::")
                ));
            }
        }
    }
    let mut out = Vec::new();
    for scc in cycles(&edges) {
        let names: Vec<String> = scc.iter().map(name).collect();
        out.push(format!(
            "{}: cycle {{{}}}",
            root.display(),
            names.join(", ")
        ));
        for a in &scc {
            for b in edges
                .get(a)
                .into_iter()
                .flatten()
                .filter(|b| scc.contains(b))
            {
                let refs = &why[&(a.clone(), b.clone())];
                out.push(format!("  {} -> {}: {}", name(a), name(b), refs.join("; ")));
            }
        }
    }
    out
}

#[test]
fn no_module_imports_in_a_circle() {
    let ws = workspace();
    let mut roots = Vec::new();
    for krate in [
        "core",
        "sim",
        "indexer",
        "filter",
        "filter-native",
        "xtask",
        "testkit",
        "bench",
    ] {
        for root in ["src/lib.rs", "src/main.rs"] {
            let p = ws.join(krate).join(root);
            if p.exists() {
                roots.push(p);
            }
        }
    }
    assert!(roots.len() >= 8, "crate roots found: {roots:?}");
    let mut found = Vec::new();
    for root in &roots {
        found.extend(report(root));
    }
    for line in &found {
        println!("{line}");
    }
    let n = found.iter().filter(|l| !l.starts_with(' ')).count();
    println!("{n} module cycles in {} crate roots", roots.len());
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
}

/// The checker finds a circle when there is one (two modules that use each other, and one through
/// a re-export), and none in a tree.
#[test]
fn the_checker_sees_a_circle() {
    let dir = std::env::temp_dir().join(format!("kvroute-modcycles-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let write = |f: &str, t: &str| std::fs::write(src.join(f), t).unwrap();
    write(
        "lib.rs",
        "mod a;\nmod b;\nmod c;\npub use c::C;\nuse std::fmt;\nfn f() { a::A; }\n",
    );
    write("a.rs", "use crate::b::B;\npub struct A;\n");
    write("b.rs", "pub struct B(crate::C);\n");
    write("c.rs", "pub struct C;\nfn f() { let _ = crate::a::A; }\n");
    let found = report(&src.join("lib.rs"));
    assert!(
        found.first().is_some_and(|l| l.contains("cycle {a, b, c}")),
        "{found:?}"
    );
    // A module of another crate bound at the root is no edge to the root.
    write("c.rs", "pub struct C;\nimpl crate::fmt::Debug for C {}\n");
    assert_eq!(report(&src.join("lib.rs")), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}
