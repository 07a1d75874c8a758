//! Prometheus metrics, rendered by hand in the text exposition format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// A histogram over fixed bucket bounds (seconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Counts one observation.
    pub fn observe(&self, seconds: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if seconds <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

const TTFT_BOUNDS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
const ITL_BOUNDS: &[f64] = &[0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0];
const REMOTE_BOUNDS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// Every metric the server exports.
#[derive(Debug)]
pub struct Metrics {
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between tokens.
    pub itl: Histogram,
    /// Queries admitted.
    pub requests: AtomicU64,
    /// Queries refused at capacity (429).
    pub rejected: AtomicU64,
    /// Queries that failed.
    pub failed: AtomicU64,
    /// Queries cancelled (client gone, or timed out).
    pub cancelled: AtomicU64,
    /// Jobs on which a pipeline worker panicked (contained: the job failed, the worker went on).
    pub worker_panics: AtomicU64,
    /// Chunks whose stored KV failed verification (recomputed, then written again).
    pub kv_corrupt: AtomicU64,
    /// Chunks served from stored KV.
    pub kv_hits: AtomicU64,
    /// Chunks recomputed.
    pub kv_misses: AtomicU64,
    /// Stored KV bytes read.
    pub kv_bytes_loaded: AtomicU64,
    /// The shared tier (`[remote]`), asked on local misses: chunks found (and kept locally),
    /// not found, failed (errors, timeouts, corrupt objects: recomputed), bytes fetched, and
    /// the time of each fetch.
    pub remote_hits: AtomicU64,
    /// Chunks the tier did not have.
    pub remote_misses: AtomicU64,
    /// Tier requests that failed.
    pub remote_errors: AtomicU64,
    /// Bytes fetched from the tier.
    pub remote_bytes: AtomicU64,
    /// Time of each tier fetch.
    pub remote_fetch: Histogram,
    /// Loader time, and the part of it that ran while the model computed (microseconds).
    pub kv_load_us: AtomicU64,
    /// Of that, while the model computed.
    pub kv_load_hidden_us: AtomicU64,
    /// Chunks recomputed by queries and written back.
    pub rematerialized: AtomicU64,
    /// Queries in flight.
    pub inflight: AtomicU64,
    /// Queries waiting for the loader.
    pub load_queue: AtomicU64,
    /// Queries waiting for the model.
    pub compute_queue: AtomicU64,
    /// Queries in the model's batch, and the KV cache bytes they reserve.
    pub batch_size: AtomicU64,
    /// KV cache bytes the batch reserves.
    pub kv_reserved_bytes: AtomicU64,
    /// Batch steps run, and the queries they ran summed over steps (their ratio is the mean
    /// batch size).
    pub batch_steps: AtomicU64,
    /// Queries run, summed over steps.
    pub batch_rows: AtomicU64,
    /// Answer tokens generated.
    pub tokens_generated: AtomicU64,
    /// Maintenance jobs run (requested or scheduled), failed, and chunks they prefilled.
    pub maintenance_runs: AtomicU64,
    /// Maintenance jobs failed.
    pub maintenance_failures: AtomicU64,
    /// Chunks they prefilled.
    pub maintenance_chunks: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
            requests: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            worker_panics: AtomicU64::new(0),
            kv_corrupt: AtomicU64::new(0),
            kv_hits: AtomicU64::new(0),
            kv_misses: AtomicU64::new(0),
            kv_bytes_loaded: AtomicU64::new(0),
            remote_hits: AtomicU64::new(0),
            remote_misses: AtomicU64::new(0),
            remote_errors: AtomicU64::new(0),
            remote_bytes: AtomicU64::new(0),
            remote_fetch: Histogram::new(REMOTE_BOUNDS),
            kv_load_us: AtomicU64::new(0),
            kv_load_hidden_us: AtomicU64::new(0),
            rematerialized: AtomicU64::new(0),
            inflight: AtomicU64::new(0),
            load_queue: AtomicU64::new(0),
            compute_queue: AtomicU64::new(0),
            batch_size: AtomicU64::new(0),
            kv_reserved_bytes: AtomicU64::new(0),
            batch_steps: AtomicU64::new(0),
            batch_rows: AtomicU64::new(0),
            tokens_generated: AtomicU64::new(0),
            maintenance_runs: AtomicU64::new(0),
            maintenance_failures: AtomicU64::new(0),
            maintenance_chunks: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.ttft.render(
            "ragkv_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            &mut out,
        );
        self.itl.render(
            "ragkv_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            &mut out,
        );
        self.remote_fetch.render(
            "ragkv_remote_fetch_seconds",
            "Time of each chunk fetch from the shared KV tier, retries included.",
            &mut out,
        );
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let secs = |a: &AtomicU64| g(a) as f64 / 1e6;
        for (name, help, v) in [
            (
                "ragkv_kv_load_seconds_total",
                "Loader time: reading, verifying, importing and re-positioning stored KV.",
                secs(&self.kv_load_us),
            ),
            (
                "ragkv_kv_load_hidden_seconds_total",
                "Loader time during which the model was computing another query.",
                secs(&self.kv_load_hidden_us),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        for (name, kind, help, v) in [
            (
                "ragkv_requests_total",
                "counter",
                "Queries admitted.",
                g(&self.requests),
            ),
            (
                "ragkv_requests_rejected_total",
                "counter",
                "Queries refused with 429.",
                g(&self.rejected),
            ),
            (
                "ragkv_requests_failed_total",
                "counter",
                "Queries that ended in an error.",
                g(&self.failed),
            ),
            (
                "ragkv_requests_cancelled_total",
                "counter",
                "Queries whose client went away or timed out.",
                g(&self.cancelled),
            ),
            (
                "ragkv_worker_panics_total",
                "counter",
                "Jobs on which a pipeline worker panicked (the job failed; the worker went on).",
                g(&self.worker_panics),
            ),
            (
                "ragkv_kv_corrupt_total",
                "counter",
                "Stored chunk KV that failed verification (recomputed and written again).",
                g(&self.kv_corrupt),
            ),
            (
                "ragkv_kv_hits_total",
                "counter",
                "Retrieved chunks served from stored KV.",
                g(&self.kv_hits),
            ),
            (
                "ragkv_kv_misses_total",
                "counter",
                "Retrieved chunks prefilled inline (missing or corrupt KV).",
                g(&self.kv_misses),
            ),
            (
                "ragkv_kv_bytes_loaded_total",
                "counter",
                "Stored KV bytes read.",
                g(&self.kv_bytes_loaded),
            ),
            (
                "ragkv_remote_hits_total",
                "counter",
                "Chunks the local store missed that the shared KV tier had (kept locally).",
                g(&self.remote_hits),
            ),
            (
                "ragkv_remote_misses_total",
                "counter",
                "Chunks neither the local store nor the shared tier had.",
                g(&self.remote_misses),
            ),
            (
                "ragkv_remote_errors_total",
                "counter",
                "Shared-tier fetches that failed or did not verify (the chunk was recomputed).",
                g(&self.remote_errors),
            ),
            (
                "ragkv_remote_bytes_total",
                "counter",
                "KV bytes fetched from the shared tier.",
                g(&self.remote_bytes),
            ),
            (
                "ragkv_kv_rematerialized_total",
                "counter",
                "Chunks whose KV was written back in the background.",
                g(&self.rematerialized),
            ),
            (
                "ragkv_maintenance_runs_total",
                "counter",
                "Maintenance jobs run (rematerialize, gc), requested or scheduled.",
                g(&self.maintenance_runs),
            ),
            (
                "ragkv_maintenance_failures_total",
                "counter",
                "Maintenance jobs that failed.",
                g(&self.maintenance_failures),
            ),
            (
                "ragkv_maintenance_chunks_rematerialized_total",
                "counter",
                "Chunks prefilled by rematerialize jobs.",
                g(&self.maintenance_chunks),
            ),
            (
                "ragkv_batch_steps_total",
                "counter",
                "Batch steps the model ran.",
                g(&self.batch_steps),
            ),
            (
                "ragkv_batch_rows_total",
                "counter",
                "Queries run by those steps, summed (over steps: the mean batch size).",
                g(&self.batch_rows),
            ),
            (
                "ragkv_tokens_generated_total",
                "counter",
                "Tokens generated.",
                g(&self.tokens_generated),
            ),
            (
                "ragkv_inflight_requests",
                "gauge",
                "Queries admitted and not finished.",
                g(&self.inflight),
            ),
            (
                "ragkv_load_queue_depth",
                "gauge",
                "Queries waiting for the KV loader.",
                g(&self.load_queue),
            ),
            (
                "ragkv_compute_queue_depth",
                "gauge",
                "Loaded queries waiting for the model.",
                g(&self.compute_queue),
            ),
            (
                "ragkv_batch_size",
                "gauge",
                "Queries in the model's batch (decoding together).",
                g(&self.batch_size),
            ),
            (
                "ragkv_kv_reserved_bytes",
                "gauge",
                "KV cache bytes reserved by the queries in the batch (bounded by serve.kv_budget_mb).",
                g(&self.kv_reserved_bytes),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.ttft.observe(0.02);
        m.ttft.observe(3.0);
        let text = m.render();
        assert!(text.contains("ragkv_time_to_first_token_seconds_bucket{le=\"0.025\"} 1"));
        assert!(text.contains("ragkv_time_to_first_token_seconds_bucket{le=\"5\"} 2"));
        assert!(text.contains("ragkv_time_to_first_token_seconds_count 2"));
    }
}
