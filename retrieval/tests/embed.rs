//! Embeddings with the project's MiniLM model and ONNX Runtime (fetched by scripts/setup.sh).

use retrieval::{Embedder, EmbedderConfig};

fn embedder() -> Embedder {
    Embedder::new(&EmbedderConfig::default()).unwrap_or_else(|e| {
        panic!("{e}\n(the model and ONNX Runtime come from scripts/fetch-models.sh)")
    })
}

fn cos(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn related_sentences_are_closer_than_unrelated_ones() {
    let e = embedder();
    assert_eq!(e.dim(), 384);
    let texts = [
        "The cat sat on the warm windowsill in the sun.",
        "A kitten is lying in the sunshine by the window.",
        "Quarterly revenue rose because of strong bond trading.",
        "How do I reset the password of my router?",
        "Steps to change the admin password on a wifi router.",
    ];
    let v = e.embed(&texts).unwrap();
    assert_eq!(v.len(), texts.len());
    for x in &v {
        assert_eq!(x.len(), 384);
        let norm = x.iter().map(|a| a * a).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    }
    assert!(cos(&v[0], &v[1]) > cos(&v[0], &v[2]) + 0.2);
    assert!(cos(&v[0], &v[1]) > cos(&v[0], &v[3]) + 0.2);
    assert!(cos(&v[3], &v[4]) > cos(&v[3], &v[2]) + 0.2);
    assert!(cos(&v[3], &v[4]) > cos(&v[3], &v[1]) + 0.2);
}

#[test]
fn batches_and_single_texts_agree() {
    let e = Embedder::new(&EmbedderConfig {
        batch_size: 4,
        ..EmbedderConfig::default()
    })
    .unwrap();
    let texts: Vec<String> = (0..7)
        .map(|i| format!("sentence number {i} {}", "padding words ".repeat(i * 5)))
        .collect();
    let batch = e.embed(&texts).unwrap();
    for (t, b) in texts.iter().zip(&batch) {
        let one = e.embed_one(t).unwrap();
        assert!(cos(&one, b) > 0.9999, "batching changed an embedding");
    }
}

#[test]
fn truncation_follows_max_tokens() {
    // With max_tokens 512, a change after ~200 word pieces changes the vector.
    let e = Embedder::new(&EmbedderConfig {
        max_tokens: 512,
        ..EmbedderConfig::default()
    })
    .unwrap();
    let head = "alpha beta gamma delta ".repeat(50); // ~200 word pieces
    let a = e
        .embed_one(&format!("{head} the tail is about volcanoes"))
        .unwrap();
    let b = e
        .embed_one(&format!("{head} the tail is about pancakes"))
        .unwrap();
    assert!(
        cos(&a, &b) < 0.99999,
        "text past 128 tokens did not change the vector"
    );

    let short = Embedder::new(&EmbedderConfig {
        max_tokens: 64,
        ..EmbedderConfig::default()
    })
    .unwrap();
    let a = short
        .embed_one(&format!("{head} the tail is about volcanoes"))
        .unwrap();
    let b = short
        .embed_one(&format!("{head} the tail is about pancakes"))
        .unwrap();
    assert!(cos(&a, &b) > 0.99999, "max_tokens = 64 did not truncate");
}
