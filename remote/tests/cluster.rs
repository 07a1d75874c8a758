//! The shared tier on a three-node Garage cluster (replication factor 3, one zone per node) on
//! loopback: KV writes and reads go on while one node is down, and nothing written while it
//! was down is lost when it returns. `scripts/test-servers.sh cluster-start` starts the
//! cluster and writes `RAGKV_TEST_GARAGE_CLUSTER_*`; `scripts/test.sh` runs this test with
//! `--ignored` when Garage is installed.

use std::process::Command;
use std::time::{Duration, Instant};

use remote::{Item, ReadMode, Remote, RemoteConfig, WriteMode};
use schema::{DType, KvLayout, NamespaceId};

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    kv_heads: 2,
    head_dim: 8,
    dtype: DType::F16,
};

struct Cluster {
    urls: Vec<String>,
    bucket: String,
    credentials: String,
    script: String,
}

impl Cluster {
    fn from_env() -> Option<Cluster> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Some(Cluster {
            urls: var("RAGKV_TEST_GARAGE_CLUSTER_URLS")?
                .split(',')
                .map(String::from)
                .collect(),
            bucket: var("RAGKV_TEST_GARAGE_CLUSTER_BUCKET")?,
            credentials: var("RAGKV_TEST_GARAGE_CLUSTER_CREDENTIALS")?,
            script: var("RAGKV_TEST_GARAGE_CLUSTER_SCRIPT")?,
        })
    }

    /// The tier through node `i`'s S3 endpoint.
    fn tier(&self, i: usize, prefix: &str) -> Remote {
        Remote::open(&RemoteConfig {
            url: self.urls[i].clone(),
            bucket: self.bucket.clone(),
            credentials: self.credentials.clone(),
            region: "garage".into(),
            prefix: prefix.into(),
            write: WriteMode::Through,
            read: ReadMode::Through,
            timeout_ms: 10_000,
            retries: 2,
            ..RemoteConfig::default()
        })
        .unwrap()
    }

    /// `cluster-kill N` or `cluster-revive N`.
    fn node(&self, what: &str, i: usize) {
        let st = Command::new(&self.script)
            .args([what, &i.to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "{} {what} {i}: {st}", self.script);
    }
}

/// Distinct KV bytes for each chunk.
fn kv(tokens: &[u32]) -> Vec<u8> {
    let n = LAYOUT.bytes_for(tokens.len());
    (0..n)
        .map(|i| (i as u32).wrapping_mul(31) as u8 ^ tokens[0] as u8)
        .collect()
}

/// Document `name`'s chunks: four of 16 tokens, distinct per document.
fn chunks(seed: u32) -> Vec<Vec<u32>> {
    (0..4)
        .map(|c| (0..16).map(|t| seed * 1000 + c * 16 + t).collect())
        .collect()
}

fn put(tier: &Remote, ns: NamespaceId, doc: &str, seed: u32) {
    let cs = chunks(seed);
    let kvs: Vec<Vec<u8>> = cs.iter().map(|c| kv(c)).collect();
    let items: Vec<Item<'_>> = cs
        .iter()
        .zip(&kvs)
        .map(|(tokens, kv)| Item {
            tokens,
            layout: LAYOUT,
            kv,
        })
        .collect();
    tier.put_doc(ns, doc, "v1", &items).unwrap();
}

/// Every chunk of the document written with `seed` reads back byte for byte.
fn all_there(tier: &Remote, ns: NamespaceId, seed: u32, via: &str) {
    for c in chunks(seed) {
        let got = tier
            .get(ns, &c)
            .unwrap_or_else(|e| panic!("{via}: chunk of document {seed}: {e}"))
            .unwrap_or_else(|| panic!("{via}: chunk of document {seed} missing"));
        assert_eq!(got.layout, LAYOUT, "{via}");
        assert!(got.kv == kv(&c), "{via}: chunk of document {seed} differs");
    }
}

/// Retries `f` until it stops panicking (a node that has just come back takes a moment to
/// rejoin), for at most `limit`.
fn eventually(limit: Duration, f: impl Fn()) {
    let start = Instant::now();
    loop {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&f)) {
            Ok(()) => return,
            Err(e) if start.elapsed() > limit => std::panic::resume_unwind(e),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

#[test]
#[ignore = "needs a Garage cluster: scripts/test-servers.sh cluster-start sets RAGKV_TEST_GARAGE_CLUSTER_*"]
fn kv_reads_and_writes_go_on_with_one_node_down_and_nothing_is_lost() {
    let cluster = Cluster::from_env().expect("RAGKV_TEST_GARAGE_CLUSTER_* name the cluster");
    assert_eq!(cluster.urls.len(), 3, "three nodes");
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let prefix = format!("test/cluster-{}-{t}", std::process::id());
    let ns = NamespaceId([9; 16]);
    let tiers: Vec<Remote> = (0..3).map(|i| cluster.tier(i, &prefix)).collect();

    // All three up: a document through node 0, readable through every node.
    put(&tiers[0], ns, "before", 1);
    for (i, tier) in tiers.iter().enumerate() {
        all_there(tier, ns, 1, &format!("node {i}, all up"));
    }

    // Node 2 killed: writes through nodes 0 and 1 go on (two copies of three are a quorum),
    // and everything reads back through both.
    cluster.node("cluster-kill", 2);
    put(&tiers[0], ns, "during-a", 2);
    put(&tiers[1], ns, "during-b", 3);
    for i in [0, 1] {
        for seed in [1, 2, 3] {
            all_there(&tiers[i], ns, seed, &format!("node {i}, node 2 down"));
        }
    }

    // Node 2 back, node 0 killed: what was written while node 2 was away reads back through
    // node 2, with node 1 as the other half of the quorum: nothing was lost.
    cluster.node("cluster-revive", 2);
    eventually(Duration::from_secs(60), || {
        all_there(&tiers[2], ns, 1, "node 2, back");
    });
    cluster.node("cluster-kill", 0);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        eventually(Duration::from_secs(60), || {
            for seed in [1, 2, 3] {
                all_there(&tiers[2], ns, seed, "node 2, node 0 down");
            }
        });
        put(&tiers[2], ns, "after", 4);
        all_there(&tiers[1], ns, 4, "node 1, node 0 down");
    }));
    cluster.node("cluster-revive", 0);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    eventually(Duration::from_secs(60), || {
        all_there(&tiers[0], ns, 4, "node 0, back");
    });
}
