//! The remote tier end to end: against a directory (object_store's local backend) always,
//! and against a real S3 server (Garage on loopback, started by `scripts/test-servers.sh`),
//! ignored unless run with `--ignored` and `RAGKV_TEST_S3_URL`, `RAGKV_TEST_S3_BUCKET` and
//! `RAGKV_TEST_S3_CREDENTIALS` (`scripts/test.sh` does both when the server is up).

use std::time::Duration;

use remote::{Error, Item, ReadMode, Remote, RemoteConfig, WriteMode};
use schema::{DType, KvLayout, NamespaceId};

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    kv_heads: 1,
    head_dim: 4,
    dtype: DType::F16,
};

fn kv(tokens: &[u32]) -> Vec<u8> {
    let n = LAYOUT.bytes_for(tokens.len());
    (0..n).map(|i| (i as u32 ^ tokens[0]) as u8).collect()
}

fn item<'a>(tokens: &'a [u32], kv: &'a [u8]) -> Item<'a> {
    Item {
        tokens,
        layout: LAYOUT,
        kv,
    }
}

/// A config for the tier under test; every run gets its own prefix.
fn on(base: RemoteConfig, prefix: &str) -> RemoteConfig {
    RemoteConfig {
        prefix: prefix.into(),
        write: WriteMode::Through,
        read: ReadMode::Through,
        timeout_ms: 5_000,
        retries: 1,
        ..base
    }
}

/// A tier in directory `d`.
fn in_dir(d: &std::path::Path) -> RemoteConfig {
    RemoteConfig {
        url: format!("file://{}", d.display()),
        ..RemoteConfig::default()
    }
}

fn s3() -> Option<RemoteConfig> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    Some(RemoteConfig {
        url: var("RAGKV_TEST_S3_URL")?,
        bucket: var("RAGKV_TEST_S3_BUCKET")?,
        credentials: var("RAGKV_TEST_S3_CREDENTIALS")?,
        region: var("RAGKV_TEST_S3_REGION").unwrap_or_else(|| "garage".into()),
        ..RemoteConfig::default()
    })
}

fn unique(name: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("test/{name}-{}-{t}", std::process::id())
}

/// Documents sharing a chunk: reads, deletes that keep what another document references,
/// version deletes, and gc of what a crashed writer left.
fn documents_share_release_and_collect(tier: &Remote) {
    let ns = NamespaceId([3; 16]);
    let (shared, a_only, b_only) = (vec![1u32, 2, 3, 4], vec![10u32, 11], vec![20u32; 7]);
    let (ks, ka, kb) = (kv(&shared), kv(&a_only), kv(&b_only));
    tier.put_doc(ns, "doc a", "v1", &[item(&shared, &ks), item(&a_only, &ka)])
        .unwrap();
    tier.put_doc(ns, "doc b", "v1", &[item(&b_only, &kb), item(&shared, &ks)])
        .unwrap();
    // Idempotent: the same version again changes nothing.
    tier.put_doc(ns, "doc b", "v1", &[item(&b_only, &kb), item(&shared, &ks)])
        .unwrap();

    let got = tier.get_many(ns, &[&shared, &a_only, &b_only, &[99, 98]]);
    let bytes: Vec<Option<Vec<u8>>> = got.into_iter().map(|r| r.unwrap().map(|f| f.kv)).collect();
    assert_eq!(
        bytes,
        vec![Some(ks.clone()), Some(ka.clone()), Some(kb.clone()), None]
    );
    // Another namespace sees nothing.
    assert!(tier.get(NamespaceId([4; 16]), &shared).unwrap().is_none());
    let m = tier.manifests(ns, "doc a").unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].doc, "doc a");
    assert_eq!(m[0].objects.len(), 2);

    // Piecewise, as ingest writes: a new chunk stored, a shared one attached (the tier holds
    // it), an unknown one not; then the manifest.
    let c_only = vec![40u32, 41];
    let kc = kv(&c_only);
    tier.put_object(ns, "doc c", "v1", item(&c_only, &kc))
        .unwrap();
    assert!(tier.attach_object(ns, "doc c", "v1", &shared).unwrap());
    assert!(!tier.attach_object(ns, "doc c", "v1", &[77, 78]).unwrap());
    tier.put_manifest(ns, "doc c", "v1", &[&c_only, &shared])
        .unwrap();
    assert_eq!(tier.manifests(ns, "doc c").unwrap()[0].objects.len(), 2);
    let r = tier.delete_doc(ns, "doc c", None).unwrap();
    assert_eq!((r.manifests, r.references, r.objects), (1, 2, 1), "{r:?}");
    assert!(tier.get(ns, &c_only).unwrap().is_none());

    // Deleting a: its own chunk goes, the shared one stays for b.
    let r = tier.delete_doc(ns, "doc a", None).unwrap();
    assert_eq!((r.manifests, r.references, r.objects), (1, 2, 1));
    assert!(tier.get(ns, &a_only).unwrap().is_none());
    assert_eq!(tier.get(ns, &shared).unwrap().unwrap().kv, ks);
    assert!(tier.manifests(ns, "doc a").unwrap().is_empty());

    // b gets a second version; deleting v1 only keeps what v2 references.
    let b2 = vec![30u32, 31, 32];
    let kb2 = kv(&b2);
    tier.put_doc(ns, "doc b", "v2", &[item(&shared, &ks), item(&b2, &kb2)])
        .unwrap();
    let r = tier.delete_doc(ns, "doc b", Some("v1")).unwrap();
    assert_eq!((r.manifests, r.objects), (1, 1), "{r:?}");
    assert!(tier.get(ns, &b_only).unwrap().is_none());
    assert!(tier.get(ns, &shared).unwrap().is_some());
    let r = tier.delete_doc(ns, "doc b", None).unwrap();
    assert_eq!((r.manifests, r.objects), (1, 2), "{r:?}");
    assert!(tier.get(ns, &shared).unwrap().is_none());

    // A writer that crashed after its objects, before its manifest: gc collects them once
    // they are older than the grace, and not before.
    tier.put(ns, item(&b2, &kb2)).unwrap();
    let young = tier.gc(Duration::from_secs(3600)).unwrap();
    assert_eq!(young.orphans, 0, "{young:?}");
    assert!(tier.get(ns, &b2).unwrap().is_some());
    let g = tier.gc(Duration::ZERO).unwrap();
    assert_eq!((g.orphans, g.manifests), (1, 0), "{g:?}");
    assert!(g.orphan_bytes > kb2.len() as u64);
    assert!(tier.get(ns, &b2).unwrap().is_none());
    assert!(tier.usage().unwrap().is_empty());

    let s = tier.stats();
    assert!(s.hits >= 4 && s.misses >= 6 && s.puts >= 7, "{s:?}");
    assert_eq!(s.errors, 0);
}

#[test]
fn a_directory_tier_shares_releases_and_collects() {
    let d = tempfile::tempdir().unwrap();
    let tier = Remote::open(&on(in_dir(d.path()), "ragkv")).unwrap();
    documents_share_release_and_collect(&tier);
}

#[test]
fn a_damaged_object_reads_as_corrupt_never_as_kv() {
    let d = tempfile::tempdir().unwrap();
    let tier = Remote::open(&on(in_dir(d.path()), "p")).unwrap();
    let ns = NamespaceId([5; 16]);
    let tokens = vec![7u32; 16];
    let k = kv(&tokens);
    tier.put_doc(ns, "d", "v", &[item(&tokens, &k)]).unwrap();
    let dir = d.path().join("p/kv").join(ns.to_hex());
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut b = std::fs::read(&file).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 0x40;
    std::fs::write(&file, &b).unwrap();
    match tier.get(ns, &tokens) {
        Err(Error::Corrupt { key, why }) => {
            assert!(
                key.contains(&ns.to_hex()) && why.contains("checksum"),
                "{key} {why}"
            )
        }
        other => panic!("expected corrupt, got {other:?}"),
    }
    assert_eq!(tier.stats().corrupt, 1);
    // Truncated: corrupt as well.
    std::fs::write(&file, &b[..10]).unwrap();
    assert!(matches!(tier.get(ns, &tokens), Err(Error::Corrupt { .. })));
}

#[test]
fn an_unreachable_server_is_an_error_within_the_timeout() {
    // A port nothing listens on (bound, then closed).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let d = tempfile::tempdir().unwrap();
    let creds = d.path().join("creds");
    std::fs::write(&creds, "access_key_id = GKx\nsecret_access_key = y\n").unwrap();
    let cfg = RemoteConfig {
        url: format!("http://127.0.0.1:{port}"),
        bucket: "b".into(),
        credentials: creds.display().to_string(),
        timeout_ms: 500,
        connect_timeout_ms: 200,
        retries: 1,
        backoff_ms: 10,
        ..on(RemoteConfig::default(), "p")
    };
    let tier = Remote::open(&cfg).unwrap();
    let t = std::time::Instant::now();
    let e = tier.get(NamespaceId([1; 16]), &[1, 2]).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        matches!(e, Error::Store { .. } | Error::Timeout { .. }),
        "{e}"
    );
    assert_eq!(tier.stats().errors, 1);
}

#[test]
#[ignore = "needs an S3 server: scripts/test-servers.sh starts Garage and sets RAGKV_TEST_S3_*"]
fn an_s3_server_shares_releases_and_collects() {
    let base = s3().expect("RAGKV_TEST_S3_URL, _BUCKET and _CREDENTIALS name the server");
    let tier = Remote::open(&on(base, &unique("tier"))).unwrap();
    documents_share_release_and_collect(&tier);
}
