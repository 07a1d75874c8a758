//! The end of an ingest run: pruning vanished documents, and detaching KV that no point
//! references any more (the reconciliation the commit order relies on; see [`super`]).

use std::collections::{HashMap, HashSet};

use super::Engine;
use crate::config::{RunOptions, Shard};
use crate::corpus::split_kv_doc;
use crate::error::Result;
use crate::report::{Failure, Report};

impl Engine {
    /// Prune (when asked), build the HNSW index, and detach KV no point references: of the
    /// documents this run read (every document with `prune`).
    pub(super) fn finish(
        &self,
        opts: &RunOptions,
        seen: &HashSet<String>,
        report: &mut Report,
    ) -> Result<()> {
        report.orphans_removed += if opts.prune {
            let versions = self.prune(seen, opts.shard, report)?;
            self.detach_orphans(&versions)?
        } else {
            // Only the documents this run read: a seek each, not a scan of every payload.
            let mut candidates = Vec::new();
            for d in seen {
                candidates.extend(self.corpus.kv_versions(d)?);
            }
            self.detach_unreferenced(candidates)?
        };
        self.corpus.index.optimize()?;
        self.corpus.index.flush()?;
        Ok(())
    }

    /// Deletes the points of indexed documents this run did not see (unless a source could
    /// not be read completely); returns the versions the index holds afterwards.
    fn prune(
        &self,
        seen: &HashSet<String>,
        shard: Option<Shard>,
        report: &mut Report,
    ) -> Result<HashMap<String, HashSet<String>>> {
        let mut versions = self.indexed_versions()?;
        // A source that could not be listed would look like a source whose documents all
        // vanished: never prune then.
        let unlisted = report
            .failures
            .iter()
            .any(|f| f.reason.starts_with("cannot list") || f.reason.starts_with("cannot open"));
        if unlisted {
            report.failures.push(Failure {
                origin: "--prune".into(),
                reason: "skipped: a source could not be read completely".into(),
            });
            report.docs_failed += 1;
            return Ok(versions);
        }
        // Another shard's documents are not this run's to judge.
        let gone: Vec<String> = versions
            .keys()
            .filter(|d| !seen.contains(*d) && shard.is_none_or(|s| s.contains(d)))
            .cloned()
            .collect();
        for d in gone {
            let _claim = self.claims.claim(&d);
            self.corpus.index.delete_document(&d)?;
            versions.remove(&d);
            report.docs_deleted += 1;
        }
        self.corpus.index.flush()?;
        Ok(versions)
    }

    /// Document → content hashes of the versions the vector index holds.
    pub(crate) fn indexed_versions(&self) -> Result<HashMap<String, HashSet<String>>> {
        let mut versions: HashMap<String, HashSet<String>> = HashMap::new();
        for (_, p) in self.corpus.index.points()? {
            versions.entry(p.doc_id).or_default().insert(p.doc_hash);
        }
        Ok(versions)
    }

    /// Detaches the KV documents (`doc@hash`) of versions not in `versions` (a snapshot of
    /// the index); returns how many. Each is checked again under its document's claim, so a
    /// version written after the snapshot survives. KV documents of another form were not
    /// written by ingest and are left alone.
    pub(crate) fn detach_orphans(
        &self,
        versions: &HashMap<String, HashSet<String>>,
    ) -> Result<usize> {
        let candidates = self.corpus.store.documents()?.into_iter().filter(|d| {
            split_kv_doc(d)
                .is_some_and(|(id, h)| !versions.get(id).is_some_and(|hs| hs.contains(h)))
        });
        self.detach_unreferenced(candidates.collect())
    }

    /// Detaches each of `kv_docs` whose version no point carries, deciding under the
    /// document's claim; returns how many.
    fn detach_unreferenced(&self, kv_docs: Vec<String>) -> Result<usize> {
        let mut n = 0;
        for d in kv_docs {
            let Some((id, h)) = split_kv_doc(&d) else {
                continue;
            };
            let _claim = self.claims.claim(id);
            if !self.indexes_version(id, h)? {
                self.corpus.store.delete_document(&d)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Whether some point of `doc` carries version `hash`.
    pub(crate) fn indexes_version(&self, doc: &str, hash: &str) -> Result<bool> {
        Ok(self
            .corpus
            .index
            .document(doc)?
            .iter()
            .any(|(_, p)| p.doc_hash == hash))
    }
}
