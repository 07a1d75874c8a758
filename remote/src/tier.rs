//! [`Remote`]: the blocking face of the tier. Its own I/O threads (`remote-io`) run the
//! object store's async client; callers are the loader's and ingest's named threads, never
//! an async worker (a call blocks until its requests finish or time out).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, PutPayload, RetryConfig};
use schema::{KvLayout, NamespaceId, TokenDigest};

use crate::config::{ReadMode, RemoteConfig, Target, WriteMode};
use crate::error::{Error, Result};
use crate::keys::{doc_key, hex, Keys};
use crate::object;

// Document-level operations (manifests, deletes, GC, usage): a second `impl Remote`.
#[path = "tier_documents.rs"]
mod documents;

/// One sequence's KV fetched from the tier, verified.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// The KV's layout.
    pub layout: KvLayout,
    /// Layer-major KV bytes.
    pub kv: Vec<u8>,
    /// Time of the request, retries included.
    pub ms: f64,
}

/// One sequence to store: its tokens and their KV.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    /// The sequence's tokens (its key).
    pub tokens: &'a [u32],
    /// The KV's layout.
    pub layout: KvLayout,
    /// Layer-major KV bytes.
    pub kv: &'a [u8],
}

/// What [`Remote::delete_doc`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteReport {
    /// Manifests removed (one per stored version of the document).
    pub manifests: usize,
    /// Reference markers removed.
    pub references: usize,
    /// KV objects no other document version referenced any more.
    pub objects: usize,
}

/// What [`Remote::gc`] found and removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Manifests listed.
    pub manifests: usize,
    /// KV objects listed.
    pub objects: usize,
    /// Reference markers whose document version has no manifest (older than the grace).
    pub dead_references: usize,
    /// KV objects nothing references (older than the grace), and their bytes.
    pub orphans: usize,
    /// Bytes of those orphans.
    pub orphan_bytes: u64,
}

/// Counters since open.
#[derive(Debug, Default)]
struct Counters {
    gets: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    errors: AtomicU64,
    bytes_read: AtomicU64,
    puts: AtomicU64,
    bytes_written: AtomicU64,
}

/// A snapshot of the tier's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Sequences asked for.
    pub gets: u64,
    /// Of those, found and verified.
    pub hits: u64,
    /// Not stored.
    pub misses: u64,
    /// Stored but not verifying.
    pub corrupt: u64,
    /// Failed requests (after retries) and timeouts.
    pub errors: u64,
    /// KV bytes of the hits.
    pub bytes_read: u64,
    /// Objects stored.
    pub puts: u64,
    /// Their bytes.
    pub bytes_written: u64,
}

/// The shared KV tier on an object store.
#[derive(Debug)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    keys: Keys,
    rt: tokio::runtime::Runtime,
    concurrency: usize,
    timeout: Duration,
    counters: Counters,
    write: WriteMode,
    read: ReadMode,
    gc_grace: Duration,
}

impl Remote {
    /// Connects to the configured store (no request is made until the first operation).
    pub fn open(cfg: &RemoteConfig) -> Result<Remote> {
        cfg.validate()?;
        let store: Arc<dyn ObjectStore> = match cfg.target()? {
            Target::Dir(dir) => {
                std::fs::create_dir_all(&dir).map_err(|e| Error::Config {
                    what: "url",
                    why: format!("{}: {e}", dir.display()),
                })?;
                let fs = LocalFileSystem::new_with_prefix(&dir).map_err(|e| Error::Config {
                    what: "url",
                    why: format!("{}: {e}", dir.display()),
                })?;
                Arc::new(fs)
            }
            Target::S3 {
                endpoint,
                bucket,
                region,
            } => {
                let mut b = AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .with_region(region)
                    .with_client_options(
                        ClientOptions::new()
                            .with_timeout(cfg.timeout())
                            .with_connect_timeout(Duration::from_millis(cfg.connect_timeout_ms)),
                    )
                    .with_retry(RetryConfig {
                        backoff: BackoffConfig {
                            init_backoff: Duration::from_millis(cfg.backoff_ms),
                            max_backoff: Duration::from_millis(cfg.backoff_ms.max(1) * 32),
                            base: 2.0,
                        },
                        max_retries: cfg.retries,
                        retry_timeout: cfg.timeout(),
                    });
                if let Some(e) = endpoint {
                    // S3-compatible servers on a host of their own: path-style requests.
                    b = b
                        .with_allow_http(e.starts_with("http://"))
                        .with_endpoint(e)
                        .with_virtual_hosted_style_request(false);
                }
                if let Some((id, secret)) = cfg.keys()? {
                    b = b.with_access_key_id(id).with_secret_access_key(secret);
                }
                Arc::new(b.build().map_err(|e| Error::Config {
                    what: "url",
                    why: e.to_string(),
                })?)
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("remote-io")
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        Ok(Remote {
            store,
            keys: Keys::new(&cfg.prefix),
            rt,
            concurrency: cfg.concurrency,
            // The store's own timeout bounds one request; this bounds an operation with its
            // retries and backoff.
            timeout: cfg.timeout() * (cfg.retries as u32 + 1)
                + Duration::from_millis(cfg.backoff_ms * 64),
            counters: Counters::default(),
            write: cfg.write,
            read: cfg.read,
            gc_grace: Duration::from_secs(cfg.gc_grace_minutes * 60),
        })
    }

    /// Whether ingest writes KV here (`remote.write`).
    pub fn writes(&self) -> bool {
        self.write != WriteMode::Off
    }

    /// `remote.gc_grace_minutes`.
    pub fn gc_grace(&self) -> Duration {
        self.gc_grace
    }

    /// Whether a local miss asks here (`remote.read`).
    pub fn reads(&self) -> bool {
        self.read != ReadMode::Off
    }

    /// Runs `f` on the I/O threads, bounded by the operation timeout.
    fn run<T>(
        &self,
        op: &'static str,
        key: &Path,
        f: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let timeout = self.timeout;
        let r = self
            .rt
            .block_on(async move { tokio::time::timeout(timeout, f).await });
        r.unwrap_or_else(|_| {
            Err(Error::Timeout {
                op,
                key: key.to_string(),
                ms: timeout.as_millis() as u64,
            })
        })
        .inspect_err(|e| {
            if !matches!(e, Error::Corrupt { .. }) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
            }
        })
    }

    fn store_err<'a>(
        op: &'static str,
        key: &'a Path,
    ) -> impl Fn(object_store::Error) -> Error + 'a {
        move |source| Error::Store {
            op,
            key: key.to_string(),
            source: Box::new(source),
        }
    }

    /// Stores one sequence's KV (an immutable object named by `ns` and its tokens); returns
    /// the object's size.
    pub fn put(&self, ns: NamespaceId, item: Item<'_>) -> Result<u64> {
        let key = self.keys.kv(ns, item.tokens);
        let body = object::encode(ns, item.layout, item.tokens, item.kv)?;
        let n = body.len() as u64;
        self.put_bytes(&key, PutPayload::from(body))?;
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes_written.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }

    /// The KV of `tokens` under `ns`: `None` when the tier has no such object; a corrupt
    /// object is an error (the caller treats it as a miss and recomputes).
    pub fn get(&self, ns: NamespaceId, tokens: &[u32]) -> Result<Option<Fetched>> {
        self.get_many(ns, &[tokens]).pop().expect("one result")
    }

    /// [`Remote::get`] for several sequences, `remote.concurrency` requests in flight;
    /// results in the order asked.
    pub fn get_many(&self, ns: NamespaceId, seqs: &[&[u32]]) -> Vec<Result<Option<Fetched>>> {
        let asks: Vec<(NamespaceId, &[u32])> = seqs.iter().map(|&t| (ns, t)).collect();
        self.get_each(&asks)
    }

    /// [`Remote::get`] for several sequences, each under its own namespace, all in one batch
    /// (`remote.concurrency` requests in flight); results in the order asked.
    pub fn get_each(&self, asks: &[(NamespaceId, &[u32])]) -> Vec<Result<Option<Fetched>>> {
        let keys: Vec<Path> = asks.iter().map(|&(ns, t)| self.keys.kv(ns, t)).collect();
        let keys = &keys;
        let fetch = |i: usize| {
            let key = &keys[i];
            let (ns, tokens) = asks[i];
            let store = &self.store;
            async move {
                let t = Instant::now();
                let got = match store.get(key).await {
                    Ok(r) => r.bytes().await,
                    Err(e) => Err(e),
                };
                let bytes = match got {
                    Ok(b) => b,
                    Err(object_store::Error::NotFound { .. }) => return Ok(None),
                    Err(e) => return Err(Self::store_err("get", key)(e)),
                };
                let d = object::decode(&bytes, ns, tokens, key.as_ref())?;
                Ok(Some(Fetched {
                    layout: d.layout,
                    kv: bytes[d.kv].to_vec(),
                    ms: t.elapsed().as_secs_f64() * 1e3,
                }))
            }
        };
        let timeout = self.timeout;
        let fetch = &fetch;
        let all = self.rt.block_on(async {
            stream::iter(0..asks.len())
                .map(|i| async move {
                    tokio::time::timeout(timeout, fetch(i))
                        .await
                        .unwrap_or_else(|_| {
                            Err(Error::Timeout {
                                op: "get",
                                key: keys[i].to_string(),
                                ms: timeout.as_millis() as u64,
                            })
                        })
                })
                .buffered(self.concurrency)
                .collect::<Vec<_>>()
                .await
        });
        let c = &self.counters;
        for r in &all {
            c.gets.fetch_add(1, Ordering::Relaxed);
            match r {
                Ok(Some(f)) => {
                    c.hits.fetch_add(1, Ordering::Relaxed);
                    c.bytes_read.fetch_add(f.kv.len() as u64, Ordering::Relaxed);
                }
                Ok(None) => {
                    c.misses.fetch_add(1, Ordering::Relaxed);
                }
                Err(Error::Corrupt { .. }) => {
                    c.corrupt.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    c.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        all
    }

    /// Stores one chunk of a document version: its KV object, then the marker saying that
    /// version references it. Returns the object's size.
    pub fn put_object(
        &self,
        ns: NamespaceId,
        doc: &str,
        version: &str,
        item: Item<'_>,
    ) -> Result<u64> {
        let n = self.put(ns, item)?;
        self.reference(ns, doc, version, item.tokens)?;
        Ok(n)
    }

    /// Marks `tokens`' object as referenced by the document version, if the tier holds the
    /// object (a chunk shared with a document stored before); returns whether it does.
    pub fn attach_object(
        &self,
        ns: NamespaceId,
        doc: &str,
        version: &str,
        tokens: &[u32],
    ) -> Result<bool> {
        let key = self.keys.kv(ns, tokens);
        let found = self.run("head", &key, async {
            match self.store.head(&key).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(Self::store_err("head", &key)(e)),
            }
        })?;
        if found {
            self.reference(ns, doc, version, tokens)?;
        }
        Ok(found)
    }

    fn reference(&self, ns: NamespaceId, doc: &str, version: &str, tokens: &[u32]) -> Result<()> {
        let digest = hex(&TokenDigest::of(tokens).0);
        self.put_bytes(
            &self.keys.reference(ns, &digest, doc, version),
            PutPayload::default(),
        )
    }

    /// One object written as is.
    fn put_bytes(&self, key: &Path, body: PutPayload) -> Result<()> {
        self.run("put", key, async {
            self.store
                .put(key, body)
                .await
                .map_err(Self::store_err("put", key))
                .map(|_| ())
        })
    }

    /// The counters since open.
    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            gets: l(&c.gets),
            hits: l(&c.hits),
            misses: l(&c.misses),
            corrupt: l(&c.corrupt),
            errors: l(&c.errors),
            bytes_read: l(&c.bytes_read),
            puts: l(&c.puts),
            bytes_written: l(&c.bytes_written),
        }
    }

    /// The document-id form used in keys (for logs).
    pub fn doc_key(doc: &str) -> String {
        doc_key(doc)
    }
}
