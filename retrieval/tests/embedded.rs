//! The vector-index suite on the embedded backend (Qdrant Edge).

mod common;

use retrieval::{IndexConfig, SearchFilter, VectorIndex};

#[test]
fn embedded_backend_suite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vectors");
    common::suite(&|dim| VectorIndex::open(&path, dim, &IndexConfig::default()));
}

#[test]
fn crossing_optimize_after_optimizes_without_changing_results() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vectors");
    let config = IndexConfig {
        optimize_after: 4_000,
        ..IndexConfig::default()
    };
    let index = VectorIndex::open(&path, common::DIM, &config).unwrap();
    let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(3);
    let mut points = Vec::new();
    for doc in 0..100 {
        for ordinal in 0..50u32 {
            points.push(retrieval::ChunkPoint::new(
                common::unit(&mut rng),
                retrieval::ChunkPayload {
                    doc_id: format!("d{doc}"),
                    ordinal,
                    text: String::new(),
                    tokens: 1,
                    kv_key: String::new(),
                    doc_hash: String::new(),
                    doc_chunks: 50,
                    metadata: Default::default(),
                },
            ));
        }
    }
    for batch in points.chunks(500) {
        index.upsert(batch).unwrap();
    }
    let info = index.info().unwrap();
    assert_eq!(info.points, 5_000);
    // 4,000 points crossed `optimize_after`: the upsert that crossed it optimized the shard.
    // Whether a segment gets an HNSW graph depends on Qdrant's indexing threshold; what must
    // hold is that results stay exact for stored vectors.
    let hit = &index
        .search(&points[4321].vector, 1, &SearchFilter::default())
        .unwrap()[0];
    assert_eq!(hit.id, points[4321].id);
    index.delete_document("d3").unwrap();
    assert_eq!(index.count(&SearchFilter::default()).unwrap(), 4_950);
}
