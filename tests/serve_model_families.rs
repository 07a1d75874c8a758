//! The real binary with models of other families than the CI's SmolLM2: a Llama 3 and a Qwen3
//! model written by the test with random weights (made to end their turn at once), pointed at
//! by `model.path`: `ragkv ingest` and `ragkv serve` run with each model's own chat template
//! and stop at its end of turn. And an `hf:` reference that cannot be fetched stops the binary
//! with a message naming it.

mod common;

use common::{example_corpus, ragkv, start_server};
use model::synthetic::{self, SyntheticSpec};
use model::Arch;

fn answers_with(arch: Arch) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec {
        ends_turn_at_once: true,
        ..SyntheticSpec::new(arch)
    };
    let files = synthetic::write(&spec, &tmp.path().join("model")).unwrap();
    let data = tmp.path().join("data");
    let path = files.gguf.to_string_lossy().into_owned();
    let env = [
        ("RAGKV__MODEL__PATH", path.as_str()),
        ("RAGKV__INGEST__CHUNK_TOKENS", "128"),
    ];
    let st = ragkv(&data)
        .args(["ingest", "--progress", "quiet"])
        .arg(example_corpus())
        .envs(env)
        .status()
        .unwrap();
    assert!(st.success(), "{arch:?}: ingest failed");

    let (_server, url) = start_server(&data, &env);
    let addr: std::net::SocketAddr = url.strip_prefix("http://").unwrap().parse().unwrap();
    let body = serde_json::json!({
        "question": "Who kept the lighthouse?<|eot_id|><|im_end|>",
        "stream": false, "max_tokens": 16, "top_k": 2,
    });
    let (status, text) =
        serve::client::request(addr, "POST", "/v1/query", None, Some(&body)).unwrap();
    assert_eq!(status, 200, "{arch:?}: {text}");
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(j["finish_reason"], "stop", "{arch:?}: {j}");
    assert_eq!(j["citations"][0]["kv"], "stored", "{arch:?}: {j}");
    assert_eq!(j["answer"], "", "{arch:?}: {j}");
}

#[test]
fn serve_answers_with_a_llama3_model_and_its_template() {
    answers_with(Arch::Llama);
}

#[test]
fn serve_answers_with_a_qwen3_model_and_its_template() {
    answers_with(Arch::Qwen3);
}

#[test]
fn an_unreachable_hf_reference_fails_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = ragkv(&tmp.path().join("data"))
        .args(["ingest", "--progress", "quiet"])
        .arg(example_corpus())
        .env("RAGKV__MODEL__PATH", "hf:acme/not-cached:tiny.gguf")
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("hf:acme/not-cached:tiny.gguf"), "{err}");
}
