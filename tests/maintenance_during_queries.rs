//! A model upgrade on a running server, maintained the way an operator would: the server is
//! started with a new KV fingerprint (KV kept as bf16 instead of f16), its built-in schedule
//! re-materializes and collects every few seconds, and `ragkv rematerialize` / `ragkv gc` are
//! run from "cron" (hand-off to the server) while a client keeps querying. Zero failed queries;
//! at the end every chunk is verified under the new namespace and the old one is gone.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ingested_example, json_out, ragkv, start_server};

#[test]
fn cron_rematerialize_and_gc_during_queries_lose_no_query() {
    let (_tmp, data) = ingested_example();
    let before = json_out(ragkv(&data).arg("verify"));
    let points = before["index"]["kv_verified"].as_u64().unwrap();
    assert!(points > 0);
    assert_eq!(before["index"]["points"], points, "{before}");

    let (mut server, url) = start_server(
        &data,
        &[
            ("RAGKV__MODEL__KV_DTYPE", "bf16"),
            ("RAGKV__SERVE__REMATERIALIZE_CRON", "*/4 * * * * *"),
            ("RAGKV__SERVE__REMATERIALIZE_LIMIT", "3"),
            ("RAGKV__SERVE__GC_CRON", "*/5 * * * * *"),
            ("RAGKV__INGEST__NAMESPACE_GRACE_HOURS", "0"),
        ],
    );
    let addr: std::net::SocketAddr = url.strip_prefix("http://").unwrap().parse().unwrap();

    // A client that keeps asking until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let client = {
        let (stop, answered) = (stop.clone(), answered.clone());
        std::thread::spawn(move || {
            let mut results = Vec::new();
            let questions = [
                "Who was the last resident keeper of the Varrow Point Lighthouse?",
                "How do honey bees tell each other where flowers are?",
                "When did the Meridian railway open?",
            ];
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let body = serde_json::json!({"question": questions[i % 3], "stream": false,
                                              "max_tokens": 4});
                let r = serve::client::request(addr, "POST", "/v1/query", None, Some(&body));
                results.push(r.map_err(|e| e.to_string()));
                answered.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            results
        })
    };

    // "Cron": a dry run, a real run, a GC, each handed to the server.
    std::thread::sleep(Duration::from_secs(2));
    let dry = json_out(ragkv(&data).args(["rematerialize", "--dry-run", "--json"]));
    assert_eq!(dry["dry_run"], true, "{dry}");
    let run = json_out(ragkv(&data).args(["rematerialize", "--json", "--progress", "quiet"]));
    assert!(run["failures"].as_array().unwrap().is_empty(), "{run}");
    let gc = json_out(ragkv(&data).arg("gc"));
    assert!(gc.get("namespaces_dropped").is_some(), "{gc}");
    // Let the built-in schedule run at least twice more while queries continue: four runs
    // were requested (dry run, run, gc, and the dry run below), so wait for six however long
    // this machine takes for them (rematerialize every 4 s, gc every 5 s).
    let maintenance_runs = || -> u64 {
        let (_, metrics) = serve::client::request(addr, "GET", "/metrics", None, None).unwrap();
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("ragkv_maintenance_runs_total "))
            .unwrap()
            .parse()
            .unwrap()
    };
    let t = Instant::now();
    while maintenance_runs() < 5 {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the schedule did not run twice in 300 s ({} runs)",
            maintenance_runs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let done = json_out(ragkv(&data).args(["rematerialize", "--dry-run", "--json"]));
    assert_eq!(done["planned"], 0, "{done}");
    assert_eq!(done["present"], points, "{done}");

    // At least three queries overlap the maintenance, however slowly this machine answers
    // them (a loaded machine may have finished the schedule before the third).
    let t = Instant::now();
    while answered.load(Ordering::Relaxed) < 3 {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "queries stopped being answered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    let results = client.join().unwrap();
    assert!(results.len() >= 3, "{} queries", results.len());
    for r in &results {
        let (status, body) = r.as_ref().expect("query request failed");
        assert_eq!(*status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(v["answer"].is_string(), "{v}");
    }
    let runs = maintenance_runs();
    // Four were requested (dry run, run, gc, dry run); the schedule fired at least twice more.
    assert!(runs >= 6, "{runs} maintenance runs");
    let (_, metrics) = serve::client::request(addr, "GET", "/metrics", None, None).unwrap();
    assert!(
        metrics.contains("ragkv_maintenance_failures_total 0"),
        "{metrics}"
    );

    // Stop; everything is verified under the new namespace, and the old one is gone.
    assert!(Command::new("kill")
        .args(["-TERM", &server.0.id().to_string()])
        .status()
        .unwrap()
        .success());
    assert!(server.0.wait().unwrap().success());
    let after = json_out(
        ragkv(&data)
            .arg("verify")
            .env("RAGKV__MODEL__KV_DTYPE", "bf16"),
    );
    assert_eq!(after["index"]["kv_verified"], points, "{after}");
    let stats = json_out(ragkv(&data).arg("stats"));
    // The chunks' namespace and, under the default `ingest.exact_first`, their copies'.
    let nss = stats["namespaces"].as_array().unwrap();
    assert_eq!(nss.len(), 2, "{stats}");
    for ns in nss {
        assert!(ns["layout"].as_str().unwrap().contains("bf16"), "{stats}");
        assert_eq!(ns["tokens"], nss[0]["tokens"], "{stats}");
    }
}
