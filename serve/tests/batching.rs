//! Continuous batching in the serving pipeline: answers given in a batch equal the answers
//! given alone (greedy, and sampled with a seed), a client that leaves mid-batch frees its
//! place for a waiting query while the others go on, and the KV budget bounds the batch
//! (queries wait for room; one that can never fit is refused). SmolLM2-135M, MiniLM, the
//! example corpus.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{json, Value};
use serve::{Rag, ServeConfig};
use tokio::io::AsyncReadExt;

use common::router::{call, fixture, send_query, serve, start, teardown};

fn questions() -> Vec<Value> {
    [
        (
            "Who was the last resident keeper of the Varrow Point Lighthouse?",
            None,
        ),
        ("How long is the Meridian Railway?", None),
        ("How often should a sourdough starter be fed?", Some(3)),
        ("Who won the Osterfeld chess tournament?", None),
        ("What gauge is the Meridian Railway?", None),
    ]
    .into_iter()
    .map(|(q, seed)| {
        let mut v = json!({"question": q, "top_k": 2, "max_tokens": 24, "stream": false});
        if let Some(seed) = seed {
            // Sampled among the 5 likeliest (over the whole vocabulary, float rounding of
            // the batched products could reorder the near-equal tail the sampler walks).
            v["temperature"] = json!(0.8);
            v["top_k"] = json!(5);
            v["seed"] = json!(seed);
        }
        v
    })
    .collect()
}

fn steps(rag: &Rag) -> (u64, u64) {
    (
        rag.metrics.batch_steps.load(Ordering::SeqCst),
        rag.metrics.batch_rows.load(Ordering::SeqCst),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_in_a_batch_equal_answers_alone() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let (rag, app) = start(&f, ServeConfig::default());
    let qs = questions();
    let mut alone = Vec::new();
    for q in &qs {
        let (s, r, text) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
        assert_eq!(s, StatusCode::OK, "{text}");
        alone.push(r);
    }
    let (s0, r0) = steps(&rag);
    assert_eq!(r0, s0, "queries sent one at a time ran alone");
    let together = futures_util::future::join_all(
        qs.iter()
            .map(|q| call(&app, "POST", "/v1/query", Some(q.clone()), None)),
    )
    .await;
    let (s1, r1) = steps(&rag);
    let mean = (r1 - r0) as f64 / (s1 - s0) as f64;
    assert!(
        mean > 1.5,
        "concurrent queries were not batched: mean batch {mean:.2}"
    );
    for ((q, a), (s, b, text)) in qs.iter().zip(&alone).zip(&together) {
        assert_eq!(*s, StatusCode::OK, "{text}");
        assert_eq!(a["answer"], b["answer"], "{q}");
        assert_eq!(a["finish_reason"], b["finish_reason"], "{q}");
        assert_eq!(a["completion_tokens"], b["completion_tokens"], "{q}");
    }
    teardown(app, rag, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chunks_loaded_side_by_side_answer_as_loaded_one_after_another() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let qs: Vec<Value> = questions()
        .into_iter()
        .take(3)
        .map(|mut q| {
            q["top_k"] = json!(3);
            q
        })
        .collect();
    // One thread loads a query's chunks one after the other (the CPU's default), then three
    // side by side: the same chunks, the same answers.
    let ask = |threads: usize| {
        let (rag, app) = start(
            &f,
            ServeConfig {
                load_threads: threads,
                ..ServeConfig::default()
            },
        );
        let qs = qs.clone();
        async move {
            let mut got = Vec::new();
            for q in &qs {
                let (s, r, text) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
                assert_eq!(s, StatusCode::OK, "{text}");
                assert_eq!(r["kv_hits"], json!(3), "{r}");
                got.push((r["answer"].clone(), r["completion_tokens"].clone()));
            }
            (rag, app, got)
        }
    };
    let (rag, app, one) = ask(1).await;
    rag.shutdown();
    drop((rag, app));
    let (rag, app, three) = ask(3).await;
    assert_eq!(one, three);
    teardown(app, rag, f).await;
}

/// Sends a streaming query over `addr` and returns the socket once a token event arrived.
async fn streaming(addr: std::net::SocketAddr, body: Value) -> tokio::net::TcpStream {
    let mut sock = send_query(addr, &body).await;
    let mut got = String::new();
    let mut buf = vec![0u8; 4096];
    while !got.contains("event: token") {
        let n = tokio::time::timeout(Duration::from_secs(60), sock.read(&mut buf))
            .await
            .expect("no token within 60 s")
            .unwrap();
        assert!(n > 0, "closed early: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    sock
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_mid_batch_frees_its_place() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let (rag, app) = start(
        &f,
        ServeConfig {
            max_batch: 2,
            ..ServeConfig::default()
        },
    );
    let server = serve(app).await;
    let addr = server.addr;
    let long = json!({"question": "Count from 1 to 1000, separated by commas.",
                      "top_k": 1, "max_tokens": 1000});
    // Two long answers fill the batch.
    let leaver = streaming(addr, long.clone()).await;
    let mut stayer = streaming(addr, long).await;
    assert_eq!(rag.metrics.batch_size.load(Ordering::SeqCst), 2);
    // A third query waits for a place; the first client leaves, and it gets that place
    // while the second answer is still being generated.
    let third = tokio::spawn(async move {
        let q = json!({"question": "How long is the Meridian Railway?", "top_k": 1,
                       "max_tokens": 4, "stream": false});
        let mut sock = send_query(addr, &q).await;
        let mut out = String::new();
        sock.read_to_string(&mut out).await.unwrap();
        out
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !third.is_finished(),
        "the batch was full: the third query must wait"
    );
    let cancelled = rag.metrics.cancelled.load(Ordering::SeqCst);
    drop(leaver);
    let out = tokio::time::timeout(Duration::from_secs(60), third)
        .await
        .expect("the third query never got a place")
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(rag.metrics.cancelled.load(Ordering::SeqCst) > cancelled);
    // The second answer is still streaming: the place came from the client that left.
    let mut buf = vec![0u8; 65536];
    let mut text = String::new();
    while let Ok(Ok(n)) =
        tokio::time::timeout(Duration::from_millis(200), stayer.read(&mut buf)).await
    {
        assert!(n > 0, "the second answer's connection closed");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
        if text.len() > 4096 {
            break;
        }
    }
    assert!(
        !text.contains("event: done"),
        "the second answer had finished: {text}"
    );
    drop(stayer);
    let t = std::time::Instant::now();
    while rag.metrics.inflight.load(Ordering::SeqCst) > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "a slot was never given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rag.metrics.batch_size.load(Ordering::SeqCst), 0);
    assert_eq!(rag.metrics.kv_reserved_bytes.load(Ordering::SeqCst), 0);
    server.teardown(rag, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kv_budget_bounds_the_batch() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let q = json!({"question": "How long is the Meridian Railway?", "top_k": 3,
                   "max_tokens": 16, "stream": false});
    // What one such query reserves: its prompt and answer, at the decoding cache's bytes per
    // token (`serve.cache_dtype`).
    let (rag, app) = start(&f, ServeConfig::default());
    let (s, r, text) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    rag.shutdown();
    drop((rag, app));
    let mut layout = f.engine.corpus().model().kv_layout().unwrap();
    layout.dtype = model::kv_schema_dtype(ServeConfig::default().cache_dtype.dtype()).unwrap();
    let per_token = layout.bytes_per_token();
    let need = (r["prompt_tokens"].as_u64().unwrap() as usize + 17) * per_token;
    // A budget that holds one of them, not two.
    let budget_mb = need.div_ceil(1 << 20);
    assert!(2 * need > budget_mb << 20);
    let config = ServeConfig {
        kv_budget_mb: budget_mb,
        default_top_k: 1,
        default_max_tokens: 1,
        ..ServeConfig::default()
    };
    let (rag, app) = start(&f, config);
    let (s0, r0) = steps(&rag);
    let answers = futures_util::future::join_all(
        (0..3).map(|_| call(&app, "POST", "/v1/query", Some(q.clone()), None)),
    )
    .await;
    for (s, a, text) in &answers {
        assert_eq!(*s, StatusCode::OK, "{text}");
        assert_eq!(a["answer"], r["answer"]);
    }
    let (s1, r1) = steps(&rag);
    assert!(s1 > s0);
    assert_eq!(
        r1 - r0,
        s1 - s0,
        "two queries shared a step past the budget"
    );
    // A query that could never fit is refused with the reason.
    let big = json!({"question": "How long is the Meridian Railway?", "top_k": 3,
                     "max_tokens": 1000, "stream": false});
    let (s, e, text) = call(&app, "POST", "/v1/query", Some(big), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{text}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kv_budget_mb"),
        "{e}"
    );
    // A budget that cannot hold one default query is refused at start-up.
    let e = Rag::start(
        f.engine.clone(),
        ServeConfig {
            kv_budget_mb: 1,
            ..ServeConfig::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            serve::Error::Config {
                key: "serve.kv_budget_mb",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().starts_with("serve.kv_budget_mb: "), "{e}");
    teardown(app, rag, f).await;
}
