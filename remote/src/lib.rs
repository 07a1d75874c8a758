#![deny(missing_docs)]
//! ragkv's shared KV tier on S3-compatible object storage (Garage, MinIO, Ceph RGW, a
//! cloud's S3), or a directory every node mounts.
//!
//! The local store ([`kvstore`](../kvstore/index.html)) stays in front: a serving node reads
//! its own disk first and asks the tier only on a miss, then keeps what it fetched under its
//! local quota, so a corpus prefilled once (by any node, or by sharded ingest workers) is
//! served by every node without prefilling it again.
//!
//! - [`object`]: one immutable object per stored sequence, named by namespace and token
//!   digest ([`keys`]), verified on read (checksum, namespace, tokens) like a local record.
//! - [`manifest`]: per document version, the objects it wrote; with a reference marker per
//!   object, so [`Remote::delete_doc`] removes an object once no document version references
//!   it, and [`Remote::gc`] removes what crashes or races left behind.
//! - [`Remote`]: blocking calls over the object store's async client on the tier's own I/O
//!   threads, with timeouts, retries with backoff, and a bound on requests in flight
//!   ([`RemoteConfig`], the `[remote]` config section).
//!
//! ```no_run
//! use remote::{Item, ReadMode, Remote, RemoteConfig, WriteMode};
//! use schema::{DType, KvLayout, NamespaceId};
//!
//! let tier = Remote::open(&RemoteConfig {
//!     url: "http://127.0.0.1:3900".into(),
//!     bucket: "ragkv".into(),
//!     region: "garage".into(),
//!     write: WriteMode::Through,
//!     read: ReadMode::Through,
//!     ..RemoteConfig::default()
//! })?;
//! let layout = KvLayout { layers: 2, kv_heads: 1, head_dim: 8, dtype: DType::F16 };
//! let (ns, tokens) = (NamespaceId([1; 16]), vec![1u32, 2, 3]);
//! let kv = vec![0u8; layout.bytes_for(tokens.len())];
//! tier.put_doc(ns, "doc-1", "v1", &[Item { tokens: &tokens, layout, kv: &kv }])?;
//! assert_eq!(tier.get(ns, &tokens)?.unwrap().kv, kv);
//! tier.delete_doc(ns, "doc-1", None)?;
//! # Ok::<(), remote::Error>(())
//! ```

mod config;
mod error;
pub mod keys;
pub mod manifest;
pub mod object;
mod tier;

pub use config::{ReadMode, RemoteConfig, WriteMode};
pub use error::{Error, Result};
pub use manifest::Manifest;
pub use tier::{DeleteReport, Fetched, GcReport, Item, Remote, TierStats};
