//! Document sources: directories, JSONL files (or stdin), single files.
//!
//! Every document gets a stable id: the path relative to the directory given (with `/`
//! separators), the `id` field of a JSONL line, or the file name of a single file. Files that
//! cannot become documents (unsupported type, unreadable, not UTF-8, binary, empty, too large)
//! are reported as [`Item::Skipped`] with the reason; they never stop the run.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A place documents come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A directory, walked recursively; `.txt`, `.md`, `.html`/`.htm` files are documents.
    Dir(PathBuf),
    /// A JSONL file: one `{"id", "text", "metadata"?}` object per line.
    Jsonl(PathBuf),
    /// JSONL on standard input.
    Stdin,
    /// One text file.
    File(PathBuf),
    /// Documents already in memory (the server's `POST /v1/documents`).
    Docs(Vec<Doc>),
}

impl Source {
    /// The source a command-line argument names: `-` is stdin, a directory, a `.jsonl` file,
    /// or another file.
    pub fn from_arg(arg: &str) -> Source {
        if arg == "-" {
            return Source::Stdin;
        }
        let p = PathBuf::from(arg);
        if p.is_dir() {
            Source::Dir(p)
        } else if p.extension().is_some_and(|e| e == "jsonl") {
            Source::Jsonl(p)
        } else {
            Source::File(p)
        }
    }
}

/// A document read from a source.
#[derive(Debug, Clone, PartialEq)]
pub struct Doc {
    /// Document id (unique in the index).
    pub id: String,
    /// Its text.
    pub text: String,
    /// Free-form metadata, stored with every chunk (filterable).
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Where it came from (path, or `file:line`), for reports.
    pub origin: String,
}

impl Doc {
    /// Content hash (hex): the text and metadata, so editing either replaces the document.
    pub fn content_hash(&self) -> String {
        let mut h = blake3::Hasher::new();
        h.update(&(self.text.len() as u64).to_le_bytes());
        h.update(self.text.as_bytes());
        h.update(
            serde_json::Value::Object(self.metadata.clone())
                .to_string()
                .as_bytes(),
        );
        h.finalize().to_hex()[..CONTENT_HASH_LEN].to_string()
    }
}

/// Length of [`Doc::content_hash`] in hex digits.
pub const CONTENT_HASH_LEN: usize = 32;

/// One thing a source yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// A document.
    Doc(Doc),
    /// Something that could not become a document (unreadable, too large, not text).
    Skipped {
        /// Where it would have come from.
        origin: String,
        /// Why it was skipped.
        reason: String,
    },
}

/// Limits applied while reading.
#[derive(Debug, Clone, Copy)]
pub struct ReadLimits {
    /// Larger documents are skipped with a reason.
    pub max_doc_bytes: u64,
}

#[derive(Deserialize)]
struct JsonDoc {
    id: serde_json::Value,
    text: String,
    #[serde(default)]
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// Calls `f` with every item of `source`, in a stable order (directories sorted by path).
/// Stops early, returning `false`, when `f` returns `false`.
pub fn read_source(source: &Source, limits: ReadLimits, f: &mut dyn FnMut(Item) -> bool) -> bool {
    match source {
        Source::Dir(root) => {
            let mut files = Vec::new();
            let mut errors = Vec::new();
            walk(root, &mut files, &mut errors);
            files.sort();
            for (origin, reason) in errors {
                if !f(Item::Skipped { origin, reason }) {
                    return false;
                }
            }
            for path in files {
                let rel = path.strip_prefix(root).unwrap_or(&path);
                let id = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                // Listed as a regular file; opened without following a link, so a file
                // swapped for a symlink since the listing is refused, not read.
                if !f(read_file(&path, id, limits, false)) {
                    return false;
                }
            }
            true
        }
        Source::File(path) => {
            let id = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            f(read_file(path, id, limits, true))
        }
        Source::Jsonl(path) => match std::fs::File::open(path) {
            Ok(file) => read_jsonl(
                std::io::BufReader::new(file),
                &path.display().to_string(),
                limits,
                f,
            ),
            Err(e) => f(Item::Skipped {
                origin: path.display().to_string(),
                reason: format!("cannot open: {e}"),
            }),
        },
        Source::Stdin => read_jsonl(std::io::stdin().lock(), "stdin", limits, f),
        Source::Docs(docs) => {
            for d in docs {
                let item = match check_text(&d.text, limits) {
                    Some(reason) => Item::Skipped {
                        origin: d.origin.clone(),
                        reason,
                    },
                    None if d.id.is_empty() || d.id.len() > 1024 => Item::Skipped {
                        origin: d.origin.clone(),
                        reason: "id must be 1 to 1024 bytes".into(),
                    },
                    None => Item::Doc(d.clone()),
                };
                if !f(item) {
                    return false;
                }
            }
            true
        }
    }
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>, errors: &mut Vec<(String, String)>) {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            errors.push((dir.display().to_string(), format!("cannot list: {e}")));
            return;
        }
    };
    for entry in entries {
        let Ok(entry) = entry else { continue };
        let path = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue; // hidden files and directories (.git, editor swap files)
        }
        match entry.file_type() {
            Ok(t) if t.is_dir() => walk(&path, files, errors),
            Ok(t) if t.is_file() => files.push(path),
            Ok(_) => {} // symlinks and special files are not followed
            Err(e) => errors.push((path.display().to_string(), format!("cannot stat: {e}"))),
        }
    }
}

/// The document kind of a file name, or why it is not one.
fn kind(path: &Path) -> Result<Kind, String> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "txt" | "md" | "markdown" | "text" => Ok(Kind::Text),
        "html" | "htm" => Ok(Kind::Html),
        "" => Err("no file extension (supported: .txt, .md, .html)".into()),
        other => Err(format!(
            "unsupported file type .{other} (supported: .txt, .md, .html)"
        )),
    }
}

enum Kind {
    Text,
    Html,
}

/// Opens `path` for reading: without following a final symlink unless `follow`, and without
/// blocking on a FIFO; refuses anything but a regular file.
fn open_regular(path: &Path, follow: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut flags = libc::O_NONBLOCK;
    if !follow {
        flags |= libc::O_NOFOLLOW;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::other("a symbolic link (not followed)")
            } else {
                e
            }
        })?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

fn read_file(path: &Path, id: String, limits: ReadLimits, follow: bool) -> Item {
    let origin = path.display().to_string();
    let skipped = |reason: String| Item::Skipped {
        origin: origin.clone(),
        reason,
    };
    let kind = match kind(path) {
        Ok(k) => k,
        Err(reason) => return skipped(reason),
    };
    let mut bytes = Vec::new();
    match open_regular(path, follow)
        .and_then(|f| f.take(limits.max_doc_bytes + 1).read_to_end(&mut bytes))
    {
        Ok(_) => {}
        Err(e) => return skipped(format!("unreadable: {e}")),
    }
    if bytes.len() as u64 > limits.max_doc_bytes {
        return skipped(format!(
            "larger than the {} byte limit",
            limits.max_doc_bytes
        ));
    }
    if bytes.contains(&0) {
        return skipped("binary content (NUL bytes)".into());
    }
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            return skipped(format!(
                "not valid UTF-8 (first bad byte at offset {})",
                e.utf8_error().valid_up_to()
            ))
        }
    };
    let text = match kind {
        Kind::Text => text,
        Kind::Html => html_to_text(&text),
    };
    match check_text(&text, limits) {
        Some(reason) => skipped(reason),
        None => Item::Doc(Doc {
            id,
            text,
            metadata: Default::default(),
            origin,
        }),
    }
}

fn check_text(text: &str, limits: ReadLimits) -> Option<String> {
    if text.trim().is_empty() {
        Some("empty document".into())
    } else if text.len() as u64 > limits.max_doc_bytes {
        Some(format!(
            "larger than the {} byte limit",
            limits.max_doc_bytes
        ))
    } else {
        None
    }
}

fn read_jsonl(
    input: impl BufRead,
    name: &str,
    limits: ReadLimits,
    f: &mut dyn FnMut(Item) -> bool,
) -> bool {
    let mut input = input;
    // A document of `max_doc_bytes` fits even with every character escaped.
    let cap = limits
        .max_doc_bytes
        .saturating_mul(6)
        .saturating_add(64 << 10);
    let mut bytes = Vec::new();
    for n in 1.. {
        let origin = format!("{name}:{n}");
        let item = match read_line_capped(&mut input, cap, &mut bytes) {
            Ok(Line::End) => return true,
            Err(e) => Item::Skipped {
                origin,
                reason: format!("unreadable: {e}"),
            },
            Ok(Line::TooLong) => Item::Skipped {
                origin,
                reason: format!("line longer than {cap} bytes (skipped to its end)"),
            },
            Ok(Line::Read) if bytes.iter().all(u8::is_ascii_whitespace) => continue,
            Ok(Line::Read) => parse_json_doc(&bytes, origin, limits),
        };
        if !f(item) {
            return false;
        }
    }
    true
}

enum Line {
    Read,
    /// Longer than the cap: consumed up to its end, not kept.
    TooLong,
    End,
}

/// Reads one `\n`-terminated line into `buf` (without the `\n`), keeping at most `cap` bytes
/// in memory whatever the line's length.
fn read_line_capped(
    input: &mut impl BufRead,
    cap: u64,
    buf: &mut Vec<u8>,
) -> std::io::Result<Line> {
    buf.clear();
    let mut seen = 0u64;
    let mut over = false;
    loop {
        let chunk = input.fill_buf()?;
        if chunk.is_empty() {
            return Ok(match (seen, over) {
                (0, _) => Line::End,
                (_, true) => Line::TooLong,
                (_, false) => Line::Read,
            });
        }
        let (take, done) = match chunk.iter().position(|b| *b == b'\n') {
            Some(i) => (i, true),
            None => (chunk.len(), false),
        };
        seen += take as u64 + done as u64;
        if !over && buf.len() as u64 + take as u64 > cap {
            over = true;
            buf.clear();
        }
        if !over {
            buf.extend_from_slice(&chunk[..take]);
        }
        input.consume(take + done as usize);
        if done {
            return Ok(if over { Line::TooLong } else { Line::Read });
        }
    }
}

fn parse_json_doc(bytes: &[u8], origin: String, limits: ReadLimits) -> Item {
    let skipped = |reason: String| Item::Skipped {
        origin: origin.clone(),
        reason,
    };
    let doc: JsonDoc = match serde_json::from_slice(bytes) {
        Ok(d) => d,
        Err(e) => return skipped(format!("not a {{\"id\", \"text\"}} JSON object: {e}")),
    };
    let id = match doc.id {
        serde_json::Value::String(s) if !s.is_empty() => s,
        serde_json::Value::Number(n) => n.to_string(),
        _ => return skipped("\"id\" must be a non-empty string or a number".into()),
    };
    if id.len() > 1024 {
        return skipped("\"id\" is longer than 1024 bytes".into());
    }
    if let Some(reason) = check_text(&doc.text, limits) {
        return skipped(reason);
    }
    Item::Doc(Doc {
        id,
        text: doc.text,
        metadata: doc.metadata.unwrap_or_default(),
        origin,
    })
}

/// Visible text of an HTML page: tags dropped, `script`/`style` contents dropped, block
/// elements turned into line breaks, the common entities decoded.
pub(crate) fn html_to_text(html: &str) -> String {
    let mut out = String::with_capacity(html.len() / 2);
    let lower = html.to_ascii_lowercase();
    let mut i = 0;
    while i < html.len() {
        let rest = &html[i..];
        if rest.starts_with('<') {
            let lrest = &lower[i..];
            for skip in ["script", "style"] {
                if lrest.starts_with(&format!("<{skip}")) {
                    if let Some(end) = lrest.find(&format!("</{skip}")) {
                        i += end;
                    }
                }
            }
            let rest = &html[i..];
            let Some(close) = rest.find('>') else { break };
            let tag = lower[i + 1..i + close]
                .trim_start_matches('/')
                .split(|c: char| c.is_whitespace() || c == '/')
                .next()
                .unwrap_or("");
            if matches!(
                tag,
                "p" | "br"
                    | "div"
                    | "li"
                    | "tr"
                    | "h1"
                    | "h2"
                    | "h3"
                    | "h4"
                    | "h5"
                    | "h6"
                    | "section"
                    | "article"
                    | "pre"
                    | "blockquote"
                    | "title"
            ) && !out.ends_with("\n\n")
            {
                out.push_str(if tag == "br" || tag == "li" || tag == "tr" {
                    "\n"
                } else {
                    "\n\n"
                });
            }
            i += close + 1;
        } else if rest.starts_with('&') {
            let (ch, len) = entity(rest);
            out.push_str(ch);
            i += len;
        } else {
            let next = rest.find(['<', '&']).unwrap_or(rest.len());
            out.push_str(&rest[..next]);
            i += next;
        }
    }
    out.trim().to_string()
}

fn entity(s: &str) -> (&'static str, usize) {
    for (name, ch) in [
        ("&amp;", "&"),
        ("&lt;", "<"),
        ("&gt;", ">"),
        ("&quot;", "\""),
        ("&#39;", "'"),
        ("&apos;", "'"),
        ("&nbsp;", " "),
    ] {
        if s.starts_with(name) {
            return (ch, name.len());
        }
    }
    ("&", 1)
}

#[cfg(test)]
#[path = "source_tests.rs"]
mod tests;
