//! With the `cuda` feature: compiles the model's own CUDA kernels (`kernels/*.cu`) to PTX with
//! the toolkit's nvcc (`$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH; see
//! `scripts/cuda-toolkit.sh`), for `$CUDA_COMPUTE_CAP` (default 75, the oldest architecture
//! CUDA 13 builds for; the driver JIT-compiles the PTX for newer GPUs).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    const KERNELS: [&str; 2] = ["attention", "step"];
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    for var in ["NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "75".into());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for k in KERNELS {
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", &format!("-arch=compute_{cap}"), "-o"])
            .arg(out.join(format!("{k}.ptx")))
            .arg(format!("kernels/{k}.cu"))
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "running {}: {e} (see scripts/cuda-toolkit.sh)",
                    nvcc.display()
                )
            });
        assert!(
            status.success(),
            "{} failed on kernels/{k}.cu",
            nvcc.display()
        );
    }
}
