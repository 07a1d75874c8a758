//! The writer stage of an ingest run: each embedded document's chunk KV (prefilled in groups,
//! stored locally and in the shared tier), then its points; see [`super`] for the commit order.

use super::*;

impl Engine {
    /// Runs on the calling thread; returns (KV write time, index time).
    pub(super) fn write_stage(
        &self,
        opts: &RunOptions,
        rx: Receiver<ToWriter<'_>>,
        shared: &Shared<'_>,
    ) -> (f64, f64) {
        let mut kv_time = Duration::ZERO;
        let mut index_time = Duration::ZERO;
        for msg in rx {
            if shared.stopped() {
                continue; // drain so upstream stages can exit
            }
            match msg {
                ToWriter::Abandon => {}
                ToWriter::Kv {
                    kv_doc,
                    tokens,
                    bytes,
                    first,
                } => {
                    let t = Instant::now();
                    let r = self.corpus.put_first(&kv_doc, &tokens, first.as_deref());
                    let r = r.and_then(|first_bytes| {
                        let mut r = self.corpus.store.put_batch(
                            self.corpus.ns,
                            self.corpus.layout,
                            &[PutItem {
                                tokens: &tokens,
                                kv: bytes.as_deref().unwrap_or(&[]),
                                doc: Some(&kv_doc),
                            }],
                        )?;
                        r.bytes_written += first_bytes;
                        Ok(r)
                    });
                    let r = r.and_then(|r| {
                        let ns = self.corpus.ns;
                        self.store_remote(ns, &kv_doc, &tokens, bytes.as_deref())?;
                        if let Some(first_ns) = self.corpus.first_ns {
                            self.store_remote(first_ns, &kv_doc, &tokens, first.as_deref())?;
                        }
                        Ok(r)
                    });
                    kv_time += t.elapsed();
                    match r {
                        Ok(r) => {
                            let mut rep = shared.report.lock();
                            rep.kv_bytes += r.bytes_written;
                            if bytes.is_some() {
                                rep.chunks_prefilled += 1;
                                rep.tokens_prefilled += tokens.len();
                            }
                        }
                        Err(e) => shared.fatal(e),
                    }
                    shared.counters.chunks_done.fetch_add(1, Ordering::Relaxed);
                    shared
                        .counters
                        .tokens_done
                        .fetch_add(tokens.len() as u64, Ordering::Relaxed);
                }
                ToWriter::Doc(e) => {
                    let t = Instant::now();
                    if let Err(err) = self.commit_doc(opts, e, shared) {
                        shared.fatal(err);
                    }
                    index_time += t.elapsed();
                    shared.counters.docs_done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        (secs(kv_time), secs(index_time))
    }

    /// A chunk just stored locally under `ns` (the corpus's namespace, or under
    /// `ingest.exact_first` its copies' for the first place), on the shared tier too
    /// (write-through): its object and the marker that `kv_doc` references it. A chunk that
    /// was stored before (`bytes` is `None`) is only attached when the tier has it, else read
    /// back and uploaded.
    fn store_remote(
        &self,
        ns: NamespaceId,
        kv_doc: &str,
        tokens: &[u32],
        bytes: Option<&[u8]>,
    ) -> Result<()> {
        let Some(r) = self.corpus.remote_writes() else {
            return Ok(());
        };
        let (doc, version) = split_kv_doc(kv_doc).ok_or_else(|| Error::Invalid {
            what: "kv document",
            why: format!("{kv_doc:?} is not doc@hash"),
        })?;
        let item = |kv| remote::Item {
            tokens,
            layout: self.corpus.layout,
            kv,
        };
        match bytes {
            Some(kv) => {
                r.put_object(ns, doc, version, item(kv))?;
            }
            None => {
                if !r.attach_object(ns, doc, version, tokens)? {
                    let local = match self.corpus.store.get_batch(ns, tokens, tokens.len()) {
                        Ok(local) => local,
                        // A copy for the first place that is not stored here (`ragkv
                        // rematerialize` writes it): other nodes read the chunk's own KV.
                        Err(e) if ns != self.corpus.ns && e.is_miss() && !e.is_damage() => {
                            return Ok(());
                        }
                        Err(e) => return Err(e.into()),
                    };
                    r.put_object(ns, doc, version, item(&local.bytes))?;
                }
            }
        }
        Ok(())
    }

    /// Steps 2 and 3 of the commit order (the KV is stored already).
    fn commit_doc(&self, opts: &RunOptions, e: Embedded<'_>, shared: &Shared<'_>) -> Result<()> {
        let Embedded { planned, vectors } = e;
        let Planned {
            _claim,
            doc,
            hash,
            old,
            chunks,
        } = planned;
        let n = chunks.len() as u32;
        let eager = opts.materialize == Materialize::Eager;
        if let Some(r) = self.corpus.remote_writes().filter(|_| eager) {
            // Step 1 on the shared tier: every object is stored; the manifest says so.
            let tokens: Vec<&[u32]> = chunks.iter().map(|c| c.tokens.as_slice()).collect();
            for ns in self.corpus.tier_namespaces() {
                r.put_manifest(ns, &doc.id, &hash, &tokens)?;
            }
        }
        let delay = self.commit_delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        let points: Vec<ChunkPoint> = chunks
            .iter()
            .zip(vectors)
            .map(|(c, v)| {
                ChunkPoint::new(
                    v,
                    ChunkPayload {
                        doc_id: doc.id.clone(),
                        ordinal: c.ordinal,
                        text: c.text.clone(),
                        tokens: c.tokens.len() as u32,
                        kv_key: if eager {
                            kv_key(&c.tokens)
                        } else {
                            String::new()
                        },
                        doc_hash: hash.clone(),
                        doc_chunks: n,
                        metadata: doc.metadata.clone(),
                    },
                )
            })
            .collect();
        self.corpus.index.upsert(&points)?;
        let fresh: HashSet<Uuid> = points.iter().map(|p| p.id).collect();
        let stale: Vec<Uuid> = old
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !fresh.contains(id))
            .collect();
        self.corpus.index.delete_points(&stale)?;
        let old_hashes: HashSet<&str> = old
            .iter()
            .map(|(_, p)| p.doc_hash.as_str())
            .filter(|h| *h != hash)
            .collect();
        for h in &old_hashes {
            self.corpus.store.delete_document(&kv_doc(&doc.id, h))?;
            if let Some(r) = self.corpus.remote_writes() {
                for ns in self.corpus.tier_namespaces() {
                    r.delete_doc(ns, &doc.id, Some(h))?;
                }
            }
        }
        let mut rep = shared.report.lock();
        if old.is_empty() {
            rep.docs_new += 1;
        } else {
            rep.docs_replaced += 1;
        }
        rep.chunks += chunks.len();
        rep.tokens += chunks.iter().map(|c| c.tokens.len()).sum::<usize>();
        if !eager {
            shared
                .counters
                .chunks_done
                .fetch_add(chunks.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}
