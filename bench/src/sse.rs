//! A streaming HTTP/1.1 POST for the peer benchmark: sends one JSON request to a loopback
//! server and reads its server-sent events as they arrive, timing the first event that
//! carries a token (time to first token as a client sees it) and the whole response.
//! Not a general client: no TLS, `connection: close`, bounded by a read timeout and a cap on
//! the response's size.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::Error;

/// Largest response read (a 64-token answer's events are a few tens of KiB).
const MAX_RESPONSE: usize = 16 << 20;

/// One streamed response.
#[derive(Debug, Clone)]
pub(crate) struct Streamed {
    pub status: u16,
    /// From sending the request to the first bytes holding the marker; `None` if it never
    /// came.
    pub first_ms: Option<f64>,
    pub total_ms: f64,
    /// The events: (`event:` name if any, `data:` text).
    pub events: Vec<(Option<String>, String)>,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Sends `body` to `path` and reads the event stream; `first_marker` (e.g. `event: token`)
/// marks the first token's event.
pub(crate) fn post(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
    first_marker: &[u8],
    timeout: Duration,
) -> Result<Streamed, Error> {
    let payload = body.to_string();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(crate::io(format!("connecting to {addr}")))?;
    s.set_read_timeout(Some(timeout))
        .map_err(crate::io("read timeout"))?;
    s.set_nodelay(true).map_err(crate::io("nodelay"))?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    );
    let t = Instant::now();
    s.write_all(request.as_bytes())
        .map_err(crate::io(format!("sending to {addr}")))?;
    let mut raw = Vec::with_capacity(16 << 10);
    let mut buf = [0u8; 16 << 10];
    let mut first_ms = None;
    let mut head_end = None;
    let mut scanned = 0;
    loop {
        let n = s
            .read(&mut buf)
            .map_err(crate::io(format!("reading from {addr}")))?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if raw.len() > MAX_RESPONSE {
            return Err(Error::Check(format!(
                "{addr}{path}: response over {MAX_RESPONSE} bytes"
            )));
        }
        if head_end.is_none() {
            head_end = find(&raw, b"\r\n\r\n").map(|i| i + 4);
            scanned = head_end.unwrap_or(0);
        }
        if let (None, Some(_)) = (first_ms, head_end) {
            let from = scanned.saturating_sub(first_marker.len());
            if find(&raw[from..], first_marker).is_some() {
                first_ms = Some(t.elapsed().as_secs_f64() * 1e3);
            }
            scanned = raw.len();
        }
    }
    let total_ms = t.elapsed().as_secs_f64() * 1e3;
    let head_end =
        head_end.ok_or_else(|| Error::Check(format!("{addr}{path}: no HTTP response head")))?;
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Error::Check(format!("{addr}{path}: bad status line")))?;
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(&raw[head_end..])?
    } else {
        raw[head_end..].to_vec()
    };
    Ok(Streamed {
        status,
        first_ms,
        total_ms,
        events: events(&String::from_utf8_lossy(&body)),
    })
}

/// The body of a chunked transfer encoding.
fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, Error> {
    let bad = || Error::Check("malformed chunked response".into());
    let mut out = Vec::with_capacity(b.len());
    loop {
        let line = find(b, b"\r\n").ok_or_else(bad)?;
        let size = std::str::from_utf8(&b[..line])
            .ok()
            .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok())
            .ok_or_else(bad)?;
        b = &b[line + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err(bad());
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// Server-sent events: blocks separated by a blank line, `event:` and `data:` fields
/// (several `data:` lines joined by newlines, as the standard says).
fn events(body: &str) -> Vec<(Option<String>, String)> {
    body.replace("\r\n", "\n")
        .split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data: Option<String> = None;
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = Some(v.trim().to_string());
                } else if let Some(v) = line.strip_prefix("data:") {
                    let v = v.strip_prefix(' ').unwrap_or(v);
                    data = Some(match data {
                        Some(d) => d + "\n" + v,
                        None => v.to_string(),
                    });
                }
            }
            data.map(|d| (name, d))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_chunked_event_streams() {
        let body = b"d\r\nevent: token\n\r\n14\r\ndata: {\"text\":\"a\"}\n\n\r\n0\r\n\r\n";
        let d = dechunk(body).unwrap();
        assert_eq!(d, b"event: token\ndata: {\"text\":\"a\"}\n\n");
        assert!(dechunk(b"zz\r\n").is_err());
        assert!(dechunk(b"5\r\nab").is_err());
        let ev = events("event: token\ndata: 1\n\ndata: 2\ndata: 3\n\n: comment\n\n");
        assert_eq!(
            ev,
            vec![
                (Some("token".to_string()), "1".to_string()),
                (None, "2\n3".to_string())
            ]
        );
    }

    #[test]
    fn times_the_first_marked_event() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut req = [0u8; 4096];
            let _ = c.read(&mut req).unwrap();
            c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
                .unwrap();
            c.write_all(b"event: ping\ndata: {}\n\n").unwrap();
            c.flush().unwrap();
            std::thread::sleep(Duration::from_millis(150));
            c.write_all(b"event: token\ndata: {\"text\":\"x\"}\n\n")
                .unwrap();
        });
        let r = post(
            addr,
            "/x",
            &serde_json::json!({}),
            b"event: token",
            Duration::from_secs(5),
        )
        .unwrap();
        server.join().unwrap();
        assert_eq!(r.status, 200);
        let first = r.first_ms.unwrap();
        assert!(first >= 140.0, "{first}");
        assert_eq!(r.events.len(), 2);
        assert_eq!(r.events[1].0.as_deref(), Some("token"));
    }
}
