//! The lookup bench (`benches/lookup.rs`) with mimalloc as the global allocator, for the
//! comparison with glibc's malloc:
//!
//! ```text
//! cargo bench --bench lookup_mimalloc [-- --pods 100000] [--engine sled|redb]
//! ```

#[path = "lookup.rs"]
mod lookup;

fn main() {
    lookup::main();
}
