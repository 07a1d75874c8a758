//! Which instruction sets the CPU kernels use, and small SIMD helpers they share
//! ([`crate::quant`], [`crate::attention`], [`crate::rope`]).
//!
//! Every kernel family picks its fastest path at run time from what the CPU has, limited by
//! the process's [`KernelPath`] (`model.kernels`): `auto` takes the best the CPU has,
//! `amx` is the AVX-512 path with AMX tile products for prompts (Intel Xeon since Sapphire
//! Rapids; opt-in: measured slower than the VNNI kernels so far, docs/BENCHMARKS.md),
//! `avx512` the AVX-512 path without them, `avx2` keeps every kernel off AVX-512 and
//! AVX-VNNI (so the AVX2 path, which CPUs without
//! AVX-512 run, can be measured on a machine that has both), `avxvnni` off AVX-512 but with
//! AVX-VNNI's 256-bit integer dot products (the path of Intel's cores since Alder Lake, which
//! have no AVX-512), `portable` keeps them on the plain loops the SIMD kernels are tested
//! against. The path is read from `RAGKV__MODEL__KERNELS` when no
//! program set it; weights repacked at load keep the layout of the path they were loaded
//! under, so set it before loading a model.

use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction sets the CPU kernels may use (`model.kernels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelPath {
    /// The best this CPU has.
    #[default]
    Auto,
    /// AVX-512 (VNNI for the repacked products), with AMX tile products for prompts' rows
    /// (`tdpbsud`, sixteen rows by sixteen per instruction); the CPU must have AMX-INT8 and
    /// the OS must grant the process the tile state. Never picked by `auto`: on the one AMX
    /// CPU measured (a 2-vCPU Emerald Rapids VM) the tile kernels ran prompts ~10-15 %
    /// slower than the VNNI kernels (docs/BENCHMARKS.md); the results are the same bits.
    Amx,
    /// AVX-512 (VNNI for the repacked products), never AMX; the CPU must have it.
    Avx512,
    /// AVX2 + FMA + F16C, never AVX-512 or AVX-VNNI; the CPU must have them.
    Avx2,
    /// The AVX2 path with AVX-VNNI (`vpdpbusd` on 256-bit vectors) for the repacked
    /// products, never AVX-512; the CPU must have them.
    AvxVnni,
    /// No SIMD kernels: the portable loops.
    Portable,
}

impl KernelPath {
    /// The setting's name (`auto`, `avx512`, `avxvnni`, `avx2`, `portable`).
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Auto => "auto",
            KernelPath::Amx => "amx",
            KernelPath::Avx512 => "avx512",
            KernelPath::Avx2 => "avx2",
            KernelPath::AvxVnni => "avxvnni",
            KernelPath::Portable => "portable",
        }
    }

    fn code(self) -> u8 {
        match self {
            KernelPath::Auto => 1,
            KernelPath::Avx512 => 2,
            KernelPath::Avx2 => 3,
            KernelPath::Portable => 4,
            KernelPath::AvxVnni => 5,
            KernelPath::Amx => 6,
        }
    }

    fn from_code(c: u8) -> Option<KernelPath> {
        Some(match c {
            1 => KernelPath::Auto,
            2 => KernelPath::Avx512,
            3 => KernelPath::Avx2,
            4 => KernelPath::Portable,
            5 => KernelPath::AvxVnni,
            6 => KernelPath::Amx,
            _ => return None,
        })
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            KernelPath::Auto | KernelPath::Portable => true,
            KernelPath::Amx => cpu_has_amx(),
            KernelPath::Avx512 => cpu_has_avx512(),
            KernelPath::Avx2 => cpu_has_avx2(),
            KernelPath::AvxVnni => cpu_has_avx_vnni(),
        }
    }

    /// What `auto` means on this CPU.
    pub fn resolved(self) -> KernelPath {
        match self {
            KernelPath::Auto if cpu_has_avx512() => KernelPath::Avx512,
            KernelPath::Auto if cpu_has_avx_vnni() => KernelPath::AvxVnni,
            KernelPath::Auto if cpu_has_avx2() => KernelPath::Avx2,
            KernelPath::Auto => KernelPath::Portable,
            other => other,
        }
    }
}

impl std::str::FromStr for KernelPath {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<KernelPath> {
        Ok(match s {
            "auto" | "" => KernelPath::Auto,
            "amx" => KernelPath::Amx,
            "avx512" => KernelPath::Avx512,
            "avx2" => KernelPath::Avx2,
            "avxvnni" => KernelPath::AvxVnni,
            "portable" => KernelPath::Portable,
            other => {
                return Err(crate::Error::Config {
                    why: format!(
                        "kernel path {other:?} (auto, amx, avx512, avxvnni, avx2, portable)"
                    ),
                })
            }
        })
    }
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The environment variable read when no program set the path.
pub const KERNELS_ENV: &str = "RAGKV__MODEL__KERNELS";

/// 0: not set yet (read [`KERNELS_ENV`] on first use); else [`KernelPath::code`].
static PATH: AtomicU8 = AtomicU8::new(0);

/// Sets the process's kernel path; fails if this CPU cannot run it.
pub fn set_kernel_path(path: KernelPath) -> crate::Result<()> {
    if !path.supported() {
        return Err(crate::Error::Unsupported {
            what: format!("kernel path {path}: this CPU lacks its instruction set"),
        });
    }
    PATH.store(path.code(), Ordering::Relaxed);
    Ok(())
}

/// The process's kernel path (as set, or from [`KERNELS_ENV`], else `auto`). An unusable
/// value in the environment is reported once and ignored.
pub fn kernel_path() -> KernelPath {
    if let Some(p) = KernelPath::from_code(PATH.load(Ordering::Relaxed)) {
        return p;
    }
    let from_env = std::env::var(KERNELS_ENV).ok().map(|v| {
        v.parse::<KernelPath>().and_then(|p| {
            if p.supported() {
                Ok(p)
            } else {
                Err(crate::Error::Unsupported {
                    what: format!("kernel path {p} on this CPU"),
                })
            }
        })
    });
    let path = match from_env {
        Some(Ok(p)) => p,
        Some(Err(e)) => {
            tracing::warn!(error = %e, "{KERNELS_ENV} ignored");
            KernelPath::Auto
        }
        None => KernelPath::Auto,
    };
    let _ = PATH.compare_exchange(0, path.code(), Ordering::Relaxed, Ordering::Relaxed);
    KernelPath::from_code(PATH.load(Ordering::Relaxed)).unwrap_or_default()
}

/// Whether kernels may use AVX-512 (each still checks the features it needs).
pub(crate) fn allows_avx512() -> bool {
    matches!(
        kernel_path(),
        KernelPath::Auto | KernelPath::Amx | KernelPath::Avx512
    )
}

/// Whether the repacked products multiply sixteen activation rows at a time on AMX's tile
/// unit: the path is `amx` (set, so the CPU has AMX-INT8 with the tile state granted; the
/// AVX-512 VNNI kernels run everything else).
pub(crate) fn amx() -> bool {
    kernel_path() == KernelPath::Amx && cpu_has_amx()
}

/// AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25) beside the AVX-512 kernels'
/// features, and the tile state granted to this process: Linux enables AMX's 8 KiB of tile
/// data per thread only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, process-wide, made
/// once here); elsewhere, or where the request fails, no AMX.
pub(crate) fn cpu_has_amx() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        return cpu_has_avx512() && *GRANTED.get_or_init(x86::request_amx);
    }
    #[allow(unreachable_code)]
    false
}

/// Whether kernels may use AVX2 (each still checks the features it needs).
pub(crate) fn allows_avx2() -> bool {
    kernel_path() != KernelPath::Portable
}

/// AVX2 + FMA + F16C, allowed by the kernel path: the AVX2 kernels' features.
pub(crate) fn avx2() -> bool {
    allows_avx2() && cpu_has_avx2()
}

/// Whether the AVX2 kernels may use AVX-VNNI: the CPU has it and the path is `auto` or
/// `avxvnni` (on `auto`, CPUs with AVX-512 VNNI take the AVX-512 kernels first).
pub(crate) fn avx_vnni() -> bool {
    matches!(kernel_path(), KernelPath::Auto | KernelPath::AvxVnni) && cpu_has_avx_vnni()
}

fn cpu_has_avx_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avxvnni") && cpu_has_avx2();
    #[allow(unreachable_code)]
    false
}

fn cpu_has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    #[allow(unreachable_code)]
    false
}

fn cpu_has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && cpu_has_avx2();
    #[allow(unreachable_code)]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_round_trips_and_auto_resolves_to_one_this_cpu_runs() {
        let all = [
            KernelPath::Auto,
            KernelPath::Amx,
            KernelPath::Avx512,
            KernelPath::AvxVnni,
            KernelPath::Avx2,
            KernelPath::Portable,
        ];
        for p in all {
            assert_eq!(p.name().parse::<KernelPath>().unwrap(), p);
            assert_eq!(KernelPath::from_code(p.code()), Some(p));
        }
        let e = "sse9".parse::<KernelPath>().unwrap_err().to_string();
        assert!(e.contains("avxvnni"), "{e}");
        let auto = KernelPath::Auto.resolved();
        assert!(auto != KernelPath::Auto && auto.supported(), "{auto}");
        // AVX-512 first (AMX only when asked for), then AVX-VNNI, then AVX2.
        if cpu_has_avx512() {
            assert_eq!(auto, KernelPath::Avx512);
        } else if cpu_has_avx_vnni() {
            assert_eq!(auto, KernelPath::AvxVnni);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Whether the CPU has AMX-TILE and AMX-INT8 and Linux granted this process the tile
    /// state (see `cpu_has_amx`).
    #[cfg(target_os = "linux")]
    pub(super) fn request_amx() -> bool {
        // SAFETY: leaf 7 exists on the CPUs that get here (AVX-512 is leaf 7 too); `cpuid`
        // only reads. (An `unsafe fn` before Rust 1.94, a safe one since.)
        #[allow(unused_unsafe)]
        let leaf = unsafe { __cpuid_count(7, 0) };
        if (leaf.edx >> 24) & 3 != 3 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: `arch_prctl` with this code only asks the kernel to enable a register
        // state for the process; it touches no memory of ours.
        let granted = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        } == 0;
        if !granted {
            tracing::info!("AMX not granted by the kernel: the AVX-512 kernels run prompts");
        }
        granted
    }

    /// The sum of a vector's eight lanes (AVX; every caller's AVX2 kernels imply it).
    #[inline]
    #[target_feature(enable = "avx")]
    pub(crate) fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The tile kernels' results: for each row `i` of `acc`, its first `n` lanes (halves of
    /// eight, `H ≤ 2`) to `out + i * stride + 8 first`.
    ///
    /// # Safety
    /// `out + i * stride + 8 first + l` is writable for `i < R`, `l < n ≤ 8 H`.
    #[inline]
    #[target_feature(enable = "avx")]
    pub(crate) unsafe fn store_lanes<const R: usize, const H: usize>(
        acc: &[[__m256; H]; R],
        out: *mut f32,
        stride: usize,
        first: usize,
        n: usize,
    ) {
        assert!(H <= 2 && n <= 8 * H);
        for (i, acc) in acc.iter().enumerate() {
            let mut v = [0f32; 16];
            for (e, acc) in acc.iter().enumerate() {
                // SAFETY: `v` holds 16 f32, `8e + 8 ≤ 16`.
                unsafe { _mm256_storeu_ps(v.as_mut_ptr().add(8 * e), *acc) };
            }
            for (l, v) in v.iter().take(n).enumerate() {
                // SAFETY: the caller's contract: lanes `8 first + l`, `l < n`, of row `i`.
                unsafe { *out.add(i * stride + 8 * first + l) = *v };
            }
        }
    }

    /// ggml's `ggml_v_expf` (AVX2) for arguments up to 87 (no overflow branch); those below
    /// -87 are clamped there (their `exp` is 0 to f32 anyway): max error about 1.5 ulp.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let r = c(0x4b40_0000);
        let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
        let e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
        let k = _mm256_castsi256_ps(_mm256_add_epi32(
            e,
            _mm256_castps_si256(_mm256_set1_ps(1.0)),
        ));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            ),
            u,
            _mm256_mul_ps(c(0x3f7f_fff6), b),
        );
        _mm256_fmadd_ps(j, k, k)
    }
}
