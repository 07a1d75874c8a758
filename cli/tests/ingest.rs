//! End-to-end tests of `ragkv ingest`, `ragkv delete` and `ragkv verify` with the real binary,
//! SmolLM2-135M and MiniLM (fetched by scripts/setup.sh), on a copy of examples/corpus.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use serde_json::Value;

/// A data directory and a private copy of the example corpus.
struct Env {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    corpus: PathBuf,
}

fn copy_dir(from: &Path, to: &Path) {
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
    fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        let corpus = tmp.path().join("corpus");
        copy_dir(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/corpus"),
            &corpus,
        );
        Env {
            data: tmp.path().join("data"),
            corpus,
            _tmp: tmp,
        }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ragkv"));
        c.arg("--data-dir").arg(&self.data).args(args);
        // Small chunks so that documents have several and replacement is exercised.
        c.env("RAGKV__INGEST__CHUNK_TOKENS", "128");
        c.env("RAGKV__EMBEDDER__THREADS", "1");
        c.current_dir(self._tmp.path());
        c
    }

    fn run(&self, args: &[&str]) -> Output {
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
    fn ingest(&self, extra: &[&str]) -> Value {
        let corpus = self.corpus.to_str().unwrap();
        let mut args = vec!["ingest", corpus, "--progress", "quiet", "--json"];
        args.extend_from_slice(extra);
        let out = self.run(&args);
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Runs `ragkv verify --search`, which fails on any broken invariant; returns its report.
    fn verify(&self) -> Value {
        let out = self.run(&["verify", "--search"]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["failed"], 0, "{v}");
        assert_eq!(v["index"]["problems"], serde_json::json!([]), "{v}");
        v
    }
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

#[test]
fn ingest_is_searchable_verified_incremental_and_prunes() {
    let env = Env::new();
    let r = env.ingest(&[]);
    assert_eq!(n(&r, "docs_new"), 6, "{r}");
    assert_eq!(n(&r, "docs_failed"), 0, "{r}");
    assert!(
        n(&r, "chunks") > 6,
        "expected several chunks per document: {r}"
    );
    assert_eq!(n(&r, "chunks"), n(&r, "chunks_prefilled"));
    let v = env.verify();
    let points = n(&v["index"], "points");
    assert_eq!(points, n(&r, "chunks"));
    assert_eq!(n(&v["index"], "kv_verified"), points);
    assert_eq!(n(&v["index"], "searchable"), points);

    // A second run changes nothing.
    let r2 = env.ingest(&[]);
    assert_eq!(n(&r2, "docs_unchanged"), 6, "{r2}");
    assert_eq!(
        (
            n(&r2, "chunks"),
            n(&r2, "chunks_prefilled"),
            n(&r2, "kv_bytes")
        ),
        (0, 0, 0)
    );

    // Editing one file replaces exactly its chunks.
    let path = env.corpus.join("meridian-railway.md");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text = text.replace("23 kilometres long", "24 kilometres long");
    text.push_str("\nIn 2024 the society bought a second steam locomotive, named \"Lotte\".\n");
    std::fs::write(&path, text).unwrap();
    let r3 = env.ingest(&[]);
    assert_eq!(
        (n(&r3, "docs_replaced"), n(&r3, "docs_unchanged")),
        (1, 5),
        "{r3}"
    );
    // Its middle chunks did not change: their KV is reused, not prefilled again.
    assert!(n(&r3, "chunks_prefilled") < n(&r3, "chunks"), "{r3}");
    // verify: the document is one complete new version, nothing stale or orphaned.
    let v3 = env.verify();
    assert_eq!(n(&v3["index"], "documents"), 6);

    // Deleting a file and pruning removes its vectors and its KV references.
    std::fs::remove_file(env.corpus.join("nature/glacier-station.txt")).unwrap();
    let r4 = env.ingest(&["--prune"]);
    assert_eq!(
        (n(&r4, "docs_deleted"), n(&r4, "docs_unchanged")),
        (1, 5),
        "{r4}"
    );
    let v4 = env.verify();
    assert_eq!(n(&v4["index"], "documents"), 5);

    // `ragkv delete` removes a document the same way.
    let out = env.run(&["delete", "osterfeld-chess.md"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"deleted\":true"));
    let v5 = env.verify();
    assert_eq!(n(&v5["index"], "documents"), 4);
}

#[test]
fn bad_input_is_reported_per_file_and_sets_the_exit_code() {
    let env = Env::new();
    std::fs::write(env.corpus.join("binary.txt"), b"abc\0def").unwrap();
    std::fs::write(env.corpus.join("latin1.txt"), [b'c', b'a', b'f', 0xe9]).unwrap();
    std::fs::write(env.corpus.join("notes.pdf"), b"%PDF-1.4").unwrap();
    std::fs::write(env.corpus.join("empty.md"), b"\n\n").unwrap();
    let corpus = env.corpus.to_str().unwrap().to_string();
    let out = env
        .cmd(&[
            "ingest",
            &corpus,
            "--progress",
            "quiet",
            "--json",
            "--materialize",
            "none",
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((n(&r, "docs_new"), n(&r, "docs_failed")), (6, 4), "{r}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for (file, why) in [
        ("binary.txt", "binary"),
        ("latin1.txt", "UTF-8"),
        ("notes.pdf", "unsupported"),
        ("empty.md", "empty"),
    ] {
        assert!(
            stderr.lines().any(|l| l.contains(file) && l.contains(why)),
            "{file}: {stderr}"
        );
    }
    // Vectors only: every point is searchable and none claims KV.
    let v = env.verify();
    assert_eq!(n(&v["index"], "kv_verified"), 0);
    assert_eq!(n(&v["index"], "kv_absent"), n(&v["index"], "points"));
}

#[test]
fn a_bad_or_unbuilt_device_is_refused_with_a_clear_error() {
    let env = Env::new();
    let corpus = env.corpus.to_str().unwrap().to_string();
    let mut cases = vec![("gpu", "model.device")];
    if !cfg!(feature = "cuda") {
        cases.push(("cuda:1", "rebuild with `--features cuda`"));
    }
    for (device, expect) in cases {
        let out = env
            .cmd(&["ingest", &corpus, "--progress", "quiet"])
            .env("RAGKV__MODEL__DEVICE", device)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{device}: {stderr}");
        assert!(stderr.contains(expect), "{device}: {stderr}");
    }
}

#[test]
fn killing_ingest_at_random_moments_never_breaks_the_invariants() {
    let env = Env::new();
    let corpus = env.corpus.to_str().unwrap().to_string();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(
        std::env::var("RAGKV_CRASH_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(11),
    );
    // Rounds go on until ten runs were killed mid-way (a run that finished before its kill
    // does not count). Each round edits three documents first, so every run has prefill,
    // KV writes, upserts and replacements to be interrupted in.
    let files = [
        "varrow-lighthouse.md",
        "sourdough-starter.txt",
        "meridian-railway.md",
        "nature/waggle-dance.md",
        "nature/glacier-station.txt",
        "osterfeld-chess.md",
    ];
    let mut kills = 0;
    let mut round = 0;
    while kills < 10 {
        assert!(
            round < 40,
            "only {kills} of {round} runs were killed mid-way"
        );
        for k in 0..3 {
            let path = env.corpus.join(files[(round * 3 + k) % files.len()]);
            let mut t = std::fs::read_to_string(&path).unwrap();
            t.push_str(&format!(
                "\nA note added in round {round}: the count was {}.\n",
                1000 + round
            ));
            std::fs::write(&path, t).unwrap();
        }
        let mut child = env
            .cmd(&["ingest", &corpus, "--progress", "quiet"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let wait = Duration::from_millis(rng.gen_range(300..7_000));
        std::thread::sleep(wait);
        let _ = child.kill(); // SIGKILL, if still running
        let status = child.wait().unwrap();
        let killed = std::os::unix::process::ExitStatusExt::signal(&status) == Some(9);
        kills += usize::from(killed);
        eprintln!(
            "round {round}: after {wait:?}: {}",
            if killed { "killed" } else { "had finished" }
        );
        round += 1;
    }
    // A full run completes the work, and everything holds.
    let r = env.ingest(&[]);
    assert_eq!(n(&r, "docs_failed"), 0, "{r}");
    let v = env.verify();
    assert_eq!(n(&v["index"], "documents"), 6, "{v}");
    assert_eq!(
        n(&v["index"], "kv_verified"),
        n(&v["index"], "points"),
        "{v}"
    );
    // And then nothing is left to do.
    let r = env.ingest(&[]);
    assert_eq!(n(&r, "docs_unchanged"), 6, "{r}");
}
