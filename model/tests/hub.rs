//! `hf:` model references against a stand-in hub on loopback (never the real hub): a small
//! HTTP server that answers the hub's file routes (`/ORG/REPO/resolve/REV/FILE`, with range
//! requests, ETag and commit headers) from a synthetic model the test writes.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use model::hub::{self, HubOptions, HubRef};
use model::synthetic::{self, SyntheticSpec};
use model::{Arch, LoadOptions, Model, ModelSource};

/// Files by URL path; the paths requested, in order.
struct Hub {
    files: HashMap<String, Vec<u8>>,
    log: Mutex<Vec<String>>,
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn handle(hub: &Hub, stream: TcpStream) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut range_start: Option<usize> = None;
    let mut range_end: Option<usize> = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                let v = v.trim().trim_start_matches("bytes=");
                let (a, b) = v.split_once('-').unwrap_or((v, ""));
                range_start = a.parse().ok();
                range_end = b.parse().ok();
            }
        }
    }
    hub.log.lock().unwrap().push(path.clone());
    let mut out = stream;
    // `/ORG/REPO/resolve/main/FILE` → key `ORG/REPO/FILE`.
    let key = path
        .trim_start_matches('/')
        .replacen("/resolve/main/", "/", 1);
    let Some(body) = hub.files.get(&key) else {
        let msg = b"Entry not found";
        write!(
            out,
            "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            msg.len()
        )?;
        return out.write_all(msg);
    };
    let size = body.len();
    let start = range_start.unwrap_or(0).min(size);
    let end = range_end.map(|e| e + 1).unwrap_or(size).min(size);
    let part = &body[start..end];
    let etag = blake3::hash(body).to_hex();
    write!(
        out,
        "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{}/{size}\r\nETag: \"{etag}\"\r\nX-Repo-Commit: {COMMIT}\r\nConnection: close\r\n\r\n",
        part.len(),
        end.saturating_sub(1),
    )?;
    out.write_all(part)
}

/// Serves `repos` (repo name → directory) until the process ends; returns the address.
fn start_hub(repos: &[(&str, &Path)]) -> (String, Arc<Hub>) {
    let mut files = HashMap::new();
    for (repo, dir) in repos {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_file() {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                files.insert(format!("{repo}/{name}"), std::fs::read(&p).unwrap());
            }
        }
    }
    let hub = Arc::new(Hub {
        files,
        log: Mutex::new(Vec::new()),
    });
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let h = hub.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let h = h.clone();
            std::thread::spawn(move || {
                let _ = handle(&h, stream);
            });
        }
    });
    (addr, hub)
}

fn opts(endpoint: &str, cache: &Path) -> HubOptions {
    HubOptions {
        endpoint: Some(endpoint.into()),
        cache_dir: cache.to_path_buf(),
        progress: false,
    }
}

fn resolve(r: &str, o: &HubOptions) -> model::Result<ModelSource> {
    hub::resolve(&r.parse::<HubRef>()?, o)
}

/// An address nothing listens on.
fn dead_endpoint() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    addr
}

#[test]
fn hf_references_fetch_into_the_cache_and_then_work_offline() {
    let work = tempfile::tempdir().unwrap();
    let files = synthetic::write(&SyntheticSpec::new(Arch::Qwen3), &work.path().join("m")).unwrap();
    let gguf_dir = work.path().join("gguf");
    std::fs::create_dir_all(&gguf_dir).unwrap();
    std::fs::copy(&files.gguf, gguf_dir.join("tiny-q3.gguf")).unwrap();
    let (endpoint, hub) = start_hub(&[("acme/tiny", &files.hf_dir), ("acme/tiny-gguf", &gguf_dir)]);
    let cache = work.path().join("cache");

    // An HF directory: config, tokenizer, weights (optional files may be missing).
    let src = resolve("hf:acme/tiny", &opts(&endpoint, &cache)).unwrap();
    let ModelSource::HfDir(dir) = &src else {
        panic!("{src:?}")
    };
    assert!(dir.starts_with(&cache), "{}", dir.display());
    let m = Model::load(&src, &LoadOptions::default()).unwrap();
    assert_eq!(m.config().arch, Arch::Qwen3);
    let local = Model::load(
        &ModelSource::HfDir(files.hf_dir.clone()),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(m.weights_hash(), local.weights_hash());

    // One GGUF file.
    let src = resolve("hf:acme/tiny-gguf:tiny-q3.gguf", &opts(&endpoint, &cache)).unwrap();
    let ModelSource::Gguf(path) = &src else {
        panic!("{src:?}")
    };
    assert_eq!(
        std::fs::read(path).unwrap(),
        std::fs::read(&files.gguf).unwrap()
    );
    let requested = hub.log.lock().unwrap().clone();
    assert!(
        requested.iter().all(|p| p.contains("/resolve/main/")),
        "{requested:?}"
    );

    // Offline: both come from the cache; nothing new is asked of the (gone) hub.
    let offline = opts(&dead_endpoint(), &cache);
    let again = resolve("hf:acme/tiny", &offline).unwrap();
    assert_eq!(again, ModelSource::HfDir(dir.clone()));
    assert_eq!(
        resolve("hf:acme/tiny-gguf:tiny-q3.gguf", &offline).unwrap(),
        ModelSource::Gguf(path.clone())
    );

    // Offline and not cached: an error that names the reference.
    let err = resolve("hf:acme/other", &offline).unwrap_err().to_string();
    assert!(err.contains("hf:acme/other"), "{err}");
    let err = resolve("hf:acme/tiny-gguf:missing.gguf", &opts(&endpoint, &cache))
        .unwrap_err()
        .to_string();
    assert!(err.contains("hf:acme/tiny-gguf:missing.gguf"), "{err}");
}

#[test]
fn model_source_resolve_takes_paths_and_references() {
    let p: PathBuf = std::env::temp_dir().join("ragkv-no-such-model.gguf");
    let err = ModelSource::resolve(&p.to_string_lossy()).unwrap_err();
    assert!(matches!(err, model::Error::NotFound { .. }), "{err}");
    let err = ModelSource::resolve("hf:not a repo")
        .unwrap_err()
        .to_string();
    assert!(err.contains("hf:not a repo"), "{err}");
}
