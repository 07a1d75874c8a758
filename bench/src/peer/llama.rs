//! llama-server's side of `ragkv bench peer`: starting it on loopback (killed when dropped)
//! and asking it the benchmark's prompts as token ids.

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::peer::{first, json_usize, Args, Outcome, Peer, TIMEOUT};
use crate::sse::post;
use crate::Error;

pub(crate) struct Llama<'a> {
    pub(crate) addr: SocketAddr,
    pub(crate) prompts: &'a [Vec<u32>],
    pub(crate) max_tokens: usize,
}

impl Peer for Llama<'_> {
    fn ask(&self, i: usize) -> Result<Outcome, String> {
        let body = serde_json::json!({
            "prompt": self.prompts[i], "n_predict": self.max_tokens, "cache_prompt": false,
            "stream": true, "temperature": 0.0, "ignore_eos": true,
        });
        let r =
            post(self.addr, "/completion", &body, b"data: ", TIMEOUT).map_err(|e| e.to_string())?;
        let first_ms = first(&r, "llama-server")?;
        let chunks: Vec<serde_json::Value> = r
            .events
            .iter()
            .filter_map(|e| serde_json::from_str(&e.1).ok())
            .collect();
        let answer = chunks
            .iter()
            .filter_map(|v| v["content"].as_str())
            .collect::<String>();
        let last = chunks
            .iter()
            .find(|v| v.get("timings").is_some())
            .ok_or_else(|| format!("llama-server: no timings: {:?}", r.events.last()))?;
        Ok(Outcome {
            first_ms,
            total_ms: r.total_ms,
            prompt: json_usize(last, &["timings", "prompt_n"]),
            completion: json_usize(last, &["timings", "predicted_n"]),
            stages: None,
            answer,
        })
    }
}

/// A started llama-server, killed when dropped.
pub(crate) struct LlamaServer(Child);

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts llama-server on a free loopback port (its output to `log`) and waits until it
/// answers `/health`.
pub(crate) fn start_llama(
    bin: &std::path::Path,
    model: &std::path::Path,
    args: &Args,
    ctx_per_slot: usize,
    log: &std::path::Path,
) -> Result<(LlamaServer, SocketAddr), Error> {
    let out = std::fs::File::create(log).map_err(crate::io(log.display().to_string()))?;
    let err = out
        .try_clone()
        .map_err(crate::io(log.display().to_string()))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(crate::io("free port"))?
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let child = crate::llama::command(bin)
        .arg("--model")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--threads-batch", &threads.to_string()])
        .args(["--parallel", &args.slots.to_string()])
        // Every layer on the GPU when ragkv runs on one, none otherwise.
        .args([
            "--n-gpu-layers",
            if args.llm.device.starts_with("cuda") {
                "999"
            } else {
                "0"
            },
        ])
        .args(["--ctx-size", &(ctx_per_slot * args.slots).to_string()])
        // Every prompt prefilled in full: no prompt cache, in the slots or in host memory.
        .args(["--no-cache-prompt", "--cache-ram", "0", "--no-webui"])
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .map_err(crate::io(format!("starting {}", bin.display())))?;
    let mut server = LlamaServer(child);
    let t = Instant::now();
    loop {
        if let Ok((200, _)) = serve::client::request(addr, "GET", "/health", None, None) {
            return Ok((server, addr));
        }
        if let Ok(Some(status)) = server.0.try_wait() {
            return Err(Error::Check(format!(
                "llama-server exited ({status}) before answering: see {}",
                log.display()
            )));
        }
        if t.elapsed() > Duration::from_secs(120) {
            return Err(Error::Check(
                "llama-server did not become healthy in 120 s".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
