//! The server loop: HTTP/1.1 (hyper) with the limits a hostile client must not get around.
//!
//! - At most `serve.max_connections` connections are open. At the cap, a new connection
//!   takes the place of the oldest one that is waiting for a request's headers (a fresh
//!   connection that has not finished its first request line and headers, or a kept-alive
//!   one between requests): that one is closed. A connection with a request in progress
//!   (its response streaming included) is never closed for room; when every connection has
//!   one, the new connection waits (in the loop, then in the kernel's backlog) until one
//!   closes. So connections that open and stall, more of them than the cap, cannot keep a
//!   well-formed request out for the header timeout: each new arrival pushes the oldest
//!   stalled one out.
//! - A request's headers must arrive within `serve.header_timeout_ms` (hyper's header read
//!   timeout, which also bounds how long a kept-alive connection idles), its body within
//!   `serve.body_timeout_ms` (see `serve/src/http.rs`); a slow client is cut off, not waited for.
//! - On shutdown, connections finish the request they are serving (up to `drain`), idle
//!   ones close at once.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

/// Limits of the server loop.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// A request's headers must arrive within this.
    pub header_timeout: Duration,
    /// How long shutdown waits for requests in progress.
    pub drain: Duration,
}

impl Limits {
    /// The limits `config` sets; requests in progress get `request_timeout_ms` to finish.
    pub fn from_config(config: &crate::ServeConfig) -> Limits {
        Limits {
            max_connections: config.max_connections,
            header_timeout: Duration::from_millis(config.header_timeout_ms),
            drain: Duration::from_millis(config.request_timeout_ms),
        }
    }
}

/// One open connection, as the loop sees it.
#[derive(Default)]
struct Conn {
    /// Requests being served, responses streaming included; 0: waiting for headers.
    busy: AtomicUsize,
    /// Told when the loop closes the connection for room.
    evict: Notify,
}

/// The open connections in accept order (oldest first).
#[derive(Default)]
struct Conns {
    next: AtomicU64,
    open: Mutex<BTreeMap<u64, Arc<Conn>>>,
}

impl Conns {
    fn add(&self) -> (u64, Arc<Conn>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let c = Arc::new(Conn::default());
        self.open.lock().insert(id, c.clone());
        (id, c)
    }

    fn remove(&self, id: u64) {
        self.open.lock().remove(&id);
    }

    /// Closes the oldest connection waiting for headers; false when every one is busy.
    fn evict_oldest_idle(&self) -> bool {
        let mut open = self.open.lock();
        let idle = open
            .iter()
            .find(|(_, c)| c.busy.load(Ordering::Acquire) == 0)
            .map(|(&id, _)| id);
        match idle.and_then(|id| open.remove(&id)) {
            Some(c) => {
                c.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Marks its connection busy while it lives: from a request's arrival to the end of its
/// response body.
struct Busy(Arc<Conn>);

impl Busy {
    fn new(c: &Arc<Conn>) -> Busy {
        c.busy.fetch_add(1, Ordering::AcqRel);
        Busy(c.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its connection busy until it is sent (or dropped).
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A slot for one more connection: a free one, or, at the cap, the one the oldest
/// connection waiting for headers gives up once a new connection is there to take it.
/// `None` when shutdown came first.
async fn slot(
    slots: &Arc<Semaphore>,
    conns: &Conns,
    listener: &TcpListener,
    shutdown: &mut Pin<&mut impl Future<Output = ()>>,
) -> Option<(OwnedSemaphorePermit, Option<TcpStream>)> {
    if let Ok(s) = slots.clone().try_acquire_owned() {
        return Some((s, None));
    }
    // At the cap: wait for a slot, or for a new connection to make room for.
    let stream = tokio::select! {
        s = slots.clone().acquire_owned() => return s.ok().map(|s| (s, None)),
        r = listener.accept() => match r {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                return slots.clone().acquire_owned().await.ok().map(|s| (s, None));
            }
        },
        _ = shutdown.as_mut() => return None,
    };
    if conns.evict_oldest_idle() {
        tracing::debug!("connection cap reached: closed the oldest connection waiting for headers");
    }
    tokio::select! {
        s = slots.clone().acquire_owned() => s.ok().map(|s| (s, Some(stream))),
        _ = shutdown.as_mut() => None,
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let conns = Arc::new(Conns::default());
    let (close_tx, close_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let Some((slot, accepted)) = slot(&slots, &conns, &listener, &mut shutdown).await else {
            break;
        };
        let stream = match accepted {
            Some(s) => s,
            None => tokio::select! {
                r = listener.accept() => match r {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, do not spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = &mut shutdown => break,
            },
        };
        let _ = stream.set_nodelay(true);
        let (id, conn_state) = conns.add();
        let service = {
            let (app, c) = (app.clone(), conn_state.clone());
            hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let busy = Busy::new(&c);
                let app = app.clone();
                async move {
                    let resp = app.oneshot(req).await?;
                    Ok::<_, Infallible>(resp.map(|inner| Body::new(Tracked { inner, _busy: busy })))
                }
            })
        };
        let mut close = close_rx.clone();
        let header_timeout = limits.header_timeout;
        let conns = conns.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(true);
            let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "connection ended");
                        }
                        break;
                    }
                    _ = close.changed() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.as_mut().await;
                        break;
                    }
                    // Closed for room while waiting for headers: dropping it closes the
                    // socket. A request that arrived meanwhile is served (the new
                    // connection then waits for this one's slot).
                    _ = conn_state.evict.notified() => {
                        if conn_state.busy.load(Ordering::Acquire) == 0 {
                            break;
                        }
                    }
                }
            }
            conns.remove(id);
        });
    }
    let _ = close_tx.send(true);
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(limits.drain, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!("shutdown: connections still open after the drain period");
    }
    Ok(())
}
