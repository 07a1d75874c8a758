//! The process heap under the compute buffers.
//!
//! Every matrix product, norm and activation of a forward pass returns a fresh buffer: for a
//! prefill of 512 tokens through Qwen2.5-1.5B's FFN that is 18 MB per product, for a decode
//! step of eight sequences a few hundred KB, the vocabulary's logits 0.6 MB per row. glibc's
//! `malloc` serves a request above its mmap threshold (128 KiB at start, then raised to the
//! largest block freed, up to 32 MiB) with fresh pages from the kernel, which faults in and
//! zeroes every 4 KiB page at its first write, and it gives the free top of its heap back to
//! the kernel past a trim threshold (twice the mmap threshold), so the next buffer faults
//! again. `perf` of a 1.5B prefill (2026-11-29, Zen 5): page faults, page clearing and
//! unmapping ~8 % of the samples, a third of them inside the products' stores.
//!
//! [`tune_heap`] fixes both thresholds instead: blocks up to 32 MiB come from the heap, and
//! freed memory stays there for the next pass (the process keeps its peak heap resident, as
//! a server wants its working set). Measured on the same VM: prefill +29 % on the 1.5B
//! (267-278 → 348-356 tokens/s), +40 % on Qwen2.5-0.5B, SmolLM2 and decoding unchanged
//! (docs/BENCHMARKS.md, "The heap under the compute buffers").

/// The mmap threshold: glibc's largest (`DEFAULT_MMAP_THRESHOLD_MAX` on 64-bit targets).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;

/// The trim threshold: free memory at the heap's top kept up to 1 GiB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = 1 << 30;

/// Keeps compute buffers on the heap (module docs). Call it early in `main`; it does nothing
/// where the C library is not glibc, or when `GLIBC_TUNABLES` already sets a malloc
/// parameter (the user's choice stands). Returns whether it changed the thresholds.
pub fn tune_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
            return false;
        }
        // SAFETY: `mallopt` changes two allocator parameters under the allocator's own lock;
        // both values are within the ranges glibc accepts (it returns 0 otherwise, and the
        // parameters keep their defaults).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_thresholds() {
        // A user's malloc tunables would make it step aside; the test environment sets none.
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
            return;
        }
        assert!(super::tune_heap(), "mallopt refused a threshold");
    }
}
