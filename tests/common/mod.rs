//! The fixture every end-to-end scenario shares: the real `ragkv` binary, data directories
//! with the example corpus ingested, and a server started from the binary. Each scenario is a
//! test binary of its own (`tests/*.rs`) that includes this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The binary under test, built by cargo for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_ragkv");

/// The example corpus of the repository (`examples/corpus`). The checkout is the one cargo
/// runs the tests from (`CARGO_MANIFEST_DIR` at run time), not necessarily the one the test
/// binary was compiled in: a shared target directory keeps binaries built from another
/// checkout's path.
pub fn example_corpus() -> PathBuf {
    manifest_dir().join("examples/corpus")
}

/// The package's directory: cargo's run-time `CARGO_MANIFEST_DIR`, else the compile-time one.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// `ragkv --data-dir DATA`.
pub fn ragkv(data: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.arg("--data-dir").arg(data);
    c
}

/// A fresh data directory (inside the returned temporary directory) with the example corpus
/// ingested by `ragkv ingest`.
pub fn ingested_example() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let corpus = example_corpus();
    let st = ragkv(&data)
        .args(["ingest", "--progress", "quiet"])
        .arg(&corpus)
        .status()
        .unwrap();
    assert!(st.success());
    (tmp, data)
}

/// A `ragkv serve` child, killed when dropped.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `ragkv serve` on a free loopback port with extra environment `env`; returns it and
/// its URL once it has written `server.json`.
pub fn start_server(data: &Path, env: &[(&str, &str)]) -> (Server, String) {
    let child = ragkv(data)
        .args(["serve", "--bind", "127.0.0.1:0"])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let file = data.join("server.json");
    let start = Instant::now();
    while !file.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "server did not start"
        );
        if let Some(s) = server.0.try_wait().unwrap() {
            panic!("server exited: {s}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(50));
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    (server, info["url"].as_str().unwrap().to_string())
}

/// Runs `cmd`, which must succeed, and parses its JSON output (or its last line).
pub fn json_out(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        cmd,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&text)
        .or_else(|_| serde_json::from_str(text.lines().last().unwrap_or_default()))
        .unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// A data directory and a private copy of the example corpus.
pub struct Env {
    _tmp: tempfile::TempDir,
    pub data: PathBuf,
    pub corpus: PathBuf,
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

impl Env {
    pub fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        let corpus = tmp.path().join("corpus");
        copy_dir(&example_corpus(), &corpus);
        Env {
            data: tmp.path().join("data"),
            corpus,
            _tmp: tmp,
        }
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--data-dir").arg(&self.data).args(args);
        // Small chunks so that documents have several and replacement is exercised.
        c.env("RAGKV__INGEST__CHUNK_TOKENS", "128");
        c.env("RAGKV__EMBEDDER__THREADS", "1");
        c.current_dir(self._tmp.path());
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        let out = self.cmd(args).output().unwrap();
        if !out.status.success() {
            panic!(
                "ragkv {args:?} failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        out
    }

    /// Runs `ragkv ingest --json` and returns its report.
    pub fn ingest(&self, extra: &[&str]) -> Value {
        let corpus = self.corpus.to_str().unwrap();
        let mut args = vec!["ingest", corpus, "--progress", "quiet", "--json"];
        args.extend_from_slice(extra);
        let out = self.run(&args);
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Runs `ragkv verify --search`, which fails on any broken invariant; returns its report.
    pub fn verify(&self) -> Value {
        let out = self.run(&["verify", "--search"]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["failed"], 0, "{v}");
        assert_eq!(v["index"]["problems"], serde_json::json!([]), "{v}");
        v
    }
}

pub fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}
