//! The LongBench-HotpotQA evaluation corpus (read in place from its directory; see its README
//! for the source and licence): `documents/doc_N.txt` (first line is the title) and
//! `dev.jsonl` (`{"id", "question", "answer"}`).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{io, Error};

/// Default location, relative to the repository root.
pub const DEFAULT_DIR: &str = "../shared/datasets/longbench-hotpotqa";

/// One document of the corpus.
#[derive(Debug, Clone)]
pub struct Document {
    /// `doc_N` (the file stem).
    pub id: String,
    /// Its text (first line: the title).
    pub text: String,
}

/// One question with its gold answer.
#[derive(Debug, Clone, Deserialize)]
pub struct Question {
    /// Question id.
    pub id: u64,
    /// The question.
    pub question: String,
    /// The gold answer.
    pub answer: String,
}

/// The corpus directory, checked.
pub fn resolve(dir: Option<&Path>) -> Result<PathBuf, Error> {
    let dir = dir.map_or_else(|| PathBuf::from(DEFAULT_DIR), Path::to_path_buf);
    if !dir.join("documents").is_dir() || !dir.join("dev.jsonl").is_file() {
        return Err(Error::Invalid {
            what: "--dataset",
            why: format!(
                "{} does not hold documents/ and dev.jsonl (LongBench-HotpotQA)",
                dir.display()
            ),
        });
    }
    Ok(dir)
}

/// The first `limit` documents in numeric order (`doc_0`, `doc_1`, ...).
pub fn documents(dir: &Path, limit: usize) -> Result<Vec<Document>, Error> {
    let docs = dir.join("documents");
    let mut ids: Vec<u64> = std::fs::read_dir(&docs)
        .map_err(io(docs.display().to_string()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix("doc_")?
                .strip_suffix(".txt")?
                .parse()
                .ok()
        })
        .collect();
    ids.sort_unstable();
    ids.truncate(limit);
    ids.into_iter()
        .map(|n| {
            let path = docs.join(format!("doc_{n}.txt"));
            let text = std::fs::read_to_string(&path).map_err(io(path.display().to_string()))?;
            Ok(Document {
                id: format!("doc_{n}"),
                text,
            })
        })
        .collect()
}

/// The first `limit` dev questions.
pub fn questions(dir: &Path, limit: usize) -> Result<Vec<Question>, Error> {
    let path = dir.join("dev.jsonl");
    let text = std::fs::read_to_string(&path).map_err(io(path.display().to_string()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(limit)
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| Error::Check(format!("{}: bad line: {e}", path.display())))
        })
        .collect()
}

/// Whether `answer` occurs in `text`, ignoring case (the answer-recall criterion).
pub fn contains_answer(text: &str, answer: &str) -> bool {
    let answer = answer.trim().to_lowercase();
    !answer.is_empty() && text.to_lowercase().contains(&answer)
}
