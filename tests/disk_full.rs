//! Ingest into a file system that fills up: a tmpfs of 128 MiB, made by the test, holds the
//! data directory (the vector index maps ~72 MiB of it while open) while the example corpus
//! (~38 MiB of f16 KV) is ingested with a free-space reserve of 16 MiB
//! (`kvstore.min_free_mib`). The run must stop with a clear error naming the full disk, leave
//! nothing unreadable and the directory openable (without the reserve the disk fills to the
//! last byte, and opening the vector index's memory-mapped files then dies of SIGBUS), and a
//! rerun after the file system grows must complete with every document whole and searchable.
//! Where the machine forbids mounts (not root, no CAP_SYS_ADMIN) the test says so and does
//! nothing.

mod common;

use std::path::Path;
use std::process::Command;

use common::{example_corpus, ragkv};

/// Unmounts when dropped, so a failing assertion leaves no mount behind.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn mount_tmpfs(at: &Path, size: &str) -> Result<Mount, String> {
    let out = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(at)
        .output()
        .map_err(|e| format!("cannot run mount: {e}"))?;
    if out.status.success() {
        Ok(Mount(at.to_path_buf()))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

#[test]
fn a_full_disk_stops_ingest_cleanly_and_a_rerun_after_freeing_space_completes() {
    let tmp = tempfile::tempdir().unwrap();
    let fs = tmp.path().join("fs");
    std::fs::create_dir(&fs).unwrap();
    let mount = match mount_tmpfs(&fs, "128m") {
        Ok(m) => m,
        Err(why) => {
            eprintln!("skipped: this machine forbids mounting a tmpfs ({why})");
            return;
        }
    };
    let data = fs.join("data");
    // f16 KV (codec none), whose ~38 MiB are what fills this file system.
    let ragkv = |data: &std::path::Path| {
        let mut c = ragkv(data);
        c.env("RAGKV__KVSTORE__CODEC", "none");
        c
    };
    let ingest = || {
        ragkv(&data)
            .args(["ingest", "--progress", "quiet", "--json"])
            .arg(example_corpus())
            .env("RAGKV__KVSTORE__MIN_FREE_MIB", "16")
            .env("RUST_LOG", "error")
            .output()
            .unwrap()
    };
    let out = ingest();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the disk did not fill up: {err}");
    assert!(err.contains("disk nearly full"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // Nothing stored is unreadable (orphaned KV of the interrupted documents is allowed: the
    // next run reconciles it).
    let verify = ragkv(&data)
        .arg("verify")
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&verify.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&verify.stderr)));
    assert_eq!(report["failed"], 0, "{report}");
    let problems = report["index"]["problems"].as_array().unwrap();
    assert!(
        problems
            .iter()
            .all(|p| p.as_str().unwrap().contains("orphaned")),
        "{report}"
    );

    // Free space (grow the file system) and run again: it completes and everything checks.
    let st = Command::new("mount")
        .args(["-o", "remount,size=256m"])
        .arg(&fs)
        .status()
        .unwrap();
    assert!(st.success());
    let out = ingest();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verify = ragkv(&data)
        .args(["verify", "--search"])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&verify.stdout).unwrap();
    assert_eq!(report["index"]["documents"], 6, "{report}");
    assert_eq!(report["index"]["searchable"], report["index"]["points"]);
    drop(mount);
}
