//! The resident tier (`serve.resident_mb`): a chunk asked for again comes from the model's
//! device with the answer unchanged, and once anything leaves the store every entry is read
//! again. SmolLM2-135M, MiniLM, the example corpus.

mod common;

use axum::http::StatusCode;
use serde_json::{json, Value};
use serve::ServeConfig;

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
