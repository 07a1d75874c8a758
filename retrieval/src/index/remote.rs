//! The remote backend: a Qdrant server or cluster over gRPC.

use std::future::Future;
use std::time::Duration;

use qdrant_client::qdrant::{
    point_id::PointIdOptions, points_selector::PointsSelectorOneOf, vectors_config, Condition,
    CountPointsBuilder, CreateCollectionBuilder, CreateFieldIndexCollectionBuilder,
    DeletePointsBuilder, Distance, FieldType, Filter, PointId, PointStruct, ScrollPointsBuilder,
    SearchParamsBuilder, SearchPointsBuilder, UpsertPointsBuilder, VectorParamsBuilder,
};
use qdrant_client::{Payload, Qdrant, QdrantError};
use uuid::Uuid;

use super::{metadata_key, payload_from, payload_json, IndexConfig, IndexInfo, DOC_ID_FIELD};
use crate::error::{Error, Result};
use crate::point::{ChunkPayload, ChunkPoint, Hit, SearchFilter};

/// A collection on a Qdrant server. Requests run on a private runtime thread
/// (`ragkv-qdrant`), so the blocking API works from any non-async thread.
pub struct RemoteIndex {
    client: Qdrant,
    runtime: tokio::runtime::Runtime,
    url: String,
    collection: String,
    dim: usize,
    retries: u32,
    upsert_batch: usize,
    hnsw_ef: usize,
}

impl std::fmt::Debug for RemoteIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteIndex")
            .field("url", &self.url)
            .field("collection", &self.collection)
            .field("dim", &self.dim)
            .finish_non_exhaustive()
    }
}

/// Whether a failed call may succeed if repeated.
fn transient(e: &QdrantError) -> Option<Duration> {
    match e {
        QdrantError::ResourceExhaustedError {
            retry_after_seconds,
            ..
        } => Some(Duration::from_secs((*retry_after_seconds).clamp(1, 30))),
        QdrantError::ResponseError { status } => matches!(
            status.code(),
            tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Aborted
                | tonic::Code::Unknown
        )
        .then_some(Duration::ZERO),
        QdrantError::Io(_) => Some(Duration::ZERO),
        _ => None,
    }
}

/// The qdrant-client release this crate is built with (Cargo.lock). Its own compatibility
/// check (a REST call, skipped here: the gRPC port is all we are given) warns beyond one
/// minor version apart; server 1.18.3 passed the whole suite with this client
/// (docs/TESTING.md), so ragkv warns beyond two.
const CLIENT_VERSION: (u64, u64) = (1, 20);

/// A warning for a server version far from the client's; `None` when close enough.
fn version_warning(server: &str) -> Option<String> {
    let mut parts = server
        .trim_start_matches('v')
        .split('.')
        .map(str::parse::<u64>);
    let (Some(Ok(major)), Some(Ok(minor))) = (parts.next(), parts.next()) else {
        return Some(format!(
            "the Qdrant server reports version {server:?}, not major.minor"
        ));
    };
    let (cm, cn) = CLIENT_VERSION;
    (major != cm || minor.abs_diff(cn) > 2).then(|| {
        format!(
            "Qdrant server {server} is more than two minor versions from the client ({cm}.{cn}); \
             requests may fail or be misread"
        )
    })
}

/// What a failure's text suggests about the URL, appended to the error.
fn hint(reason: &str) -> &'static str {
    if reason.contains("h2 protocol error") || reason.contains("http2 error") {
        " (not a gRPC server: index.url must name Qdrant's gRPC port, 6334 by default; 6333 is its REST API)"
    } else if reason.contains("Connection refused") {
        " (nothing listens there: is the Qdrant server running?)"
    } else {
        ""
    }
}

impl RemoteIndex {
    /// Connects, creating the collection (cosine, `dim`) and its payload index if absent.
    pub fn open(dim: usize, config: &IndexConfig) -> Result<RemoteIndex> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ragkv-qdrant")
            .enable_all()
            .build()
            .map_err(|cause| Error::Io {
                path: "tokio runtime".into(),
                cause,
            })?;
        let api_key = if config.api_key.is_empty() {
            std::env::var("QDRANT_API_KEY")
                .ok()
                .filter(|k| !k.is_empty())
        } else {
            Some(config.api_key.clone())
        };
        let timeout = Duration::from_millis(config.timeout_ms);
        let client = {
            let _rt = runtime.enter();
            Qdrant::from_url(&config.url)
                .api_key(api_key)
                .timeout(timeout)
                .connect_timeout(timeout)
                .skip_compatibility_check()
                .build()
        };
        let mut index = RemoteIndex {
            client: client.map_err(|e| Error::Remote {
                url: config.url.clone(),
                collection: config.collection.clone(),
                op: "connect",
                reason: e.to_string(),
            })?,
            runtime,
            url: config.url.clone(),
            collection: config.collection.clone(),
            dim,
            retries: config.retries,
            upsert_batch: config.upsert_batch,
            hnsw_ef: config.hnsw_ef,
        };
        let health = index.call("health_check", |c| async move { c.health_check().await })?;
        tracing::info!(url = %index.url, version = %health.version, "connected to a Qdrant server");
        if let Some(w) = version_warning(&health.version) {
            tracing::warn!(url = %index.url, "{w}");
        }
        index.ensure_collection()?;
        Ok(index)
    }

    /// Dimension of the vectors it holds.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Runs `f` on the private runtime, retrying transient failures with exponential backoff.
    fn call<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(Qdrant) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, QdrantError>> + Send + 'static,
    {
        let client = self.client.clone();
        let retries = self.retries;
        let task = self.runtime.spawn(async move {
            let mut attempt = 0u32;
            loop {
                match f(client.clone()).await {
                    Ok(v) => return Ok(v),
                    Err(e) => match transient(&e) {
                        Some(wait) if attempt < retries => {
                            let backoff = Duration::from_millis(100 << attempt.min(6)).max(wait);
                            tracing::warn!(op, attempt, error = %e, ?backoff, "Qdrant call failed; retrying");
                            tokio::time::sleep(backoff).await;
                            attempt += 1;
                        }
                        _ => return Err(e),
                    },
                }
            }
        });
        let joined = futures_executor::block_on(task).map_err(|e| self.err(op, e.to_string()))?;
        joined.map_err(|e| self.err(op, e.to_string()))
    }

    fn err(&self, op: &'static str, reason: String) -> Error {
        let reason = format!("{reason}{}", hint(&reason));
        Error::Remote {
            url: self.url.clone(),
            collection: self.collection.clone(),
            op,
            reason,
        }
    }

    fn ensure_collection(&mut self) -> Result<()> {
        let name = self.collection.clone();
        let exists = {
            let name = name.clone();
            self.call("collection_exists", move |c| {
                let name = name.clone();
                async move { c.collection_exists(name).await }
            })?
        };
        if !exists {
            let dim = self.dim as u64;
            let n = name.clone();
            self.call("create_collection", move |c| {
                let n = n.clone();
                async move {
                    c.create_collection(
                        CreateCollectionBuilder::new(n)
                            .vectors_config(VectorParamsBuilder::new(dim, Distance::Cosine)),
                    )
                    .await
                }
            })
            .or_else(|e| {
                // Another client may have created it between our check and our call.
                if e.to_string().contains("already exists") {
                    Ok(Default::default())
                } else {
                    Err(e)
                }
            })?;
        }
        let n = name.clone();
        let info = self.call("collection_info", move |c| {
            let n = n.clone();
            async move { c.collection_info(n).await }
        })?;
        let info = info.result.unwrap_or_default();
        let stored_dim = info
            .config
            .and_then(|c| c.params)
            .and_then(|p| p.vectors_config)
            .and_then(|v| v.config)
            .and_then(|c| match c {
                vectors_config::Config::Params(p) => Some(p.size as usize),
                vectors_config::Config::ParamsMap(_) => None,
            });
        match stored_dim {
            Some(d) if d == self.dim => {}
            Some(d) => {
                return Err(Error::Dimension {
                    expected: d,
                    got: self.dim,
                })
            }
            None => {
                return Err(self.err(
                    "collection_info",
                    "the collection has named vectors: not a ragkv collection".into(),
                ))
            }
        }
        if !info.payload_schema.contains_key(DOC_ID_FIELD) {
            let n = name.clone();
            self.call("create_field_index", move |c| {
                let n = n.clone();
                async move {
                    c.create_field_index(
                        CreateFieldIndexCollectionBuilder::new(n, DOC_ID_FIELD, FieldType::Keyword)
                            .wait(true),
                    )
                    .await
                }
            })?;
        }
        Ok(())
    }

    /// Inserts or replaces points (by id).
    pub fn upsert(&self, points: &[ChunkPoint]) -> Result<()> {
        for batch in points.chunks(self.upsert_batch) {
            let mut list = Vec::with_capacity(batch.len());
            for p in batch {
                let payload = Payload::try_from(payload_json(&p.payload))
                    .map_err(|e| self.err("upsert", e.to_string()))?;
                list.push(PointStruct::new(
                    p.id.to_string(),
                    p.vector.clone(),
                    payload,
                ));
            }
            let name = self.collection.clone();
            self.call("upsert", move |c| {
                let req = UpsertPointsBuilder::new(name.clone(), list.clone()).wait(true);
                async move { c.upsert_points(req).await }
            })?;
        }
        Ok(())
    }

    /// The `k` points closest to `vector` (cosine) that pass `filter`, best first.
    pub fn search(&self, vector: &[f32], k: usize, filter: &SearchFilter) -> Result<Vec<Hit>> {
        let mut req = SearchPointsBuilder::new(self.collection.clone(), vector.to_vec(), k as u64)
            .with_payload(true);
        if let Some(f) = to_filter(filter)? {
            req = req.filter(f);
        }
        if self.hnsw_ef > 0 {
            req = req.params(SearchParamsBuilder::default().hnsw_ef(self.hnsw_ef as u64));
        }
        let req = req.build();
        let res = self.call("search", move |c| {
            let req = req.clone();
            async move { c.search_points(req).await }
        })?;
        res.result
            .into_iter()
            .map(|p| {
                let id = uuid_of(p.id.as_ref())?;
                Ok(Hit {
                    id,
                    score: p.score,
                    payload: payload_from(&id, Payload::from(p.payload).into())?,
                })
            })
            .collect()
    }

    /// Every point passing `filter`, with its payload.
    pub fn scroll(&self, filter: &SearchFilter) -> Result<Vec<(Uuid, ChunkPayload)>> {
        let mut out = Vec::new();
        let mut offset: Option<PointId> = None;
        let f = to_filter(filter)?;
        loop {
            let mut req = ScrollPointsBuilder::new(self.collection.clone())
                .limit(1024)
                .with_payload(true);
            if let Some(f) = &f {
                req = req.filter(f.clone());
            }
            if let Some(o) = offset.take() {
                req = req.offset(o);
            }
            let req = req.build();
            let page = self.call("scroll", move |c| {
                let req = req.clone();
                async move { c.scroll(req).await }
            })?;
            for p in page.result {
                let id = uuid_of(p.id.as_ref())?;
                out.push((id, payload_from(&id, Payload::from(p.payload).into())?));
            }
            match page.next_page_offset {
                Some(o) => offset = Some(o),
                None => return Ok(out),
            }
        }
    }

    /// Deletes every point of a document.
    pub fn delete_document(&self, doc_id: &str) -> Result<()> {
        self.delete(Filter::must([Condition::matches(
            DOC_ID_FIELD,
            doc_id.to_string(),
        )]))
    }

    /// Deletes points by id.
    pub fn delete_points(&self, ids: &[Uuid]) -> Result<()> {
        let ids: Vec<PointId> = ids.iter().map(|u| PointId::from(u.to_string())).collect();
        self.delete(ids)
    }

    fn delete(&self, selector: impl Into<PointsSelectorOneOf>) -> Result<()> {
        let req = DeletePointsBuilder::new(self.collection.clone())
            .points(selector)
            .wait(true)
            .build();
        self.call("delete", move |c| {
            let req = req.clone();
            async move { c.delete_points(req).await }
        })
        .map(drop)
    }

    /// Points passing `filter`.
    pub fn count(&self, filter: &SearchFilter) -> Result<usize> {
        let mut req = CountPointsBuilder::new(self.collection.clone()).exact(true);
        if let Some(f) = to_filter(filter)? {
            req = req.filter(f);
        }
        let req = req.build();
        let res = self.call("count", move |c| {
            let req = req.clone();
            async move { c.count(req).await }
        })?;
        Ok(res.result.map_or(0, |r| r.count as usize))
    }

    /// Deletes the collection and every point in it.
    pub fn delete_collection(self) -> Result<()> {
        let n = self.collection.clone();
        self.call("delete_collection", move |c| {
            let n = n.clone();
            async move { c.delete_collection(n).await }
        })?;
        Ok(())
    }

    /// Counts describing the index.
    pub fn info(&self) -> Result<IndexInfo> {
        let n = self.collection.clone();
        let info = self.call("collection_info", move |c| {
            let n = n.clone();
            async move { c.collection_info(n).await }
        })?;
        let info = info.result.unwrap_or_default();
        Ok(IndexInfo {
            backend: "remote",
            dim: self.dim,
            points: info.points_count.unwrap_or(0) as usize,
            indexed: info.indexed_vectors_count.unwrap_or(0) as usize,
            segments: info.segments_count as usize,
        })
    }
}

/// The Qdrant filter for `f`, `None` when it admits everything.
fn to_filter(f: &SearchFilter) -> Result<Option<Filter>> {
    if f.is_empty() {
        return Ok(None);
    }
    let mut must = Vec::new();
    match f.doc_ids.as_slice() {
        [] => {}
        [one] => must.push(Condition::matches(DOC_ID_FIELD, one.clone())),
        many => must.push(Condition::matches(DOC_ID_FIELD, many.to_vec())),
    }
    for (k, v) in &f.metadata {
        must.push(Condition::matches(metadata_key(k)?, v.clone()));
    }
    Ok(Some(Filter::must(must)))
}

fn uuid_of(id: Option<&PointId>) -> Result<Uuid> {
    match id.and_then(|i| i.point_id_options.as_ref()) {
        Some(PointIdOptions::Uuid(s)) => s.parse().map_err(|_| Error::Payload {
            id: s.clone(),
            reason: "point id is not a UUID".into(),
        }),
        Some(PointIdOptions::Num(n)) => Err(Error::Payload {
            id: n.to_string(),
            reason: "numeric point id: not written by ragkv".into(),
        }),
        None => Err(Error::Payload {
            id: "?".into(),
            reason: "point without id".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_far_from_the_clients_are_warned_about() {
        for near in ["1.20.0", "1.18.3", "1.22.1", "v1.19.0"] {
            assert_eq!(version_warning(near), None, "{near}");
        }
        for far in ["1.17.0", "1.23.0", "2.20.0", "dev", ""] {
            assert!(version_warning(far).is_some(), "{far}");
        }
    }

    #[test]
    fn a_rest_port_or_a_dead_one_is_named_in_the_error() {
        assert!(hint("Internal error h2 protocol error: http2 error").contains("6334"));
        assert!(hint("tcp connect error ... Connection refused").contains("running"));
        assert_eq!(hint("collection not found"), "");
    }
}
