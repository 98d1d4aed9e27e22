//! The public API, listed from the source and held in `docs/api.txt`, so that every change
//! to the surface is deliberate (issue 57: the surface freezes at 0.1.0). No nightly
//! toolchain is needed (cargo-public-api reads rustdoc JSON, which needs one): the listing
//! is read from `src/` with syn, as the layer rules are.
//!
//! What is listed, one line each, `path: item` in sorted order: every module, struct (with
//! its public fields), enum (with its variants), trait (with its items), function, method
//! of an inherent impl, trait impl of a public type, const, static, type alias and exported
//! macro reachable from `src/lib.rs` by public paths, re-exports resolved to what they name
//! (`pub use` of kube or another crate listed as the path it re-exports). Signatures are
//! printed from their tokens, so formatting never changes the listing. `#[cfg(..)]` gates
//! are printed on their items (a module's on all it holds); `#[doc(hidden)]` items and
//! those of test, doctest and fuzzing builds are left out.
//!
//! On a difference the test prints the lines gone and the lines new; after a deliberate
//! change, `KP_BLESS_API=1 cargo test --release --test layers public_api` rewrites the file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use proc_macro2::{Delimiter, Spacing, TokenStream, TokenTree};
use quote::ToTokens;
use syn::{Attribute, Fields, ImplItem, Item, Meta, TraitItem, Type, UseTree, Visibility};

const CRATE: &str = "kube_persist";
const LISTING: &str = "docs/api.txt";
const HEADER: &str = "# kube-persist's public API, one item a line (tests/layers/api.rs).\n\
# Regenerate after a deliberate change: KP_BLESS_API=1 cargo test --release --test layers public_api\n";

/// One module of the crate: its path from the crate root, the `#[cfg]`s it is under, and
/// its items.
struct Module {
    path: Vec<String>,
    parent: Option<usize>,
    cfgs: Vec<String>,
    items: Vec<Item>,
}

/// What a name resolves to.
#[derive(Clone, Debug, PartialEq)]
enum Target {
    /// `items[1]` of module `0`.
    Item(usize, usize),
    Module(usize),
    /// A path outside the crate, as written.
    External(String),
}

struct Crate {
    modules: Vec<Module>,
}

/// Whether attributes leave an item out of the listing: `#[doc(hidden)]`, or a `cfg` of
/// test, doctest or fuzzing builds only.
fn excluded(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        let Meta::List(list) = &a.meta else {
            return false;
        };
        let words = idents(list.tokens.clone());
        (a.path().is_ident("doc") && words.iter().any(|w| w == "hidden"))
            || (a.path().is_ident("cfg")
                && !words.iter().any(|w| w == "not")
                && words
                    .iter()
                    .any(|w| ["test", "doctest", "fuzzing"].contains(&w.as_str())))
    })
}

/// The identifiers of a token stream, groups included (not the contents of literals).
fn idents(ts: TokenStream) -> Vec<String> {
    ts.into_iter()
        .flat_map(|tt| match tt {
            TokenTree::Ident(i) => vec![i.to_string()],
            TokenTree::Group(g) => idents(g.stream()),
            _ => vec![],
        })
        .collect()
}

fn cfgs(attrs: &[Attribute]) -> Vec<String> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("cfg"))
        .map(|a| format!("#[{}]", print(a.meta.to_token_stream())))
        .collect()
}

/// The attributes that are part of an item's API, printed.
fn api_attrs(attrs: &[Attribute]) -> String {
    attrs
        .iter()
        .filter(|a| {
            ["derive", "non_exhaustive", "must_use", "deprecated", "repr"]
                .iter()
                .any(|p| a.path().is_ident(p))
        })
        .map(|a| match &a.meta {
            Meta::Path(p) => format!("#[{}] ", print(p.to_token_stream())),
            m => format!("#[{}] ", print(m.to_token_stream())),
        })
        .collect()
}

fn is_pub(vis: &Visibility) -> bool {
    matches!(vis, Visibility::Public(_))
}

impl Crate {
    fn load(src: &Path) -> Crate {
        let mut krate = Crate {
            modules: Vec::new(),
        };
        let file = src.join("lib.rs");
        let items = parse(&file);
        krate.add(vec![], None, vec![], items, src.to_path_buf());
        krate
    }

    /// Add a module and, recursively, the modules it declares; `dir` is where the files of
    /// its child modules are.
    fn add(
        &mut self,
        path: Vec<String>,
        parent: Option<usize>,
        cfgs_: Vec<String>,
        items: Vec<Item>,
        dir: PathBuf,
    ) -> usize {
        let me = self.modules.len();
        self.modules.push(Module {
            path: path.clone(),
            parent,
            cfgs: cfgs_.clone(),
            items: items.clone(),
        });
        for item in &items {
            let Item::Mod(m) = item else { continue };
            if excluded(&m.attrs) {
                continue;
            }
            let name = m.ident.to_string();
            let mut child_path = path.clone();
            child_path.push(name.clone());
            let mut child_cfgs = cfgs_.clone();
            child_cfgs.extend(cfgs(&m.attrs));
            let child_dir = dir.join(&name);
            let child_items = match &m.content {
                Some((_, items)) => items.clone(),
                None => {
                    let flat = dir.join(format!("{name}.rs"));
                    let nested = child_dir.join("mod.rs");
                    parse(if flat.exists() { &flat } else { &nested })
                }
            };
            self.add(child_path, Some(me), child_cfgs, child_items, child_dir);
        }
        me
    }

    fn child(&self, m: usize, name: &str) -> Option<usize> {
        self.modules
            .iter()
            .position(|c| c.parent == Some(m) && c.path.last().map(String::as_str) == Some(name))
    }

    /// What `name` means in module `m`: an item, a child module or an import.
    fn lookup(&self, m: usize, name: &str, depth: usize) -> Vec<Target> {
        if depth > 16 {
            return vec![];
        }
        if let Some(c) = self.child(m, name) {
            return vec![Target::Module(c)];
        }
        let mut found = Vec::new();
        for (i, item) in self.modules[m].items.iter().enumerate() {
            if item_name(item).as_deref() == Some(name) && !excluded(item_attrs(item)) {
                found.push(Target::Item(m, i));
            }
        }
        if !found.is_empty() {
            return found;
        }
        for item in &self.modules[m].items {
            let Item::Use(u) = item else { continue };
            for (alias, segs, glob) in use_leaves(&u.tree) {
                if glob {
                    if let Some(Target::Module(g)) = self.resolve(m, &segs, depth + 1).first() {
                        let inner = self.lookup(*g, name, depth + 1);
                        if !inner.is_empty() {
                            return inner;
                        }
                    }
                } else if alias == name {
                    return self.resolve(m, &segs, depth + 1);
                }
            }
        }
        vec![]
    }

    /// A `use` path from module `m`.
    fn resolve(&self, m: usize, segs: &[String], depth: usize) -> Vec<Target> {
        let (mut at, rest) = match segs[0].as_str() {
            "crate" => (0, &segs[1..]),
            "self" => (m, &segs[1..]),
            "super" => {
                let mut at = m;
                let mut rest = segs;
                while rest.first().map(String::as_str) == Some("super") {
                    at = self.modules[at].parent.unwrap_or(0);
                    rest = &rest[1..];
                }
                (at, rest)
            }
            first => {
                if self.lookup(m, first, depth + 1).is_empty() {
                    return vec![Target::External(segs.join("::"))];
                }
                (m, segs)
            }
        };
        if rest.is_empty() {
            return vec![Target::Module(at)];
        }
        for (i, seg) in rest.iter().enumerate() {
            let found = self.lookup(at, seg, depth + 1);
            if i + 1 == rest.len() {
                return found;
            }
            match found.first() {
                Some(Target::Module(c)) => at = *c,
                Some(Target::External(p)) => {
                    return vec![Target::External(format!(
                        "{p}::{}",
                        rest[i + 1..].join("::")
                    ))];
                }
                _ => return vec![],
            }
        }
        vec![]
    }

    /// Every public line, by walking the crate's public paths from the root.
    fn listing(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        // Items listed, and the public paths they were listed at (for their impls).
        let mut at: Vec<(usize, usize, String)> = Vec::new();
        let root = vec![CRATE.to_string()];
        out.insert(format!("{CRATE}: crate"));
        self.walk(0, &root, &[], &mut out, &mut at, 0);
        self.impls(&at, &mut out);
        self.macros(&mut out);
        out
    }

    fn walk(
        &self,
        m: usize,
        prefix: &[String],
        outer_cfgs: &[String],
        out: &mut BTreeSet<String>,
        at: &mut Vec<(usize, usize, String)>,
        depth: usize,
    ) {
        if depth > 16 {
            return;
        }
        for (i, item) in self.modules[m].items.iter().enumerate() {
            if excluded(item_attrs(item)) {
                continue;
            }
            match item {
                Item::Mod(md) if is_pub(&md.vis) => {
                    let Some(c) = self.child(m, &md.ident.to_string()) else {
                        continue;
                    };
                    let path = join(prefix, &md.ident.to_string());
                    self.module_lines(c, &path, outer_cfgs, &md.attrs, out, at, depth);
                }
                Item::Use(u) if is_pub(&u.vis) => {
                    let mut use_cfgs = outer_cfgs.to_vec();
                    use_cfgs.extend(cfgs(&u.attrs));
                    for (alias, segs, glob) in use_leaves(&u.tree) {
                        let targets = self.resolve(m, &segs, 0);
                        if glob {
                            match targets.first() {
                                Some(Target::Module(g)) => {
                                    self.walk(*g, prefix, &use_cfgs, out, at, depth + 1)
                                }
                                _ => {
                                    out.insert(format!(
                                        "{}: {}pub use {}::*",
                                        prefix.join("::"),
                                        gates(&use_cfgs),
                                        segs.join("::")
                                    ));
                                }
                            }
                            continue;
                        }
                        let path = join(prefix, &alias);
                        for t in targets {
                            match t {
                                Target::Item(tm, ti) => {
                                    let mut c = use_cfgs.clone();
                                    c.extend(self.modules[tm].cfgs.iter().cloned());
                                    self.item_lines(tm, ti, &path, &c, out, at);
                                }
                                Target::Module(c) => {
                                    self.module_lines(c, &path, &use_cfgs, &[], out, at, depth)
                                }
                                Target::External(p) => {
                                    out.insert(format!(
                                        "{}: {}pub use {p}",
                                        path.join("::"),
                                        gates(&use_cfgs)
                                    ));
                                }
                            }
                        }
                    }
                }
                _ if item_vis(item).is_some_and(is_pub) => self.item_lines(
                    m,
                    i,
                    &join(prefix, &item_name(item).unwrap_or_default()),
                    outer_cfgs,
                    out,
                    at,
                ),
                _ => {}
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn module_lines(
        &self,
        c: usize,
        path: &[String],
        outer_cfgs: &[String],
        attrs: &[Attribute],
        out: &mut BTreeSet<String>,
        at: &mut Vec<(usize, usize, String)>,
        depth: usize,
    ) {
        let mut c_cfgs = outer_cfgs.to_vec();
        c_cfgs.extend(cfgs(attrs));
        c_cfgs.extend(self.modules[c].cfgs.iter().cloned());
        dedup(&mut c_cfgs);
        out.insert(format!(
            "{}: {}pub mod {}",
            path.join("::"),
            gates(&c_cfgs),
            path.last().unwrap()
        ));
        self.walk(c, path, &c_cfgs, out, at, depth + 1);
    }

    /// The lines of item `i` of module `m`, listed at `path`.
    fn item_lines(
        &self,
        m: usize,
        i: usize,
        path: &[String],
        outer_cfgs: &[String],
        out: &mut BTreeSet<String>,
        at: &mut Vec<(usize, usize, String)>,
    ) {
        let item = &self.modules[m].items[i];
        let mut c = outer_cfgs.to_vec();
        c.extend(cfgs(item_attrs(item)));
        dedup(&mut c);
        let p = path.join("::");
        let g = gates(&c);
        let attrs = api_attrs(item_attrs(item));
        let mut line = |sub: Option<&str>, text: String| {
            let key = match sub {
                Some(s) => format!("{p}::{s}"),
                None => p.clone(),
            };
            out.insert(format!("{key}: {g}{text}"));
        };
        match item {
            Item::Struct(s) => {
                let mut head = s.clone();
                head.attrs.clear();
                head.fields = Fields::Unit;
                head.semi_token = Some(Default::default());
                let mut text = print(head.to_token_stream());
                text = strip_body(&text);
                match &s.fields {
                    Fields::Named(named) => {
                        let private = named.named.iter().any(|f| !is_pub(&f.vis));
                        text.push_str(if private { " { .. }" } else { " { }" });
                        for f in named.named.iter().filter(|f| is_pub(&f.vis)) {
                            if excluded(&f.attrs) {
                                continue;
                            }
                            let name = f.ident.as_ref().unwrap().to_string();
                            line(
                                Some(&name),
                                format!(
                                    "{}{}pub {name}: {}",
                                    gates(&cfgs(&f.attrs)),
                                    api_attrs(&f.attrs),
                                    print(f.ty.to_token_stream())
                                ),
                            );
                        }
                    }
                    Fields::Unnamed(unnamed) => {
                        let fields: Vec<String> = unnamed
                            .unnamed
                            .iter()
                            .map(|f| {
                                if is_pub(&f.vis) {
                                    format!("pub {}", print(f.ty.to_token_stream()))
                                } else {
                                    "_".to_string()
                                }
                            })
                            .collect();
                        text.push_str(&format!("({})", fields.join(", ")));
                    }
                    Fields::Unit => {}
                }
                line(None, format!("{attrs}{text}"));
            }
            Item::Enum(e) => {
                let mut head = e.clone();
                head.attrs.clear();
                head.variants.clear();
                let text = print(head.to_token_stream());
                line(None, format!("{attrs}{}", strip_body(&text)));
                for v in &e.variants {
                    if excluded(&v.attrs) {
                        continue;
                    }
                    let mut v = v.clone();
                    let vattrs = api_attrs(&v.attrs);
                    let vg = gates(&cfgs(&v.attrs));
                    v.attrs.clear();
                    for f in v.fields.iter_mut() {
                        f.attrs.clear();
                    }
                    line(
                        Some(&v.ident.to_string()),
                        format!("{vg}{vattrs}{}", print(v.to_token_stream())),
                    );
                }
            }
            Item::Trait(t) => {
                let mut head = t.clone();
                head.attrs.clear();
                head.items.clear();
                let text = print(head.to_token_stream());
                line(None, format!("{attrs}{}", strip_body(&text)));
                for ti in &t.items {
                    let (name, text, attrs) = match ti {
                        TraitItem::Fn(f) => {
                            let provided = if f.default.is_some() {
                                " (provided)"
                            } else {
                                ""
                            };
                            (
                                f.sig.ident.to_string(),
                                format!("{}{provided}", signature(&f.sig)),
                                &f.attrs,
                            )
                        }
                        TraitItem::Type(ty) => {
                            let mut bare = ty.clone();
                            bare.attrs.clear();
                            bare.default = None;
                            (
                                ty.ident.to_string(),
                                strip_body(&print(bare.to_token_stream())),
                                &ty.attrs,
                            )
                        }
                        TraitItem::Const(k) => (
                            k.ident.to_string(),
                            format!("const {}: {}", k.ident, print(k.ty.to_token_stream())),
                            &k.attrs,
                        ),
                        _ => continue,
                    };
                    if excluded(attrs) {
                        continue;
                    }
                    line(Some(&name), format!("{}{text}", gates(&cfgs(attrs))));
                }
            }
            Item::Fn(f) => line(None, format!("{attrs}pub {}", signature(&f.sig))),
            Item::Const(k) => line(
                None,
                format!("pub const {}: {}", k.ident, print(k.ty.to_token_stream())),
            ),
            Item::Static(s) => line(
                None,
                format!("pub static {}: {}", s.ident, print(s.ty.to_token_stream())),
            ),
            Item::Type(t) => {
                let mut t = t.clone();
                t.attrs.clear();
                line(None, strip_body(&print(t.to_token_stream())));
            }
            _ => {}
        }
        at.push((m, i, p));
    }

    /// Impl blocks of the listed types, wherever they are: inherent ones with their public
    /// methods, trait impls whole.
    fn impls(&self, at: &[(usize, usize, String)], out: &mut BTreeSet<String>) {
        for (m, module) in self.modules.iter().enumerate() {
            for item in &module.items {
                let Item::Impl(imp) = item else { continue };
                if excluded(&imp.attrs) {
                    continue;
                }
                let Type::Path(tp) = &*imp.self_ty else {
                    continue;
                };
                let segs: Vec<String> = tp
                    .path
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                let targets = if segs.len() == 1 {
                    self.lookup(m, &segs[0], 0)
                } else {
                    self.resolve(m, &segs, 0)
                };
                let mut impl_cfgs = module.cfgs.clone();
                impl_cfgs.extend(cfgs(&imp.attrs));
                let mut head = imp.clone();
                head.attrs.clear();
                head.items.clear();
                let head = strip_body(&print(head.to_token_stream()));
                for t in targets {
                    let Target::Item(tm, ti) = t else { continue };
                    for (_, _, path) in at.iter().filter(|(a, b, _)| (*a, *b) == (tm, ti)) {
                        out.insert(format!("{path}: {}{head}", gates(&impl_cfgs)));
                        if imp.trait_.is_some() {
                            continue;
                        }
                        for ii in &imp.items {
                            let ImplItem::Fn(f) = ii else { continue };
                            if !is_pub(&f.vis) || excluded(&f.attrs) {
                                continue;
                            }
                            let mut c = impl_cfgs.clone();
                            c.extend(cfgs(&f.attrs));
                            out.insert(format!(
                                "{path}::{}: {}{}pub {}",
                                f.sig.ident,
                                gates(&c),
                                api_attrs(&f.attrs),
                                signature(&f.sig)
                            ));
                        }
                    }
                }
            }
        }
    }

    /// `#[macro_export]` macros, at the crate root wherever they are defined.
    fn macros(&self, out: &mut BTreeSet<String>) {
        for module in &self.modules {
            for item in &module.items {
                let Item::Macro(mac) = item else { continue };
                if excluded(&mac.attrs)
                    || !mac.attrs.iter().any(|a| a.path().is_ident("macro_export"))
                {
                    continue;
                }
                if let Some(name) = &mac.ident {
                    out.insert(format!(
                        "{CRATE}::{name}: {}macro_rules! {name}",
                        gates(&module.cfgs)
                    ));
                }
            }
        }
    }
}

fn dedup(v: &mut Vec<String>) {
    let mut seen = BTreeSet::new();
    v.retain(|c| seen.insert(c.clone()));
}

fn gates(cfgs: &[String]) -> String {
    let mut v = cfgs.to_vec();
    dedup(&mut v);
    v.iter().map(|c| format!("{c} ")).collect()
}

fn join(prefix: &[String], name: &str) -> Vec<String> {
    let mut p = prefix.to_vec();
    p.push(name.to_string());
    p
}

/// A signature without the bindings' `mut` (`mut self`, `mut x: T`), which is the body's
/// business, not the caller's.
fn signature(sig: &syn::Signature) -> String {
    let mut sig = sig.clone();
    for arg in sig.inputs.iter_mut() {
        match arg {
            syn::FnArg::Receiver(r) => r.mutability = None,
            syn::FnArg::Typed(t) => {
                if let syn::Pat::Ident(p) = &mut *t.pat {
                    p.mutability = None;
                }
            }
        }
    }
    print(sig.to_token_stream())
}

/// `... {}` or `... ;` without the empty body.
fn strip_body(text: &str) -> String {
    text.trim_end()
        .trim_end_matches(';')
        .trim_end_matches("{}")
        .trim_end()
        .trim_end_matches(',')
        .to_string()
}

fn parse(file: &Path) -> Vec<Item> {
    let src = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    syn::parse_file(&src)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .items
}

fn item_name(item: &Item) -> Option<String> {
    Some(match item {
        Item::Struct(i) => i.ident.to_string(),
        Item::Enum(i) => i.ident.to_string(),
        Item::Trait(i) => i.ident.to_string(),
        Item::Fn(i) => i.sig.ident.to_string(),
        Item::Const(i) => i.ident.to_string(),
        Item::Static(i) => i.ident.to_string(),
        Item::Type(i) => i.ident.to_string(),
        Item::Union(i) => i.ident.to_string(),
        Item::Mod(i) => i.ident.to_string(),
        _ => return None,
    })
}

fn item_vis(item: &Item) -> Option<&Visibility> {
    Some(match item {
        Item::Struct(i) => &i.vis,
        Item::Enum(i) => &i.vis,
        Item::Trait(i) => &i.vis,
        Item::Fn(i) => &i.vis,
        Item::Const(i) => &i.vis,
        Item::Static(i) => &i.vis,
        Item::Type(i) => &i.vis,
        Item::Union(i) => &i.vis,
        _ => return None,
    })
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Struct(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::Const(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        _ => &[],
    }
}

/// The leaves of a `use` tree: (the name it binds, the path, whether a glob).
fn use_leaves(tree: &UseTree) -> Vec<(String, Vec<String>, bool)> {
    fn go(tree: &UseTree, prefix: &mut Vec<String>, out: &mut Vec<(String, Vec<String>, bool)>) {
        match tree {
            UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                go(&p.tree, prefix, out);
                prefix.pop();
            }
            UseTree::Name(n) => {
                let name = n.ident.to_string();
                if name == "self" {
                    let alias = prefix.last().cloned().unwrap_or_default();
                    out.push((alias, prefix.clone(), false));
                } else {
                    out.push((name.clone(), join(prefix, &name), false));
                }
            }
            UseTree::Rename(r) => {
                let alias = r.rename.to_string();
                if alias != "_" {
                    let name = r.ident.to_string();
                    let path = if name == "self" {
                        prefix.clone()
                    } else {
                        join(prefix, &name)
                    };
                    out.push((alias, path, false));
                }
            }
            UseTree::Glob(_) => out.push((String::new(), prefix.clone(), true)),
            UseTree::Group(g) => {
                for t in &g.items {
                    go(t, prefix, out);
                }
            }
        }
    }
    let mut out = Vec::new();
    go(tree, &mut Vec::new(), &mut out);
    out
}

/// Tokens as a line of Rust, spaced as rustfmt would in a signature, whatever the
/// source's formatting; trailing commas dropped.
fn print(ts: TokenStream) -> String {
    let mut out = String::new();
    print_into(ts, &mut out);
    out
}

fn print_into(ts: TokenStream, out: &mut String) {
    let tokens: Vec<TokenTree> = ts.into_iter().collect();
    // The previous token: its text, and whether it was a punct joined to this one.
    let mut prev: Option<(String, bool)> = None;
    let mut path_sep = false;
    for (k, tt) in tokens.iter().enumerate() {
        let last = k + 1 == tokens.len();
        let (text, joint) = match tt {
            TokenTree::Punct(p) => (p.as_char().to_string(), p.spacing() == Spacing::Joint),
            TokenTree::Ident(i) => (i.to_string(), false),
            TokenTree::Literal(l) => (l.to_string(), false),
            TokenTree::Group(_) => (String::new(), false),
        };
        if last && text == "," {
            break;
        }
        let space = match &prev {
            None => false,
            Some((_, true)) => false,
            Some((p, false)) => {
                let after_sep = std::mem::take(&mut path_sep);
                !(after_sep
                    || p == "&"
                    || p == "#"
                    || p == "<"
                    || p == "?"
                    || p == "!"
                    || (p == "*" && text != "=")
                    || matches!(text.as_str(), "," | ";" | "." | ">")
                    || (text == "?" && (word(p) || p == ")" || p == ">"))
                    || (text == ":" && joint)
                    || (text == ":" && !joint && p != ":")
                    || (text == "<" && word(p))
                    || (text == "!" && word(p))
                    || matches!(tt, TokenTree::Group(g) if g.delimiter() != Delimiter::Brace
                        && (word(p) || p == ">" || p == "#")))
            }
        };
        if space {
            out.push(' ');
        }
        if let TokenTree::Punct(p) = tt
            && p.as_char() == ':'
            && prev.as_ref().is_some_and(|(t, j)| t == ":" && *j)
        {
            path_sep = true;
        }
        match tt {
            TokenTree::Group(g) => {
                let (open, close) = match g.delimiter() {
                    Delimiter::Parenthesis => ("(", ")"),
                    Delimiter::Bracket => ("[", "]"),
                    Delimiter::Brace => ("{ ", " }"),
                    Delimiter::None => ("", ""),
                };
                let mut inner = String::new();
                print_into(g.stream(), &mut inner);
                if inner.is_empty() {
                    out.push_str(open.trim());
                    out.push_str(close.trim());
                } else {
                    out.push_str(open);
                    out.push_str(&inner);
                    out.push_str(close);
                }
                prev = Some((close.trim().to_string(), false));
            }
            _ => {
                out.push_str(&text);
                prev = Some((text, joint));
            }
        }
    }
    // `<K, V,>` from a trailing comma in generics.
    while out.contains(",>") {
        *out = out.replace(",>", ">");
    }
}

/// Whether printed text is an identifier or a keyword (or a literal's digits).
fn word(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_alphanumeric() || c == '_')
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn listing_text() -> String {
    let krate = Crate::load(&root().join("src"));
    let mut text = HEADER.to_string();
    for line in krate.listing() {
        text.push_str(&line);
        text.push('\n');
    }
    text
}

/// `docs/api.txt` is the public API as the source defines it.
#[test]
fn public_api_is_docs_api_txt() {
    let now = listing_text();
    let file = root().join(LISTING);
    if std::env::var_os("KP_BLESS_API").is_some_and(|v| v == "1") {
        std::fs::write(&file, &now).unwrap();
        return;
    }
    let held = std::fs::read_to_string(&file).unwrap_or_default();
    if held == now {
        return;
    }
    let (held_lines, now_lines): (BTreeSet<&str>, BTreeSet<&str>) =
        (held.lines().collect(), now.lines().collect());
    let mut msg = format!(
        "the public API differs from {LISTING} (- in the file, not in the source; + new in the source):\n"
    );
    for l in held_lines.difference(&now_lines) {
        msg.push_str(&format!("- {l}\n"));
    }
    for l in now_lines.difference(&held_lines) {
        msg.push_str(&format!("+ {l}\n"));
    }
    msg.push_str(
        "If the change is deliberate (and named in CHANGELOG.md), rewrite the file:\n  \
         KP_BLESS_API=1 cargo test --release --test layers public_api\n",
    );
    panic!("{msg}");
}

/// The printer spaces tokens as a signature is written, whatever the source's layout, and
/// the walk resolves re-exports, globs, gates and hidden items.
#[test]
fn public_api_listing_reads_what_it_should() {
    let sig: syn::Signature = syn::parse_str(
        "pub async fn get_named<'a, K: Resource + ?Sized,>(\n  &self,\n namespace: Option<&'a str>,\n f: impl Fn(&K) -> Vec<String>,\n) -> Result<Option<Arc<K>>, crate::Error> where K::DynamicType: Clone",
    )
    .or_else(|_| {
        syn::parse_str::<syn::ItemFn>(
            "pub async fn get_named<'a, K: Resource + ?Sized,>(\n  &self,\n namespace: Option<&'a str>,\n f: impl Fn(&K) -> Vec<String>,\n) -> Result<Option<Arc<K>>, crate::Error> where K::DynamicType: Clone {}",
        )
        .map(|f| f.sig)
    })
    .unwrap();
    assert_eq!(
        signature(&sig),
        "async fn get_named<'a, K: Resource + ?Sized>(&self, namespace: Option<&'a str>, f: impl Fn(&K) -> Vec<String>) -> Result<Option<Arc<K>>, crate::Error> where K::DynamicType: Clone"
    );
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir_all(src.join("inner")).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "mod inner;\npub mod open;\n#[cfg(feature = \"m\")]\npub mod gated { pub fn g() {} }\n\
         #[cfg(any(fuzzing, test))]\npub mod fuzz { pub fn f() {} }\n\
         pub use inner::{Thing, Kind as Sort};\npub use inner::deep::*;\npub use kube::runtime::reflector::ObjectRef;\n",
    )
    .unwrap();
    std::fs::write(
        src.join("inner/mod.rs"),
        "pub mod deep;\n#[derive(Debug, Clone)]\n#[non_exhaustive]\npub struct Thing<K> { pub a: u32, b: K }\n\
         impl<K> Thing<K> { pub fn a(&self) -> u32 { self.a } pub fn m(mut self, mut n: u8) -> Self { self } pub(crate) fn no(&self) {} #[doc(hidden)] pub fn hid(&self) {} }\n\
         impl<K: Clone> From<K> for Thing<K> { fn from(k: K) -> Self { todo!() } }\n\
         pub enum Kind { A, B { x: u8 }, #[doc(hidden)] C }\n",
    )
    .unwrap();
    std::fs::write(
        src.join("inner/deep.rs"),
        "pub const N: usize = 3;\npub(crate) fn hidden() {}\n",
    )
    .unwrap();
    std::fs::write(
        src.join("open.rs"),
        "pub trait T: Send { fn f(&self) -> u8; fn g(&self) {} }\n",
    )
    .unwrap();
    let listing: Vec<String> = Crate::load(src).listing().into_iter().collect();
    assert_eq!(
        listing,
        [
            "kube_persist: crate",
            "kube_persist::N: pub const N: usize",
            "kube_persist::ObjectRef: pub use kube::runtime::reflector::ObjectRef",
            "kube_persist::Sort: pub enum Kind",
            "kube_persist::Sort::A: A",
            "kube_persist::Sort::B: B { x: u8 }",
            "kube_persist::Thing: #[derive(Debug, Clone)] #[non_exhaustive] pub struct Thing<K> { .. }",
            "kube_persist::Thing: impl<K: Clone> From<K> for Thing<K>",
            "kube_persist::Thing: impl<K> Thing<K>",
            "kube_persist::Thing::a: pub a: u32",
            "kube_persist::Thing::a: pub fn a(&self) -> u32",
            "kube_persist::Thing::m: pub fn m(self, n: u8) -> Self",
            "kube_persist::gated: #[cfg(feature = \"m\")] pub mod gated",
            "kube_persist::gated::g: #[cfg(feature = \"m\")] pub fn g()",
            "kube_persist::open: pub mod open",
            "kube_persist::open::T: pub trait T: Send",
            "kube_persist::open::T::f: fn f(&self) -> u8",
            "kube_persist::open::T::g: fn g(&self) (provided)",
        ]
        .map(String::from)
        .to_vec()
    );
}
