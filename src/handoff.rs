//! Handing CLI work to the server that owns the data directory.
//!
//! `ragkv serve` writes `server.json` into the data directory (mode 0600): its URL, pid, a
//! random instance id and its body limit. Before the CLI sends anything, let alone the admin
//! token or document text, to the address that file names, it checks that:
//! - the file belongs to this user and no one else can write it;
//! - the address is a loopback address or the configured `serve.bind`;
//! - the process named by the pid is alive (a file left by a killed server is stale);
//! - the server at the address answers `/healthz` with the same instance id (only a process
//!   that could read the file knows it).
//!
//! A file that fails a check is ignored with a warning; the CLI then opens the data directory
//! itself, which the store's lock refuses while a server really holds it.

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use serve::client::{self, Limits};

use crate::config::Config;

/// What the CLI knows of a running server.
#[derive(Debug, Clone, Copy)]
pub struct Server {
    pub addr: SocketAddr,
    /// Its `serve.max_body_bytes`.
    pub max_body_bytes: usize,
}

/// Writes `server.json` for a server listening on `addr` (atomically, mode 0600).
pub fn announce(config: &Config, addr: SocketAddr, instance: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = config.server_file();
    let tmp = path.with_extension("json.tmp");
    let info = json!({"url": format!("http://{addr}"), "pid": std::process::id(),
                      "instance": instance, "max_body_bytes": config.serve.max_body_bytes});
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(info.to_string().as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The server that owns this data directory, if `server.json` names one that passes every
/// check in the module docs.
pub fn running_server(config: &Config) -> Option<Server> {
    let path = config.server_file();
    let meta = std::fs::symlink_metadata(&path).ok()?;
    match trusted(config, &meta, &std::fs::read_to_string(&path).ok()?) {
        Ok(s) => Some(s),
        Err(why) => {
            eprintln!("warning: ignoring {}: {why}", path.display());
            None
        }
    }
}

fn trusted(config: &Config, meta: &std::fs::Metadata, text: &str) -> Result<Server, String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.file_type().is_file() {
        return Err("not a regular file".into());
    }
    if meta.uid() != me {
        return Err(format!("owned by uid {}, not by this user", meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "writable by others (mode {:o})",
            meta.mode() & 0o777
        ));
    }
    let info: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let addr: SocketAddr = info["url"]
        .as_str()
        .and_then(|u| u.strip_prefix("http://"))
        .and_then(|a| a.parse().ok())
        .ok_or("no http://IP:PORT url")?;
    let bind: Option<SocketAddr> = config.serve.bind.parse().ok();
    if !addr.ip().is_loopback() && bind.map(|b| b.ip()) != Some(addr.ip()) {
        return Err(format!(
            "{addr} is neither a loopback address nor serve.bind"
        ));
    }
    let pid = info["pid"]
        .as_u64()
        .and_then(|p| i32::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or("no pid")?;
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return Err(format!("stale: process {pid} is gone"));
    }
    let instance = info["instance"].as_str().ok_or("no instance id")?;
    let reply = client::request_with(addr, "GET", "/healthz", None, None, Limits::QUICK)
        .map_err(|e| format!("no answer: {e}"))?;
    if reply.header("x-ragkv-instance") != Some(instance) {
        return Err(format!("the server at {addr} is not the one that wrote it"));
    }
    if reply.status != 200 {
        return Err(format!(
            "the server is unhealthy ({}): {}",
            reply.status,
            client::error_message(&reply.body)
        ));
    }
    let max_body_bytes = info["max_body_bytes"]
        .as_u64()
        .map_or(config.serve.max_body_bytes, |n| n as usize);
    Ok(Server {
        addr,
        max_body_bytes,
    })
}

/// POSTs to an admin route of the running server (waiting while another maintenance job runs);
/// the JSON answer, or an error naming the status.
pub fn admin_post(
    config: &Config,
    server: Server,
    path: &str,
    body: Option<&Value>,
) -> Result<Value> {
    let token = Some(config.serve.admin_token.as_str());
    // 409: another maintenance job (perhaps the server's own schedule) is running; wait.
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    let (status, text) = loop {
        let (status, text) = client::request(server.addr, "POST", path, token, body)?;
        if status != 409 || std::time::Instant::now() > give_up {
            break (status, text);
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    anyhow::ensure!(
        status == 200,
        "server answered {status}: {}",
        client::error_message(&text)
    );
    Ok(serde_json::from_str(&text)?)
}

/// Sums the numeric fields of ingest reports; collects their failures.
#[derive(Default)]
struct Totals {
    sums: serde_json::Map<String, Value>,
    failures: Vec<Value>,
}

impl Totals {
    fn add(&mut self, report: &Value) {
        for (k, v) in report.as_object().into_iter().flatten() {
            if let Some(n) = v.as_u64() {
                let cur = self.sums.get(k).and_then(|c| c.as_u64()).unwrap_or(0);
                self.sums.insert(k.clone(), json!(cur + n));
            } else if let Some(x) = v.as_f64() {
                let cur = self.sums.get(k).and_then(|c| c.as_f64()).unwrap_or(0.0);
                self.sums.insert(k.clone(), json!(cur + x));
            }
        }
        self.failures
            .extend(report["failures"].as_array().cloned().unwrap_or_default());
    }

    fn get(&self, k: &str) -> u64 {
        self.sums.get(k).and_then(|v| v.as_u64()).unwrap_or(0)
    }
}

/// Room in a request body for `{"documents": [...], "materialize": ...}` around the documents.
const ENVELOPE_BYTES: usize = 1024;

/// `ragkv ingest` while a server owns the data directory: read the sources here, send the
/// documents to `POST /v1/documents` in batches that fit the server's body limit, sum the
/// server's reports. Returns whether every document was committed.
pub fn ingest(
    config: &Config,
    server: Server,
    sources: &[ingest::Source],
    materialize: ingest::Materialize,
    json_out: bool,
) -> Result<bool> {
    eprintln!(
        "a server is running on this data directory: sending the documents to http://{}",
        server.addr
    );
    let limits = ingest::ReadLimits {
        max_doc_bytes: config.ingest.max_doc_bytes,
    };
    let budget = server
        .max_body_bytes
        .saturating_sub(ENVELOPE_BYTES)
        .min(4 << 20);
    let mut totals = Totals::default();
    let mut batch: Vec<Value> = Vec::new();
    let mut batch_bytes = 0usize;
    let send = |batch: &mut Vec<Value>, totals: &mut Totals| -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let body = json!({"documents": std::mem::take(batch), "materialize": materialize});
        let token = Some(config.serve.admin_token.as_str());
        let (status, text) =
            client::request(server.addr, "POST", "/v1/documents", token, Some(&body))?;
        // 200: all committed; 207: some failed; 422: none committed. Each carries the report.
        if !matches!(status, 200 | 207 | 422) {
            anyhow::bail!("server answered {status}: {}", client::error_message(&text));
        }
        totals.add(&serde_json::from_str(&text).context("decoding the server's report")?);
        Ok(())
    };
    let mut skipped: Vec<Value> = Vec::new();
    let mut err = None;
    for src in sources {
        ingest::read_source(src, limits, &mut |item| {
            match item {
                ingest::Item::Skipped { origin, reason } => {
                    skipped.push(json!({"origin": origin, "reason": reason}));
                }
                ingest::Item::Doc(d) => {
                    let doc = json!({"id": d.id, "text": d.text, "metadata": d.metadata});
                    let size = doc.to_string().len() + 1;
                    if size > budget {
                        skipped.push(json!({"origin": d.origin, "reason": format!(
                            "{size} bytes as JSON: more than the server accepts in one request \
                             (serve.max_body_bytes = {})", server.max_body_bytes)}));
                        return true;
                    }
                    if batch_bytes + size > budget || batch.len() >= 16 {
                        batch_bytes = 0;
                        if let Err(e) = send(&mut batch, &mut totals) {
                            err = Some(e);
                            return false;
                        }
                    }
                    batch_bytes += size;
                    batch.push(doc);
                }
            }
            true
        });
        if err.is_some() {
            break;
        }
    }
    if let Some(e) = err {
        return Err(e);
    }
    send(&mut batch, &mut totals)?;
    let failed = totals.get("docs_failed") as usize + skipped.len();
    totals.sums.insert("docs_failed".into(), json!(failed));
    totals.failures.extend(skipped);
    for f in &totals.failures {
        eprintln!(
            "skipped {}: {}",
            f["origin"].as_str().unwrap_or("?"),
            f["reason"].as_str().unwrap_or("?")
        );
    }
    eprintln!(
        "documents: {} new, {} unchanged, {} replaced, {} failed (through the server)",
        totals.get("docs_new"),
        totals.get("docs_unchanged"),
        totals.get("docs_replaced"),
        failed
    );
    if json_out {
        let mut out = totals.sums;
        out.insert("failures".into(), Value::Array(totals.failures));
        println!("{}", Value::Object(out));
    }
    Ok(failed == 0)
}
