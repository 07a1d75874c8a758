//! Hands `ingest` and `delete` to a running server: the server owns the data directory, so
//! these commands talk to it over HTTP instead of opening the store (which would fail on the
//! lock). A minimal HTTP/1.1 client for the loopback address the server advertises in
//! `data_dir/server.json`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::config::Config;

/// A running server's address, if `server.json` names one that answers `/healthz`.
pub fn running_server(config: &Config) -> Option<SocketAddr> {
    let text = std::fs::read_to_string(config.server_file()).ok()?;
    let info: Value = serde_json::from_str(&text).ok()?;
    let addr: SocketAddr = info["url"]
        .as_str()?
        .strip_prefix("http://")?
        .parse()
        .ok()?;
    let (status, body) = request(addr, "GET", "/healthz", None, None).ok()?;
    (status == 200 && body.trim() == "ok").then_some(addr)
}

/// One request; returns the status and the body.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to the server at {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(3600)))?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        req.push_str(&format!("authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    s.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let Some((head, rest)) = text.split_once("\r\n\r\n") else {
        bail!("malformed response from {addr}");
    };
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("malformed status line from {addr}"))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut s: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").context("malformed chunked body")?;
        let n = usize::from_str_radix(size.trim(), 16).context("malformed chunk size")?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).context("truncated chunk")?);
        s = rest.get(n + 2..).context("truncated chunk")?;
    }
}

/// Percent-encodes a document id for a URL path segment.
pub fn encode_segment(id: &str) -> String {
    id.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The error a non-2xx response carries.
pub fn api_error(status: u16, body: &str) -> anyhow::Error {
    let msg = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.to_string());
    anyhow::anyhow!("server answered {status}: {msg}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_encoded_and_chunked_bodies_decoded() {
        assert_eq!(encode_segment("docs/a b.md"), "docs%2Fa%20b.md");
        assert_eq!(
            dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            "abcde"
        );
    }
}
