//! The question log of `ragkv eval qa` (`<dir>/qa-log.jsonl`; `qa-log-<context>-<codec>.jsonl`
//! with `--context` and/or `--codec`, `:` written `-`, and `-chained` after the context with
//! `--chunk-order neighbours`): a header line naming the run's settings, then one line per
//! finished question, each synced before the next question starts.

use std::io::{BufRead, Write};
use std::path::Path;

use crate::qa::{Logged, RunHeader};
use crate::Error;

/// The question log: its lines so far, appended to as questions finish.
pub(crate) struct Log {
    file: Option<std::fs::File>,
    pub(crate) done: Vec<Logged>,
}

impl Log {
    /// Opens `<dir>/qa-log.jsonl` for `header` (a log of other settings is refused), keeping
    /// its complete lines; `None`: no log (a temporary run).
    pub(crate) fn open(dir: Option<&Path>, header: &RunHeader) -> Result<Log, Error> {
        let Some(dir) = dir else {
            return Ok(Log {
                file: None,
                done: Vec::new(),
            });
        };
        let io = |cause| Error::Io {
            what: "qa log".into(),
            cause,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        // A codec comparison logs apart, so that runs with and without one (and with several
        // codecs, one after the other) share the directory's index and f16 KV.
        // So does a run materialized after neighbours (`--context`).
        let mut name = String::from("qa-log");
        // Chunks arranged after their neighbours: `-chained` after the context.
        let chained = if header.chunk_order.is_empty() {
            ""
        } else {
            "chained"
        };
        for part in [&header.context, chained, &header.codec] {
            if !part.is_empty() {
                name.push('-');
                name.push_str(&part.replace(':', "-"));
            }
        }
        let path = dir.join(format!("{name}.jsonl"));
        let mut done = Vec::new();
        let mut keep = 0u64;
        if path.exists() {
            let f = std::fs::File::open(&path).map_err(io)?;
            let mut lines = std::io::BufReader::new(f).split(b'\n');
            let first = lines.next().transpose().map_err(io)?.unwrap_or_default();
            match serde_json::from_slice::<RunHeader>(&first) {
                Ok(h) if h == *header => keep = first.len() as u64 + 1,
                Ok(h) => {
                    return Err(Error::Invalid {
                        what: "--dir",
                        why: format!(
                            "{} holds a run with other settings ({h:?}); use another --dir",
                            path.display()
                        ),
                    })
                }
                Err(_) => {} // cut short before the header was whole: start over
            }
            if keep > 0 {
                for line in lines {
                    let line = line.map_err(io)?;
                    match serde_json::from_slice::<Logged>(&line) {
                        Ok(l) => {
                            keep += line.len() as u64 + 1;
                            done.push(l);
                        }
                        Err(_) => break, // a crash cut this line: redo its question
                    }
                }
            }
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io)?;
        file.set_len(keep).map_err(io)?;
        if keep == 0 {
            let mut line = serde_json::to_vec(header).map_err(|e| Error::Check(e.to_string()))?;
            line.push(b'\n');
            file.write_all(&line).map_err(io)?;
            file.sync_data().map_err(io)?;
        }
        Ok(Log {
            file: Some(file),
            done,
        })
    }

    pub(crate) fn append(&mut self, l: Logged) -> Result<(), Error> {
        if let Some(f) = &mut self.file {
            let io = |cause| Error::Io {
                what: "qa log".into(),
                cause,
            };
            let mut line = serde_json::to_vec(&l).map_err(|e| Error::Check(e.to_string()))?;
            line.push(b'\n');
            f.write_all(&line).map_err(io)?;
            f.sync_data().map_err(io)?;
        }
        self.done.push(l);
        Ok(())
    }
}
