//! `ragkv ingest` over bad input: each bad file is reported on its own and sets the exit code;
//! the good ones are ingested (SmolLM2-135M and MiniLM, fetched by scripts/setup.sh; a private
//! copy of examples/corpus).

mod common;

use serde_json::Value;

use common::{n, Env};

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
