//! A missing or broken ONNX Runtime library is an error naming where we looked, not a panic.
//! Its own test binary: ONNX Runtime can be loaded once per process, and this test changes the
//! environment.

use retrieval::{Embedder, EmbedderConfig, Error};

#[test]
fn missing_or_broken_onnxruntime_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing configured, nothing in the environment, an empty cache.
    std::env::remove_var(retrieval::ORT_ENV);
    std::env::set_var("RAGKV_CACHE", dir.path());
    let configured = dir.path().join("lib/libonnxruntime.so");
    let config = EmbedderConfig {
        onnxruntime: configured.clone(),
        ..EmbedderConfig::default()
    };
    let err = Embedder::new(&config).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::OnnxRuntimeMissing { .. }), "{msg}");
    assert!(msg.contains(&configured.display().to_string()), "{msg}");
    let cache = dir.path().join("onnxruntime");
    assert!(msg.contains(&cache.display().to_string()), "{msg}");

    // A file that is not a shared library.
    std::fs::create_dir_all(configured.parent().unwrap()).unwrap();
    std::fs::write(&configured, b"not an ELF file").unwrap();
    let err = Embedder::new(&config).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::OnnxRuntimeUnusable { .. }), "{msg}");
    assert!(msg.contains(&configured.display().to_string()), "{msg}");
}
