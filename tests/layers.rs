//! The tree is the architecture: `src/` is cut into layers, one folder each, and the rules
//! below keep the dependencies between them one-way. ARCHITECTURE.md's code map says what
//! each layer owns and its invariants name the test of each rule.
//!
//! Longer than 600 lines: each rule's checker, and beside it the forms it must catch, run
//! against a mutated copy of the real `src/` (`each_forbidden_form_in_a_copy_of_src_is_caught`);
//! the list of those forms is most of the file, and reads best beside the rules it tests.
//!
//! How the source is read: each file is parsed with syn (items, `use` trees, impls,
//! signatures) and lexed with proc-macro2 (every token with its line, macro bodies included),
//! so comments, doc comments and the contents of string literals are never read as code.
//!
//! - A file's layer is its first folder under `src/` (`src/store/reader/iter.rs` is `store`;
//!   any file inside `sync/` is `sync`, whatever its name); the files at the root of `src/`
//!   are the top layer, which may name anything.
//! - A path that reaches the crate root (`crate::x`, `$crate::x`, or a `super::` chain that
//!   climbs out of the file's modules, inline ones counted) is placed by its first segment
//!   through `lib.rs`: a layer's module, a top module, an item defined in `lib.rs`, a name
//!   `lib.rs` imports (`pub use`, `pub(crate) use`, `use`), or nothing the test can place;
//!   below the top only a module of the file's own layer or a lower one passes.
//! - The crate root is only ever named `crate`: an alias of it (`use crate as x`,
//!   `use crate::{self as x}`, `use super::super as x`, `extern crate self as x`) is an
//!   error, and so are `#[path]` modules (in `cfg_attr` too), `include!` and `#[macro_use]`,
//!   which would let a file's code or macros live outside its folder's layer.
//! - Inherent impls stay in the layer of their type; no code below the top can reach a
//!   method of `Db` (see `facade_calls`); no layer above the store builds a stream's object
//!   keys (see `object_keys_above_store`); `disk/` names nothing of Kubernetes and `store/`
//!   no client.
//!
//! The last test applies each forbidden form to a copy of the real `src/` and expects its
//! rule to report it in the file it was put in, while the unchanged copy passes.

#[path = "layers/api.rs"]
mod api;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use proc_macro2::{Delimiter, TokenStream, TokenTree};
use syn::visit::{self, Visit};

/// The layers, lowest first. Each may name its own layer and those before it.
const LAYERS: &[&str] = &[
    "model",
    "exec",
    "disk",
    "store",
    "sync",
    "controller",
    "top",
];

/// Files at the root of `src/`: the top layer.
const TOP_FILES: &[&str] = &["lib", "db", "fuzz", "metrics"];

/// The object key tags of a stream's keyspace, defined in `disk/keys.rs`: only `store/`
/// builds keys with them.
const OBJECT_TAGS: &[&str] = &["OBJECT", "SEEN", "INDEX", "ENTRIES"];

/// The functions of `disk::keys` that take a tag (and the tag argument's position), and
/// those that build object keyspace keys themselves.
const TAG_FNS: &[(&str, usize)] = &[("tagged", 0), ("range", 0), ("chunk", 1)];
const OBJECT_KEY_FNS: &[&str] = &["index_prefix", "index_range"];

/// Types an inherent `impl` may extend outside the layer that defines them, with the reason.
const FOREIGN_IMPLS_ALLOWED: &[(&str, &str, &str)] = &[
    // The public handle's methods, each a delegation to the layer that does the work.
    ("Db", "db.rs", "the facade"),
    // `Engine::of_store` reads a directory: `Engine` the value is `model/`'s (the public
    // `Error::EngineMismatch` holds it), the files that tell an engine are the disk's.
    (
        "Engine",
        "disk/engine/mod.rs",
        "Engine::of_store reads the disk",
    ),
];

fn rank(layer: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == layer)
}

/// The layer of a file, from its path relative to `src/`.
fn layer_of(rel: &Path) -> Option<&'static str> {
    let parts: Vec<_> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.len() == 1 {
        let stem = parts[0].strip_suffix(".rs")?;
        return TOP_FILES.contains(&stem).then_some("top");
    }
    LAYERS
        .iter()
        .copied()
        .find(|l| *l == parts[0] && *l != "top")
}

/// How many modules deep a file is: `lib.rs` 0, `store/mod.rs` 1, `store/cache.rs` 2.
fn depth(rel: &Path) -> usize {
    let n = rel.iter().count();
    let file = rel.file_name().map(|f| f.to_string_lossy().into_owned());
    match file.as_deref() {
        Some("lib.rs") => 0,
        Some("mod.rs") => n - 1,
        _ => n,
    }
}

/// A position in a file: line (from 1) and column.
type Pos = (usize, usize);

fn pos(span: proc_macro2::Span) -> Pos {
    let lc = span.start();
    (lc.line, lc.column)
}

#[derive(Debug, Clone, PartialEq)]
enum Tk {
    Ident(String),
    Punct(char),
    Lit,
    Open(char),
    Close(char),
}

/// One token, groups flattened into their delimiters.
#[derive(Debug, Clone)]
struct Tok {
    tk: Tk,
    at: Pos,
}

fn flatten(ts: TokenStream, out: &mut Vec<Tok>) {
    for tt in ts {
        match tt {
            TokenTree::Group(g) => {
                let c = match g.delimiter() {
                    Delimiter::Parenthesis => '(',
                    Delimiter::Brace => '{',
                    Delimiter::Bracket => '[',
                    Delimiter::None => ' ',
                };
                out.push(Tok {
                    tk: Tk::Open(c),
                    at: pos(g.span_open()),
                });
                flatten(g.stream(), out);
                out.push(Tok {
                    tk: Tk::Close(c),
                    at: pos(g.span_close()),
                });
            }
            TokenTree::Ident(i) => out.push(Tok {
                tk: Tk::Ident(i.to_string()),
                at: pos(i.span()),
            }),
            TokenTree::Punct(p) => out.push(Tok {
                tk: Tk::Punct(p.as_char()),
                at: pos(p.span()),
            }),
            TokenTree::Literal(l) => out.push(Tok {
                tk: Tk::Lit,
                at: pos(l.span()),
            }),
        }
    }
}

/// A file of `src/`: its path relative to `src/`, source, syntax tree and tokens.
#[derive(Clone)]
struct Source {
    rel: PathBuf,
    text: String,
    ast: syn::File,
    toks: Vec<Tok>,
    /// The brace spans of its inline modules (`mod tests { … }`), for `super::` paths.
    inline_mods: Vec<(Pos, Pos)>,
}

impl Source {
    fn shown(&self) -> String {
        format!("src/{}", self.rel.to_string_lossy().replace('\\', "/"))
    }

    fn layer(&self) -> Option<&'static str> {
        layer_of(&self.rel)
    }

    /// `src/file:line: what: the line's text`.
    fn report(&self, at: Pos, what: &str) -> String {
        let text = self.text.lines().nth(at.0 - 1).unwrap_or("").trim();
        format!("{}:{}: {what}: {text}", self.shown(), at.0)
    }

    fn ident(&self, i: usize) -> Option<&str> {
        match &self.toks.get(i)?.tk {
            Tk::Ident(s) => Some(s),
            _ => None,
        }
    }

    fn punct(&self, i: usize, c: char) -> bool {
        self.toks.get(i).is_some_and(|t| t.tk == Tk::Punct(c))
    }

    /// A `::` starts at token `i`.
    fn path_sep(&self, i: usize) -> bool {
        self.punct(i, ':') && self.punct(i + 1, ':')
    }

    /// A `::` ends just before token `i`.
    fn after_path_sep(&self, i: usize) -> bool {
        i >= 2 && self.path_sep(i - 2)
    }

    /// The first segment of the path token `i` is part of (walking back over `a::b::`).
    fn path_start(&self, mut i: usize) -> usize {
        while self.after_path_sep(i) && i >= 3 && self.ident(i - 3).is_some() {
            i -= 3;
        }
        i
    }

    /// The matching close of the group opened at token `i`.
    fn close_of(&self, i: usize) -> usize {
        let mut level = 0;
        for (j, t) in self.toks.iter().enumerate().skip(i) {
            match t.tk {
                Tk::Open(_) => level += 1,
                Tk::Close(_) => {
                    level -= 1;
                    if level == 0 {
                        return j;
                    }
                }
                _ => {}
            }
        }
        self.toks.len()
    }

    /// The top-level items of the group opened at token `i`, as token ranges.
    fn group_items(&self, i: usize) -> Vec<(usize, usize)> {
        let end = self.close_of(i);
        let (mut items, mut start, mut level) = (Vec::new(), i + 1, 0);
        for j in i + 1..end {
            match self.toks[j].tk {
                Tk::Open(_) => level += 1,
                Tk::Close(_) => level -= 1,
                Tk::Punct(',') if level == 0 => {
                    items.push((start, j));
                    start = j + 1;
                }
                _ => {}
            }
        }
        if start < end {
            items.push((start, end));
        }
        items
    }

    /// The module depth at `at`: the file's, plus the inline modules around it.
    fn depth_at(&self, at: Pos) -> usize {
        depth(&self.rel)
            + self
                .inline_mods
                .iter()
                .filter(|(a, b)| *a < at && at < *b)
                .count()
    }
}

fn parse(rel: PathBuf, text: String) -> Result<Source, String> {
    let shown = format!("src/{}", rel.display());
    let ast = syn::parse_file(&text).map_err(|e| {
        let at = e.span().start();
        format!("{shown}:{}: does not parse: {e}", at.line)
    })?;
    let stream: TokenStream = text
        .parse()
        .map_err(|e| format!("{shown}: does not lex: {e}"))?;
    let mut toks = Vec::new();
    flatten(stream, &mut toks);
    struct Mods(Vec<(Pos, Pos)>);
    impl<'a> Visit<'a> for Mods {
        fn visit_item_mod(&mut self, m: &'a syn::ItemMod) {
            if let Some((brace, _)) = &m.content {
                self.0
                    .push((pos(brace.span.open()), pos(brace.span.close())));
            }
            visit::visit_item_mod(self, m);
        }
    }
    let mut mods = Mods(Vec::new());
    mods.visit_file(&ast);
    Ok(Source {
        rel,
        text,
        ast,
        toks,
        inline_mods: mods.0,
    })
}

/// One leaf of a `use` tree: the name it binds (`None` for a glob), the path it imports, and
/// whether it is renamed.
struct UseLeaf<'a> {
    local: Option<&'a syn::Ident>,
    path: Vec<&'a syn::Ident>,
    renamed: bool,
}

fn use_leaves<'a>(
    tree: &'a syn::UseTree,
    prefix: &mut Vec<&'a syn::Ident>,
    out: &mut Vec<UseLeaf<'a>>,
) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(&p.ident);
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let mut path = prefix.clone();
            path.push(&n.ident);
            let local = if n.ident == "self" {
                prefix.last().copied()
            } else {
                Some(&n.ident)
            };
            out.push(UseLeaf {
                local,
                path,
                renamed: false,
            });
        }
        syn::UseTree::Rename(r) => {
            let mut path = prefix.clone();
            path.push(&r.ident);
            out.push(UseLeaf {
                local: Some(&r.rename),
                path,
                renamed: true,
            });
        }
        syn::UseTree::Glob(_) => out.push(UseLeaf {
            local: None,
            path: prefix.clone(),
            renamed: false,
        }),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_leaves(t, prefix, out);
            }
        }
    }
}

/// Every `use` item of a file, nested ones included.
fn uses(ast: &syn::File) -> Vec<&syn::ItemUse> {
    struct V<'a>(Vec<&'a syn::ItemUse>);
    impl<'a> Visit<'a> for V<'a> {
        fn visit_item_use(&mut self, u: &'a syn::ItemUse) {
            self.0.push(u);
        }
    }
    let mut v = V(Vec::new());
    v.visit_file(ast);
    v.0
}

/// What a name at the crate root is, as `lib.rs` says.
#[derive(Debug, Clone)]
enum Place {
    /// The module of a layer (`mod store;`).
    Layer(&'static str),
    /// A module or item of the top layer, described.
    Top(String),
    /// A name `lib.rs` imports (re-exports): from this path.
    Import(String),
}

/// The names of the crate root, from `lib.rs` (and the `#[macro_export]` macros of every
/// file, which the root holds too).
fn root_table(files: &[Source]) -> HashMap<String, Place> {
    let mut names = HashMap::new();
    let Some(lib) = files.iter().find(|f| f.rel == Path::new("lib.rs")) else {
        return names;
    };
    for item in &lib.ast.items {
        let (name, place) = match item {
            syn::Item::Mod(m) => {
                let name = m.ident.to_string();
                let layer = LAYERS.iter().copied().find(|l| *l == name && *l != "top");
                let place = match (layer, &m.content) {
                    (Some(l), None) => Place::Layer(l),
                    _ => Place::Top(format!("the top module `{name}`")),
                };
                (name, place)
            }
            syn::Item::Use(u) => {
                let mut leaves = Vec::new();
                use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                for leaf in leaves {
                    if let Some(local) = leaf.local {
                        let path: Vec<_> = leaf.path.iter().map(|i| i.to_string()).collect();
                        names.insert(local.to_string(), Place::Import(path.join("::")));
                    }
                }
                continue;
            }
            syn::Item::ExternCrate(e) => {
                let name = e.rename.as_ref().map_or(&e.ident, |(_, r)| r).to_string();
                (name, Place::Import(format!("extern crate {}", e.ident)))
            }
            other => {
                let ident = match other {
                    syn::Item::Const(i) => Some(&i.ident),
                    syn::Item::Enum(i) => Some(&i.ident),
                    syn::Item::Fn(i) => Some(&i.sig.ident),
                    syn::Item::Macro(i) => i.ident.as_ref(),
                    syn::Item::Static(i) => Some(&i.ident),
                    syn::Item::Struct(i) => Some(&i.ident),
                    syn::Item::Trait(i) => Some(&i.ident),
                    syn::Item::TraitAlias(i) => Some(&i.ident),
                    syn::Item::Type(i) => Some(&i.ident),
                    syn::Item::Union(i) => Some(&i.ident),
                    _ => None,
                };
                let Some(ident) = ident else { continue };
                (
                    ident.to_string(),
                    Place::Top(format!("`{ident}`, defined in lib.rs")),
                )
            }
        };
        names.insert(name, place);
    }
    // `#[macro_export]` macros live at the crate root, from the layer that defines them.
    for f in files {
        struct V<'a>(Vec<&'a syn::Ident>);
        impl<'a> Visit<'a> for V<'a> {
            fn visit_item_macro(&mut self, m: &'a syn::ItemMacro) {
                if m.attrs.iter().any(|a| a.path().is_ident("macro_export")) {
                    self.0.extend(m.ident.as_ref());
                }
            }
        }
        let mut v = V(Vec::new());
        v.visit_file(&f.ast);
        for ident in v.0 {
            let place = match f.layer() {
                Some("top") | None => Place::Top(format!("the macro `{ident}`")),
                Some(l) => Place::Layer(l),
            };
            names.insert(ident.to_string(), place);
        }
    }
    names
}

/// The paths of a file that reach the crate root: the token index of each and the first
/// segment after the root (`*` for a glob; one entry per item of a group).
fn root_paths(f: &Source) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let firsts = |j: usize, found: &mut Vec<(usize, String)>, at: usize| {
        let first = |k: usize| -> Option<String> {
            match &f.toks.get(k)?.tk {
                Tk::Ident(s) => Some(s.clone()),
                Tk::Punct('*') => Some("*".into()),
                _ => None,
            }
        };
        if f.toks.get(j).is_some_and(|t| t.tk == Tk::Open('{')) {
            for (a, _) in f.group_items(j) {
                found.extend(first(a).map(|s| (at, s)));
            }
        } else {
            found.extend(first(j).map(|s| (at, s)));
        }
    };
    for i in 0..f.toks.len() {
        match f.ident(i) {
            Some("crate") if f.path_sep(i + 1) && !f.after_path_sep(i) => {
                firsts(i + 3, &mut found, i);
            }
            // A chain's first `super`, after a leading `self::` or none.
            Some("super")
                if !f.after_path_sep(i)
                    || i >= 3 && f.ident(i - 3) == Some("self") && !f.after_path_sep(i - 3) =>
            {
                let mut j = i;
                let mut climbs = 0;
                while f.ident(j) == Some("super") && f.path_sep(j + 1) {
                    climbs += 1;
                    j += 3;
                }
                if climbs > 0 && climbs >= f.depth_at(f.toks[i].at) {
                    firsts(j, &mut found, i);
                }
            }
            _ => {}
        }
    }
    found.retain(|(_, s)| s != "self");
    found
}

/// Whether a `use` path names the crate root itself (`crate`, `crate::self`, `super` up to
/// the root), in a module `depth` deep.
fn is_root(path: &[&syn::Ident], depth: usize) -> bool {
    let segs: Vec<String> = path
        .iter()
        .map(|i| i.to_string())
        .filter(|s| s != "self")
        .collect();
    segs == ["crate"] || (depth > 0 && segs.len() == depth && segs.iter().all(|s| s == "super"))
}

/// Every name of a higher layer, or of the crate root, that a file below the top names; every
/// alias of the crate root; every `#[path]` module and `include!`; every file in no layer.
fn violations(files: &[Source]) -> Vec<String> {
    let names = root_table(files);
    let mut bad = Vec::new();
    for f in files {
        let Some(layer) = f.layer() else {
            bad.push(format!(
                "{}: in no layer (add its folder to LAYERS in tests/layers.rs and to \
                 ARCHITECTURE.md's code map)",
                f.shown()
            ));
            continue;
        };
        // Forms that make a file's module, or the crate root's name, other than its path.
        for i in 0..f.toks.len() {
            // An attribute `#[…]` or `#![…]`, `cfg_attr` included: `path = …`, `macro_use`.
            let open = if f.punct(i + 1, '!') { i + 2 } else { i + 1 };
            if f.punct(i, '#') && f.toks.get(open).is_some_and(|t| t.tk == Tk::Open('[')) {
                for j in open + 1..f.close_of(open) {
                    if f.ident(j) == Some("path") && f.punct(j + 1, '=') {
                        bad.push(f.report(
                            f.toks[j].at,
                            "a #[path] module: a file's layer is the folder it is in",
                        ));
                    }
                    if f.ident(j) == Some("macro_use") {
                        bad.push(f.report(
                            f.toks[j].at,
                            "#[macro_use]: a macro is named by its path, as any item",
                        ));
                    }
                }
            }
            if f.ident(i) == Some("include") && f.punct(i + 1, '!') {
                bad.push(f.report(
                    f.toks[i].at,
                    "include!: a file's code belongs to the layer of its folder",
                ));
            }
        }
        struct V<'a>(Vec<&'a syn::ItemExternCrate>);
        impl<'a> Visit<'a> for V<'a> {
            fn visit_item_extern_crate(&mut self, e: &'a syn::ItemExternCrate) {
                self.0.push(e);
            }
        }
        let mut v = V(Vec::new());
        v.visit_file(&f.ast);
        for e in v.0 {
            if e.ident == "self" {
                bad.push(f.report(
                    pos(e.ident.span()),
                    "`extern crate self`: the crate root is named `crate` only",
                ));
            }
        }
        if layer == "top" {
            continue;
        }
        for u in uses(&f.ast) {
            let mut leaves = Vec::new();
            use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
            let depth = f.depth_at(pos(u.use_token.span));
            for leaf in leaves.iter().filter(|l| l.local.is_some()) {
                if is_root(&leaf.path, depth) {
                    bad.push(f.report(
                        pos(leaf.local.unwrap().span()),
                        &format!(
                            "{layer}/ aliases the crate root as `{}`: name it `crate`",
                            leaf.local.unwrap()
                        ),
                    ));
                }
            }
        }
        for (i, first) in root_paths(f) {
            let at = f.toks[i].at;
            let target = match names.get(&first) {
                _ if first == "*" => {
                    bad.push(f.report(at, &format!("{layer}/ globs the crate root (the top)")));
                    continue;
                }
                Some(Place::Layer(l)) => *l,
                Some(Place::Top(what)) => {
                    bad.push(f.report(
                        at,
                        &format!("{layer}/ names {what}, of the higher layer top"),
                    ));
                    continue;
                }
                Some(Place::Import(from)) => {
                    bad.push(f.report(
                        at,
                        &format!(
                            "{layer}/ names `{first}` through the crate root's import of \
                             `{from}`: name it by its layer's path"
                        ),
                    ));
                    continue;
                }
                None => {
                    bad.push(f.report(
                        at,
                        &format!(
                            "{layer}/ names `crate::{first}`, which is no module or item of \
                             lib.rs"
                        ),
                    ));
                    continue;
                }
            };
            if rank(target) > rank(layer) {
                bad.push(f.report(
                    at,
                    &format!("{layer}/ names `{first}` of the higher layer {target}/"),
                ));
            }
        }
    }
    bad
}

/// Every inherent `impl T` outside the layer that defines `T` (except those allowed above).
fn foreign_impls(files: &[Source]) -> Vec<String> {
    struct Defs(Vec<String>);
    impl<'a> Visit<'a> for Defs {
        fn visit_item_struct(&mut self, i: &'a syn::ItemStruct) {
            self.0.push(i.ident.to_string());
        }
        fn visit_item_enum(&mut self, i: &'a syn::ItemEnum) {
            self.0.push(i.ident.to_string());
        }
        fn visit_item_union(&mut self, i: &'a syn::ItemUnion) {
            self.0.push(i.ident.to_string());
        }
        fn visit_item_trait(&mut self, i: &'a syn::ItemTrait) {
            self.0.push(i.ident.to_string());
            visit::visit_item_trait(self, i);
        }
        fn visit_item_type(&mut self, i: &'a syn::ItemType) {
            self.0.push(i.ident.to_string());
        }
    }
    struct Impls<'a>(Vec<&'a syn::ItemImpl>);
    impl<'a> Visit<'a> for Impls<'a> {
        fn visit_item_impl(&mut self, i: &'a syn::ItemImpl) {
            self.0.push(i);
            visit::visit_item_impl(self, i);
        }
    }
    let mut defined: HashMap<String, Vec<&'static str>> = HashMap::new();
    for f in files {
        let Some(layer) = f.layer() else { continue };
        let mut d = Defs(Vec::new());
        d.visit_file(&f.ast);
        for name in d.0 {
            defined.entry(name).or_default().push(layer);
        }
    }
    let mut bad = Vec::new();
    for f in files {
        let Some(layer) = f.layer() else { continue };
        let shown = f.rel.to_string_lossy().replace('\\', "/");
        let mut v = Impls(Vec::new());
        v.visit_file(&f.ast);
        for imp in v.0 {
            if imp.trait_.is_some() {
                continue;
            }
            let syn::Type::Path(tp) = &*imp.self_ty else {
                continue;
            };
            let Some(seg) = tp.path.segments.last() else {
                continue;
            };
            let name = seg.ident.to_string();
            let Some(homes) = defined.get(&name) else {
                continue; // not the crate's type (a compile error anyway)
            };
            if homes.contains(&layer)
                || FOREIGN_IMPLS_ALLOWED
                    .iter()
                    .any(|(t, file, _)| *t == name && *file == shown)
            {
                continue;
            }
            bad.push(f.report(
                pos(imp.impl_token.span),
                &format!(
                    "an inherent impl of `{name}` in {layer}/, which does not define it \
                     (defined in {})",
                    homes.join(", ")
                ),
            ));
        }
    }
    bad
}

/// The names of the crates `src/` depends on (`[dependencies]` of Cargo.toml), and std's.
fn extern_crates() -> HashSet<String> {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("Cargo.toml");
    let mut names: HashSet<String> = ["std", "core", "alloc"].map(String::from).into();
    let mut inside = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == "[dependencies]";
        } else if inside
            && !line.starts_with('#')
            && let Some(name) = line.split(['=', '.', ' ']).next().filter(|n| !n.is_empty())
        {
            names.insert(name.replace('-', "_"));
        }
    }
    names
}

/// `Db` as a parameter's type: `Db`, `&Db`, `&mut Db`, `&'a crate::store::Db`.
fn db_type(ty: &syn::Type) -> Option<&syn::Ident> {
    match ty {
        syn::Type::Reference(r) => db_type(&r.elem),
        syn::Type::Path(tp) if tp.qself.is_none() && tp.path.leading_colon.is_none() => {
            // The crate's `Db`: `Db`, or a path from the crate (not `sled::Db`).
            let first = &tp.path.segments.first()?.ident;
            let ours = tp.path.segments.len() == 1
                || ["crate", "super", "self", "store"]
                    .iter()
                    .any(|s| first == s);
            let last = tp.path.segments.last().filter(|_| ours)?;
            (last.ident == "Db" && last.arguments.is_none()).then_some(&last.ident)
        }
        _ => None,
    }
}

/// The façade: no code below the top can call a method of `Db` (all of them are in
/// `db.rs`). Below the top, the identifier `Db` (the crate's, not `sled::Db`) appears only
/// where `store/` defines it (`struct Db`), in a `use` that does not rename it, as the self
/// type of a trait impl, and as the type of a function's parameter (`db: &Db`); such a
/// parameter, and `self` in a trait impl for `Db`, is used only to take its `Dir`
/// (`db.dir`), and `Self` is not used in such an impl's bodies. So a value of `Db` is never
/// held below the top other than to unwrap it, whatever the method's name.
fn facade_calls(files: &[Source], externs: &HashSet<String>) -> Vec<String> {
    #[derive(Default)]
    struct V {
        allowed: HashSet<Pos>,
        /// A binding of `Db` and the body it must only unwrap it in.
        bindings: Vec<(String, Pos, Pos)>,
        renames: Vec<Pos>,
        self_impls: Vec<(Pos, Pos)>,
    }
    impl V {
        fn sig(&mut self, sig: &syn::Signature, body: Option<&syn::Block>) {
            for arg in &sig.inputs {
                let syn::FnArg::Typed(pt) = arg else { continue };
                let (Some(db), syn::Pat::Ident(pi)) = (db_type(&pt.ty), &*pt.pat) else {
                    continue;
                };
                if pi.subpat.is_some() || pi.by_ref.is_some() {
                    continue;
                }
                self.allowed.insert(pos(db.span()));
                if let Some(b) = body {
                    self.bindings.push((
                        pi.ident.to_string(),
                        pos(b.brace_token.span.open()),
                        pos(b.brace_token.span.close()),
                    ));
                }
            }
        }
    }
    impl<'a> Visit<'a> for V {
        fn visit_item_struct(&mut self, i: &'a syn::ItemStruct) {
            if i.ident == "Db" {
                self.allowed.insert(pos(i.ident.span()));
            }
            visit::visit_item_struct(self, i);
        }
        fn visit_item_use(&mut self, u: &'a syn::ItemUse) {
            let mut leaves = Vec::new();
            use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
            for leaf in leaves {
                let (Some(local), Some(last)) = (leaf.local, leaf.path.last()) else {
                    continue;
                };
                if leaf.renamed && (*last == "Db" || local == "Db") {
                    self.renames.push(pos(local.span()));
                } else if *last == "Db" {
                    self.allowed.insert(pos(last.span()));
                }
            }
        }
        fn visit_item_impl(&mut self, i: &'a syn::ItemImpl) {
            if let (Some(_), Some(db)) = (&i.trait_, db_type(&i.self_ty)) {
                self.allowed.insert(pos(db.span()));
                for item in &i.items {
                    if let syn::ImplItem::Fn(f) = item {
                        self.bindings.push((
                            "self".into(),
                            pos(f.block.brace_token.span.open()),
                            pos(f.block.brace_token.span.close()),
                        ));
                        self.self_impls.push((
                            pos(f.block.brace_token.span.open()),
                            pos(f.block.brace_token.span.close()),
                        ));
                    }
                }
            }
            visit::visit_item_impl(self, i);
        }
        fn visit_item_fn(&mut self, i: &'a syn::ItemFn) {
            self.sig(&i.sig, Some(&i.block));
            visit::visit_item_fn(self, i);
        }
        fn visit_impl_item_fn(&mut self, i: &'a syn::ImplItemFn) {
            self.sig(&i.sig, Some(&i.block));
            visit::visit_impl_item_fn(self, i);
        }
        fn visit_trait_item_fn(&mut self, i: &'a syn::TraitItemFn) {
            self.sig(&i.sig, i.default.as_ref());
            visit::visit_trait_item_fn(self, i);
        }
    }
    let mut bad = Vec::new();
    for f in files {
        if f.layer().is_none_or(|l| l == "top") {
            continue;
        }
        let mut v = V::default();
        v.visit_file(&f.ast);
        for at in &v.renames {
            bad.push(f.report(*at, "renames `Db` below the top"));
        }
        for (i, t) in f.toks.iter().enumerate() {
            if t.tk != Tk::Ident("Db".into()) || v.allowed.contains(&t.at) {
                continue;
            }
            let start = f.path_start(i);
            if start < i && f.ident(start).is_some_and(|s| externs.contains(s)) {
                continue; // `sled::Db`
            }
            bad.push(f.report(
                t.at,
                "names `Db` below the top other than as a parameter's type, a trait impl's \
                 self type, a plain `use` or its definition",
            ));
        }
        for (name, open, close) in &v.bindings {
            for (i, t) in f.toks.iter().enumerate() {
                if !(*open < t.at && t.at < *close) {
                    continue;
                }
                if t.tk == Tk::Ident("Self".into())
                    && name == "self"
                    && v.self_impls.iter().any(|(a, b)| a == open && b == close)
                {
                    bad.push(f.report(t.at, "uses `Self` in a trait impl for `Db`"));
                    continue;
                }
                if t.tk != Tk::Ident(name.clone())
                    || f.after_path_sep(i)
                    || i > 0 && f.punct(i - 1, '.')
                {
                    continue;
                }
                let unwraps = f.punct(i + 1, '.')
                    && f.ident(i + 2) == Some("dir")
                    && !f.toks.get(i + 3).is_some_and(|t| t.tk == Tk::Open('('))
                    && !f.path_sep(i + 3);
                if !unwraps {
                    bad.push(f.report(
                        t.at,
                        &format!(
                            "uses the `Db` `{name}` other than to take its Dir (`{name}.dir`)"
                        ),
                    ));
                }
            }
        }
    }
    bad
}

/// What each lower layer must not name of the Kubernetes client: `disk/` nothing of `kube`
/// or `k8s_openapi` (the identifiers, anywhere), `store/` no `Client` or `Api` (the
/// identifiers, whatever the path).
fn kubernetes_below(files: &[Source]) -> Vec<String> {
    let mut bad = Vec::new();
    for f in files {
        let layer = f.layer();
        let forbidden: &[&str] = match layer {
            Some("disk") => &["kube", "k8s_openapi"],
            Some("store") => &["Client", "Api"],
            _ => continue,
        };
        for (i, t) in f.toks.iter().enumerate() {
            if let Some(name) = f.ident(i).filter(|n| forbidden.contains(n)) {
                bad.push(f.report(t.at, &format!("{}/ names `{name}`", layer.unwrap())));
            }
        }
    }
    bad
}

/// The consts of a set of files, by name: the file of each and its value if that is a byte
/// literal.
fn byte_consts<'a>(
    files: impl Iterator<Item = &'a Source>,
) -> HashMap<String, Vec<(PathBuf, Option<u8>)>> {
    struct V(PathBuf, HashMap<String, Vec<(PathBuf, Option<u8>)>>);
    impl<'a> Visit<'a> for V {
        fn visit_item_const(&mut self, c: &'a syn::ItemConst) {
            let value = match &*c.expr {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Byte(b),
                    ..
                }) => Some(b.value()),
                _ => None,
            };
            self.1
                .entry(c.ident.to_string())
                .or_default()
                .push((self.0.clone(), value));
        }
    }
    let mut v = V(PathBuf::new(), HashMap::new());
    for f in files {
        v.0 = f.rel.clone();
        v.visit_file(&f.ast);
    }
    v.1
}

/// Above the store, no object key of a stream: no object key tag (`OBJECT`, `SEEN`, `INDEX`,
/// `ENTRIES`) is named, no index key is built (`keys::index_prefix`, `index_range`), and the
/// tag given to `keys::tagged`, `range` or `chunk` (by a `keys::` path, or a name imported
/// from `keys`) is a const of the upper layers (the file's own of that name, else every one
/// of that name) whose value is a byte literal that is no object key tag. A key built byte by
/// byte is not seen.
fn object_keys_above_store(files: &[Source]) -> Vec<String> {
    let above =
        |f: &&Source| !matches!(f.layer(), None | Some("model" | "exec" | "disk" | "store"));
    let mut bad = Vec::new();
    let Some(keys) = files
        .iter()
        .find(|f| f.rel == Path::new("disk/keys.rs") || f.rel == Path::new("disk/keys/mod.rs"))
    else {
        return vec!["src/disk/keys.rs: not found: the object key tags are defined there".into()];
    };
    let tags = byte_consts(std::iter::once(keys));
    let tag_values: Vec<u8> = OBJECT_TAGS
        .iter()
        .filter_map(|t| tags.get(*t)?.first()?.1)
        .collect();
    if tag_values.len() != OBJECT_TAGS.len() {
        bad.push(format!(
            "src/disk/keys.rs: the object key tags {OBJECT_TAGS:?} are not all byte literal consts"
        ));
    }
    let consts = byte_consts(files.iter().filter(above));
    for f in files.iter().filter(above) {
        // The names `keys` and its functions have in this file.
        let mut modules: HashSet<String> = ["keys".to_string()].into();
        let mut fns: HashMap<String, &str> = HashMap::new();
        for u in uses(&f.ast) {
            let mut leaves = Vec::new();
            use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
            for leaf in leaves {
                let path: Vec<String> = leaf
                    .path
                    .iter()
                    .map(|i| i.to_string())
                    .filter(|s| s != "self")
                    .collect();
                let Some(k) = path.iter().position(|s| s == "keys") else {
                    continue;
                };
                match (leaf.local, path.get(k + 1)) {
                    (Some(local), None) => {
                        modules.insert(local.to_string());
                    }
                    (Some(local), Some(item)) => {
                        if let Some(known) = TAG_FNS
                            .iter()
                            .map(|(n, _)| *n)
                            .chain(OBJECT_KEY_FNS.iter().copied())
                            .find(|n| n == item)
                        {
                            fns.insert(local.to_string(), known);
                        }
                    }
                    (None, None) => {
                        for n in TAG_FNS
                            .iter()
                            .map(|(n, _)| *n)
                            .chain(OBJECT_KEY_FNS.iter().copied())
                        {
                            fns.insert(n.to_string(), n);
                        }
                    }
                    (None, Some(_)) => {}
                }
            }
        }
        let use_items: Vec<(Pos, Pos)> = uses(&f.ast)
            .iter()
            .map(|u| (pos(u.use_token.span), pos(u.semi_token.span)))
            .collect();
        for (i, t) in f.toks.iter().enumerate() {
            let Some(name) = f.ident(i) else { continue };
            if OBJECT_TAGS.contains(&name) {
                bad.push(f.report(
                    t.at,
                    &format!("names the object key tag `{name}` above the store"),
                ));
                continue;
            }
            if use_items.iter().any(|(a, b)| *a <= t.at && t.at <= *b) {
                continue; // the import itself
            }
            let by_path = f.after_path_sep(i)
                && i >= 3
                && f.ident(i - 3).is_some_and(|m| modules.contains(m));
            let by_import =
                !(f.after_path_sep(i) || i > 0 && f.punct(i - 1, '.')) && fns.contains_key(name);
            if !(by_path || by_import) {
                continue;
            }
            let function = if by_path { name } else { fns[name] };
            if OBJECT_KEY_FNS.contains(&function) {
                bad.push(f.report(
                    t.at,
                    &format!("builds an index key (`keys::{function}`) above the store"),
                ));
                continue;
            }
            let Some(&(_, arg)) = TAG_FNS.iter().find(|(n, _)| *n == function) else {
                continue;
            };
            if !f.toks.get(i + 1).is_some_and(|t| t.tk == Tk::Open('(')) {
                bad.push(f.report(
                    t.at,
                    &format!("takes `keys::{function}` as a value above the store"),
                ));
                continue;
            }
            let args = f.group_items(i + 1);
            let tag = args.get(arg).map(|&(a, b)| &f.toks[a..b]);
            let named = match tag {
                Some([.., last]) => match &last.tk {
                    Tk::Ident(c)
                        if tag
                            .unwrap()
                            .iter()
                            .all(|t| matches!(t.tk, Tk::Ident(_) | Tk::Punct(':'))) =>
                    {
                        Some(c.clone())
                    }
                    _ => None,
                },
                _ => None,
            };
            // The file's own const of that name, else every const of that name above the store.
            let defs = named.as_ref().and_then(|c| consts.get(c));
            let values: Vec<Option<u8>> = defs.map_or(Vec::new(), |defs| {
                let own: Vec<_> = defs.iter().filter(|(p, _)| *p == f.rel).collect();
                let chosen = if own.is_empty() {
                    defs.iter().collect()
                } else {
                    own
                };
                chosen.into_iter().map(|(_, v)| *v).collect()
            });
            let ok = !values.is_empty()
                && values
                    .iter()
                    .all(|v| v.is_some_and(|v| !tag_values.contains(&v)));
            if !ok {
                bad.push(f.report(
                    t.at,
                    &format!(
                        "gives `keys::{function}` a tag that is not a const of the upper layers \
                         with a byte value other than the object key tags'"
                    ),
                ));
            }
        }
    }
    bad
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The files of a `src/` tree, parsed; a file that does not parse is an error.
fn read_tree(src: &Path) -> Result<Vec<Source>, Vec<String>> {
    let mut paths = Vec::new();
    rust_files(src, &mut paths);
    let (mut files, mut errors) = (Vec::new(), Vec::new());
    for p in &paths {
        let rel = p.strip_prefix(src).unwrap().to_path_buf();
        let text = std::fs::read_to_string(p).unwrap();
        match parse(rel, text) {
            Ok(f) => files.push(f),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(files)
    } else {
        Err(errors)
    }
}

fn source_files() -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = read_tree(&src).unwrap_or_else(|e| panic!("{}", e.join("\n")));
    assert!(
        files.len() > 20,
        "read {} files of {}",
        files.len(),
        src.display()
    );
    files
}

/// Every rule, on a tree.
fn all_rules(files: &[Source]) -> Vec<String> {
    let externs = extern_crates();
    let mut bad = violations(files);
    bad.extend(foreign_impls(files));
    bad.extend(facade_calls(files, &externs));
    bad.extend(object_keys_above_store(files));
    bad.extend(kubernetes_below(files));
    bad
}

#[test]
fn every_layer_imports_only_lower_layers() {
    let bad = violations(&source_files());
    assert!(
        bad.is_empty(),
        "{} upward import(s) (layers, lowest first: {}):\n{}",
        bad.len(),
        LAYERS.join(" < "),
        bad.join("\n")
    );
}

#[test]
fn every_inherent_impl_is_in_the_layer_of_its_type() {
    let bad = foreign_impls(&source_files());
    assert!(
        bad.is_empty(),
        "{} misplaced impl(s):\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn no_layer_below_the_top_calls_the_facade() {
    let files = source_files();
    let bad = facade_calls(&files, &extern_crates());
    assert!(
        bad.is_empty(),
        "{} facade use(s):\n{}",
        bad.len(),
        bad.join("\n")
    );
    // The rule is about every method of `Db`, whatever its name: it must know them.
    let db = files
        .iter()
        .find(|f| f.rel == Path::new("db.rs"))
        .expect("src/db.rs");
    let methods = db
        .ast
        .items
        .iter()
        .filter_map(|i| match i {
            syn::Item::Impl(imp) if imp.trait_.is_none() && db_type(&imp.self_ty).is_some() => {
                Some(
                    imp.items
                        .iter()
                        .filter(|i| matches!(i, syn::ImplItem::Fn(_)))
                        .count(),
                )
            }
            _ => None,
        })
        .sum::<usize>();
    assert!(methods > 0, "no `impl Db` with methods in src/db.rs");
}

#[test]
fn only_the_store_reads_and_writes_object_keys() {
    let bad = object_keys_above_store(&source_files());
    assert!(bad.is_empty(), "{}:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn disk_knows_no_kubernetes_and_store_makes_no_request() {
    let bad = kubernetes_below(&source_files());
    assert!(bad.is_empty(), "{}:\n{}", bad.len(), bad.join("\n"));
}

/// One forbidden form: what it is, the text appended to files of a copy of `src/` (a file
/// that does not exist is created), and the file and words of the report that prove it
/// caught by its rule.
struct Mutation {
    what: &'static str,
    edits: Vec<(String, String)>,
    expect: String,
    says: &'static str,
}

/// Each forbidden form, placed in a lower layer by folder: a layer's `mod.rs`, or its deepest
/// file (whatever it is called, so that files may move inside a folder).
fn mutations(files: &[Source]) -> Vec<Mutation> {
    let deepest = |layer: &str| -> (String, usize) {
        let f = files
            .iter()
            .filter(|f| f.layer() == Some(layer))
            .max_by_key(|f| (depth(&f.rel), f.rel.clone()))
            .unwrap_or_else(|| panic!("no file in {layer}/"));
        (f.rel.to_string_lossy().replace('\\', "/"), depth(&f.rel))
    };
    let (store_deep, store_depth) = deepest("store");
    let (sync_deep, sync_depth) = deepest("sync");
    let climb = |n: usize| "super::".repeat(n);
    let m =
        |what: &'static str, edits: &[(&str, String)], expect: &str, says: &'static str| Mutation {
            what,
            edits: edits
                .iter()
                .map(|(f, t)| (f.to_string(), t.clone()))
                .collect(),
            expect: expect.to_string(),
            says,
        };
    let s = |t: &str| t.to_string();
    vec![
        // The layer order.
        m(
            "an upward use",
            &[("store/mod.rs", s("use crate::sync::StreamConfig;"))],
            "store/mod.rs",
            "of the higher layer sync/",
        ),
        m(
            "an upward use in a group",
            &[("disk/mod.rs", s("use crate::{model::Error, store::Dir};"))],
            "disk/mod.rs",
            "of the higher layer store/",
        ),
        m(
            "an upward pub(crate) use (a re-export of a higher layer)",
            &[("exec/mod.rs", s("pub(crate) use crate::disk::keys;"))],
            "exec/mod.rs",
            "of the higher layer disk/",
        ),
        m(
            "an upward path in a macro's arguments",
            &[(
                "exec/mod.rs",
                s("fn _m() { debug_assert!(crate::disk::keys::prefix_end(b\"\").len() > 0); }"),
            )],
            "exec/mod.rs",
            "of the higher layer disk/",
        ),
        m(
            "an upward type in a turbofish",
            &[(
                "model/mod.rs",
                s("fn _m() -> usize { std::mem::size_of::<crate::store::Dir>() }"),
            )],
            "model/mod.rs",
            "of the higher layer store/",
        ),
        m(
            "an upward generic call with a turbofish",
            &[(
                "store/mod.rs",
                s("fn _m() { let _ = crate::sync::open_store::<(), ()>; }"),
            )],
            "store/mod.rs",
            "of the higher layer sync/",
        ),
        m(
            "an upward type in a signature",
            &[(
                "disk/mod.rs",
                s("pub(crate) fn _m(_: &crate::sync::Watcher<()>) {}"),
            )],
            "disk/mod.rs",
            "of the higher layer sync/",
        ),
        m(
            "an upward path through super:: from the deepest file",
            &[(
                &store_deep,
                format!("use {}sync::StreamConfig;", climb(store_depth)),
            )],
            &store_deep,
            "of the higher layer sync/",
        ),
        m(
            "an upward path through self::super::",
            &[("store/mod.rs", s("use self::super::sync::StreamConfig;"))],
            "store/mod.rs",
            "of the higher layer sync/",
        ),
        m(
            "an upward path through super:: from an inline module",
            &[(
                "store/mod.rs",
                s("mod _m { use super::super::controller::Controller; }"),
            )],
            "store/mod.rs",
            "of the higher layer controller/",
        ),
        m(
            "an upward path of controller from sync's deepest file",
            &[(
                &sync_deep,
                format!(
                    "fn _m() {{ let _ = {}controller::Config::default(); }}",
                    climb(sync_depth)
                ),
            )],
            &sync_deep,
            "of the higher layer controller/",
        ),
        m(
            "an upward $crate path in a macro",
            &[(
                "disk/mod.rs",
                s("macro_rules! up { () => { $crate::controller::Config::default() }; }"),
            )],
            "disk/mod.rs",
            "of the higher layer controller/",
        ),
        m(
            "a glob of the crate root",
            &[("controller/mod.rs", s("use crate::*;"))],
            "controller/mod.rs",
            "globs the crate root",
        ),
        m(
            "a crate-root re-export below the top (of a lower layer)",
            &[("sync/mod.rs", s("fn _m() -> crate::Error { todo!() }"))],
            "sync/mod.rs",
            "through the crate root's import",
        ),
        m(
            "a name lib.rs imports with pub(crate) use",
            &[
                (
                    "lib.rs",
                    s("pub(crate) use sync::StreamConfig as SyncConfig;"),
                ),
                ("store/mod.rs", s("use crate::SyncConfig;")),
            ],
            "store/mod.rs",
            "through the crate root's import",
        ),
        m(
            "an item defined in lib.rs",
            &[
                ("lib.rs", s("pub(crate) fn top_helper() {}")),
                ("disk/mod.rs", s("fn _m() { crate::top_helper() }")),
            ],
            "disk/mod.rs",
            "defined in lib.rs, of the higher layer top",
        ),
        m(
            "a module defined in lib.rs",
            &[("model/mod.rs", s("use crate::db as _;"))],
            "model/mod.rs",
            "the top module `db`",
        ),
        m(
            "a top module",
            &[("controller/mod.rs", s("use crate::db as _;"))],
            "controller/mod.rs",
            "the top module `db`",
        ),
        m(
            "a crate-root name lib.rs does not have",
            &[("store/mod.rs", s("fn _m() { crate::no_such_thing(); }"))],
            "store/mod.rs",
            "which is no module or item of lib.rs",
        ),
        m(
            "use crate as x",
            &[(
                "store/mod.rs",
                s("use crate as root;\nfn _m() { let _ = root::sync::StreamConfig::default(); }"),
            )],
            "store/mod.rs",
            "aliases the crate root",
        ),
        m(
            "use crate::{self as x}",
            &[("disk/mod.rs", s("use crate::{self as root};"))],
            "disk/mod.rs",
            "aliases the crate root",
        ),
        m(
            "use super::…::super as x, up to the root",
            &[(
                &store_deep,
                format!("use {}super as root;", climb(store_depth - 1)),
            )],
            &store_deep,
            "aliases the crate root",
        ),
        m(
            "extern crate self as x, in a lower layer",
            &[(
                "store/mod.rs",
                s("extern crate self as kp;\nuse kp::sync::StreamConfig;"),
            )],
            "store/mod.rs",
            "`extern crate self`",
        ),
        m(
            "extern crate self as x, at the root",
            &[
                ("lib.rs", s("extern crate self as kp;")),
                ("store/mod.rs", s("use kp::sync::StreamConfig;")),
            ],
            "lib.rs",
            "`extern crate self`",
        ),
        m(
            "a #[path] module taking a higher layer's file",
            &[(
                "store/mod.rs",
                s("#[path = \"../sync/mod.rs\"]\nmod upper;"),
            )],
            "store/mod.rs",
            "a #[path] module",
        ),
        m(
            "#[cfg_attr(…, path = …)]",
            &[(
                "store/mod.rs",
                s("#[cfg_attr(all(), path = \"../sync/mod.rs\")]\nmod upper;"),
            )],
            "store/mod.rs",
            "a #[path] module",
        ),
        m(
            "#[macro_use] (a higher layer's macros by textual scope)",
            &[("lib.rs", s("#[macro_use]\nmod more_macros {}"))],
            "lib.rs",
            "#[macro_use]",
        ),
        m(
            "include! of a higher layer's file",
            &[(
                "store/mod.rs",
                s("mod upper { include!(\"../sync/mod.rs\"); }"),
            )],
            "store/mod.rs",
            "include!",
        ),
        m(
            "a file in no layer",
            &[("stray/mod.rs", s("pub(crate) fn f() {}"))],
            "stray/mod.rs",
            "in no layer",
        ),
        // Impls.
        m(
            "an inherent impl of a lower layer's type",
            &[(
                "sync/mod.rs",
                s("impl crate::store::Dir { fn _m(&self) {} }"),
            )],
            "sync/mod.rs",
            "an inherent impl of `Dir`",
        ),
        // The façade.
        m(
            "a Db method called with a turbofish",
            &[(
                "controller/mod.rs",
                s("fn _m(db: &crate::store::Db) { let _ = db.store::<()>(\"x\", (), ()); }"),
            )],
            "controller/mod.rs",
            "other than to take its Dir",
        ),
        m(
            "a Db method whose name other types have (path)",
            &[(
                "controller/mod.rs",
                s("fn _m(db: &crate::store::Db) -> &std::path::Path { db.path() }"),
            )],
            "controller/mod.rs",
            "other than to take its Dir",
        ),
        m(
            "a Db method in a macro's arguments",
            &[(
                "sync/mod.rs",
                s("fn _m(db: &crate::store::Db) { tracing::debug!(\"{:?}\", db.streams()); }"),
            )],
            "sync/mod.rs",
            "other than to take its Dir",
        ),
        m(
            "a method named dir on a Db",
            &[(
                "controller/mod.rs",
                s("fn _m(db: &crate::store::Db) { let _ = db.dir(); }"),
            )],
            "controller/mod.rs",
            "other than to take its Dir",
        ),
        m(
            "Self in a trait impl for Db",
            &[(
                "store/mod.rs",
                s("impl Default for Db { fn default() -> Self { Self::open(\"x\").unwrap() } }"),
            )],
            "store/mod.rs",
            "uses `Self` in a trait impl for `Db`",
        ),
        m(
            "a Db method through a let",
            &[(
                "controller/mod.rs",
                s("fn _m(db: &crate::store::Db) { let d = db; let _ = d.flush(); }"),
            )],
            "controller/mod.rs",
            "other than to take its Dir",
        ),
        m(
            "a Db associated function (Db::open)",
            &[(
                "sync/mod.rs",
                s("fn _m() { let _ = crate::store::Db::open(\"x\"); }"),
            )],
            "sync/mod.rs",
            "names `Db` below the top",
        ),
        m(
            "a Db method by its path, with a turbofish",
            &[(
                "sync/mod.rs",
                s(
                    "fn _m(db: &crate::store::Db) { let _ = crate::store::Db::store::<()>(db, \"x\", (), ()); }",
                ),
            )],
            "sync/mod.rs",
            "names `Db` below the top",
        ),
        m(
            "Db renamed",
            &[(
                "controller/mod.rs",
                s("use crate::store::Db as Handle;\nfn _m(h: &Handle) { let _ = h.flush(); }"),
            )],
            "controller/mod.rs",
            "renames `Db`",
        ),
        m(
            "Db in a field",
            &[("controller/mod.rs", s("struct _M { db: crate::store::Db }"))],
            "controller/mod.rs",
            "names `Db` below the top",
        ),
        m(
            "Db in a closure's bound",
            &[(
                "controller/mod.rs",
                s("fn _m(f: impl Fn(&crate::store::Db)) { let _ = f; }"),
            )],
            "controller/mod.rs",
            "names `Db` below the top",
        ),
        m(
            "an inherent impl of Db in store/",
            &[(
                "store/mod.rs",
                s("impl Db { pub(crate) fn _m(&self) { let _ = self.flush(); } }"),
            )],
            "store/mod.rs",
            "names `Db` below the top",
        ),
        m(
            "a Db method on self in a trait impl for Db",
            &[(
                "store/mod.rs",
                s(
                    "impl std::hash::Hash for Db { fn hash<H: std::hash::Hasher>(&self, _: &mut H) { let _ = self.path(); } }",
                ),
            )],
            "store/mod.rs",
            "the `Db` `self` other than",
        ),
        // Object keys.
        m(
            "keys::tagged(b'o', ..)",
            &[(
                "sync/mod.rs",
                s("fn _m(s: &[u8]) -> Vec<u8> { crate::disk::keys::tagged(b'o', s) }"),
            )],
            "sync/mod.rs",
            "gives `keys::tagged` a tag",
        ),
        m(
            "keys::range with an integer tag",
            &[(
                "controller/mod.rs",
                s("fn _m() { let _ = crate::disk::keys::range(111, None); }"),
            )],
            "controller/mod.rs",
            "gives `keys::range` a tag",
        ),
        m(
            "keys::chunk with a const whose value is an object tag",
            &[(
                &sync_deep,
                s(
                    "const MINE: u8 = b's';\nfn _m(b: &dyn crate::disk::Backend) { let _ = crate::disk::keys::chunk(b, MINE, None, 1); }",
                ),
            )],
            &sync_deep,
            "gives `keys::chunk` a tag",
        ),
        m(
            "keys::tagged imported under another name",
            &[(
                "controller/mod.rs",
                s(
                    "use crate::disk::keys::tagged as tag;\nfn _m(s: &[u8]) -> Vec<u8> { tag(b'x', s) }",
                ),
            )],
            "controller/mod.rs",
            "gives `keys::tagged` a tag",
        ),
        m(
            "keys imported under another name",
            &[(
                "sync/mod.rs",
                s("use crate::disk::keys as k;\nfn _m(s: &[u8]) -> Vec<u8> { k::tagged(b'i', s) }"),
            )],
            "sync/mod.rs",
            "gives `keys::tagged` a tag",
        ),
        m(
            "keys imported as {self as x}",
            &[(
                "controller/mod.rs",
                s(
                    "use crate::disk::{keys::{self as k}};\nfn _m(s: &[u8]) -> Vec<u8> { k::tagged(b'o', s) }",
                ),
            )],
            "controller/mod.rs",
            "gives `keys::tagged` a tag",
        ),
        m(
            "keys::tagged taken as a value",
            &[(
                "sync/mod.rs",
                s("fn _m(s: &[u8]) -> Vec<u8> { let f = crate::disk::keys::tagged; f(b'o', s) }"),
            )],
            "sync/mod.rs",
            "takes `keys::tagged` as a value",
        ),
        m(
            "an object key tag named",
            &[("controller/mod.rs", s("use crate::disk::keys::OBJECT;"))],
            "controller/mod.rs",
            "names the object key tag `OBJECT`",
        ),
        m(
            "an index key built above the store",
            &[(
                "sync/mod.rs",
                s("fn _m() { let _ = crate::disk::keys::index_prefix(\"a\", \"b\"); }"),
            )],
            "sync/mod.rs",
            "builds an index key",
        ),
        // Kubernetes below sync/.
        m(
            "kube in disk/",
            &[("disk/mod.rs", s("fn _m(_: kube::core::ObjectMeta) {}"))],
            "disk/mod.rs",
            "names `kube`",
        ),
        m(
            "k8s_openapi in disk/",
            &[("disk/mod.rs", s("use k8s_openapi as _;"))],
            "disk/mod.rs",
            "names `k8s_openapi`",
        ),
        m(
            "a kube Client in store/",
            &[("store/mod.rs", s("use kube::{Client as _};"))],
            "store/mod.rs",
            "names `Client`",
        ),
        m(
            "a kube Api in store/",
            &[(
                &store_deep,
                s("fn _m(_: kube::api::Api<k8s_openapi::api::core::v1::Pod>) {}"),
            )],
            &store_deep,
            "names `Api`",
        ),
    ]
}

/// The rules on the real tree: a copy of `src/` passes them all, and each forbidden form,
/// applied alone to the copy, makes them report it in the file it was put in.
#[test]
fn each_forbidden_form_in_a_copy_of_src_is_caught() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    for p in &paths {
        let to = copy.join(p.strip_prefix(&src).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(p, &to).unwrap();
    }
    let clean = read_tree(&copy).unwrap_or_else(|e| panic!("{}", e.join("\n")));
    let bad = all_rules(&clean);
    assert!(
        bad.is_empty(),
        "the unchanged copy fails:\n{}",
        bad.join("\n")
    );
    let mut missed = Vec::new();
    let list = mutations(&clean);
    for m in &list {
        let saved: Vec<(PathBuf, Option<String>)> = m
            .edits
            .iter()
            .map(|(rel, _)| {
                let p = copy.join(rel);
                (p.clone(), std::fs::read_to_string(&p).ok())
            })
            .collect();
        for ((_, text), (p, before)) in m.edits.iter().zip(&saved) {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let after = format!("{}\n{text}\n", before.as_deref().unwrap_or(""));
            std::fs::write(p, after).unwrap();
        }
        // The copy's files, the edited ones read again (the others are as parsed above).
        let mut files: Vec<Source> = clean
            .iter()
            .filter(|f| !m.edits.iter().any(|(rel, _)| f.rel == Path::new(rel)))
            .cloned()
            .collect();
        let mut unparsed = Vec::new();
        for (rel, _) in &m.edits {
            let text = std::fs::read_to_string(copy.join(rel)).unwrap();
            match parse(PathBuf::from(rel), text) {
                Ok(f) => files.push(f),
                Err(e) => unparsed.push(e),
            }
        }
        if unparsed.is_empty() {
            let bad = all_rules(&files);
            let prefix = format!("src/{}:", m.expect);
            if !bad
                .iter()
                .any(|b| b.starts_with(&prefix) && b.contains(m.says))
            {
                missed.push(format!(
                    "{}: no report in {} that says {:?} (reports: {bad:#?})",
                    m.what, m.expect, m.says
                ));
            }
        } else {
            missed.push(format!(
                "{}: the mutated copy does not parse: {unparsed:?}",
                m.what
            ));
        }
        for (p, before) in saved {
            match before {
                Some(text) => std::fs::write(&p, text).unwrap(),
                None => std::fs::remove_file(&p).unwrap(),
            }
        }
    }
    assert!(
        missed.is_empty(),
        "{} of {} forms missed:\n{}",
        missed.len(),
        list.len(),
        missed.join("\n")
    );
    // And the copy is back as it was.
    let bad = all_rules(&read_tree(&copy).unwrap_or_else(|e| panic!("{}", e.join("\n"))));
    assert!(
        bad.is_empty(),
        "the restored copy fails:\n{}",
        bad.join("\n")
    );
}
