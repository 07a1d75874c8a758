//! Maintenance jobs the server runs for the store it owns: re-materialization and garbage
//! collection, on request (`POST /v1/admin/rematerialize`, `POST /v1/admin/gc`: how the CLI
//! hands a cron job to a running server) and on the built-in schedule (`serve.*_cron`).
//!
//! One job runs at a time: a request that finds one running gets 409, a scheduled run waits
//! for it. Jobs share the process with queries but not their threads: the query pipeline keeps
//! serving (chunks a job has not reached yet are recomputed, as on any miss).
//!
//! [`Maintenance::close`] (the server's shutdown) stops the schedule, stops a running
//! re-materialization at its next chunk (what it redid is stored; the next run does the
//! rest), waits for a running GC, and refuses later jobs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use ingest::{Counters, Engine, GcReport, RematOptions, RematReport};
use parking_lot::Mutex;

use crate::metrics::Metrics;
use crate::schedule::Cron;

/// When the server runs jobs by itself (`ServeConfig::schedules`).
#[derive(Debug, Clone, Default)]
pub struct Schedules {
    /// Re-materialization, with what it redoes.
    pub rematerialize: Option<(Cron, RematOptions)>,
    /// Garbage collection.
    pub gc: Option<Cron>,
}

/// Why a job did not run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Another job is running.
    #[error("another maintenance job is running")]
    Busy,
    /// The server is shutting down.
    #[error("the server is shutting down")]
    Closing,
    /// The job failed.
    #[error(transparent)]
    Failed(#[from] ingest::Error),
}

/// The server's maintenance runner.
#[derive(Debug)]
pub struct Maintenance {
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
    running: Mutex<()>,
    /// Set by [`Maintenance::close`]: jobs stop, the schedule ends.
    closing: AtomicBool,
    cron: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Maintenance {
    /// A runner for `engine`, counting into `metrics`; no schedule until started.
    pub fn new(engine: Arc<Engine>, metrics: Arc<Metrics>) -> Arc<Maintenance> {
        Arc::new(Maintenance {
            engine,
            metrics,
            running: Mutex::new(()),
            closing: AtomicBool::new(false),
            cron: Mutex::new(None),
        })
    }

    /// Re-materializes now (blocking); [`JobError::Busy`] if a job runs, unless `wait`.
    pub fn rematerialize(&self, opts: &RematOptions, wait: bool) -> Result<RematReport, JobError> {
        let _g = self.lock(wait)?;
        let r = self
            .engine
            .rematerialize_until(opts, &Counters::default(), || {
                self.closing.load(Ordering::Relaxed)
            });
        self.count(&r);
        let r = r?;
        self.metrics
            .maintenance_chunks
            .fetch_add(r.prefilled as u64, Ordering::Relaxed);
        Ok(r)
    }

    /// Garbage-collects now (blocking); [`JobError::Busy`] if a job runs, unless `wait`.
    pub fn gc(&self, wait: bool) -> Result<GcReport, JobError> {
        let _g = self.lock(wait)?;
        let r = self.engine.gc();
        self.count(&r);
        Ok(r?)
    }

    /// Holds maintenance off while the guard lives (e.g. during a backup of the data
    /// directory): requested jobs get [`JobError::Busy`], scheduled ones wait. `None` if a job
    /// is running.
    pub fn try_exclusive(&self) -> Option<parking_lot::MutexGuard<'_, ()>> {
        self.running.try_lock()
    }

    /// Stops the schedule and a running re-materialization (at its next chunk), waits for
    /// them and for a running GC, and refuses later jobs ([`JobError::Closing`]).
    pub fn close(&self) {
        self.closing.store(true, Ordering::Relaxed);
        if let Some(h) = self.cron.lock().take() {
            h.thread().unpark();
            if h.join().is_err() {
                tracing::error!("ragkv-cron had panicked");
            }
        }
        drop(self.running.lock());
    }

    fn lock(&self, wait: bool) -> Result<parking_lot::MutexGuard<'_, ()>, JobError> {
        let guard = if wait {
            self.running.lock()
        } else {
            self.running.try_lock().ok_or(JobError::Busy)?
        };
        // Checked holding the lock: a job that waited for one ended by `close` does not start.
        if self.closing.load(Ordering::Relaxed) {
            return Err(JobError::Closing);
        }
        Ok(guard)
    }

    fn count<T>(&self, r: &ingest::Result<T>) {
        self.metrics
            .maintenance_runs
            .fetch_add(1, Ordering::Relaxed);
        if let Err(e) = r {
            tracing::warn!(error = %e, "maintenance job failed");
            self.metrics
                .maintenance_failures
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Starts the `ragkv-cron` thread for the configured schedules (none: no thread). It
    /// stops at [`Maintenance::close`], or when the last handle to `self` is dropped.
    pub fn schedule(self: &Arc<Self>, schedules: Schedules) -> Result<(), crate::Error> {
        if schedules.rematerialize.is_none() && schedules.gc.is_none() {
            return Ok(());
        }
        let weak: Weak<Maintenance> = Arc::downgrade(self);
        let h = std::thread::Builder::new()
            .name("ragkv-cron".into())
            .spawn(move || cron_loop(weak, schedules))
            .map_err(|source| crate::Error::Spawn {
                thread: "ragkv-cron",
                source,
            })?;
        *self.cron.lock() = Some(h);
        Ok(())
    }
}

fn cron_loop(m: Weak<Maintenance>, schedules: Schedules) {
    let Schedules {
        rematerialize: remat,
        gc,
    } = schedules;
    let now = chrono::Utc::now;
    let mut next_remat = remat.as_ref().and_then(|(c, _)| c.next_after(now()));
    let mut next_gc = gc.as_ref().and_then(|c| c.next_after(now()));
    loop {
        let due = [next_remat, next_gc].into_iter().flatten().min();
        let Some(due) = due else {
            return; // neither schedule ever fires again
        };
        // Sleep in short slices so the thread notices the server going away; `close` wakes
        // it at once.
        let wait = (due - now()).to_std().unwrap_or(Duration::ZERO);
        std::thread::park_timeout(wait.min(Duration::from_millis(500)));
        let Some(m) = m.upgrade() else {
            return;
        };
        if m.closing.load(Ordering::Relaxed) {
            return;
        }
        let t = now();
        if next_remat.is_some_and(|d| d <= t) {
            let (cron, opts) = remat.as_ref().expect("scheduled");
            match m.rematerialize(opts, true) {
                Ok(r) => tracing::info!(
                    planned = r.planned,
                    prefilled = r.prefilled,
                    interrupted = r.interrupted,
                    "scheduled rematerialize done"
                ),
                Err(JobError::Closing) => return,
                Err(e) => tracing::warn!(error = %e, "scheduled rematerialize failed"),
            }
            next_remat = cron.next_after(now());
        }
        if next_gc.is_some_and(|d| d <= t) {
            match m.gc(true) {
                Ok(r) => tracing::info!(?r, "scheduled gc done"),
                Err(JobError::Closing) => return,
                Err(e) => tracing::warn!(error = %e, "scheduled gc failed"),
            }
            next_gc = gc.as_ref().and_then(|c| c.next_after(now()));
        }
    }
}
