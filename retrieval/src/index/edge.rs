//! The embedded backend: a Qdrant Edge shard in-process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use qdrant_edge::{
    AnyVariants, Condition, CountRequest, CreateIndex, Distance, EdgeConfigBuilder, EdgeShard,
    EdgeVectorParamsBuilder, FieldCondition, FieldIndexOperations, Filter, JsonPath, Match,
    MatchAny, NamedQuery, PayloadFieldSchema, PayloadSchemaType, PointId, PointInsertOperations,
    PointOperations, PointStruct, QueryEnum, ScrollRequest, SearchParams, SearchRequest,
    UpdateOperation, WithPayloadInterface, WithVector, DEFAULT_VECTOR_NAME,
};
use uuid::Uuid;

use super::{metadata_key, payload_from, payload_json, IndexConfig, IndexInfo, DOC_ID_FIELD};
use crate::error::{Error, Result};
use crate::point::{ChunkPayload, ChunkPoint, Hit, SearchFilter};

/// Qdrant Edge shard with ragkv's schema (one unnamed cosine vector, keyword index on `doc_id`).
pub struct EdgeIndex {
    /// Dropped by hand: Qdrant Edge flushes in `drop` and panics if that fails.
    shard: std::mem::ManuallyDrop<EdgeShard>,
    path: PathBuf,
    dim: usize,
    hnsw_ef: usize,
    optimize_after: usize,
    /// Points written since the last optimize.
    pending: AtomicUsize,
    /// Serializes writes, flushes and optimizes: Qdrant Edge's `flush` panics if the WAL is
    /// busy, so it must never race an update.
    write: Mutex<()>,
}

impl std::fmt::Debug for EdgeIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeIndex")
            .field("path", &self.path)
            .field("dim", &self.dim)
            .finish_non_exhaustive()
    }
}

impl EdgeIndex {
    /// Opens the shard in `dir`, creating it for `dim`-dimensional vectors if absent.
    pub fn open(dir: &Path, dim: usize, config: &IndexConfig) -> Result<EdgeIndex> {
        let err = |op: &'static str| {
            let path = dir.to_path_buf();
            move |e: qdrant_edge::OperationError| Error::Edge {
                path: path.clone(),
                op,
                reason: e.to_string(),
            }
        };
        std::fs::create_dir_all(dir).map_err(|cause| Error::Io {
            path: dir.to_path_buf(),
            cause,
        })?;
        let exists = dir.join("edge_config.json").exists();
        let shard = if exists {
            let shard = EdgeShard::load(dir, None).map_err(err("load"))?;
            let stored = shard
                .config()
                .vectors
                .get(DEFAULT_VECTOR_NAME)
                .map(|v| v.size);
            match stored {
                Some(d) if d == dim => {}
                Some(d) => {
                    return Err(Error::Dimension {
                        expected: d,
                        got: dim,
                    })
                }
                None => {
                    return Err(Error::Edge {
                        path: dir.to_path_buf(),
                        op: "load",
                        reason: "the shard has no default vector: not a ragkv index".into(),
                    })
                }
            }
            shard
        } else {
            let edge_config = EdgeConfigBuilder::new()
                .vector(
                    DEFAULT_VECTOR_NAME,
                    EdgeVectorParamsBuilder::new(dim, Distance::Cosine).build(),
                )
                .build();
            EdgeShard::new(dir, edge_config).map_err(err("create"))?
        };
        let index = EdgeIndex {
            shard: std::mem::ManuallyDrop::new(shard),
            path: dir.to_path_buf(),
            dim,
            hnsw_ef: config.hnsw_ef,
            optimize_after: config.optimize_after,
            pending: AtomicUsize::new(0),
            write: Mutex::new(()),
        };
        let info = index.info();
        if !index
            .shard
            .info()
            .payload_schema
            .contains_key(&field(DOC_ID_FIELD)?)
        {
            index.update(
                "create payload index",
                UpdateOperation::FieldIndexOperation(FieldIndexOperations::CreateIndex(
                    CreateIndex {
                        field_name: field(DOC_ID_FIELD)?,
                        field_schema: Some(PayloadFieldSchema::FieldType(
                            PayloadSchemaType::Keyword,
                        )),
                    },
                )),
            )?;
        }
        // Points left unindexed by an earlier run count towards the next build.
        index
            .pending
            .store(info.points.saturating_sub(info.indexed), Ordering::Relaxed);
        Ok(index)
    }

    /// Dimension of the vectors it holds.
    pub fn dim(&self) -> usize {
        self.dim
    }

    fn edge_err(&self, op: &'static str, e: qdrant_edge::OperationError) -> Error {
        Error::Edge {
            path: self.path.clone(),
            op,
            reason: e.to_string(),
        }
    }

    fn update(&self, op: &'static str, operation: UpdateOperation) -> Result<()> {
        let _w = self.write.lock();
        self.shard
            .update(operation)
            .map_err(|e| self.edge_err(op, e))
    }

    /// Inserts or replaces points (by id).
    pub fn upsert(&self, points: &[ChunkPoint]) -> Result<()> {
        if points.is_empty() {
            return Ok(());
        }
        let list = points
            .iter()
            .map(|p| {
                PointStruct::new(
                    PointId::Uuid(p.id),
                    p.vector.clone(),
                    payload_json(&p.payload),
                )
                .into()
            })
            .collect();
        self.update(
            "upsert",
            UpdateOperation::PointOperation(PointOperations::UpsertPoints(
                PointInsertOperations::PointsList(list),
            )),
        )?;
        let pending = self.pending.fetch_add(points.len(), Ordering::Relaxed) + points.len();
        if pending >= self.optimize_after {
            self.optimize()?;
        }
        Ok(())
    }

    /// The `k` points closest to `vector` (cosine) that pass `filter`, best first.
    pub fn search(&self, vector: &[f32], k: usize, filter: &SearchFilter) -> Result<Vec<Hit>> {
        let params = (self.hnsw_ef > 0).then(|| SearchParams {
            hnsw_ef: Some(self.hnsw_ef),
            ..SearchParams::default()
        });
        let found = self
            .shard
            .search(SearchRequest {
                query: QueryEnum::Nearest(NamedQuery {
                    query: vector.to_vec().into(),
                    using: None,
                }),
                filter: to_filter(filter)?,
                params,
                limit: k,
                offset: 0,
                with_payload: Some(WithPayloadInterface::Bool(true)),
                with_vector: Some(WithVector::Bool(false)),
                score_threshold: None,
            })
            .map_err(|e| self.edge_err("search", e))?;
        found
            .into_iter()
            .map(|p| {
                let id = uuid_of(&p.id)?;
                let payload = payload_from(&id, p.payload.map(|p| p.0).unwrap_or_default())?;
                Ok(Hit {
                    id,
                    score: p.score,
                    payload,
                })
            })
            .collect()
    }

    /// Every point passing `filter`, with its payload.
    pub fn scroll(&self, filter: &SearchFilter) -> Result<Vec<(Uuid, ChunkPayload)>> {
        let mut out = Vec::new();
        let mut offset = None;
        loop {
            let (page, next) = self
                .shard
                .scroll(ScrollRequest {
                    offset,
                    limit: Some(1024),
                    filter: to_filter(filter)?,
                    with_payload: Some(WithPayloadInterface::Bool(true)),
                    with_vector: WithVector::Bool(false),
                    order_by: None,
                })
                .map_err(|e| self.edge_err("scroll", e))?;
            for r in page {
                let id = uuid_of(&r.id)?;
                let payload = payload_from(&id, r.payload.map(|p| p.0).unwrap_or_default())?;
                out.push((id, payload));
            }
            match next {
                Some(n) => offset = Some(n),
                None => return Ok(out),
            }
        }
    }

    /// Deletes every point of a document.
    pub fn delete_document(&self, doc_id: &str) -> Result<()> {
        let filter = Filter::new_must(keyword(DOC_ID_FIELD, doc_id)?);
        self.update(
            "delete",
            UpdateOperation::PointOperation(PointOperations::DeletePointsByFilter(filter)),
        )
    }

    /// Deletes points by id.
    pub fn delete_points(&self, ids: &[Uuid]) -> Result<()> {
        self.update(
            "delete",
            UpdateOperation::PointOperation(PointOperations::DeletePoints {
                ids: ids.iter().map(|id| PointId::Uuid(*id)).collect(),
            }),
        )
    }

    /// Points passing `filter`.
    pub fn count(&self, filter: &SearchFilter) -> Result<usize> {
        self.shard
            .count(CountRequest {
                filter: to_filter(filter)?,
                exact: true,
            })
            .map_err(|e| self.edge_err("count", e))
    }

    /// Persists what was written.
    pub fn flush(&self) -> Result<()> {
        let _w = self.write.lock();
        self.shard.flush();
        Ok(())
    }

    /// Runs Qdrant Edge's optimizer (merges segments, builds their HNSW index); whether
    /// anything changed.
    pub fn optimize(&self) -> Result<bool> {
        let _w = self.write.lock();
        let t = std::time::Instant::now();
        let changed = self
            .shard
            .optimize()
            .map_err(|e| self.edge_err("optimize", e))?;
        self.pending.store(0, Ordering::Relaxed);
        tracing::info!(
            changed,
            ms = t.elapsed().as_millis() as u64,
            "vector index optimized"
        );
        Ok(changed)
    }

    /// Counts describing the index.
    pub fn info(&self) -> IndexInfo {
        let i = self.shard.info();
        IndexInfo {
            backend: "embedded",
            dim: self.dim,
            points: i.points_count,
            indexed: i.indexed_vectors_count,
            segments: i.segments_count,
        }
    }
}

impl Drop for EdgeIndex {
    fn drop(&mut self) {
        // Qdrant Edge's own `drop` flushes and panics on failure (a panic in drop can abort
        // the process). Flush here first; if the directory is gone, leak the shard instead.
        let _w = self.write.lock();
        if self.path.join("segments").is_dir() {
            // SAFETY: `shard` is never used again.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.shard) };
        } else {
            tracing::error!(path = %self.path.display(), "vector index directory vanished; not flushing");
        }
    }
}

fn field(key: &str) -> Result<JsonPath> {
    key.try_into().map_err(|_| Error::Invalid {
        what: "payload key",
        reason: format!("{key:?}"),
    })
}

fn keyword(key: &str, value: &str) -> Result<Condition> {
    Ok(Condition::Field(FieldCondition::new_match(
        field(key)?,
        Match::from(value.to_string()),
    )))
}

/// The Qdrant filter for `f`, `None` when it admits everything.
fn to_filter(f: &SearchFilter) -> Result<Option<Filter>> {
    if f.is_empty() {
        return Ok(None);
    }
    let mut must = Vec::new();
    match f.doc_ids.as_slice() {
        [] => {}
        [one] => must.push(keyword(DOC_ID_FIELD, one)?),
        many => must.push(Condition::Field(FieldCondition::new_match(
            field(DOC_ID_FIELD)?,
            Match::Any(MatchAny {
                any: AnyVariants::Strings(many.iter().cloned().collect()),
            }),
        ))),
    }
    for (k, v) in &f.metadata {
        must.push(keyword(&metadata_key(k)?, v)?);
    }
    Ok(Some(Filter {
        should: None,
        min_should: None,
        must: Some(must),
        must_not: None,
    }))
}

fn uuid_of(id: &PointId) -> Result<Uuid> {
    match id {
        PointId::Uuid(u) => Ok(*u),
        PointId::NumId(n) => Err(Error::Payload {
            id: n.to_string(),
            reason: "numeric point id: not written by ragkv".into(),
        }),
    }
}
