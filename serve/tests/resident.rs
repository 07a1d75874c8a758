//! The resident tier (`serve.resident_mb`): a chunk asked for again comes from the model's
//! device with the answer unchanged (f16 and q8 caches, `naive` and `link:2`, against a
//! server without the tier), and once anything leaves the store every entry is read again.
//! SmolLM2-135M, MiniLM, the example corpus.

mod common;

use axum::http::StatusCode;
use serde_json::{json, Value};
use serve::{CacheDtype, ServeConfig};

use common::router::{call, fixture, start, teardown};

async fn ask(app: &axum::Router, question: &str) -> Value {
    let q = json!({"question": question, "top_k": 2, "max_tokens": 16, "stream": false});
    let (s, r, text) = call(app, "POST", "/v1/query", Some(q), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(r["kv_hits"], 2, "{r}");
    r
}

async fn resident(app: &axum::Router) -> (u64, u64, u64) {
    let (s, r, text) = call(app, "GET", "/v1/stats", None, None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    let t = &r["resident"];
    let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k} in {t}"));
    (n("hits"), n("misses"), n("entries"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_come_back_from_the_device_until_blocks_leave_the_store() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let config = ServeConfig {
        resident_mb: 64,
        ..ServeConfig::default()
    };
    let (rag, app) = start(&f, config);
    let question = "Who was the last resident keeper of the Varrow Point Lighthouse?";

    let first = ask(&app, question).await;
    assert_eq!(resident(&app).await, (0, 2, 2), "both chunks read and kept");
    let again = ask(&app, question).await;
    assert_eq!(resident(&app).await, (2, 2, 2), "both chunks from the tier");
    assert_eq!(first["answer"], again["answer"]);
    let (_, _, metrics) = call(&app, "GET", "/metrics", None, None).await;
    for line in ["ragkv_resident_hits_total 2", "ragkv_resident_chunks 2"] {
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }

    // A document the question does not retrieve leaves: every entry is read again (the tier
    // cannot tell which blocks went), with the same answer.
    let cited: Vec<&str> = first["citations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["doc_id"].as_str().unwrap())
        .collect();
    let other = [
        "sourdough-starter.txt",
        "meridian-railway.md",
        "osterfeld-chess.md",
    ]
    .into_iter()
    .find(|d| !cited.contains(d))
    .unwrap();
    let engine = f.engine.clone();
    let deleted = tokio::task::spawn_blocking(move || engine.delete_document(other))
        .await
        .unwrap()
        .unwrap();
    assert!(deleted);
    let after = ask(&app, question).await;
    assert_eq!(
        resident(&app).await,
        (2, 4, 2),
        "read again after the removal"
    );
    assert_eq!(first["answer"], after["answer"]);
    let last = ask(&app, question).await;
    assert_eq!(resident(&app).await, (4, 4, 2));
    assert_eq!(first["answer"], last["answer"]);

    // Off by default: nothing kept, nothing looked up.
    teardown(app, rag, f).await;
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let (rag, app) = start(&f, ServeConfig::default());
    ask(&app, question).await;
    ask(&app, question).await;
    assert_eq!(resident(&app).await, (0, 0, 0));
    teardown(app, rag, f).await;
}

/// Answers from resident chunks equal answers read from the store, for the strategies that
/// use a chunk's stored values as they are (`naive`: its keys too) and for each cache dtype:
/// nothing a query does to its chunks writes into the tensors the tier keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resident_chunks_answer_as_stored_ones_for_every_cache_and_strategy() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let question = "How long is the Meridian Railway?";
    let ask_with = |app: axum::Router, assembly: &'static str| async move {
        let q = json!({"question": question, "top_k": 2, "max_tokens": 12, "stream": false,
                       "assembly": assembly});
        let (s, r, text) = call(&app, "POST", "/v1/query", Some(q), None).await;
        assert_eq!(s, StatusCode::OK, "{text}");
        r["answer"].as_str().unwrap().to_string()
    };
    for cache in [CacheDtype::F16, CacheDtype::Q8] {
        let mut stored = Vec::new();
        let config = ServeConfig {
            cache_dtype: cache,
            ..ServeConfig::default()
        };
        let (rag, app) = start(&f, config);
        for assembly in ["naive", "link:2"] {
            stored.push(ask_with(app.clone(), assembly).await);
        }
        release(&f, app, rag).await;
        let config = ServeConfig {
            cache_dtype: cache,
            resident_mb: 64,
            ..ServeConfig::default()
        };
        let (rag, app) = start(&f, config);
        for (assembly, want) in ["naive", "link:2"].into_iter().zip(&stored) {
            // Read and kept, then twice from the tier.
            for round in 0..3 {
                let got = ask_with(app.clone(), assembly).await;
                assert_eq!(&got, want, "{cache:?} {assembly} round {round}");
            }
        }
        let (hits, _, _) = resident(&app).await;
        assert!(hits >= 8, "{hits} resident hits");
        release(&f, app, rag).await;
    }
    tokio::task::spawn_blocking(move || f.close())
        .await
        .unwrap();
}

/// Drops a server and waits until its threads have let go of the fixture's engine.
async fn release(f: &common::router::Fixture, app: axum::Router, rag: std::sync::Arc<serve::Rag>) {
    drop(app);
    drop(rag);
    let start = std::time::Instant::now();
    while std::sync::Arc::strong_count(&f.engine) > 1 {
        assert!(start.elapsed().as_secs() < 30, "the engine is still held");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A server starting with a resident tier fills it in the background with the chunks read
/// most often before it started (`serve.resident_warm`), so their first query finds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_server_warms_the_tier_with_the_most_read_chunks() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let question = "Who won the Osterfeld chess tournament?";
    let (rag, app) = start(&f, ServeConfig::default());
    let before = ask(&app, question).await;
    release(&f, app, rag).await;

    let config = ServeConfig {
        resident_mb: 64,
        ..ServeConfig::default()
    };
    let (rag, app) = start(&f, config.clone());
    let t = std::time::Instant::now();
    while resident(&app).await.2 < 2 {
        assert!(t.elapsed().as_secs() < 60, "the tier was not warmed");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let warm = ask(&app, question).await;
    assert_eq!(resident(&app).await.0, 2, "both chunks found in the tier");
    assert_eq!(before["answer"], warm["answer"]);
    release(&f, app, rag).await;

    // Without the warm-up the first query reads the store.
    let (rag, app) = start(
        &f,
        ServeConfig {
            resident_warm: false,
            ..config
        },
    );
    assert_eq!(resident(&app).await.2, 0);
    ask(&app, question).await;
    assert_eq!(resident(&app).await.0, 0);
    teardown(app, rag, f).await;
}
