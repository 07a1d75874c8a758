//! A minimal blocking HTTP/1.1 client for talking to a ragkv server on a loopback address:
//! the CLI hands `ingest` and `delete` to a running server with it, and the benchmarks drive
//! the server with it. Not a general client (no TLS, `connection: close`). Every call is
//! bounded: connect and read timeouts, and a cap on the response's size.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

/// A client-side failure (connecting, or a malformed response).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, sending or reading failed.
    #[error("server at {addr}: {cause}")]
    Io {
        /// The server.
        addr: SocketAddr,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The response is not HTTP as expected.
    #[error("server at {addr}: malformed response ({what})")]
    Malformed {
        /// The server.
        addr: SocketAddr,
        /// What is wrong.
        what: &'static str,
    },
    /// The response exceeds `Limits::max_response_bytes`.
    #[error("server at {addr}: response larger than {limit} bytes")]
    TooLarge {
        /// The server.
        addr: SocketAddr,
        /// The limit.
        limit: u64,
    },
}

/// Bounds of one request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest wait for the connection.
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes of the response (not for all of it).
    pub read_timeout: Duration,
    /// Largest response read.
    pub max_response_bytes: u64,
}

impl Limits {
    /// For a health check or a small query: seconds.
    pub const QUICK: Limits = Limits {
        connect_timeout: Duration::from_secs(2),
        read_timeout: Duration::from_secs(5),
        max_response_bytes: 64 << 10,
    };
    /// For work the server does before answering (a batch of documents prefilled, a
    /// maintenance job): minutes.
    pub const WORK: Limits = Limits {
        connect_timeout: Duration::from_secs(2),
        read_timeout: Duration::from_secs(1800),
        max_response_bytes: 64 << 20,
    };
}

/// A response.
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status code.
    pub status: u16,
    /// The header block, as sent (status line included).
    pub head: String,
    /// The body, as text.
    pub body: String,
}

impl Reply {
    /// The value of header `name` (case-insensitive), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// One request with [`Limits::WORK`]; returns the status and the body.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<(u16, String), ClientError> {
    let r = request_with(addr, method, path, token, body, Limits::WORK)?;
    Ok((r.status, r.body))
}

/// One request within `limits`.
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
    limits: Limits,
) -> Result<Reply, ClientError> {
    let io = |cause| ClientError::Io { addr, cause };
    let bad = |what| ClientError::Malformed { addr, what };
    let mut s = TcpStream::connect_timeout(&addr, limits.connect_timeout).map_err(io)?;
    s.set_read_timeout(Some(limits.read_timeout)).map_err(io)?;
    s.set_write_timeout(Some(limits.read_timeout)).map_err(io)?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        req.push_str(&format!("authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).map_err(io)?;
    s.write_all(body.as_bytes()).map_err(io)?;
    let mut raw = Vec::new();
    (&mut s)
        .take(limits.max_response_bytes + 1)
        .read_to_end(&mut raw)
        .map_err(io)?;
    if raw.len() as u64 > limits.max_response_bytes {
        return Err(ClientError::TooLarge {
            addr,
            limit: limits.max_response_bytes,
        });
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or(bad("no end of headers"))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or(bad("status line"))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest).ok_or(bad("chunked body"))?
    } else {
        rest.to_string()
    };
    Ok(Reply {
        status,
        head: head.to_string(),
        body,
    })
}

fn dechunk(mut s: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n")?;
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..n)?);
        s = rest.get(n + 2..)?;
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

/// The message of an error response (`{"error": {"message"}}`), or the body as is.
pub fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.to_string())
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
        assert!(dechunk("zz\r\n").is_none());
        assert_eq!(error_message(r#"{"error": {"message": "no"}}"#), "no");
    }

    /// A loopback server that reads the request, then runs `answer` on the connection.
    fn fake(answer: impl FnOnce(TcpStream) + Send + 'static) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            answer(c);
        });
        addr
    }

    #[test]
    fn responses_are_bounded_in_size_and_time() {
        let huge = fake(|mut c| {
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
            let block = vec![b'x'; 64 << 10];
            while c.write_all(&block).is_ok() {}
        });
        let limits = Limits {
            max_response_bytes: 1 << 20,
            ..Limits::QUICK
        };
        let e = request_with(huge, "GET", "/", None, None, limits).unwrap_err();
        assert!(matches!(e, ClientError::TooLarge { .. }), "{e}");

        let silent = fake(|c| {
            std::thread::sleep(Duration::from_secs(3));
            drop(c);
        });
        let limits = Limits {
            read_timeout: Duration::from_millis(200),
            ..Limits::QUICK
        };
        let t = std::time::Instant::now();
        let e = request_with(silent, "GET", "/", None, None, limits).unwrap_err();
        assert!(matches!(e, ClientError::Io { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2));

        let ok = fake(|mut c| {
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\nX-Ragkv-Instance: abc\r\n\r\nok");
        });
        let r = request_with(ok, "GET", "/healthz", None, None, Limits::QUICK).unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "ok"));
        assert_eq!(r.header("x-ragkv-instance"), Some("abc"));
    }
}
