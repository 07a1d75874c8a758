//! `ragkv rematerialize` stopped with Ctrl-C (SIGINT): it stops after the chunk in progress,
//! reports what it did (`interrupted`), exits 3 and keeps what it stored; a rerun does the
//! rest and `ragkv verify` finds every chunk's KV. SmolLM2-135M and MiniLM, a private copy of
//! examples/corpus.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

use common::{n, Env};

/// `env.cmd(args)` with 48-token chunks: about fifty, a run long enough to interrupt.
fn cmd(env: &Env, args: &[&str]) -> Command {
    let mut c = env.cmd(args);
    c.env("RAGKV__INGEST__CHUNK_TOKENS", "48");
    c
}

#[test]
fn ctrl_c_stops_rematerialize_after_a_chunk_and_a_rerun_does_the_rest() {
    let env = Env::new();
    let corpus = env.corpus.to_str().unwrap().to_string();
    let st = cmd(&env, &["ingest", &corpus, "--progress", "quiet"])
        .status()
        .unwrap();
    assert!(st.success());
    let points = n(
        &common::json_out(&mut cmd(&env, &["verify"]))["index"],
        "points",
    );
    assert!(points >= 30, "{points} chunks");
    for seg in std::fs::read_dir(env.data.join("kv/segments")).unwrap() {
        std::fs::remove_file(seg.unwrap().path()).unwrap();
    }

    let mut child = cmd(&env, &["rematerialize", "--progress", "quiet", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its signal handlers are in place once it says it is rematerializing.
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    while !said.lines().any(|l| l.starts_with("rematerializing")) {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "exited before starting: {said}"
        );
        said.push_str(&line);
    }
    // SAFETY: plain kill(2) on our child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    stderr.read_to_string(&mut said).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{said}");
    assert!(said.contains("interrupted before the end"), "{said}");
    let first: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(first["interrupted"], true, "{first}");
    let stored = n(&first, "prefilled") + n(&first, "attached");
    assert!(stored < points, "{first}");

    // What it stored is kept; the rerun redoes the rest.
    let rerun = common::json_out(&mut cmd(
        &env,
        &["rematerialize", "--progress", "quiet", "--json"],
    ));
    assert_eq!(rerun["interrupted"], false, "{rerun}");
    // (An identical chunk of another document reads as present too.)
    let present = n(&rerun, "present");
    assert!(present >= stored, "{rerun}");
    assert_eq!(n(&rerun, "planned"), points - present, "{rerun}");
    let check = common::json_out(&mut cmd(&env, &["verify"]));
    assert_eq!(n(&check["index"], "kv_verified"), points, "{check}");
}
