//! A device that does not exist, or that this build was not made for, is refused at start-up
//! with a clear error.

mod common;

use common::Env;

#[test]
fn a_bad_or_unbuilt_device_is_refused_with_a_clear_error() {
    let env = Env::new();
    let corpus = env.corpus.to_str().unwrap().to_string();
    let mut cases = vec![("gpu", "model.device")];
    if !cfg!(feature = "cuda") {
        cases.push(("cuda:1", "rebuild with `--features cuda`"));
    }
    for (device, expect) in cases {
        let out = env
            .cmd(&["ingest", &corpus, "--progress", "quiet"])
            .env("RAGKV__MODEL__DEVICE", device)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{device}: {stderr}");
        assert!(stderr.contains(expect), "{device}: {stderr}");
    }
}
