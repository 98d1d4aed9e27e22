//! The testkit server's API semantics over real HTTP with kube's clients, one module per
//! subject, in one test binary (one link instead of seven): CRUD, LIST paging and
//! `resourceVersionMatch`, request options, error statuses, validation, WATCH, and
//! kube-runtime's reflector against it. `cargo test -p kube-persist-testkit --test api
//! watch::` runs one module. The comparison with a real kube-apiserver is `differential`.

mod common;

mod crud;
mod errors;
mod list;
mod options;
mod reflector;
mod validation;
mod watch;
