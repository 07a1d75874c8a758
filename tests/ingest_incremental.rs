//! `ragkv ingest`, `ragkv delete` and `ragkv verify` with the real binary: an ingest is
//! searchable and verified, a rerun is incremental, and `--prune` removes what vanished
//! (SmolLM2-135M and MiniLM, fetched by scripts/setup.sh; a private copy of examples/corpus).

mod common;

use common::{n, Env};

#[test]
fn ingest_is_searchable_verified_incremental_and_prunes() {
    let env = Env::new();
    let r = env.ingest(&[]);
    assert_eq!(n(&r, "docs_new"), 6, "{r}");
    assert_eq!(n(&r, "docs_failed"), 0, "{r}");
    assert!(
        n(&r, "chunks") > 6,
        "expected several chunks per document: {r}"
    );
    assert_eq!(n(&r, "chunks"), n(&r, "chunks_prefilled"));
    let v = env.verify();
    let points = n(&v["index"], "points");
    assert_eq!(points, n(&r, "chunks"));
    assert_eq!(n(&v["index"], "kv_verified"), points);
    assert_eq!(n(&v["index"], "searchable"), points);

    // A second run changes nothing.
    let r2 = env.ingest(&[]);
    assert_eq!(n(&r2, "docs_unchanged"), 6, "{r2}");
    assert_eq!(
        (
            n(&r2, "chunks"),
            n(&r2, "chunks_prefilled"),
            n(&r2, "kv_bytes")
        ),
        (0, 0, 0)
    );

    // Editing one file replaces exactly its chunks.
    let path = env.corpus.join("meridian-railway.md");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text = text.replace("23 kilometres long", "24 kilometres long");
    text.push_str("\nIn 2024 the society bought a second steam locomotive, named \"Lotte\".\n");
    std::fs::write(&path, text).unwrap();
    let r3 = env.ingest(&[]);
    assert_eq!(
        (n(&r3, "docs_replaced"), n(&r3, "docs_unchanged")),
        (1, 5),
        "{r3}"
    );
    // Its middle chunks did not change: their KV is reused, not prefilled again.
    assert!(n(&r3, "chunks_prefilled") < n(&r3, "chunks"), "{r3}");
    // verify: the document is one complete new version, nothing stale or orphaned.
    let v3 = env.verify();
    assert_eq!(n(&v3["index"], "documents"), 6);

    // Deleting a file and pruning removes its vectors and its KV references.
    std::fs::remove_file(env.corpus.join("nature/glacier-station.txt")).unwrap();
    let r4 = env.ingest(&["--prune"]);
    assert_eq!(
        (n(&r4, "docs_deleted"), n(&r4, "docs_unchanged")),
        (1, 5),
        "{r4}"
    );
    let v4 = env.verify();
    assert_eq!(n(&v4["index"], "documents"), 5);

    // `ragkv delete` removes a document the same way.
    let out = env.run(&["delete", "osterfeld-chess.md"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"deleted\":true"));
    let v5 = env.verify();
    assert_eq!(n(&v5["index"], "documents"), 4);
}
