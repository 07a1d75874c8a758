//! The write-back thread (`ragkv-materialize`): stores the KV of chunks the model thread
//! prefilled because it was missing or damaged, attached to the chunk's document version,
//! so the next query finds it.

use std::sync::atomic::Ordering;

use crossbeam_channel::Receiver;

use super::job::{Worker, Writeback};
use crate::error::Error;
use crate::supervise::{contain, Faults};

/// The write-back loop; returns when its queue closes (every pending write-back stored).
pub(crate) fn run(w: &Worker, rx: Receiver<Writeback>) {
    let m = &*w.metrics;
    for wb in rx {
        Faults::delay(&w.faults.writeback_delay_ms);
        let r = contain("ragkv-materialize", m, || {
            if Faults::take(&w.faults.panic_writeback) {
                panic!("injected write-back fault");
            }
            w.engine
                .write_back(
                    &wb.doc,
                    &wb.hash,
                    &wb.tokens,
                    (&wb.bytes, wb.first.as_deref()),
                    wb.replace,
                )
                .map_err(Error::from)
        });
        match r.and_then(|r| r) {
            Ok(true) => {
                m.rematerialized.fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {
                tracing::debug!(doc = %wb.doc, "write-back skipped: the version is gone")
            }
            Err(e) => tracing::warn!(error = %e.chain(), doc = %wb.doc, "KV write-back failed"),
        }
    }
}
