//! Router fixtures: an engine over the example corpus, and one-shot calls through `app()`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use serve::{AppState, Rag, ServeConfig};
use tower::ServiceExt;

/// Fields drop in order: the engine (and its index) before the directory it lives in.
pub struct Fixture {
    pub engine: Arc<ingest::Engine>,
    _dir: tempfile::TempDir,
}

impl Fixture {
    /// Waits for the server threads (which hold the engine) to exit once their app is gone,
    /// then closes the engine here. A holder left after 30 s fails the test: it would close
    /// the index on another thread while the process exits, which aborts the test binary
    /// from RocksDB's static destructors ("pthread lock: Invalid argument").
    pub fn close(self) {
        let start = std::time::Instant::now();
        while Arc::strong_count(&self.engine) > 1 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the engine is still held 30 s after its server was dropped"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    // The run-time manifest directory: the test binary may have been built in another checkout.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let corpus = manifest.join("../examples/corpus");
    let engine = super::engine(
        dir.path(),
        ingest::IngestConfig::default(),
        ingest::Source::Dir(corpus),
        6,
    );
    Fixture {
        engine: Arc::new(engine),
        _dir: dir,
    }
}

pub fn app_with(f: &Fixture, config: ServeConfig) -> axum::Router {
    start(f, config).1
}

/// The pipeline over `f`'s engine with `config`, and its router.
pub fn start(f: &Fixture, config: ServeConfig) -> (Arc<Rag>, axum::Router) {
    let rag = Rag::start(f.engine.clone(), config).unwrap();
    let app = serve::app(AppState::new(rag.clone()));
    (rag, app)
}

pub async fn call(
    app: &axum::Router,
    method: &str,
    uri: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> (StatusCode, Value, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    (status, json, text)
}

/// Sends `POST /v1/query` with `body` to a real server at `addr` over a new connection
/// (closed after the response) and returns the socket to read the answer from.
pub async fn send_query(addr: std::net::SocketAddr, body: &Value) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let req = format!(
        "POST /v1/query HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(req.as_bytes()).await.unwrap();
    sock
}

/// Sends `GET /healthz` to a real server at `addr` over a new connection (closed after the
/// response) and returns the socket to read the answer from.
pub async fn send_healthz(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET /healthz HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    sock.write_all(req.as_bytes()).await.unwrap();
    sock
}

/// A real server for an app on a loopback port, stopped with [`Server::stop`].
pub struct Server {
    pub addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

/// Serves `app` on a free loopback port.
pub async fn serve(app: axum::Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
            .unwrap()
    });
    Server { addr, stop, task }
}

/// Serves `app` on a free loopback port through ragkv's own server loop with `limits`
/// (connection cap, header timeout), as `ragkv serve` does.
pub async fn serve_limited(app: axum::Router, limits: serve::listen::Limits) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        serve::listen::serve(listener, app, limits, async {
            let _ = stopped.await;
        })
        .await
        .unwrap()
    });
    Server { addr, stop, task }
}

impl Server {
    /// Stops accepting and waits for the open connections to end, so that nothing holds
    /// the app (and through it the engine) afterwards.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("a connection was still open 30 s after the server was stopped")
            .unwrap();
    }

    /// Stops the server, then drops the pipeline and waits for the engine to be released.
    pub async fn teardown(self, rag: Arc<Rag>, f: Fixture) {
        self.stop().await;
        drop(rag);
        tokio::task::spawn_blocking(move || f.close())
            .await
            .unwrap();
    }
}

/// Drops the router and the pipeline, then waits for the engine to be released.
pub async fn teardown(app: axum::Router, rag: Arc<Rag>, f: Fixture) {
    drop(app);
    drop(rag);
    tokio::task::spawn_blocking(move || f.close())
        .await
        .unwrap();
}
