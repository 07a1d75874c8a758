//! The server loop: HTTP/1.1 (hyper) with the limits a hostile client must not get around.
//!
//! - At most `serve.max_connections` connections are open; past it the loop stops accepting
//!   until one closes (new ones wait in the kernel's backlog).
//! - A request's headers must arrive within `serve.header_timeout_ms` (hyper's header read
//!   timeout, which also bounds how long a kept-alive connection idles), its body within
//!   `serve.body_timeout_ms` (see [`crate::http`]); a slow client is cut off, not waited for.
//! - On shutdown, connections finish the request they are serving (up to `drain`), idle
//!   ones close at once.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

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

/// Serves `app` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (close_tx, close_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
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
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut close = close_rx.clone();
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(true);
            let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended");
                    }
                }
                _ = close.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
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
