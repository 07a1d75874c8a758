//! `ragkv config` prints the effective configuration without its secrets: its output ends up
//! in logs and bug reports.

mod common;

#[test]
fn config_output_redacts_the_admin_token_and_the_index_api_key() {
    let tmp = tempfile::tempdir().unwrap();
    let out = common::ragkv(&tmp.path().join("data"))
        .arg("config")
        .env("RAGKV__SERVE__ADMIN_TOKEN", "tok-8c1f2d")
        .env("RAGKV__INDEX__API_KEY", "key-77aa01")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("tok-8c1f2d") && !text.contains("key-77aa01"),
        "{text}"
    );
    assert_eq!(text.matches("<redacted>").count(), 2, "{text}");
    // Unset secrets stay visibly empty.
    let out = common::ragkv(&tmp.path().join("data"))
        .arg("config")
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("<redacted>"));
}
