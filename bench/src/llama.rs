//! llama.cpp, the CPU peer: locating the binaries `scripts/llama-server.sh` builds, and running
//! `llama-bench` on a GGUF file.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Error;

/// Where `scripts/llama-server.sh` puts llama.cpp's binaries: `$RAGKV_CACHE/llama.cpp/bin`,
/// default `~/.cache/ragkv/llama.cpp/bin`.
pub fn default_bin_dir() -> PathBuf {
    let cache = std::env::var_os("RAGKV_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ragkv")
        });
    cache.join("llama.cpp/bin")
}

/// The llama.cpp binary `name`: `given` if set, else the one in [`default_bin_dir`]; an error
/// that says how to build it when missing.
pub fn binary(given: Option<&Path>, name: &str) -> Result<PathBuf, Error> {
    let path = given
        .map(Path::to_path_buf)
        .unwrap_or_else(|| default_bin_dir().join(name));
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::Invalid {
            what: "llama.cpp",
            why: format!(
                "{} not found: run scripts/llama-server.sh (builds llama.cpp's {name} from the \
                 llama-cpp-python sdist into the cache, ~6 minutes) or pass its path",
                path.display()
            ),
        })
    }
}

/// A `llama-bench` command with its shared libraries (built beside it) on the library path.
pub fn command(bin: &Path) -> Command {
    let mut cmd = Command::new(bin);
    if let Some(dir) = bin.parent() {
        let mut paths = vec![dir.to_path_buf()];
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            paths.extend(std::env::split_paths(&old));
        }
        if let Ok(joined) = std::env::join_paths(paths) {
            cmd.env("LD_LIBRARY_PATH", joined);
        }
    }
    cmd
}

/// llama-bench's figures: prompt processing and generation, tokens/s.
#[derive(Debug, Clone, Copy)]
pub struct BenchFigures {
    /// `pp{prompt}`: prefill tokens/s.
    pub prefill: f64,
    /// `tg{decode} @ d{depth}`: decode tokens/s after `depth` tokens of context.
    pub decode: f64,
}

/// Runs `llama-bench -m model -p prompt -n decode -d 0,depth -t threads -ngl gpu_layers -r reps
/// -o json`: prefill from an empty context, decode after `depth` tokens (the context a decode
/// after a prompt of `depth` tokens attends to); `gpu_layers` 0 on a CPU run.
#[allow(clippy::too_many_arguments)]
pub fn bench(
    bin: &Path,
    model: &Path,
    prompt: usize,
    decode: usize,
    depth: usize,
    threads: usize,
    gpu_layers: usize,
    reps: usize,
) -> Result<BenchFigures, Error> {
    let out = command(bin)
        .arg("-m")
        .arg(model)
        .args(["-p", &prompt.to_string(), "-n", &decode.to_string()])
        .args(["-d", &format!("0,{depth}")])
        .args(["-t", &threads.to_string(), "-r", &reps.max(1).to_string()])
        .args(["-ngl", &gpu_layers.to_string()])
        .args(["-o", "json"])
        .output()
        .map_err(crate::io(format!("running {}", bin.display())))?;
    if !out.status.success() {
        return Err(Error::Check(format!(
            "llama-bench failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )));
    }
    parse(&out.stdout, depth)
}

/// Reads llama-bench's JSON: one record per test, `n_prompt`, `n_gen`, `n_depth` (0 when
/// absent) and `avg_ts`; the prefill at depth 0 and the decode at `depth`.
fn parse(json: &[u8], depth: usize) -> Result<BenchFigures, Error> {
    let records: Vec<serde_json::Value> = serde_json::from_slice(json)
        .map_err(|e| Error::Check(format!("llama-bench output is not JSON: {e}")))?;
    let find = |prompt: bool| {
        records
            .iter()
            .find(|r| {
                let n = |k: &str| r.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
                if prompt {
                    n("n_prompt") > 0 && n("n_gen") == 0 && n("n_depth") == 0
                } else {
                    n("n_gen") > 0 && n("n_prompt") == 0 && n("n_depth") == depth as u64
                }
            })
            .and_then(|r| r.get("avg_ts")?.as_f64())
            .ok_or_else(|| Error::Check("llama-bench output lacks a pp or tg record".into()))
    };
    Ok(BenchFigures {
        prefill: find(true)?,
        decode: find(false)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_llama_bench_json() {
        let json = br#"[
          {"model_type": "llama 256M Q4_1", "n_prompt": 512, "n_gen": 0, "avg_ts": 217.4},
          {"model_type": "llama 256M Q4_1", "n_prompt": 0, "n_gen": 32, "avg_ts": 88.35}
        ]"#;
        let f = parse(json, 0).unwrap();
        assert_eq!((f.prefill, f.decode), (217.4, 88.35));
        assert!(parse(b"[]", 0).is_err());
        // With a depth: the prefill from an empty context, the decode after `depth` tokens.
        let json = br#"[
          {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 200.0},
          {"n_prompt": 0, "n_gen": 32, "n_depth": 0, "avg_ts": 90.0},
          {"n_prompt": 512, "n_gen": 0, "n_depth": 512, "avg_ts": 150.0},
          {"n_prompt": 0, "n_gen": 32, "n_depth": 512, "avg_ts": 80.0}
        ]"#;
        let f = parse(json, 512).unwrap();
        assert_eq!((f.prefill, f.decode), (200.0, 80.0));
        assert!(parse(json, 100).is_err());
        assert!(parse(b"not json", 0).is_err());
    }
}
