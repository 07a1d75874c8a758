//! Compute devices by name (`cpu`, `cuda`, `cuda:N`) and the process's compute threads.

use candle_core::Device;

#[cfg(feature = "cuda")]
use crate::error::Ctx;
use crate::error::{Error, Result};

/// Fixes the compute thread count for the process: `RAYON_NUM_THREADS`, when unset, becomes
/// the number of CPUs this process may use. Call it first thing in `main`, before any thread
/// starts (it sets an environment variable).
///
/// Without it candle looks the count up on every f32 matrix product, and where the kernel
/// reports no CPU capacities (most VMs) that means parsing `/proc/cpuinfo`: measured at
/// several milliseconds per decoded token on SmolLM2-135M (`perf`, 2-core VM).
pub fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// A compute device by name: `cpu`, `cuda` (GPU 0) or `cuda:N`.
///
/// Parsing checks the name only; [`DeviceSpec::open`] opens the device. CUDA needs a build with
/// the `cuda` feature (`cargo build --features cuda`, see `scripts/cuda-toolkit.sh`); without it
/// opening a CUDA device is an [`Error::Unsupported`] that says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(name: &str) -> Result<DeviceSpec> {
        let name = name.trim();
        let bad = || Error::Config {
            why: format!("device {name:?}: expected cpu, cuda or cuda:N"),
        };
        if name.eq_ignore_ascii_case("cpu") {
            return Ok(DeviceSpec::Cpu);
        }
        match name.strip_prefix("cuda") {
            Some("") => Ok(DeviceSpec::Cuda(0)),
            Some(rest) => rest
                .strip_prefix(':')
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(bad),
            None => Err(bad()),
        }
    }
}

impl DeviceSpec {
    /// Opens the device (for CUDA: creates its context and stream).
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(ordinal) => cuda_device(ordinal),
        }
    }
}

/// Parses and opens a device name (see [`DeviceSpec`]).
pub fn device(name: &str) -> Result<Device> {
    name.parse::<DeviceSpec>()?.open()
}

/// A CUDA device. cudarc creates two CUDA events per allocation (and destroys them on free)
/// for its cross-stream tracking, which only acts once a context has streams of its own;
/// candle queues each thread's work on the per-thread default stream, which that tracking
/// does not cover, and ragkv orders threads itself (`upload::settle`). So the tracking is
/// off: four driver calls fewer on every candle operation's output. `RAGKV_CUDA_EVENTS=on`
/// keeps it, for comparison.
#[cfg(feature = "cuda")]
fn cuda_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal).ctx(&format!("opening CUDA device {ordinal}"))?;
    if let (Device::Cuda(dev), false) = (
        &device,
        std::env::var("RAGKV_CUDA_EVENTS").as_deref() == Ok("on"),
    ) {
        // SAFETY: no stream of this context is created with `new_stream` (candle and the
        // loader use the per-thread default stream), so no synchronization relied on the
        // events; a tensor made on one thread reaches another only after `upload::settle`.
        unsafe { dev.disable_event_tracking() };
    }
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(ordinal: usize) -> Result<Device> {
    Err(Error::Unsupported {
        what: format!(
            "device cuda:{ordinal}: this build has no CUDA support (rebuild with `--features cuda`)"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        let parse = |s: &str| s.parse::<DeviceSpec>();
        assert_eq!(parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(parse(" CPU ").unwrap(), DeviceSpec::Cpu);
        assert_eq!(parse("cuda").unwrap(), DeviceSpec::Cuda(0));
        assert_eq!(parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
        assert!(matches!(device("cpu"), Ok(Device::Cpu)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda0", "metal", ""] {
            assert!(
                matches!(parse(bad), Err(Error::Config { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_get_it() {
        for name in ["cuda", "cuda:1"] {
            let err = device(name).unwrap_err().to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }
}
