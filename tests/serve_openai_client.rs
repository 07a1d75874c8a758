//! The real server binary end to end: `ragkv ingest`, `ragkv serve`, then the official
//! `openai` Python client (installed by scripts/setup.sh into the cache) against it, streaming
//! and not; then SIGTERM for a graceful shutdown.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{ingested_example, ragkv, start_server};

const CLIENT: &str = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
q = "Who was the last resident keeper of the Varrow Point Lighthouse?"
r = client.chat.completions.create(model="ragkv", max_tokens=24,
        messages=[{"role": "user", "content": q}])
out = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
       "usage": r.usage.completion_tokens}
pieces = []
for chunk in client.chat.completions.create(model="ragkv", max_tokens=24, stream=True,
        messages=[{"role": "user", "content": q}]):
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
out["stream_pieces"] = len(pieces)
out["stream_text"] = "".join(pieces)
try:
    client.chat.completions.create(model="ragkv", max_tokens=0,
        messages=[{"role": "user", "content": q}])
    out["bad_request"] = "accepted"
except Exception as e:
    out["bad_request"] = type(e).__name__
print(json.dumps(out))
"#;

#[test]
fn openai_python_client_streams_and_not_against_the_real_server() {
    let pylib = retrieval::cache_dir().join("pylib");
    assert!(
        pylib.join("openai").exists(),
        "the openai client is missing from {}: run scripts/setup.sh",
        pylib.display()
    );
    let (tmp, data) = ingested_example();

    let (mut server, url) = start_server(&data, &[]);
    let out = Command::new("python3")
        .arg("-c")
        .arg(CLIENT)
        .arg(&url)
        .env("PYTHONPATH", &pylib)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!r["text"].as_str().unwrap().is_empty(), "{r}");
    assert!(r["usage"].as_u64().unwrap() > 0);
    assert!(r["stream_pieces"].as_u64().unwrap() >= 2, "{r}");
    // Greedy decoding: streaming and not give the same text.
    assert_eq!(r["stream_text"], r["text"], "{r}");
    assert_eq!(r["bad_request"], "BadRequestError", "{r}");

    // While the server runs, `ragkv ingest` and `ragkv delete` hand their work to it.
    let extra = tmp.path().join("extra");
    std::fs::create_dir_all(&extra).unwrap();
    std::fs::write(
        extra.join("ferry.txt"),
        "The Keller Bay ferry leaves at 7:10 every morning.",
    )
    .unwrap();
    let out = ragkv(&data)
        .args(["ingest", "--json", "--progress", "quiet"])
        .arg(&extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("a server is running"));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["docs_new"], 1, "{rep}");
    let out = ragkv(&data)
        .args(["delete", "ferry.txt", "nope.txt"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("\"id\":\"ferry.txt\",\"deleted\":true")
            || text.contains("\"deleted\":true,\"id\":\"ferry.txt\""),
        "{text}"
    );
    assert!(text.contains("\"deleted\":false"), "{text}");

    // Other commands cannot open the data directory while the server owns it: they say so.
    let v = ragkv(&data).arg("stats").output().unwrap();
    assert!(!v.status.success());
    assert!(
        String::from_utf8_lossy(&v.stderr).contains("locked"),
        "{}",
        String::from_utf8_lossy(&v.stderr)
    );

    // SIGTERM: graceful shutdown, exit 0, the server file is gone.
    let pid = server.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = server.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no shutdown after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    assert!(!data.join("server.json").exists());
}
