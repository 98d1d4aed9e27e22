//! The memory bench (`benches/memory.rs`) with mimalloc as the global allocator, for the
//! comparison with glibc's malloc:
//!
//! ```text
//! cargo bench --bench memory_mimalloc -- --streams 20 [--engine sled|redb]
//! ```

#[path = "memory.rs"]
mod memory;

fn main() {
    memory::main();
}
