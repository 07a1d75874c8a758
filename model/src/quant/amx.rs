//! AMX's tile unit for the repacked products' prompt rows ([`packed`](super::packed)'s
//! 32-element types, [`kpacked`](super::kpacked)'s K-quants): the tile configuration every
//! AMX kernel of the crate shares, and the products, in inline assembly (Rust has no stable
//! AMX intrinsics; the instructions need no target feature to assemble, only a CPU that has
//! them: callers run where [`crate::simd::cpu_has_amx`] holds; the products run on the
//! `amx` kernel path only, [`crate::simd::amx`]).
//!
//! A product is `tdpbsud` (signed A bytes times unsigned B bytes, summed in fours into the
//! 32-bit lanes of C): A is sixteen activation rows' quants of one 32-element block (read in
//! place, a row stride apart), B a block of sixteen weight rows in the repacked layouts'
//! order (vector `i`: elements `4i..4i + 4` of each row, four bytes per row: eight rows of 64
//! bytes), C the 16 × 16 integer sums, stored to memory for the vector units to scale.
//!
//! Tile registers ([`CONFIG`], palette 1, loaded once per thread): `tmm0`, `tmm1` sums (16
//! rows of 64 bytes), `tmm2`, `tmm3` weights (8 rows of 64 bytes), `tmm4`, `tmm5` activations
//! (16 rows of 32 bytes). Every AMX kernel uses this one configuration, so a thread that has
//! loaded it never loads another.

use std::arch::asm;
use std::cell::Cell;

use super::QK;

/// Activation rows per product: an A tile's rows.
pub(crate) const ROWS: usize = 16;

/// The tile configuration (`ldtilecfg`'s 64-byte operand): palette 1; bytes 16 + 2t hold
/// tile `t`'s row width in bytes, byte 48 + t its rows.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    // (tile, rows, bytes per row): sums, weights, activations.
    let shapes = [
        (0, 16, 64),
        (1, 16, 64),
        (2, 8, 64),
        (3, 8, 64),
        (4, 16, QK),
        (5, 16, QK),
    ];
    let mut i = 0;
    while i < shapes.len() {
        let (t, rows, bytes) = shapes[i];
        c[16 + 2 * t] = bytes as u8;
        c[48 + t] = rows as u8;
        i += 1;
    }
    TileConfig(c)
};

thread_local! {
    /// Whether this thread has loaded [`CONFIG`] (the OS keeps it with the thread's state).
    static CONFIGURED: Cell<bool> = const { Cell::new(false) };
}

/// Loads [`CONFIG`] into this thread's tile state, once.
pub(crate) fn configure() {
    CONFIGURED.with(|done| {
        if !done.get() {
            // SAFETY: `CONFIG` is a valid palette-1 configuration (64 bytes, aligned); the
            // caller runs only where `crate::simd::cpu_has_amx()` holds (the CPU has AMX and
            // the process was granted the tile state).
            unsafe {
                asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly))
            };
            done.set(true);
        }
    });
}

/// A 64-byte-aligned buffer: two blocks' decoded weights, or two blocks' sums.
#[repr(C, align(64))]
pub(crate) struct Buf<const N: usize>(pub(crate) [u8; N]);

/// `tdpbsud` of two blocks: sums of `a0`·`w0` into `c0` and `a1`·`w1` into `c1` (each
/// 16 × 16 i32, rows 64 bytes apart).
///
/// # Safety
/// [`configure`] ran on this thread; `a0`/`a1` point at 16 rows of 32 readable bytes,
/// `a_stride` apart; `w0`/`w1` at 8 rows of 64 readable bytes, contiguous; `c0`/`c1` at 1
/// KiB writable each.
#[inline]
pub(crate) unsafe fn products2(
    a0: *const u8,
    a1: *const u8,
    a_stride: usize,
    w0: *const u8,
    w1: *const u8,
    c0: *mut u8,
    c1: *mut u8,
) {
    // SAFETY: the caller's contract covers every address the tile loads and stores touch.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm2, [{w0} + {sw}*1]",
            "tdpbsud tmm0, tmm4, tmm2",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm3, [{w1} + {sw}*1]",
            "tdpbsud tmm1, tmm5, tmm3",
            "tilestored [{c0} + {sw}*1], tmm0",
            "tilestored [{c1} + {sw}*1], tmm1",
            a0 = in(reg) a0,
            a1 = in(reg) a1,
            sa = in(reg) a_stride,
            w0 = in(reg) w0,
            w1 = in(reg) w1,
            sw = in(reg) 64usize,
            c0 = in(reg) c0,
            c1 = in(reg) c1,
            options(nostack),
        );
    }
}

/// [`products2`] of one block.
///
/// # Safety
/// As [`products2`]'s, for `a0`, `w0`, `c0`.
#[inline]
pub(crate) unsafe fn products1(a0: *const u8, a_stride: usize, w0: *const u8, c0: *mut u8) {
    // SAFETY: the caller's contract covers every address the tile loads and stores touch.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm2, [{w0} + {sw}*1]",
            "tdpbsud tmm0, tmm4, tmm2",
            "tilestored [{c0} + {sw}*1], tmm0",
            a0 = in(reg) a0,
            sa = in(reg) a_stride,
            w0 = in(reg) w0,
            sw = in(reg) 64usize,
            c0 = in(reg) c0,
            options(nostack),
        );
    }
}
