//! The vector-index test suite, run against each backend.

#![allow(dead_code)]

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use retrieval::{ChunkPayload, ChunkPoint, Error, SearchFilter, VectorIndex};

pub const DIM: usize = 32;

pub fn unit(rng: &mut SmallRng) -> Vec<f32> {
    let mut v: Vec<f32> = (0..DIM).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    retrieval::normalize(&mut v);
    v
}

/// Three documents of five chunks; document `c` is German, the others English.
pub fn corpus() -> Vec<ChunkPoint> {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut out = Vec::new();
    for doc in ["a", "b", "c"] {
        for ordinal in 0..5u32 {
            let mut metadata = serde_json::Map::new();
            metadata.insert("lang".into(), (if doc == "c" { "de" } else { "en" }).into());
            out.push(ChunkPoint::new(
                unit(&mut rng),
                ChunkPayload {
                    doc_id: doc.into(),
                    ordinal,
                    text: format!("chunk {ordinal} of {doc}"),
                    tokens: 3 + ordinal,
                    kv_key: format!("{doc}{ordinal:02x}"),
                    doc_hash: format!("hash-{doc}"),
                    doc_chunks: 5,
                    metadata,
                },
            ));
        }
    }
    out
}

/// (id, score) of the top 5 for a few fixed queries: what must survive a reopen.
fn fingerprint(index: &VectorIndex) -> Vec<Vec<(uuid::Uuid, i32)>> {
    let mut rng = SmallRng::seed_from_u64(99);
    (0..4)
        .map(|_| {
            let q = unit(&mut rng);
            index
                .search(&q, 5, &SearchFilter::default())
                .unwrap()
                .into_iter()
                .map(|h| (h.id, (h.score * 1e4).round() as i32))
                .collect()
        })
        .collect()
}

/// Upsert → search → filters → delete by document → reopen → same results; dimension checks.
/// `open` opens (or reopens) the same index with the given dimension.
pub fn suite(open: &dyn Fn(usize) -> Result<VectorIndex, Error>) {
    let points = corpus();
    let index = open(DIM).unwrap();
    assert_eq!(index.dim(), DIM);
    index.upsert(&points).unwrap();
    // Upserting the same ids again replaces, never duplicates.
    index.upsert(&points[..4]).unwrap();
    index.flush().unwrap();
    assert_eq!(index.count(&SearchFilter::default()).unwrap(), 15);
    assert_eq!(index.count(&SearchFilter::document("a")).unwrap(), 5);

    // The exact vector of a stored point finds that point first, payload intact.
    let target = &points[7];
    let hits = index
        .search(&target.vector, 3, &SearchFilter::default())
        .unwrap();
    assert_eq!(hits.len(), 3);
    assert_eq!(hits[0].id, target.id);
    assert!((hits[0].score - 1.0).abs() < 1e-4, "{}", hits[0].score);
    assert_eq!(hits[0].payload, target.payload);
    assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));

    // Filters: by document, by several documents, by metadata.
    let hits = index
        .search(&target.vector, 10, &SearchFilter::document("c"))
        .unwrap();
    assert_eq!(hits.len(), 5);
    assert!(hits.iter().all(|h| h.payload.doc_id == "c"));
    let both = SearchFilter {
        doc_ids: vec!["a".into(), "c".into()],
        metadata: vec![],
    };
    let hits = index.search(&target.vector, 20, &both).unwrap();
    assert_eq!(hits.len(), 10);
    assert!(hits.iter().all(|h| h.payload.doc_id != "b"));
    let german = SearchFilter {
        doc_ids: vec![],
        metadata: vec![("lang".into(), "de".into())],
    };
    let hits = index.search(&target.vector, 20, &german).unwrap();
    assert_eq!(hits.len(), 5);
    assert!(hits.iter().all(|h| h.payload.doc_id == "c"));
    assert_eq!(index.count(&german).unwrap(), 5);

    // A document's chunks, by ordinal.
    let doc = index.document("b").unwrap();
    assert_eq!(
        doc.iter().map(|(_, p)| p.ordinal).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    assert_eq!(doc[2].0, points[7].id);

    // Delete by document.
    index.delete_document("a").unwrap();
    assert_eq!(index.count(&SearchFilter::default()).unwrap(), 10);
    assert!(index
        .search(&points[0].vector, 5, &SearchFilter::document("a"))
        .unwrap()
        .is_empty());
    assert!(index.document("a").unwrap().is_empty());
    index.delete_points(&[points[14].id]).unwrap();
    assert_eq!(index.count(&SearchFilter::default()).unwrap(), 9);

    // Dimension mismatches are clear errors.
    let mut bad = points[5].clone();
    bad.vector.push(0.0);
    match index.upsert(&[bad]) {
        Err(Error::Dimension { expected, got }) => assert_eq!((expected, got), (DIM, DIM + 1)),
        other => panic!("expected a dimension error, got {other:?}"),
    }
    assert!(matches!(
        index.search(&[1.0; 3], 1, &SearchFilter::default()),
        Err(Error::Dimension { .. })
    ));

    // Reopen from disk (or reconnect): same contents, same answers.
    let before = fingerprint(&index);
    index.optimize().unwrap();
    assert_eq!(fingerprint(&index), before, "optimize changed results");
    index.flush().unwrap();
    drop(index);
    let index = open(DIM).unwrap();
    assert_eq!(index.count(&SearchFilter::default()).unwrap(), 9);
    assert_eq!(fingerprint(&index), before, "results changed across reopen");
    assert_eq!(index.document("b").unwrap(), doc);
    drop(index);

    // The index remembers its dimension.
    match open(DIM * 2) {
        Err(Error::Dimension { expected, got }) => assert_eq!((expected, got), (DIM, DIM * 2)),
        other => panic!("expected a dimension error, got {other:?}"),
    }
}
