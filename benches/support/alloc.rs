//! The benches' global allocator: glibc's malloc, or mimalloc in a bench target whose name
//! ends in `_mimalloc` (`lookup_mimalloc`, `memory_mimalloc`: the same bench built with the
//! other allocator). The choice is made at compile time from the crate's name; the child
//! processes a bench re-executes are the same binary, so they use the same allocator. It can
//! also count the live bytes Rust code allocated ([`count_live_bytes`], off by default).

use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

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

/// Whether [`live_bytes`] counts: off unless [`count_live_bytes`] turned it on (the soak's
/// `SOAK_HEAP=1`), so that the other benches pay one relaxed load per call.
static COUNTING: AtomicBool = AtomicBool::new(false);
/// Bytes allocated and not yet freed since counting was turned on (frees of what was
/// allocated before count too, so it may be off by what the process had allocated then).
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// Turns on the count of [`live_bytes`]; call it first thing, before the process allocates.
pub fn count_live_bytes() {
    COUNTING.store(true, Ordering::Relaxed);
}

/// The bytes allocated through the global allocator and not freed since [`count_live_bytes`]
/// (what Rust code asked for, without the allocator's overhead); 0 when not counting.
pub fn live_bytes() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn count(delta: isize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

struct Allocator;

// SAFETY: every call is forwarded to one allocator, the same one for the whole process.
unsafe impl std::alloc::GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe {
            if MIMALLOC {
                mimalloc::MiMalloc.alloc(layout)
            } else {
                std::alloc::System.alloc(layout)
            }
        };
        if !ptr.is_null() {
            count(layout.size() as isize);
        }
        ptr
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
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        // SAFETY: as above.
        let new = unsafe {
            if MIMALLOC {
                mimalloc::MiMalloc.realloc(ptr, layout, size)
            } else {
                std::alloc::System.realloc(ptr, layout, size)
            }
        };
        if !new.is_null() {
            count(size as isize - layout.size() as isize);
        }
        new
    }
}

#[global_allocator]
static GLOBAL: Allocator = Allocator;
