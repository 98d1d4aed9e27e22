//! The benches' global allocator: glibc's malloc, or mimalloc in a bench target whose name
//! ends in `_mimalloc` (`lookup_mimalloc`, `memory_mimalloc`: the same bench built with the
//! other allocator). The choice is made at compile time from the crate's name; the child
//! processes a bench re-executes are the same binary, so they use the same allocator.

/// Whether this binary's global allocator is mimalloc (a bench whose name ends in
/// `_mimalloc`) rather than glibc's malloc (the system allocator).
pub const MIMALLOC: bool = ends_with(env!("CARGO_CRATE_NAME").as_bytes(), b"_mimalloc");

/// The allocator's name, as the benches print it (`allocator=`).
pub const NAME: &str = if MIMALLOC { "mimalloc" } else { "glibc" };

const fn ends_with(a: &[u8], b: &[u8]) -> bool {
    if a.len() < b.len() {
        return false;
    }
    let (mut i, skip) = (0, a.len() - b.len());
    while i < b.len() {
        if a[skip + i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

struct Allocator;

// SAFETY: every call is forwarded to one allocator, the same one for the whole process.
unsafe impl std::alloc::GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            if MIMALLOC {
                mimalloc::MiMalloc.alloc(layout)
            } else {
                std::alloc::System.alloc(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from the same allocator's `alloc`.
        unsafe {
            if MIMALLOC {
                mimalloc::MiMalloc.dealloc(ptr, layout)
            } else {
                std::alloc::System.dealloc(ptr, layout)
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        // SAFETY: as above.
        unsafe {
            if MIMALLOC {
                mimalloc::MiMalloc.realloc(ptr, layout, size)
            } else {
                std::alloc::System.realloc(ptr, layout, size)
            }
        }
    }
}

#[global_allocator]
static GLOBAL: Allocator = Allocator;
