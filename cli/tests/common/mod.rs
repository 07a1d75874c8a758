//! Shared by the CLI test binaries: the real `ragkv` binary and a server started from it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `ragkv --data-dir DATA`.
pub fn ragkv(data: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ragkv"));
    c.arg("--data-dir").arg(data);
    c
}

/// A fresh data directory (inside the returned temporary directory) with the example corpus
/// ingested by `ragkv ingest`.
pub fn ingested_example() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/corpus");
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
