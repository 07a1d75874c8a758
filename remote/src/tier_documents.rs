//! [`Remote`]'s document-level operations: manifests, document versions, deletes, garbage
//! collection and usage (a second `impl` block of the type `tier.rs` defines).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use schema::{NamespaceId, TokenDigest};

use super::{DeleteReport, GcReport, Item, Remote};
use crate::error::{Error, Result};
use crate::keys::hex;
use crate::manifest::Manifest;
use crate::object;

impl Remote {
    /// Writes a document version's manifest, naming its chunks' objects in order. Call it
    /// once every object is stored ([`Remote::put_object`], [`Remote::attach_object`]): a
    /// manifest that exists names stored objects.
    pub fn put_manifest(
        &self,
        ns: NamespaceId,
        doc: &str,
        version: &str,
        chunks: &[&[u32]],
    ) -> Result<()> {
        let key = self.keys.manifest(ns, doc, version);
        let digests = chunks.iter().map(|t| hex(&TokenDigest::of(t).0)).collect();
        let body = Manifest::new(ns, doc, version, digests).encode();
        self.put_bytes(&key, PutPayload::from(body))
    }

    /// A whole document version at once: its objects (`remote.concurrency` at a time), a
    /// reference marker per object, then its manifest. Idempotent: storing the same version
    /// again rewrites the same names. Returns the bytes written.
    pub fn put_doc(
        &self,
        ns: NamespaceId,
        doc: &str,
        version: &str,
        items: &[Item<'_>],
    ) -> Result<u64> {
        let mkey = self.keys.manifest(ns, doc, version);
        let mut bodies = Vec::with_capacity(items.len());
        for it in items {
            let digest = hex(&TokenDigest::of(it.tokens).0);
            bodies.push((
                self.keys.kv_digest(ns, &digest),
                object::encode(ns, it.layout, it.tokens, it.kv)?,
                self.keys.reference(ns, &digest, doc, version),
            ));
        }
        let bytes: u64 = bodies.iter().map(|(_, b, _)| b.len() as u64).sum();
        self.run("put document", &mkey, async {
            stream::iter(bodies)
                .map(|(key, body, reference)| async move {
                    self.store
                        .put(&key, PutPayload::from(body))
                        .await
                        .map_err(Self::store_err("put", &key))?;
                    self.store
                        .put(&reference, PutPayload::default())
                        .await
                        .map_err(Self::store_err("put", &reference))
                })
                .buffer_unordered(self.concurrency)
                .try_collect::<Vec<_>>()
                .await
                .map(|_| ())
        })?;
        self.counters
            .puts
            .fetch_add(items.len() as u64, Ordering::Relaxed);
        self.counters
            .bytes_written
            .fetch_add(bytes, Ordering::Relaxed);
        let chunks: Vec<&[u32]> = items.iter().map(|i| i.tokens).collect();
        self.put_manifest(ns, doc, version, &chunks)?;
        Ok(bytes)
    }

    /// The manifests of `doc` under `ns` (every stored version).
    pub fn manifests(&self, ns: NamespaceId, doc: &str) -> Result<Vec<Manifest>> {
        let dir = self.keys.doc_manifests(ns, doc);
        self.run("list manifests", &dir, async {
            let metas: Vec<_> = self
                .store
                .list(Some(&dir))
                .try_collect()
                .await
                .map_err(Self::store_err("list", &dir))?;
            let mut out = Vec::with_capacity(metas.len());
            for m in metas {
                let b = self
                    .store
                    .get(&m.location)
                    .await
                    .map_err(Self::store_err("get", &m.location))?
                    .bytes()
                    .await
                    .map_err(Self::store_err("get", &m.location))?;
                out.push(Manifest::decode(&b, ns, m.location.as_ref())?);
            }
            Ok(out)
        })
    }

    /// Removes `doc` from the tier: every version's manifest (or only `version`'s), its
    /// reference markers, and each KV object no other document version references.
    ///
    /// A writer storing the same chunk for another document at the same moment can lose the
    /// object between its put and its reference (the object is then missing, never wrong: a
    /// read misses and the chunk is recomputed, and `rematerialize` writes it again).
    pub fn delete_doc(
        &self,
        ns: NamespaceId,
        doc: &str,
        version: Option<&str>,
    ) -> Result<DeleteReport> {
        let manifests: Vec<Manifest> = self
            .manifests(ns, doc)?
            .into_iter()
            .filter(|m| version.is_none_or(|v| m.version == v))
            .collect();
        let mut report = DeleteReport::default();
        let dir = self.keys.doc_manifests(ns, doc);
        self.run("delete document", &dir, async {
            let mut touched = HashSet::new();
            for m in &manifests {
                for d in &m.objects {
                    let r = self.keys.reference(ns, d, doc, &m.version);
                    delete_quiet(&*self.store, &r).await?;
                    report.references += 1;
                    touched.insert(d.clone());
                }
            }
            for d in touched {
                let refs = self.keys.refs(ns, &d);
                let left = self
                    .store
                    .list(Some(&refs))
                    .try_next()
                    .await
                    .map_err(Self::store_err("list", &refs))?;
                if left.is_none() {
                    delete_quiet(&*self.store, &self.keys.kv_digest(ns, &d)).await?;
                    report.objects += 1;
                }
            }
            for m in &manifests {
                delete_quiet(&*self.store, &self.keys.manifest(ns, doc, &m.version)).await?;
                report.manifests += 1;
            }
            Ok(())
        })?;
        Ok(report)
    }

    /// Removes what nothing references, older than `grace` (writers put objects and markers
    /// before their manifest; the grace keeps an ingest in flight safe): reference markers
    /// of document versions without a manifest, then KV objects without a marker.
    pub fn gc(&self, grace: Duration) -> Result<GcReport> {
        let root = self.keys.manifest_root();
        self.run("gc", &root, async {
            let mut report = GcReport::default();
            let now = chrono_now();
            let old = |m: &object_store::ObjectMeta| {
                let age = now - m.last_modified.timestamp_millis();
                age >= grace.as_millis() as i64
            };
            let mut alive: HashSet<(String, String)> = HashSet::new();
            let manifests: Vec<_> = self
                .store
                .list(Some(&root))
                .try_collect()
                .await
                .map_err(Self::store_err("list", &root))?;
            for m in &manifests {
                if let Some(p) = self.keys.parts(&m.location, "manifests") {
                    if let [ns, doc, version] = &p[..] {
                        alive.insert((ns.clone(), format!("{doc}.{version}")));
                    }
                }
            }
            report.manifests = manifests.len();
            let refs_root = self.keys.ref_root();
            let refs: Vec<_> = self
                .store
                .list(Some(&refs_root))
                .try_collect()
                .await
                .map_err(Self::store_err("list", &refs_root))?;
            let mut referenced: HashSet<(String, String)> = HashSet::new();
            for r in &refs {
                let Some(p) = self.keys.parts(&r.location, "refs") else {
                    continue;
                };
                let [ns, digest, referrer] = &p[..] else {
                    continue;
                };
                if alive.contains(&(ns.clone(), referrer.clone())) || !old(r) {
                    referenced.insert((ns.clone(), digest.clone()));
                } else {
                    delete_quiet(&*self.store, &r.location).await?;
                    report.dead_references += 1;
                }
            }
            let kv_root = self.keys.kv_root();
            let objects: Vec<_> = self
                .store
                .list(Some(&kv_root))
                .try_collect()
                .await
                .map_err(Self::store_err("list", &kv_root))?;
            report.objects = objects.len();
            for o in &objects {
                let Some(p) = self.keys.parts(&o.location, "kv") else {
                    continue;
                };
                let [ns, digest] = &p[..] else {
                    continue;
                };
                if !referenced.contains(&(ns.clone(), digest.clone())) && old(o) {
                    delete_quiet(&*self.store, &o.location).await?;
                    report.orphans += 1;
                    report.orphan_bytes += o.size;
                }
            }
            Ok(report)
        })
    }

    /// Every stored KV object's size per namespace (hex), for reports and tests.
    pub fn usage(&self) -> Result<HashMap<String, (usize, u64)>> {
        let root = self.keys.kv_root();
        self.run("list", &root, async {
            let mut out: HashMap<String, (usize, u64)> = HashMap::new();
            let objects: Vec<_> = self
                .store
                .list(Some(&root))
                .try_collect()
                .await
                .map_err(Self::store_err("list", &root))?;
            for o in objects {
                if let Some(p) = self.keys.parts(&o.location, "kv") {
                    let e = out.entry(p[0].clone()).or_default();
                    e.0 += 1;
                    e.1 += o.size;
                }
            }
            Ok(out)
        })
    }
}

/// Deletes `p`; one already gone is not an error (deletes are retried and raced).
async fn delete_quiet(store: &dyn ObjectStore, p: &Path) -> Result<()> {
    match store.delete(p).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(source) => Err(Error::Store {
            op: "delete",
            key: p.to_string(),
            source: Box::new(source),
        }),
    }
}

/// Milliseconds since the epoch, in the object store's clock terms.
fn chrono_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
