//! Keeping the serving pipeline's threads alive and honest about their state.
//!
//! - A [`Ticket`] is one admitted query: it holds the query's admission permit and its
//!   `inflight` count, and travels with the job through retrieval, the loader and the model.
//!   Dropping it (when the job ends, is cancelled, fails, or unwinds from a panic) gives both
//!   back, so admission bounds the work actually queued or running, not the open responses:
//!   a client that disconnects does not free its slot until its job has left the pipeline.
//! - [`contain`] runs one job of a worker and catches a panic in it: the job fails with an
//!   error its client sees, the panic is counted (`ragkv_worker_panics_total`) and logged, and
//!   the worker goes on with the next job.
//! - [`Health`] records which workers are running; a worker that exits while the pipeline is
//!   open (a panic outside a job, a bug) makes `/healthz` answer 503 naming it.
//! - [`Faults`] lets tests make a worker panic or stall at a chosen place; production never
//!   sets it.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::OwnedSemaphorePermit;

use crate::error::Error;
use crate::metrics::Metrics;

/// One admitted query's slot; see the module docs.
#[derive(Debug)]
pub struct Ticket {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl Ticket {
    /// Counts the query in flight until the ticket is dropped.
    pub fn new(permit: OwnedSemaphorePermit, metrics: Arc<Metrics>) -> Ticket {
        metrics.inflight.fetch_add(1, Ordering::Relaxed);
        Ticket {
            _permit: permit,
            metrics,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs `f`; a panic in it becomes [`Error::Panicked`] and is counted and logged.
pub fn contain<T>(worker: &'static str, m: &Metrics, f: impl FnOnce() -> T) -> Result<T, Error> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        m.worker_panics.fetch_add(1, Ordering::Relaxed);
        let message = panic_message(&*p);
        tracing::error!(worker, panic = %message, "a pipeline worker panicked on a job; it goes on");
        Error::Panicked { worker, message }
    })
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Which pipeline workers are running.
#[derive(Debug, Default)]
pub struct Health {
    running: Mutex<Vec<(&'static str, Arc<AtomicBool>)>>,
    closing: AtomicBool,
}

/// Marks its worker stopped when dropped (on return or unwinding).
#[derive(Debug)]
pub struct Alive(Arc<AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Health {
    /// Registers a worker as running; keep the guard for the worker's whole life.
    pub fn register(&self, worker: &'static str) -> Alive {
        let flag = Arc::new(AtomicBool::new(true));
        self.running.lock().push((worker, flag.clone()));
        Alive(flag)
    }

    /// The pipeline is shutting down: workers stopping is expected.
    pub fn closing(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Whether the pipeline is shutting down.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Workers that stopped while the pipeline was open.
    pub fn dead(&self) -> Vec<&'static str> {
        if self.closing.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.running
            .lock()
            .iter()
            .filter(|(_, f)| !f.load(Ordering::Acquire))
            .map(|(n, _)| *n)
            .collect()
    }
}

/// Faults a test can inject; see `Rag::faults` (with the `testing` feature).
#[derive(Debug, Default)]
pub struct Faults {
    /// Panic in the loader on its next job.
    pub panic_loader: AtomicBool,
    /// Panic in the model thread on its next job.
    pub panic_model: AtomicBool,
    /// Panic in the write-back thread on its next write.
    pub panic_writeback: AtomicBool,
    /// Make the loader thread exit (as an uncontained bug would) before its next job.
    pub kill_loader: AtomicBool,
    /// Milliseconds retrieval sleeps before searching.
    pub retrieval_delay_ms: AtomicU64,
    /// Milliseconds the write-back thread sleeps before each write.
    pub writeback_delay_ms: AtomicU64,
}

impl Faults {
    /// Takes a one-shot flag.
    pub fn take(flag: &AtomicBool) -> bool {
        flag.swap(false, Ordering::AcqRel)
    }

    /// Sleeps for a delay fault, if set.
    pub fn delay(ms: &AtomicU64) {
        let ms = ms.load(Ordering::Relaxed);
        if ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_and_is_counted() {
        let m = Metrics::default();
        let r: Result<u32, Error> = contain("ragkv-test", &m, || panic!("boom {}", 7));
        match r.unwrap_err() {
            Error::Panicked { worker, message } => {
                assert_eq!((worker, message.as_str()), ("ragkv-test", "boom 7"))
            }
            e => panic!("{e}"),
        }
        assert_eq!(contain("ragkv-test", &m, || 3).unwrap(), 3);
        assert_eq!(m.worker_panics.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_stopped_worker_is_reported_until_closing() {
        let h = Health::default();
        let a = h.register("ragkv-a");
        let _b = h.register("ragkv-b");
        assert!(h.dead().is_empty());
        drop(a);
        assert_eq!(h.dead(), vec!["ragkv-a"]);
        h.closing();
        assert!(h.dead().is_empty());
    }
}
