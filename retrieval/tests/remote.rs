//! The vector-index suite against a real Qdrant server. Skipped unless `QDRANT_URL` names one
//! (gRPC port, e.g. `QDRANT_URL=http://localhost:6334`; `QDRANT_API_KEY` if it needs a key):
//!
//! ```text
//! QDRANT_URL=http://localhost:6334 cargo test --workspace --test remote -- --ignored
//! ```
//!
//! `scripts/test.sh` does that by itself when `QDRANT_URL` is set.

mod common;

use retrieval::{IndexConfig, VectorIndex};

#[test]
#[ignore = "needs a Qdrant server: set QDRANT_URL (see retrieval/tests/remote.rs)"]
fn remote_backend_suite() {
    let url = std::env::var("QDRANT_URL").expect("QDRANT_URL is not set");
    let collection = format!("ragkv_test_{}", uuid::Uuid::new_v4().simple());
    let config = IndexConfig {
        url: url.clone(),
        collection: collection.clone(),
        ..IndexConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    common::suite(&|dim| VectorIndex::open(dir.path(), dim, &config));
    // Leave the server as we found it, through the index's own call.
    let index = VectorIndex::open(dir.path(), common::DIM, &config).unwrap();
    index.delete_collection().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let exists = rt.block_on(async {
        let client = qdrant_client::Qdrant::from_url(&url)
            .api_key(std::env::var("QDRANT_API_KEY").ok())
            .build()
            .unwrap();
        client.collection_exists(collection).await.unwrap()
    });
    assert!(
        !exists,
        "the collection is still there after delete_collection"
    );
}
