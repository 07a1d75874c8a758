//! Unit tests of `source.rs` (a module of it, kept in its own file).

use super::*;

const LIMITS: ReadLimits = ReadLimits {
    max_doc_bytes: 1000,
};

fn collect(source: &Source) -> Vec<Item> {
    let mut v = Vec::new();
    read_source(source, LIMITS, &mut |i| {
        v.push(i);
        true
    });
    v
}

#[test]
fn directories_yield_documents_with_relative_ids_and_skip_bad_files_with_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("sub/deeper")).unwrap();
    std::fs::write(d.join("a.txt"), "alpha").unwrap();
    std::fs::write(d.join("sub/b.md"), "# beta").unwrap();
    std::fs::write(d.join("sub/deeper/c.html"), "<p>gamma &amp; delta</p>").unwrap();
    std::fs::write(d.join("image.png"), [0x89, b'P', b'N', b'G']).unwrap();
    std::fs::write(d.join("empty.txt"), "  \n").unwrap();
    std::fs::write(d.join("latin1.txt"), [b'c', b'a', b'f', 0xe9]).unwrap();
    std::fs::write(d.join("nul.txt"), b"a\0b").unwrap();
    std::fs::write(d.join("big.txt"), "x".repeat(1001)).unwrap();
    std::fs::write(d.join(".hidden.txt"), "secret").unwrap();
    let items = collect(&Source::Dir(d.to_path_buf()));
    let docs: Vec<(&str, &str)> = items
        .iter()
        .filter_map(|i| match i {
            Item::Doc(doc) => Some((doc.id.as_str(), doc.text.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        docs,
        vec![
            ("a.txt", "alpha"),
            ("sub/b.md", "# beta"),
            ("sub/deeper/c.html", "gamma & delta")
        ]
    );
    let reasons: Vec<String> = items
        .iter()
        .filter_map(|i| match i {
            Item::Skipped { origin, reason } => Some(format!("{origin}: {reason}")),
            _ => None,
        })
        .collect();
    assert_eq!(reasons.len(), 5, "{reasons:?}");
    for (file, why) in [
        ("image.png", "unsupported file type .png"),
        ("empty.txt", "empty"),
        ("latin1.txt", "UTF-8"),
        ("nul.txt", "binary"),
        ("big.txt", "limit"),
    ] {
        assert!(
            reasons.iter().any(|r| r.contains(file) && r.contains(why)),
            "{file}: {reasons:?}"
        );
    }
}

#[test]
fn jsonl_lines_become_documents_and_bad_lines_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("docs.jsonl");
    std::fs::write(
        &p,
        "{\"id\": \"x\", \"text\": \"one\", \"metadata\": {\"lang\": \"en\"}}\n\
         \n\
         {\"id\": 7, \"text\": \"two\"}\n\
         not json\n\
         {\"id\": \"\", \"text\": \"three\"}\n\
         {\"id\": \"e\", \"text\": \"\"}\n",
    )
    .unwrap();
    let items = collect(&Source::Jsonl(p));
    let Item::Doc(x) = &items[0] else {
        panic!("{items:?}")
    };
    assert_eq!((x.id.as_str(), x.text.as_str()), ("x", "one"));
    assert_eq!(x.metadata["lang"], "en");
    assert!(x.origin.ends_with(":1"));
    let Item::Doc(y) = &items[1] else {
        panic!("{items:?}")
    };
    assert_eq!(y.id, "7");
    assert_eq!(items.len(), 5);
    assert!(items[2..].iter().all(|i| matches!(i, Item::Skipped { .. })));
}

#[test]
fn an_overlong_jsonl_line_is_skipped_without_being_held_and_reading_goes_on() {
    // The cap is 6 x 1000 + 64 KiB; this line is far longer, in small reads.
    let long = format!("{{\"id\": \"big\", \"text\": \"{}\"}}", "x".repeat(200_000));
    let text = format!("{long}\n{{\"id\": \"ok\", \"text\": \"fine\"}}\n");
    let mut items = Vec::new();
    let reader = std::io::BufReader::with_capacity(512, text.as_bytes());
    read_jsonl(reader, "in", LIMITS, &mut |i| {
        items.push(i);
        true
    });
    assert!(
        matches!(&items[0], Item::Skipped { origin, reason } if origin == "in:1" && reason.contains("line longer")),
        "{items:?}"
    );
    assert!(
        matches!(&items[1], Item::Doc(d) if d.id == "ok"),
        "{items:?}"
    );
    assert_eq!(items.len(), 2);
    let mut buf = Vec::new();
    let mut r = std::io::BufReader::with_capacity(4, &b"abcdefgh\nxy"[..]);
    assert!(matches!(
        read_line_capped(&mut r, 5, &mut buf).unwrap(),
        Line::TooLong
    ));
    assert!(buf.len() <= 5);
    assert!(matches!(
        read_line_capped(&mut r, 5, &mut buf).unwrap(),
        Line::Read
    ));
    assert_eq!(buf, b"xy");
    assert!(matches!(
        read_line_capped(&mut r, 5, &mut buf).unwrap(),
        Line::End
    ));
}

#[test]
fn a_walked_file_replaced_by_a_symlink_or_fifo_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret.txt");
    std::fs::write(&secret, "private").unwrap();
    let link = dir.path().join("doc.txt");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let refused = read_file(&link, "doc.txt".into(), LIMITS, false);
    assert!(
        matches!(&refused, Item::Skipped { reason, .. } if reason.contains("symbolic link")),
        "{refused:?}"
    );
    // Named on the command line, a link is the user's choice and is followed.
    assert!(matches!(
        read_file(&link, "doc.txt".into(), LIMITS, true),
        Item::Doc(_)
    ));
    let fifo = dir.path().join("pipe.txt");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let made = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(made, 0);
    let r = read_file(&fifo, "pipe.txt".into(), LIMITS, true);
    assert!(
        matches!(&r, Item::Skipped { reason, .. } if reason.contains("not a regular file")),
        "{r:?}"
    );
}

#[test]
fn content_hash_covers_text_and_metadata() {
    let mut d = Doc {
        id: "a".into(),
        text: "t".into(),
        metadata: Default::default(),
        origin: String::new(),
    };
    let h = d.content_hash();
    d.metadata.insert("k".into(), "v".into());
    assert_ne!(d.content_hash(), h);
    d.metadata.clear();
    assert_eq!(d.content_hash(), h);
    d.text.push('!');
    assert_ne!(d.content_hash(), h);
}

#[test]
fn html_drops_markup_scripts_and_styles() {
    let t = html_to_text(
        "<html><head><title>T</title><style>p{}</style></head><body><p>A &lt;b&gt;</p>\
         <script>alert(1)</script><div>C<br>D</div></body></html>",
    );
    assert_eq!(t, "T\n\nA <b>\n\nC\nD");
}
