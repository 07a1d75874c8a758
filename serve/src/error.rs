//! serve's error type: what went wrong on the request path or at start-up, with the facts
//! of each case, and the [`FailKind`] (hence the HTTP status) it answers with.

use crate::events::FailKind;

/// What the serving pipeline, its start-up or a query can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A `[serve]` setting is invalid, or the model cannot serve it (at start-up).
    #[error("{key}: {why}")]
    Config {
        /// The setting (`serve.kv_budget_mb`, ...).
        key: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The query cannot be served as asked (its prompt does not fit the model, ...).
    #[error("{why}")]
    Invalid {
        /// What to change.
        why: String,
    },
    /// No room now: the query may be retried.
    #[error("the {queue} is full")]
    Busy {
        /// Which queue.
        queue: &'static str,
    },
    /// The pipeline is shutting down or has stopped.
    #[error("the serving pipeline has stopped")]
    Stopped,
    /// A pipeline worker panicked while working on this query (the worker goes on).
    #[error("{worker} panicked: {message}")]
    Panicked {
        /// The worker thread.
        worker: &'static str,
        /// The panic's message.
        message: String,
    },
    /// A pipeline step found a state it should never be in.
    #[error("pipeline invariant broken: {what}")]
    Invariant {
        /// What was found.
        what: &'static str,
    },
    /// Threads could not be started.
    #[error("spawning {thread}")]
    Spawn {
        /// The thread's name.
        thread: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A tensor operation on logits failed.
    #[error("tensor operation {op}")]
    Tensor {
        /// The operation.
        op: &'static str,
        /// candle's error.
        #[source]
        source: model::TensorError,
    },
    /// The model failed (tokenizing, prefill, decode, KV import).
    #[error(transparent)]
    Model(#[from] model::Error),
    /// Embedding the question or searching the index failed.
    #[error(transparent)]
    Retrieval(#[from] retrieval::Error),
    /// The ingest engine failed (chunk tokens, prefill of a missing chunk, write-back).
    #[error(transparent)]
    Ingest(#[from] ingest::Error),
}

impl Error {
    /// How a query that failed with this error is answered.
    pub fn kind(&self) -> FailKind {
        match self {
            Error::Invalid { .. } | Error::Config { .. } => FailKind::Invalid,
            Error::Busy { .. } => FailKind::Busy,
            Error::Stopped => FailKind::Unavailable,
            Error::Panicked { .. }
            | Error::Invariant { .. }
            | Error::Spawn { .. }
            | Error::Tensor { .. }
            | Error::Model(_)
            | Error::Retrieval(_)
            | Error::Ingest(_) => FailKind::Internal,
        }
    }

    /// What a client is told: the message itself where it is about the request or the
    /// server's state, a generic line for the server's own faults (their details go to the
    /// log, with the whole chain of causes).
    pub fn public_message(&self) -> String {
        match self.kind() {
            FailKind::Internal => INTERNAL.into(),
            _ => self.to_string(),
        }
    }

    /// The message and every cause under it, `: `-joined (for the log).
    pub fn chain(&self) -> String {
        chain(self)
    }
}

/// What a client is told of a fault of the server's own.
pub(crate) const INTERNAL: &str = "internal server error (details in the server's log)";

/// `e`'s message and every cause under it, `: `-joined.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// serve's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_faults_stay_in_the_log() {
        let e = Error::Panicked {
            worker: "ragkv-loader",
            message: "index out of bounds".into(),
        };
        assert_eq!(e.kind(), FailKind::Internal);
        assert!(!e.public_message().contains("index out of bounds"));
        assert!(e.chain().contains("index out of bounds"));
        let e = Error::Invalid {
            why: "lower top_k".into(),
        };
        assert_eq!(
            (e.kind(), e.public_message()),
            (FailKind::Invalid, "lower top_k".into())
        );
        let e = Error::Spawn {
            thread: "ragkv-model",
            source: std::io::Error::other("no threads left"),
        };
        assert_eq!(e.chain(), "spawning ragkv-model: no threads left");
    }
}
