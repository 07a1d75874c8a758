//! Router tests through `app()`, and a real-socket SSE test: SmolLM2-135M, MiniLM and the
//! example corpus (fetched/shipped by the project).

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use serve::{AppState, Rag, ServeConfig};
use tower::ServiceExt;

use common::router::{app_with, call, fixture, send_query, serve, start};

const QUESTION: &str = "Who was the last resident keeper of the Varrow Point Lighthouse?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_routes_validate_answer_and_match_full_recompute() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let app = app_with(&f, ServeConfig::default());

    let (s, _, body) = call(&app, "GET", "/healthz", None, None).await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "ok"));

    // Bad input: clear 4xx with a message naming the problem.
    for (body, needle) in [
        (json!({"question": "  "}), "question"),
        (json!({"question": "x", "top_k": 0}), "top_k"),
        (json!({"question": "x", "top_k": 999}), "top_k"),
        (json!({"question": "x", "max_tokens": 100000}), "max_tokens"),
        (json!({"question": "x", "temperature": -1.0}), "temperature"),
        (json!({"question": "x", "kv": "maybe"}), "kv"),
        (json!({"question": "x", "assembly": "blend"}), "assembly"),
        (
            json!({"question": "x", "assembly": "link:0"}),
            "tokens per chunk",
        ),
        (
            json!({"question": "x", "assembly": "query-aware:2"}),
            "share",
        ),
        (json!({"question": "x".repeat(5000)}), "question"),
        (json!({"question": "x", "colour": "blue"}), "colour"),
    ] {
        let (s, j, text) = call(&app, "POST", "/v1/query", Some(body.clone()), None).await;
        assert!(s.is_client_error(), "{body}: {s} {text}");
        let msg = j["error"]["message"].as_str().unwrap_or(&text).to_string();
        assert!(msg.contains(needle), "{body}: {msg}");
    }

    // A retrieved question answered from stored KV.
    let q = json!({"question": QUESTION, "top_k": 1, "stream": false, "max_tokens": 24});
    let (s, on, text) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(on["citations"][0]["doc_id"], "varrow-lighthouse.md", "{on}");
    assert_eq!(on["citations"][0]["kv"], "stored");
    assert_eq!(
        (on["kv_hits"].as_u64(), on["kv_misses"].as_u64()),
        (Some(1), Some(0))
    );
    assert!(on["timings"]["first_token_ms"].as_f64().unwrap() > 0.0);
    // One query at a time: the model was idle during the load, nothing was hidden.
    assert!(on["timings"]["load_ms"].as_f64().unwrap() > 0.0, "{on}");
    assert_eq!(on["timings"]["load_hidden_ms"].as_f64(), Some(0.0), "{on}");
    assert!(!on["answer"].as_str().unwrap().is_empty());

    // kv=off recomputes the chunk: greedy output is identical.
    let (s, off, _) = call(&app, "POST", "/v1/query?kv=off", Some(q.clone()), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(off["citations"][0]["kv"], "off");
    assert_eq!(off["answer"], on["answer"], "stored KV changed the answer");

    // Assembly per request: in the body, or in the URL (an unescaped `+` arrives as a space).
    let mut full = q.clone();
    full["assembly"] = json!("full");
    let (s, j, text) = call(&app, "POST", "/v1/query", Some(full), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(
        (j["citations"][0]["kv"].as_str(), j["kv_hits"].as_u64()),
        (Some("full"), Some(0))
    );
    let (s, j, text) = call(
        &app,
        "POST",
        "/v1/query?assembly=reposition+recompute",
        Some(q.clone()),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(j["assembly"], "reposition+recompute");
    assert!(j["recomputed_tokens"].as_u64().unwrap() > 0, "{j}");

    // A chunk whose KV is gone is prefilled inline (same answer) and written back.
    let hash = f
        .engine
        .corpus()
        .index()
        .document("varrow-lighthouse.md")
        .unwrap()[0]
        .1
        .doc_hash
        .clone();
    f.engine
        .corpus()
        .store()
        .delete_document(&ingest::kv_doc("varrow-lighthouse.md", &hash))
        .unwrap();
    let (_, miss, _) = call(&app, "POST", "/v1/query", Some(q.clone()), None).await;
    assert_eq!(miss["citations"][0]["kv"], "recomputed", "{miss}");
    assert_eq!(miss["kv_misses"], 1);
    assert_eq!(miss["answer"], on["answer"]);
    let mut back = Value::Null;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        back = call(&app, "POST", "/v1/query", Some(q.clone()), None)
            .await
            .1;
        if back["kv_hits"] == 1 {
            break;
        }
    }
    assert_eq!(back["kv_hits"], 1, "the KV was not written back: {back}");

    // OpenAI-compatible, non-streaming.
    let chat = json!({"model": "ragkv", "messages": [
        {"role": "system", "content": "ignored"}, {"role": "user", "content": QUESTION}],
        "max_tokens": 24});
    let (s, j, text) = call(&app, "POST", "/v1/chat/completions", Some(chat), None).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["choices"][0]["message"]["role"], "assistant");
    assert!(j["usage"]["completion_tokens"].as_u64().unwrap() > 0);

    // Metrics and stats.
    let (_, _, metrics) = call(&app, "GET", "/metrics", None, None).await;
    assert!(
        metrics.contains("ragkv_time_to_first_token_seconds_count"),
        "{metrics}"
    );
    assert!(metrics.contains("ragkv_kv_hits_total"));
    assert!(metrics.contains("ragkv_kv_load_hidden_seconds_total"));
    let (_, stats, _) = call(&app, "GET", "/v1/stats", None, None).await;
    assert!(
        stats["queries"]["admitted"].as_u64().unwrap() >= 4,
        "{stats}"
    );
    // The store's read counters are reported (what the read-ahead thread fetched is part of
    // what was read).
    let read = stats["kv"]["bytes_read"].as_u64().unwrap();
    let ahead = stats["kv"]["bytes_read_ahead"].as_u64().unwrap();
    assert!(ahead <= read, "{stats}");
    // What the loader announced ahead of its reads is reported too.
    assert!(stats["kv"]["bytes_prefetched"].is_u64(), "{stats}");

    // A web page cannot drive the server: foreign Host (DNS rebinding), foreign Origin or a
    // cross-site fetch are refused before any route runs, with a JSON 403.
    for (name, value) in [
        ("host", "attacker.example:8080"),
        ("origin", "https://attacker.example"),
        ("sec-fetch-site", "cross-site"),
    ] {
        for (method, uri) in [
            ("POST", "/v1/admin/gc"),
            ("GET", "/v1/stats"),
            ("POST", "/v1/query"),
        ] {
            let req = Request::builder()
                .method(method)
                .uri(uri)
                .header(name, value)
                .body(Body::empty())
                .unwrap();
            let resp = app.clone().oneshot(req).await.unwrap();
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let j: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(status, StatusCode::FORBIDDEN, "{name}: {value} {uri}: {j}");
            assert_eq!(j["error"]["type"], "permission_error", "{j}");
        }
    }
    let (_, after, _) = call(&app, "GET", "/v1/stats", None, None).await;
    assert_eq!(
        after["queries"]["admitted"], stats["queries"]["admitted"],
        "a refused query was admitted"
    );
    // The server's own names pass.
    for host in ["127.0.0.1:8080", "localhost:8080", "[::1]:8080"] {
        let req = Request::builder()
            .uri("/healthz")
            .header("host", host)
            .header("origin", format!("http://{host}"))
            .body(Body::empty())
            .unwrap();
        assert_eq!(
            app.clone().oneshot(req).await.unwrap().status(),
            StatusCode::OK,
            "{host}"
        );
    }
    drop(app);
    tokio::task::spawn_blocking(move || f.close())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_token_and_documents_round_trip() {
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let app = app_with(
        &f,
        ServeConfig {
            admin_token: "s3cret".into(),
            ..ServeConfig::default()
        },
    );
    let doc = json!({"documents": [{"id": "notes/ferry.txt",
        "text": "The Keller Bay ferry leaves at 7:10 every morning and takes forty minutes."}]});
    let (s, _, _) = call(&app, "POST", "/v1/documents", Some(doc.clone()), None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(
        &app,
        "POST",
        "/v1/documents",
        Some(doc.clone()),
        Some("wrong"),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, r, text) = call(&app, "POST", "/v1/documents", Some(doc), Some("s3cret")).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(r["docs_new"], 1, "{r}");
    let (s, d, _) = call(&app, "GET", "/v1/documents/notes%2Fferry.txt", None, None).await;
    assert_eq!(s, StatusCode::OK, "{d}");
    assert_eq!(d["chunks"].as_array().unwrap().len(), 1);
    let q = json!({"question": "When does the Keller Bay ferry leave?", "top_k": 1,
                   "stream": false, "max_tokens": 16, "documents": ["notes/ferry.txt"]});
    let (_, a, _) = call(&app, "POST", "/v1/query", Some(q), None).await;
    assert_eq!(a["citations"][0]["doc_id"], "notes/ferry.txt", "{a}");
    assert_eq!(a["kv_hits"], 1);
    let (s, _, _) = call(
        &app,
        "DELETE",
        "/v1/documents/notes%2Fferry.txt",
        None,
        None,
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(
        &app,
        "DELETE",
        "/v1/documents/notes%2Fferry.txt",
        None,
        Some("s3cret"),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, _) = call(&app, "GET", "/v1/documents/notes%2Fferry.txt", None, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(f.engine.check(false).unwrap().ok());

    // Maintenance routes: admin only, validated, one job at a time.
    let remat = "/v1/admin/rematerialize";
    let (s, _, _) = call(&app, "POST", remat, None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, e, _) = call(
        &app,
        "POST",
        remat,
        Some(json!({"scope": "some"})),
        Some("s3cret"),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{e}");
    let dry = json!({"scope": "hot", "min_reads": 1, "limit": 2, "dry_run": true});
    let (s, r, text) = call(&app, "POST", remat, Some(dry), Some("s3cret")).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(
        (r["dry_run"].clone(), r["planned"].clone()),
        (json!(true), json!(0)),
        "{r}"
    );
    assert!(r["present"].as_u64().unwrap() > 0, "{r}");
    {
        // While a job runs (here: maintenance held off by hand), requests get 409.
        let rag = Rag::start(f.engine.clone(), ServeConfig::default()).unwrap();
        let maintenance = rag.maintenance.clone();
        let app2 = serve::app(AppState::new(rag));
        // A thread holds maintenance off, as a running job would.
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (held, is_held) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _guard = maintenance.try_exclusive().unwrap();
            held.send(()).unwrap();
            released.recv().unwrap();
        });
        is_held.recv().unwrap();
        let (s, e, _) = call(&app2, "POST", "/v1/admin/gc", None, None).await;
        assert_eq!(s, StatusCode::CONFLICT, "{e}");
        release.send(()).unwrap();
        holder.join().unwrap();
        let (s, r, _) = call(&app2, "POST", "/v1/admin/gc", None, None).await;
        assert_eq!(s, StatusCode::OK, "{r}");
    }
    let (s, r, text) = call(&app, "POST", "/v1/admin/gc", None, Some("s3cret")).await;
    assert_eq!(s, StatusCode::OK, "{text}");
    assert_eq!(r["namespaces_dropped"], json!([]), "{r}");
    drop(app);
    tokio::task::spawn_blocking(move || f.close())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_capacity_is_429_and_sse_streams_over_a_real_socket() {
    use tokio::io::AsyncReadExt;
    let f = tokio::task::spawn_blocking(fixture).await.unwrap();
    let (rag, app) = start(
        &f,
        ServeConfig {
            max_inflight: 1,
            ..ServeConfig::default()
        },
    );
    let server = serve(app).await;
    let addr = server.addr;

    let body = json!({"question": QUESTION, "top_k": 2, "max_tokens": 48});
    let mut sock = send_query(addr, &body).await;

    // While it runs, a second query is refused with 429 and Retry-After.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut s2 = send_query(addr, &body).await;
    let mut buf = vec![0u8; 4096];
    let n = s2.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_lowercase();
    assert!(head.starts_with("http/1.1 429"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");

    // The first streams token events, then a done event with citations and timings.
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !text.contains("event: done") {
        let n = tokio::time::timeout_at(deadline, sock.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "connection closed early: {text}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(
        text.to_lowercase()
            .contains("content-type: text/event-stream"),
        "{text}"
    );
    assert!(text.matches("event: token").count() >= 2, "{text}");
    let done = text.split("event: done").nth(1).unwrap();
    assert!(
        done.contains("\"citations\"") && done.contains("\"first_token_ms\""),
        "{done}"
    );
    drop(sock);

    // A client that goes away mid-answer cancels its generation: the model is free again
    // long before 1,000 tokens could have been generated.
    let long = json!({"question": "Count from 1 to 1000, separated by commas.",
                      "top_k": 1, "max_tokens": 1000});
    let mut s3 = send_query(addr, &long).await;
    let mut got = String::new();
    while !got.contains("event: token") {
        let n = s3.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let cancelled = |r: &Rag| {
        r.metrics
            .cancelled
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = cancelled(&rag);
    drop(s3);
    let t = std::time::Instant::now();
    while cancelled(&rag) == before {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "generation was not cancelled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        rag.metrics
            .inflight
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    server.teardown(rag, f).await;
}
