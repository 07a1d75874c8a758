//! Per-document write claims: the one rule for concurrent writers of an [`crate::Engine`].
//!
//! Every operation that writes a document's state holds that document's claim from the moment
//! it reads the state it decides on until its last write:
//! - ingest: from reading the document's indexed version (plan) through storing its KV, the
//!   upsert of its points and the detaching of older versions (commit);
//! - delete: the whole removal (points, then every KV version);
//! - reconciliation (`gc`, the end of an ingest run): re-reading the index for the document
//!   before detaching one of its KV versions;
//! - rematerialization: re-checking that the version still exists before attaching KV to it.
//!
//! So a DELETE and a POST of the same id are ordered (the later one wins, whole), and a KV
//! version that an ingest stored but has not yet made searchable is never taken for an orphan.
//!
//! Claims on different documents never wait for each other. An ingest run holds claims of the
//! documents in its pipeline while it plans the next one; the stages downstream of planning
//! never wait for a claim, so each held claim is released after its commit, whatever the
//! planner waits for: no cycle, no deadlock.

use std::collections::HashSet;

use parking_lot::{Condvar, Mutex};

/// The set of claimed document ids.
#[derive(Debug, Default)]
pub(crate) struct Claims {
    held: Mutex<HashSet<String>>,
    freed: Condvar,
}

/// A held claim; released on drop (also on unwinding).
#[derive(Debug)]
pub(crate) struct Claim<'a> {
    claims: &'a Claims,
    doc: String,
}

impl Claims {
    /// Waits until no one else holds `doc`'s claim, then holds it.
    pub(crate) fn claim(&self, doc: &str) -> Claim<'_> {
        let mut held = self.held.lock();
        while held.contains(doc) {
            self.freed.wait(&mut held);
        }
        held.insert(doc.to_string());
        Claim {
            claims: self,
            doc: doc.to_string(),
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.claims.held.lock().remove(&self.doc);
        self.claims.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn one_holder_per_document_and_others_proceed() {
        let claims = Claims::default();
        let inside = AtomicUsize::new(0);
        let max = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let _c = claims.claim("d");
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        max.fetch_max(n, Ordering::SeqCst);
                        // Another document is never blocked by "d".
                        drop(claims.claim("e"));
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            }
        });
        assert_eq!(max.load(Ordering::SeqCst), 1);
        assert!(claims.held.lock().is_empty());
    }
}
