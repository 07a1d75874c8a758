//! Crash test: a child process (this test binary, re-run) writes batches, deletes documents
//! and merges segments; the parent kills it with SIGKILL at random moments, then checks that the
//! store reopens, that every index entry reads back with a valid checksum, and that everything
//! the child saw acknowledged is there, byte for byte.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvstore::{PutItem, StoreOptions, SyncPolicy};
use rand::{Rng, SeedableRng};

const CHILD_ENV: &str = "KVSTORE_CRASH_CHILD_DIR";
const ROUNDS: u64 = 24;

fn child_options(round: u64) -> StoreOptions {
    StoreOptions {
        // Alternate policies: both must survive a process crash.
        sync: if round.is_multiple_of(2) {
            SyncPolicy::EveryBatch
        } else {
            SyncPolicy::Never
        },
        segment_bytes: 128 << 10,
        ..small_options()
    }
}

/// The child: writes forever until killed, printing what has been acknowledged.
#[test]
fn crash_child_writer() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return; // only meaningful as a child of `sigkill_at_random_moments`
    };
    let round: u64 = std::env::var("KVSTORE_CRASH_ROUND")
        .unwrap()
        .parse()
        .unwrap();
    let store = open(std::path::Path::new(&dir), child_options(round));
    let mut rng = rand::rngs::StdRng::seed_from_u64(round);
    let mut next: u64 = round * 100_000;
    loop {
        let n = rng.gen_range(1..8);
        let seqs: Vec<(u64, Vec<u32>, Vec<u8>)> = (next..next + n)
            .map(|i| {
                let t = sequence(i);
                let kv = kv_for(&layout(), &t);
                (i, t, kv)
            })
            .collect();
        let docs: Vec<String> = seqs.iter().map(|(i, ..)| doc_of(*i)).collect();
        let items: Vec<PutItem<'_>> = seqs
            .iter()
            .zip(&docs)
            .map(|((_, t, kv), d)| PutItem {
                tokens: t,
                kv,
                doc: Some(d),
            })
            .collect();
        store.put_batch(NS, layout(), &items).unwrap();
        for (i, ..) in &seqs {
            println!("put {i}");
        }
        next += n;
        if rng.gen_bool(0.2) {
            let victim = rng.gen_range(round * 100_000..next);
            // Announced first: if the kill lands inside the delete, its outcome is unknown.
            println!("deleting {}", doc_of(victim));
            store.delete_document(&doc_of(victim)).unwrap();
        }
        if rng.gen_bool(0.1) {
            store.merge_now().unwrap();
        }
    }
}

#[test]
fn sigkill_at_random_moments() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut acknowledged: BTreeSet<u64> = BTreeSet::new();
    let mut total_puts = 0;
    let mut opening: Option<Duration> = None;
    for round in 0..ROUNDS {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child_writer",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir.path())
            .env("KVSTORE_CRASH_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (started, first_put) = std::sync::mpsc::sync_channel::<()>(1);
        let reader = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines.is_empty() {
                    let _ = started.try_send(());
                }
                lines.push(line);
            }
            lines
        });
        // Every fourth round the kill lands while the child opens (and recovers) the store,
        // within the time an opening took here; the others let it get going (its first batch
        // acknowledged, however long that takes on this machine) and kill it at a random
        // moment of its writing.
        match opening {
            Some(took) if round % 4 == 3 => {
                std::thread::sleep(took.mul_f64(rng.gen_range(0.0..1.0)))
            }
            _ => {
                let t = Instant::now();
                first_put
                    .recv_timeout(Duration::from_secs(120))
                    .expect("the child acknowledged no batch within 120 s");
                opening = Some(t.elapsed());
                std::thread::sleep(Duration::from_millis(rng.gen_range(0..550)));
            }
        }
        // SAFETY: plain kill(2) on our child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let status = child.wait().unwrap();
        assert!(!status.success(), "child must have been killed, not exited");
        for line in reader.join().unwrap() {
            if let Some(i) = line.strip_prefix("put ") {
                acknowledged.insert(i.parse().unwrap());
                total_puts += 1;
            } else if let Some(d) = line.strip_prefix("deleting ") {
                // Deleted, or not if the kill came first: no longer required either way.
                acknowledged.retain(|i| doc_of(*i) != d);
            }
        }

        let t0 = Instant::now();
        let store = open(dir.path(), child_options(round));
        let report = store.verify().unwrap();
        assert!(
            report.failures.is_empty(),
            "round {round}: {} of {} entries fail: {:?}",
            report.failures.len(),
            report.entries,
            &report.failures[..report.failures.len().min(3)]
        );
        for i in &acknowledged {
            let t = sequence(*i);
            let got = store
                .get_batch(NS, &t, t.len())
                .unwrap_or_else(|e| panic!("round {round}: acknowledged seq {i} lost: {e}"));
            assert_eq!(got.bytes, kv_for(&layout(), &t), "round {round}: seq {i}");
        }
        // Accounting matches the index after recovery.
        assert_eq!(store.stats().entries, report.entries, "round {round}");
        eprintln!(
            "round {round}: {} entries, {} acknowledged sequences verified, reopen+verify {:?}",
            report.entries,
            acknowledged.len(),
            t0.elapsed()
        );
    }
    assert!(
        total_puts > 100,
        "children wrote too little to mean anything ({total_puts})"
    );
}
