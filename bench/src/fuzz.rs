//! `ragkv bench fuzz`: thousands of generated bad requests to every route of a real server
//! (the example corpus, served in this process on a loopback socket through the production
//! server loop). Each request is well-framed HTTP/1.1 (`connection: close`) carrying one
//! fault: wrong JSON types, out-of-range values, unknown fields, deep nesting, truncated or
//! non-UTF-8 bodies, wrong content types, odd paths and ids, wrong methods, missing or wrong
//! tokens, foreign `Origin`/`Host`/`Sec-Fetch-Site`; a few valid queries are mixed in.
//!
//! Counted: 5xx answers (must be 0), error answers whose body is not the API's JSON error
//! (0), cross-site requests not refused with 403 (0), connections closed without an answer
//! (0, except after a truncated body). Afterwards a normal query must be answered.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use serve::ServeConfig;

use crate::{Error, Line};

/// Arguments of `ragkv bench fuzz`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Requests to send.
    #[arg(long, default_value_t = 5000)]
    pub requests: usize,
    /// Concurrent senders.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Seed of the generated requests.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Working directory (default: a fresh temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

const TOKEN: &str = "fuzz-admin-token";

/// One generated request and what it must not get.
struct Case {
    raw: Vec<u8>,
    /// Foreign origin or host: must be refused with 403.
    cross_site: bool,
    /// The body is cut short: the connection may close without an answer.
    truncated: bool,
    /// `HEAD`: the answer has no body, only its headers can be judged.
    head: bool,
    kind: &'static str,
}

#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    server_errors: AtomicU64,
    non_json_errors: AtomicU64,
    cross_site_accepted: AtomicU64,
    no_answer: AtomicU64,
    by_status: Mutex<std::collections::BTreeMap<u16, u64>>,
    examples: Mutex<Vec<String>>,
}

fn pick<'a, T>(rng: &mut SmallRng, xs: &'a [T]) -> &'a T {
    &xs[rng.gen_range(0..xs.len())]
}

/// A JSON value of a random wrong (or right) type.
fn junk(rng: &mut SmallRng) -> Value {
    match rng.gen_range(0..12) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(-1),
        3 => json!(0),
        4 => json!(1e300),
        5 => json!(u64::MAX),
        6 => json!("x".repeat(rng.gen_range(0..3000))),
        7 => json!([1, "a", null]),
        8 => json!({"nested": {"deeper": [1, 2]}}),
        9 => json!(-0.5),
        10 => json!("\u{0}\u{202e}\u{FFFF}<|im_start|>"),
        _ => json!(12345678901234567890.0),
    }
}

fn query_body(rng: &mut SmallRng, valid: bool) -> Value {
    let mut b = json!({"question": "How long is the Meridian Railway?", "top_k": 2,
                       "max_tokens": 4, "stream": rng.gen_bool(0.5)});
    if valid {
        return b;
    }
    let fields = [
        "question",
        "top_k",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "kv",
        "assembly",
        "documents",
        "stream",
        "unknown_field",
        "messages",
    ];
    for _ in 0..rng.gen_range(1..4) {
        let f = *pick(rng, &fields);
        if rng.gen_bool(0.2) {
            b.as_object_mut().unwrap().remove(f);
        } else {
            b[f] = junk(rng);
        }
    }
    b
}

fn chat_body(rng: &mut SmallRng) -> Value {
    let messages = match rng.gen_range(0..5) {
        0 => json!([]),
        1 => json!([{"role": "user", "content": junk(rng)}]),
        2 => json!([{"role": junk(rng), "content": "hi"}]),
        3 => json!("not a list"),
        _ => json!([{"role": "user", "content": [{"type": "text", "text": junk(rng)}]}]),
    };
    json!({"model": junk(rng), "messages": messages, "max_tokens": 4,
           "temperature": if rng.gen_bool(0.3) { junk(rng) } else { json!(0) }})
}

fn documents_body(rng: &mut SmallRng) -> Value {
    let id = match rng.gen_range(0..6) {
        0 => json!(""),
        1 => json!("a/../../etc/passwd"),
        2 => json!("x".repeat(2000)),
        3 => junk(rng),
        4 => json!("doc with spaces and ünïcode"),
        _ => json!(format!("fuzz-{}", rng.gen::<u32>())),
    };
    let text = if rng.gen_bool(0.5) {
        junk(rng)
    } else {
        json!("A short fuzz document about harbour tides.")
    };
    let odd = junk(rng);
    let materialize = pick(rng, &[json!("none"), json!("lazy"), odd]).clone();
    json!({"documents": [{"id": id, "text": text, "metadata": junk(rng)}],
           "materialize": materialize})
}

fn deep(depth: usize) -> String {
    format!("{}{}", "[".repeat(depth), "]".repeat(depth))
}

fn case(rng: &mut SmallRng, addr: SocketAddr) -> Case {
    let host = format!("{addr}");
    let mut cross_site = false;
    let mut truncated = false;
    let mut headers: Vec<(String, String)> = vec![("host".into(), host.clone())];
    let routes: &[(&str, &str)] = &[
        ("POST", "/v1/query"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/documents"),
        ("GET", "/v1/documents/{id}"),
        ("DELETE", "/v1/documents/{id}"),
        ("POST", "/v1/admin/rematerialize"),
        ("POST", "/v1/admin/gc"),
        ("GET", "/v1/stats"),
        ("GET", "/metrics"),
        ("GET", "/healthz"),
    ];
    let (mut method, route) = *pick(rng, routes);
    let odd_ids = [
        "lighthouse.md",
        "%2e%2e%2f%2e%2e",
        "%FF%FE%00",
        "a%2Fb",
        "%E2%80%AE",
        "..",
        "x%20y",
    ];
    let long_id = "z".repeat(5000);
    let id = if rng.gen_bool(0.1) {
        long_id.as_str()
    } else {
        *pick(rng, &odd_ids)
    };
    let mut path = route.replace("{id}", id);
    let mut kind = "route";
    let mut body: Vec<u8> = Vec::new();
    let mut content_type = Some("application/json".to_string());
    match route {
        "/v1/query" => {
            let valid = rng.gen_bool(0.03);
            kind = if valid { "valid-query" } else { "query" };
            body = query_body(rng, valid).to_string().into_bytes();
        }
        "/v1/chat/completions" => {
            kind = "chat";
            body = chat_body(rng).to_string().into_bytes();
        }
        "/v1/documents" => {
            kind = "documents";
            body = documents_body(rng).to_string().into_bytes();
        }
        "/v1/admin/rematerialize" => {
            kind = "admin";
            body = json!({"scope": junk(rng), "limit": junk(rng), "dry_run": true})
                .to_string()
                .into_bytes();
        }
        _ => {}
    }
    // The token: absent, wrong, or right (right only where it cannot start heavy work).
    match rng.gen_range(0..4) {
        0 => headers.push(("authorization".into(), "Bearer wrong".into())),
        1 if route != "/v1/admin/gc" => {
            headers.push(("authorization".into(), format!("Bearer {TOKEN}")))
        }
        2 => headers.push(("authorization".into(), "Basic Zm9vOmJhcg==".into())),
        _ => {}
    }
    // One more fault on top, sometimes.
    match rng.gen_range(0..16) {
        0 => {
            kind = "non-utf8-body";
            body = vec![0xff, 0xfe, b'{', 0xc3, 0x28, b'}'];
        }
        1 => {
            kind = "deep-json";
            body = deep(rng.gen_range(200..5000)).into_bytes();
        }
        2 => {
            kind = "content-type";
            content_type = Some(
                pick(
                    rng,
                    &[
                        "text/plain",
                        "multipart/form-data; boundary=x",
                        "application/xml",
                    ],
                )
                .to_string(),
            );
        }
        3 => {
            kind = "no-content-type";
            content_type = None;
        }
        4 => {
            kind = "method";
            method = *pick(rng, &["PUT", "PATCH", "OPTIONS", "HEAD", "DELETE", "GET"]);
        }
        5 => {
            kind = "path";
            path = pick(
                rng,
                &[
                    "//v1//query",
                    "/v1/query/",
                    "/v1/%2e%2e/admin/gc",
                    "/v1/query?kv=maybe",
                    "/v1/query?assembly=%FF",
                    "/v1/query?kv=on&kv=off",
                    "/%00",
                    "/v1/documents/",
                    "/v1/admin",
                ],
            )
            .to_string();
            if path.starts_with("/v1/query") && body.is_empty() {
                body = query_body(rng, true).to_string().into_bytes();
            }
        }
        6 => {
            kind = "long-path";
            path = format!("/v1/documents/{}", "a".repeat(rng.gen_range(1000..7000)));
        }
        7 => {
            kind = "cross-origin";
            cross_site = true;
            headers.push((
                "origin".into(),
                pick(
                    rng,
                    &[
                        "http://evil.example",
                        "null",
                        "http://127.0.0.1.evil.example",
                    ],
                )
                .to_string(),
            ));
        }
        8 => {
            kind = "foreign-host";
            cross_site = true;
            headers[0].1 = pick(
                rng,
                &[
                    "evil.example",
                    "attacker.test:8080",
                    "127.0.0.1.nip.example",
                ],
            )
            .to_string();
        }
        9 => {
            kind = "sec-fetch-site";
            cross_site = true;
            headers.push(("sec-fetch-site".into(), "cross-site".into()));
        }
        10 => {
            kind = "truncated";
            truncated = true;
        }
        11 => {
            kind = "empty-body";
            body.clear();
        }
        12 => {
            kind = "garbage-body";
            body = (0..rng.gen_range(1..400))
                .map(|_| rng.gen::<u8>())
                .collect();
        }
        _ => {}
    }
    let declared = if truncated {
        body.len() + rng.gen_range(1..500)
    } else {
        body.len()
    };
    let mut raw = format!("{method} {path} HTTP/1.1\r\n");
    for (k, v) in &headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(ct) = content_type {
        raw.push_str(&format!("content-type: {ct}\r\n"));
    }
    raw.push_str(&format!(
        "content-length: {declared}\r\nconnection: close\r\n\r\n"
    ));
    let mut raw = raw.into_bytes();
    raw.extend_from_slice(&body);
    Case {
        raw,
        cross_site,
        truncated,
        head: method == "HEAD",
        kind,
    }
}

/// Sends one request; (status, content type, body) or `None` when the connection closed
/// without an answer.
fn send(addr: SocketAddr, c: &Case) -> std::io::Result<Option<(u16, String, Vec<u8>)>> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    s.write_all(&c.raw)?;
    if c.truncated {
        s.shutdown(Shutdown::Write)?;
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = String::from_utf8_lossy(&out[..end]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let ct = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    let mut body = out[end + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Ok(Some((status, ct, body)))
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16).unwrap_or(0);
        if n == 0 || b.len() < i + 2 + n {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + n]);
        b = &b[(i + 4 + n).min(b.len())..];
    }
    out
}

fn is_json_error(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .ok()
        .is_some_and(|v| v["error"]["message"].is_string())
}

fn judge(t: &Tally, c: &Case, r: std::io::Result<Option<(u16, String, Vec<u8>)>>) {
    t.sent.fetch_add(1, Ordering::Relaxed);
    let note = |t: &Tally, what: &str| {
        let mut ex = t.examples.lock().unwrap();
        if ex.len() < 20 {
            let head = String::from_utf8_lossy(&c.raw[..c.raw.len().min(200)]).to_string();
            ex.push(format!("{what} [{}]: {head}", c.kind));
        }
    };
    let (status, ct, body) = match r {
        Ok(Some(x)) => x,
        Ok(None) | Err(_) => {
            if !c.truncated {
                t.no_answer.fetch_add(1, Ordering::Relaxed);
                note(t, "no answer");
            }
            return;
        }
    };
    *t.by_status.lock().unwrap().entry(status).or_default() += 1;
    if status >= 500 {
        t.server_errors.fetch_add(1, Ordering::Relaxed);
        note(t, &format!("{status}"));
    }
    let json = ct.starts_with("application/json") && (c.head || is_json_error(&body));
    if status >= 400 && !json {
        t.non_json_errors.fetch_add(1, Ordering::Relaxed);
        note(t, &format!("non-JSON {status}"));
    }
    if c.cross_site && status != 403 {
        t.cross_site_accepted.fetch_add(1, Ordering::Relaxed);
        note(t, &format!("cross-site got {status}"));
    }
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<Vec<Line>, Error> {
    let tmp = tempfile::tempdir().map_err(crate::io("temporary directory"))?;
    let work = args.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let engine = crate::engine::example(&work, &crate::engine::ModelArgs::default())?;
    let config = ServeConfig {
        admin_token: TOKEN.into(),
        max_body_bytes: 1 << 20,
        header_timeout_ms: 5_000,
        body_timeout_ms: 2_000,
        ..ServeConfig::default()
    };
    let (rt, addr, rag) = crate::engine::serve_loopback(&engine, config)?;

    let tally = Arc::new(Tally::default());
    let start = Instant::now();
    let per = args.requests.div_ceil(args.clients.max(1));
    let handles: Vec<_> = (0..args.clients.max(1))
        .map(|c| {
            let tally = tally.clone();
            let seed = args.seed.wrapping_mul(1_000_003).wrapping_add(c as u64);
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed);
                for _ in 0..per {
                    let k = case(&mut rng, addr);
                    let r = send(addr, &k);
                    judge(&tally, &k, r);
                    if tally.sent.load(Ordering::Relaxed) % 500 == 0 {
                        eprintln!("[fuzz] {} requests", tally.sent.load(Ordering::Relaxed));
                    }
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
    let wall = start.elapsed().as_secs_f64();
    // The server still answers a normal query.
    let ok_after = serve::client::request(
        addr,
        "POST",
        "/v1/query",
        None,
        Some(
            &json!({"question": "Who was the last resident keeper of the Varrow Point Lighthouse?",
                     "top_k": 2, "max_tokens": 8, "stream": false}),
        ),
    )
    .is_ok_and(|(s, _)| s == 200);
    let healthy = rag.dead_workers().is_empty();
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let bad = g(&tally.server_errors)
        + g(&tally.non_json_errors)
        + g(&tally.cross_site_accepted)
        + g(&tally.no_answer);
    let mut line = Line::lower(
        "fuzz_bad_answers",
        bad as f64,
        0.0,
        "answers",
        "none allowed (5xx + non-JSON errors + cross-site accepted + no answer)",
    );
    let examples = tally.examples.lock().unwrap().clone();
    line.detail = Some(json!({
        "requests": g(&tally.sent), "seconds": wall, "clients": args.clients, "seed": args.seed,
        "server_errors_5xx": g(&tally.server_errors),
        "non_json_errors": g(&tally.non_json_errors),
        "cross_site_accepted": g(&tally.cross_site_accepted),
        "no_answer": g(&tally.no_answer),
        "by_status": *tally.by_status.lock().unwrap(),
        "answers_a_query_after": ok_after, "workers_alive_after": healthy,
        "worker_panics": g(&rag.metrics.worker_panics),
        "examples": examples,
    }));
    drop(rt);
    rag.shutdown();
    drop(rag);
    crate::engine::close(engine);
    if bad > 0 || !ok_after || !healthy {
        eprintln!("{}", line.detail.clone().unwrap_or_default());
        return Err(Error::Check(format!(
            "fuzz: {bad} bad answers, query after: {ok_after}, healthy: {healthy}"
        )));
    }
    Ok(vec![line])
}
