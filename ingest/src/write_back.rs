//! Write-backs: a chunk's KV computed while answering a query (missing or damaged when read),
//! stored for the document version it was retrieved from.

use kvstore::PutItem;

use crate::corpus::kv_doc;
use crate::error::Result;
use crate::pipeline::Engine;

impl Engine {
    /// Stores one chunk's KV, computed while answering a query, for version `hash` of `doc`
    /// (with, under `ingest.exact_first`, its copy for the first place: `first`), unless that
    /// version is no longer indexed (deleted or replaced since it was retrieved: attaching
    /// would leave an orphan). `replace`: the stored copy failed verification, so it is
    /// deleted first and written again. Decided under the document's claim. Returns whether
    /// it was stored.
    pub fn write_back(
        &self,
        doc: &str,
        hash: &str,
        tokens: &[u32],
        (bytes, first): (&[u8], Option<&[u8]>),
        replace: bool,
    ) -> Result<bool> {
        let _claim = self.claim(doc);
        if !self.indexes_version(doc, hash)? {
            return Ok(false);
        }
        if replace {
            self.corpus
                .store
                .delete(self.corpus.namespace(), tokens, 0)?;
        }
        if first.is_some() {
            self.corpus.put_first(&kv_doc(doc, hash), tokens, first)?;
        }
        self.corpus.store.put_batch(
            self.corpus.namespace(),
            self.corpus.layout(),
            &[PutItem {
                tokens,
                kv: bytes,
                doc: Some(&kv_doc(doc, hash)),
            }],
        )?;
        Ok(true)
    }
}
