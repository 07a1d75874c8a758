//! `ragkv ingest` killed (SIGKILL) at random moments until ten runs were killed mid-way; a
//! final run completes and `ragkv verify --search` finds every invariant intact (SmolLM2-135M
//! and MiniLM, fetched by scripts/setup.sh; a private copy of examples/corpus).

mod common;

use std::process::Stdio;
use std::time::Duration;

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
    // Kills land anywhere within the time a whole first ingest takes (start-up included):
    // with quantized weights a run of this corpus takes a second or two, with f32 ones far
    // longer, so a fixed window would mostly miss or mostly hit the start-up.
    let t = std::time::Instant::now();
    let status = env
        .cmd(&["ingest", &corpus, "--progress", "quiet"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the first ingest failed: {status}");
    let whole = (t.elapsed().as_millis() as u64).max(200);
    eprintln!("a whole ingest took {whole} ms");
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
        let wait = Duration::from_millis(rng.gen_range(whole / 20..whole));
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
