//! The pipeline under faults and hostile clients: panics in each worker are contained and
//! reported, a stopped worker fails `/healthz`, admission follows the job and not the
//! response, every error is JSON with the right status, shutdown stores pending write-backs,
//! and the server loop cuts off slow clients. SmolLM2-135M, MiniLM, the example corpus.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{json, Value};
use serve::{AppState, Rag, ServeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::router::{call, fixture, send_healthz, serve_limited, start, teardown};

const QUESTION: &str = "Who was the last resident keeper of the Varrow Point Lighthouse?";

fn ask(max_tokens: usize) -> Value {
    json!({"question": QUESTION, "top_k": 2, "max_tokens": max_tokens, "stream": false})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_worker_fails_one_query_and_the_pipeline_goes_on() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let (rag, app) = start(&f, ServeConfig::default());
    for (name, flag) in [
        ("loader", &rag.faults().panic_loader),
        ("model", &rag.faults().panic_model),
    ] {
        flag.store(true, Ordering::SeqCst);
        let (s, e, text) = call(&app, "POST", "/v1/query", Some(ask(4)), None).await;
        assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{name}: {text}");
        // A fault of the server's own: the client gets a generic message (the panic's
        // text goes to the log), and the panic is counted.
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("internal server error") && !message.contains("injected"),
            "{e}"
        );
        assert!(
            rag.metrics.worker_panics.load(Ordering::SeqCst) > 0,
            "{name}"
        );
        // The slot came back and the next query is answered.
        assert_eq!(rag.metrics.inflight.load(Ordering::SeqCst), 0, "{name}");
        let (s, r, text) = call(&app, "POST", "/v1/query", Some(ask(4)), None).await;
        assert_eq!(s, StatusCode::OK, "{name}: {text}");
        assert!(r["answer"].is_string());
        let (s, _, body) = call(&app, "GET", "/healthz", None, None).await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, "ok"));
    }
    assert_eq!(rag.metrics.worker_panics.load(Ordering::SeqCst), 2);
    let (_, _, metrics) = call(&app, "GET", "/metrics", None, None).await;
    assert!(metrics.contains("ragkv_worker_panics_total 2"), "{metrics}");

    // A write-back that panics loses only that write; the next one is stored.
    let doc = json!({"documents": [{"id": "lazy-doc", "text":
        "The Quillmere ferry leaves Harrow Quay at seven and returns at noon."}],
        "materialize": "none"});
    let (s, _, text) = call(&app, "POST", "/v1/documents", Some(doc), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    rag.faults().panic_writeback.store(true, Ordering::SeqCst);
    let q = json!({"question": "When does the Quillmere ferry leave?", "top_k": 1,
                   "max_tokens": 2, "stream": false, "documents": ["lazy-doc"]});
    let (s, r, _) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
    assert_eq!(
        (s, r["kv_misses"].as_u64()),
        (StatusCode::OK, Some(1)),
        "{r}"
    );
    let t = std::time::Instant::now();
    while rag.metrics.worker_panics.load(Ordering::SeqCst) < 3 {
        assert!(t.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, r, _) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
    assert_eq!(
        r["kv_misses"].as_u64(),
        Some(1),
        "the panicked write was lost: {r}"
    );
    let t = std::time::Instant::now();
    while rag.metrics.rematerialized.load(Ordering::SeqCst) < 1 {
        assert!(t.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, r, _) = call(&app, "POST", "/v1/query", Some(q), None).await;
    assert_eq!(r["kv_hits"].as_u64(), Some(1), "{r}");

    // A worker that stops (a bug outside any job) makes /healthz fail, naming it.
    rag.faults().kill_loader.store(true, Ordering::SeqCst);
    let (s, e, _) = call(&app, "POST", "/v1/query", Some(ask(2)), None).await;
    assert!(s.is_server_error(), "{e}");
    let t = std::time::Instant::now();
    loop {
        let (s, e, _) = call(&app, "GET", "/healthz", None, None).await;
        if s == StatusCode::SERVICE_UNAVAILABLE {
            assert!(
                e["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("ragkv-loader"),
                "{e}"
            );
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "healthz stayed ok");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    teardown(app, rag, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_keeps_its_slot_until_its_job_is_gone() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let (rag, app) = start(
        &f,
        ServeConfig {
            max_inflight: 1,
            ..ServeConfig::default()
        },
    );
    // Retrieval takes 1.5 s: the first client sends its query and leaves at once.
    rag.faults()
        .retrieval_delay_ms
        .store(1500, Ordering::SeqCst);
    let app2 = app.clone();
    let first = tokio::spawn(async move {
        let q = json!({"question": QUESTION, "top_k": 1, "max_tokens": 2});
        let _ = tokio::time::timeout(
            Duration::from_millis(100),
            call(&app2, "POST", "/v1/query", Some(q), None),
        )
        .await;
    });
    first.await.unwrap();
    // Its job still runs: a second query is refused rather than admitted past the limit.
    let (s, e, _) = call(&app, "POST", "/v1/query", Some(ask(2)), None).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{e}");
    assert_eq!(e["error"]["type"], "rate_limit_error");
    // Once the abandoned job has left the pipeline, the slot is free again.
    let t = std::time::Instant::now();
    while rag.metrics.inflight.load(Ordering::SeqCst) > 0 {
        assert!(t.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rag.faults().retrieval_delay_ms.store(0, Ordering::SeqCst);
    let (s, _, text) = call(&app, "POST", "/v1/query", Some(ask(2)), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    teardown(app, rag, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_json_with_its_status() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let config = ServeConfig {
        request_timeout_ms: 300,
        max_body_bytes: 4096,
        ..ServeConfig::default()
    };
    let (rag, app) = start(&f, config);
    let cases: Vec<(&str, &str, Option<Value>, u16)> = vec![
        ("GET", "/no/such/route", None, 404),
        ("PUT", "/v1/query", None, 405),
        (
            "POST",
            "/v1/query?assembly=naive&assembly=full",
            Some(ask(2)),
            400,
        ),
        ("POST", "/v1/query?kv=maybe", Some(ask(2)), 400),
        ("GET", "/v1/documents/%FF%FE", None, 400),
        (
            "POST",
            "/v1/documents",
            Some(json!({"documents": [{"id": "x", "text": "y".repeat(5000)}]})),
            413,
        ),
        // top_k x chunk_tokens + max_tokens past the model's context (8,192 positions).
        (
            "POST",
            "/v1/query",
            Some(json!({"question": "q", "top_k": 16, "max_tokens": 1024})),
            400,
        ),
    ];
    for (method, uri, body, want) in cases {
        let (s, e, text) = call(&app, method, uri, body, None).await;
        assert_eq!(s.as_u16(), want, "{method} {uri}: {text}");
        assert!(e["error"]["message"].is_string(), "{method} {uri}: {text}");
    }
    // A non-streaming query past request_timeout_ms: 504, not 500.
    rag.faults()
        .retrieval_delay_ms
        .store(1000, Ordering::SeqCst);
    let (s, e, text) = call(&app, "POST", "/v1/query", Some(ask(2)), None).await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT, "{text}");
    assert_eq!(e["error"]["type"], "timeout_error");
    rag.faults().retrieval_delay_ms.store(0, Ordering::SeqCst);

    // Some documents failed: 207 with the report; all failed: 422.
    let docs = json!({"documents": [{"id": "good", "text": "A fine document about ferries."},
                                    {"id": "bad", "text": "   "}], "materialize": "none"});
    let (s, r, text) = call(&app, "POST", "/v1/documents", Some(docs), None).await;
    assert_eq!(s, StatusCode::MULTI_STATUS, "{text}");
    assert_eq!(
        (r["docs_new"].as_u64(), r["docs_failed"].as_u64()),
        (Some(1), Some(1))
    );
    let docs = json!({"documents": [{"id": "bad", "text": ""}]});
    let (s, r, text) = call(&app, "POST", "/v1/documents", Some(docs), None).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert_eq!(r["failures"].as_array().map(Vec::len), Some(1), "{r}");
    assert!(r["error"]["message"].is_string(), "{r}");
    teardown(app, rag, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stores_pending_write_backs_and_joins_the_threads() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let (rag, app) = start(&f, ServeConfig::default());
    let doc = json!({"documents": [{"id": "late", "text":
        "The Orrin tide gauge was moved to the north pier in the spring."}],
        "materialize": "none"});
    let (s, _, text) = call(&app, "POST", "/v1/documents", Some(doc), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    // Long enough that the write-back is still pending when the answer is back, even on a
    // machine busy with other work (1.5 s was not, under a parallel build).
    rag.faults()
        .writeback_delay_ms
        .store(4000, Ordering::SeqCst);
    let q = json!({"question": "Where was the Orrin tide gauge moved?", "top_k": 1,
                   "max_tokens": 2, "stream": false, "documents": ["late"]});
    let (s, r, _) = call(&app, "POST", "/v1/query", Some(q), None).await;
    assert_eq!(
        (s, r["kv_misses"].as_u64()),
        (StatusCode::OK, Some(1)),
        "{r}"
    );
    assert_eq!(rag.metrics.rematerialized.load(Ordering::SeqCst), 0);
    let r2 = rag.clone();
    tokio::task::spawn_blocking(move || r2.shutdown())
        .await
        .unwrap();
    assert_eq!(rag.metrics.rematerialized.load(Ordering::SeqCst), 1);
    let engine = f.engine.clone();
    let stored = tokio::task::spawn_blocking(move || {
        let chunks = engine.corpus().index().document("late").unwrap();
        let tokens = engine.corpus().chunk_tokens(&chunks[0].1.text).unwrap();
        engine
            .corpus()
            .store()
            .probe(engine.corpus().namespace(), &tokens)
            .unwrap()
            == tokens.len()
    })
    .await
    .unwrap();
    assert!(stored, "the pending write-back was lost at shutdown");
    // After shutdown, queries and maintenance jobs get 503.
    let (s, _, text) = call(&app, "POST", "/v1/query", Some(ask(2)), None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    for job in ["/v1/admin/rematerialize", "/v1/admin/gc"] {
        let (s, _, text) = call(&app, "POST", job, None, None).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{job}: {text}");
        assert!(text.contains("shutting down"), "{job}: {text}");
    }
    teardown(app, rag, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_and_connections_are_capped() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let config = ServeConfig {
        max_inflight: 2,
        max_connections: 2,
        header_timeout_ms: 500,
        body_timeout_ms: 500,
        ..ServeConfig::default()
    };
    let limits = serve::listen::Limits::from_config(&config);
    let (rag, app) = start(&f, config);
    let server = serve_limited(app, limits).await;
    let addr = server.addr;
    let read_all = |mut s: tokio::net::TcpStream| async move {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    };

    // Headers trickled: the connection is closed after the header timeout.
    let t = std::time::Instant::now();
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        .await
        .unwrap();
    let got = read_all(slow).await;
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(!got.contains("200 OK"), "{got}");

    // A body promised but not sent: 408 after the body timeout.
    let mut body = tokio::net::TcpStream::connect(addr).await.unwrap();
    body.write_all(
        format!("POST /v1/query HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{")
            .as_bytes(),
    )
    .await
    .unwrap();
    let got = read_all(body).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("\"error\""), "{got}");

    // At the cap, a new connection takes the place of the oldest one waiting for headers:
    // `a` (the oldest, idle) is closed, `b` stays, `c` is served at once.
    let mut a = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut b = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = std::time::Instant::now();
    let c = send_healthz(addr).await;
    let got = read_all(c).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(
        t.elapsed() < Duration::from_millis(450),
        "{:?}",
        t.elapsed()
    );
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(Duration::from_millis(300), a.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the oldest idle connection stayed open"
    );
    let open = tokio::time::timeout(Duration::from_millis(100), b.read(&mut buf)).await;
    assert!(open.is_err(), "a younger idle connection was closed too");
    drop((a, b));
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Connections with a request in progress are never closed for room: two requests
    // whose bodies are promised but not sent hold both slots, and a third connection waits
    // until one of them ends (408 after the body timeout).
    let post = format!(
        "POST /v1/query HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{"
    );
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(post.as_bytes()).await.unwrap();
        busy.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut c = send_healthz(addr).await;
    let early = tokio::time::timeout(Duration::from_millis(200), c.read(&mut buf)).await;
    assert!(early.is_err(), "served past the connection cap");
    let got = read_all(c).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    for s in busy {
        let got = read_all(s).await;
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    }

    server.teardown(rag, f).await;
}

/// A flood of connections that send half a request line and stall, four times the cap,
/// with the default 10 s header timeout: a well-formed request that comes after them is
/// answered within a second (each arrival pushes the oldest stalled connection out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_past_the_cap_do_not_keep_a_request_out() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let config = ServeConfig {
        max_inflight: 2,
        max_connections: 4,
        ..ServeConfig::default()
    };
    assert!(config.header_timeout_ms >= 10_000);
    let limits = serve::listen::Limits::from_config(&config);
    let (rag, app) = start(&f, config);
    let server = serve_limited(app, limits).await;
    let addr = server.addr;
    let mut stalled = Vec::new();
    for _ in 0..16 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /heal").await.unwrap();
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = std::time::Instant::now();
    let mut c = send_healthz(addr).await;
    let mut out = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(1), c.read_to_end(&mut out)).await;
    let got = String::from_utf8_lossy(&out);
    assert!(
        r.is_ok() && got.starts_with("HTTP/1.1 200"),
        "after {:?}: {got}",
        t.elapsed()
    );
    eprintln!(
        "answered after {:?} behind 16 stalled connections (cap 4)",
        t.elapsed()
    );
    drop(stalled);
    server.teardown(rag, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_stored_chunk_is_recomputed_and_replaced_by_the_write_back() {
    let dir = tempfile::tempdir().unwrap();
    let text = "The Brannock weir was rebuilt in granite after the great thaw. ".repeat(4);
    let d = dir.path().to_path_buf();
    let t2 = text.clone();
    let engine = tokio::task::spawn_blocking(move || {
        let source = ingest::Source::Docs(vec![ingest::Doc {
            id: "weir".into(),
            text: t2,
            metadata: Default::default(),
            origin: "weir".into(),
        }]);
        drop(common::engine(
            &d,
            ingest::IngestConfig::default(),
            source,
            1,
        ));
        // Flip payload bytes in every segment file while the store is closed.
        for seg in std::fs::read_dir(d.join("kv/segments")).unwrap() {
            let path = seg.unwrap().path();
            if !path.is_file() {
                continue;
            }
            let mut bytes = std::fs::read(&path).unwrap();
            for at in [bytes.len() / 3, bytes.len() / 2, 2 * bytes.len() / 3] {
                bytes[at] ^= 0x5a;
            }
            std::fs::write(&path, bytes).unwrap();
        }
        std::sync::Arc::new(common::open_engine(
            &d,
            ingest::IngestConfig::default(),
            model::DType::F16,
        ))
    })
    .await
    .unwrap();
    let rag = Rag::start(engine.clone(), ServeConfig::default()).unwrap();
    let app = serve::app(AppState::new(rag.clone()));
    let q = json!({"question": "What was the Brannock weir rebuilt in?", "top_k": 1,
                   "max_tokens": 2, "stream": false, "documents": ["weir"]});
    let (s, r, text) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(r["kv_misses"].as_u64(), Some(1), "{r}");
    assert_eq!(rag.metrics.kv_corrupt.load(Ordering::SeqCst), 1);
    let t = std::time::Instant::now();
    while rag.metrics.rematerialized.load(Ordering::SeqCst) < 1 {
        assert!(t.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The index entry pointed at the damaged record; the write-back replaced it.
    let (_, r, _) = call(&app, "POST", "/v1/query", Some(q), None).await;
    assert_eq!(r["kv_hits"].as_u64(), Some(1), "{r}");
    let e2 = engine.clone();
    let c = tokio::task::spawn_blocking(move || e2.check(false).unwrap())
        .await
        .unwrap();
    assert!(c.ok(), "{:?}", c.problems);
    drop(app);
    rag.shutdown();
    drop(rag);
    drop(engine);
}
