//! `ragkv ingest` killed (SIGKILL) at random moments until ten runs were killed mid-way; a
//! final run completes and `ragkv verify --search` finds every invariant intact (SmolLM2-135M
//! and MiniLM, fetched by scripts/setup.sh; a private copy of examples/corpus).

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use common::{n, Env};

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
    let edit = |round: usize, note: &str| {
        for k in 0..3 {
            let path = env.corpus.join(files[(round * 3 + k) % files.len()]);
            let mut t = std::fs::read_to_string(&path).unwrap();
            t.push_str(&format!("\nA note added in round {round}: {note}.\n"));
            std::fs::write(&path, t).unwrap();
        }
    };
    let ingest = || {
        env.cmd(&["ingest", &corpus, "--progress", "quiet"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let status = ingest().wait().unwrap();
    assert!(status.success(), "the first ingest failed: {status}");
    // Kills land anywhere within the time the run being killed takes, measured on this
    // machine and on exactly that kind of run (start-up and three edited documents), never
    // assumed: a whole first ingest takes several times as long as an incremental one, and
    // both vary tenfold between machines and weight formats. The window starts as one
    // uninterrupted incremental run, and every run that ends before its kill re-measures it.
    edit(1000, "calibration");
    let t = Instant::now();
    let status = ingest().wait().unwrap();
    assert!(status.success(), "the calibration ingest failed: {status}");
    let mut window = t.elapsed().max(Duration::from_millis(100));
    eprintln!("an incremental ingest took {window:?}");
    let mut kills = 0;
    let mut round = 0;
    while kills < 10 {
        assert!(
            round < 40,
            "only {kills} of {round} runs were killed mid-way"
        );
        edit(round, &format!("the count was {}", 1000 + round));
        let wait = window.mul_f64(rng.gen_range(0.05..1.0));
        let t = Instant::now();
        let mut child = ingest();
        let ended = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if t.elapsed() >= wait {
                break None;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let killed = match ended {
            Some(status) => {
                assert!(status.success(), "round {round}: ingest failed: {status}");
                window = t.elapsed().max(Duration::from_millis(100));
                false
            }
            None => {
                let _ = child.kill(); // SIGKILL
                let status = child.wait().unwrap();
                std::os::unix::process::ExitStatusExt::signal(&status) == Some(9)
            }
        };
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
