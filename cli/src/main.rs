//! `kube-persist`: look inside, check, measure and remove kube-persist store directories.
//! The commands are the package's library ([`kube_persist_cli::main_from_args`]), which a
//! controller can also ship in its own binary.

#![deny(unsafe_code)]

fn main() -> std::process::ExitCode {
    kube_persist_cli::main_from_args(std::env::args_os())
}
