//! Flipped bytes in a segment are detected and never returned as data.

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use kvstore::Error;

#[test]
fn flipped_bytes_are_detected_never_returned() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u64> = (0..40).collect();
    {
        let store = open(dir.path(), small_options());
        for i in &ids {
            let t = sequence(*i);
            put_seq(&store, &t, None);
        }
    }
    // Flip one byte every 7919 bytes of every segment, past the header.
    let segs = std::fs::read_dir(dir.path().join("segments")).unwrap();
    let mut flipped = 0;
    for e in segs {
        let path = e.unwrap().path();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let len = f.metadata().unwrap().len();
        let mut off = 500;
        while off < len {
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, off).unwrap();
            b[0] ^= 0x10;
            f.write_all_at(&b, off).unwrap();
            flipped += 1;
            off += 7919;
        }
    }
    assert!(flipped > 20, "{flipped}");

    let store = open(dir.path(), small_options());
    let mut corrupt = 0;
    let mut good = 0;
    for i in &ids {
        let t = sequence(*i);
        match store.get_batch(NS, &t, t.len()) {
            Ok(kv) => {
                // Whatever is returned must be exactly right.
                assert_eq!(
                    kv.bytes,
                    kv_for(&layout(), &t),
                    "seq {i} returned wrong bytes"
                );
                good += 1;
            }
            Err(e) => {
                assert!(e.is_miss(), "corruption must surface as a miss: {e}");
                assert!(matches!(e, Error::Corrupt { .. }), "{e}");
                corrupt += 1;
            }
        }
    }
    assert!(corrupt > 0, "flips must be detected");
    let report = store.verify().unwrap();
    assert!(!report.failures.is_empty());
    assert_eq!(store.stats().corrupt, corrupt);
    eprintln!(
        "{corrupt} corrupt, {good} intact sequences; verify found {} bad blocks",
        report.failures.len()
    );
}
