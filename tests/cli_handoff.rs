//! The CLI's hand-off to a running server: it trusts `server.json` only after checking it
//! (owner and mode, address, live pid, the server's instance id), never sends the admin token
//! to anything else, and splits documents into requests the server accepts.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{ingested_example, ragkv, start_server};

/// A loopback listener that answers every request `200 ok` (as a stranger's web server on a
/// reused port would) and records what it was sent.
fn stranger() -> (std::net::SocketAddr, Arc<Mutex<String>>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(String::new()));
    let s2 = seen.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let mut buf = [0u8; 65536];
            let n = c.read(&mut buf).unwrap_or(0);
            s2.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        }
    });
    (addr, seen)
}

fn write_server_json(data: &Path, url: &str, pid: u32, mode: u32) {
    let path = data.join("server.json");
    let _ = std::fs::remove_file(&path);
    std::fs::write(
        &path,
        serde_json::json!({"url": url, "pid": pid, "instance": "abc", "max_body_bytes": 8 << 20})
            .to_string(),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn a_server_json_that_fails_a_check_gets_neither_the_token_nor_the_documents() {
    let (_tmp, data) = ingested_example();
    let (addr, seen) = stranger();
    let url = format!("http://{addr}");
    let dead = {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    };
    let cases = [
        // Alive pid, loopback address, but not the server that wrote the file.
        (std::process::id(), 0o600, "not the one that wrote it"),
        (dead, 0o600, "stale"),
        (std::process::id(), 0o666, "writable by others"),
    ];
    for (pid, mode, why) in cases {
        write_server_json(&data, &url, pid, mode);
        let out = ragkv(&data)
            .args(["delete", "lighthouse.md"])
            .env("RAGKV__SERVE__ADMIN_TOKEN", "tok-5e9a")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{why}: {err}");
        assert!(
            err.contains("ignoring") && err.contains(why),
            "{why}: {err}"
        );
    }
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.contains("tok-5e9a"), "the token was sent: {seen}");
    assert!(!seen.contains("DELETE"), "{seen}");
    assert!(
        seen.lines()
            .filter(|l| l.contains("HTTP/1.1"))
            .all(|l| l.starts_with("GET /healthz")),
        "{seen}"
    );
}

#[test]
fn documents_are_sent_in_requests_that_fit_the_servers_body_limit() {
    let (tmp, data) = ingested_example();
    let (server, _url) = start_server(&data, &[("RAGKV__SERVE__MAX_BODY_BYTES", "65536")]);
    let jsonl = tmp.path().join("docs.jsonl");
    let mut lines = String::new();
    for i in 0..6 {
        let text = format!("Harbour note {i}. ").repeat(1500); // ~25 KB each
        lines.push_str(&serde_json::json!({"id": format!("note-{i}"), "text": text}).to_string());
        lines.push('\n');
    }
    let big = "An oversized appendix. ".repeat(5000); // ~115 KB: more than one request
    lines.push_str(&serde_json::json!({"id": "appendix", "text": big}).to_string());
    lines.push('\n');
    std::fs::write(&jsonl, lines).unwrap();
    let out = ragkv(&data)
        .args(["ingest", "--materialize", "none", "--json"])
        .arg(&jsonl)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sending the documents"), "{err}");
    // Some documents failed: the partial exit status, not an abort.
    assert_eq!(out.status.code(), Some(3), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["docs_new"], 6, "{report}");
    assert_eq!(report["docs_failed"], 1, "{report}");
    let why = report["failures"][0]["reason"].as_str().unwrap();
    assert!(why.contains("max_body_bytes"), "{why}");
    drop(server);
}
