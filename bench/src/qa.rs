//! `ragkv eval qa`: answer quality of each assembly strategy against full prefill of the same
//! assembled prompt, on LongBench-HotpotQA.
//!
//! The corpus is indexed once (vectors only); for each question the top-k chunks are
//! retrieved once, their KV is materialized if missing (lazily: only chunks some question
//! uses are ever prefilled), and the same chunks are answered with every strategy and with
//! `full` (no stored KV: the chunks are prefilled together with the question). Greedy
//! decoding; the first line of each answer is scored against the gold answer with the usual
//! SQuAD/HotpotQA normalization (lower case, punctuation and articles removed) as token F1
//! and exact match. Agreement: the share of questions whose answer is identical to full
//! prefill's. Time to first token is measured from submission (retrieval excluded) and
//! includes loading the stored KV.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use retrieval::SearchFilter;
use serde::Serialize;
use serve::{Assembly, KvMode, Query, Rag, ServeConfig};

use crate::{dataset, Error};

/// The LongBench prompt for HotpotQA, as a system prompt.
const SYSTEM: &str = "Answer the question based on the given passages. Only give me the answer \
                      and do not output any other words.";

/// Arguments of `ragkv eval qa`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Dev questions (the first N).
    #[arg(long, default_value_t = 20)]
    pub questions: usize,
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    /// Strategies to compare with full prefill (repeat the flag); default: all three.
    #[arg(long = "strategy")]
    pub strategies: Vec<Assembly>,
    /// Share of chunk tokens `reposition+recompute` recomputes.
    #[arg(long, default_value_t = 0.15)]
    pub recompute_share: f64,
    /// Corpus documents indexed (default: all).
    #[arg(long, default_value_t = 100_000)]
    pub docs: usize,
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Text before every chunk (`ingest.chunk_preamble`; `\n` is a newline): to compare chunk
    /// boundary handling. Use a separate `--dir` per preamble.
    #[arg(long, default_value = "")]
    pub chunk_preamble: String,
    #[command(flatten)]
    pub llm: crate::engine::ModelArgs,
    /// Working directory, reused across runs (index and KV of one model); default: a fresh
    /// temporary directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// One strategy's result: the JSON line `ragkv eval qa` prints.
#[derive(Debug, Clone, Serialize)]
pub struct QaLine {
    pub eval: &'static str,
    pub strategy: String,
    pub questions: usize,
    pub f1: f64,
    pub em: f64,
    pub ttft_ms_mean: f64,
    /// Share of answers identical to full prefill's.
    pub agreement_with_full: f64,
    /// `f1 - f1(full)`, in F1 points (×100).
    pub f1_points_vs_full: f64,
    pub top_k: usize,
    pub model: String,
    pub chunk_preamble: String,
}

/// SQuAD normalization: lower case, no punctuation, no articles, single spaces.
pub fn normalize(s: &str) -> String {
    let lower: String = s
        .to_lowercase()
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    lower
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Token-level F1 of normalized answers (HotpotQA: yes/no/noanswer must match exactly).
pub fn f1(prediction: &str, gold: &str) -> f64 {
    let (p, g) = (normalize(prediction), normalize(gold));
    let special = ["yes", "no", "noanswer"];
    if (special.contains(&p.as_str()) || special.contains(&g.as_str())) && p != g {
        return 0.0;
    }
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for w in g.split_whitespace() {
        *counts.entry(w).or_default() += 1;
    }
    let mut same = 0;
    for w in p.split_whitespace() {
        if let Some(c) = counts.get_mut(w) {
            if *c > 0 {
                *c -= 1;
                same += 1;
            }
        }
    }
    if same == 0 {
        return 0.0;
    }
    let precision = same as f64 / p.split_whitespace().count() as f64;
    let recall = same as f64 / g.split_whitespace().count() as f64;
    2.0 * precision * recall / (precision + recall)
}

pub fn exact_match(prediction: &str, gold: &str) -> bool {
    normalize(prediction) == normalize(gold)
}

/// The scored part of a generated answer: its first non-empty line.
pub fn first_line(answer: &str) -> &str {
    answer
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
}

fn check(what: &'static str) -> impl Fn(String) -> Error {
    move |why| Error::Check(format!("{what}: {why}"))
}

#[derive(Default)]
struct Tally {
    f1: f64,
    em: f64,
    ttft: f64,
    agree: usize,
}

/// Runs the evaluation; the last line is `full`.
pub fn run(args: &Args) -> Result<Vec<QaLine>, Error> {
    if args.questions == 0 || args.top_k == 0 {
        return Err(Error::Invalid {
            what: "--questions/--top-k",
            why: "must be positive".into(),
        });
    }
    let requested = if args.strategies.is_empty() {
        vec![Assembly::Naive, Assembly::Reposition, Assembly::Recompute]
    } else {
        args.strategies.clone()
    };
    // `full` is always run, last; each strategy once.
    let mut strategies: Vec<Assembly> = Vec::new();
    for s in requested {
        if s != Assembly::Full && !strategies.contains(&s) {
            strategies.push(s);
        }
    }
    let ds = dataset::resolve(args.dataset.as_deref())?;
    let work_dir = crate::WorkDir::new(args.dir.as_deref())?;
    let work = work_dir.path().to_path_buf();
    let engine = Arc::new(crate::engine::open_indexed(
        &work,
        &args.llm,
        args.chunk_tokens,
        &args.chunk_preamble.replace("\\n", "\n"),
        &ds,
        args.docs,
        "qa",
    )?);
    let model_name = args.llm.name();
    let questions = dataset::questions(&ds, args.questions)?;
    let rag = Rag::start(
        engine.clone(),
        ServeConfig {
            system_prompt: SYSTEM.into(),
            recompute_share: args.recompute_share,
            max_tokens_limit: args.max_tokens.max(1),
            default_max_tokens: args.max_tokens.max(1),
            ..ServeConfig::default()
        },
    )
    .map_err(check("server pipeline"))?;

    let mut all = strategies.clone();
    all.push(Assembly::Full);
    let mut tally: Vec<Tally> = all.iter().map(|_| Tally::default()).collect();
    let t0 = Instant::now();
    for (i, q) in questions.iter().enumerate() {
        let query = |assembly| Query {
            question: q.question.clone(),
            top_k: args.top_k,
            filter: SearchFilter::default(),
            params: model::GenerateParams {
                max_tokens: args.max_tokens,
                ..model::GenerateParams::default()
            },
            kv: KvMode::On,
            assembly,
        };
        let hits = rag
            .retrieve(&query(Assembly::Full))
            .map_err(check("retrieve"))?;
        crate::engine::materialize(&engine, &hits)?;
        let mut answers = Vec::with_capacity(all.len());
        for &a in &all {
            let rx = crate::engine::submit(&rag, query(a), hits.clone(), Instant::now())?;
            let f = crate::engine::wait(rx)?;
            if a.uses_stored_kv() && f.kv_hits != hits.len() {
                return Err(Error::Check(format!(
                    "{a}: expected stored KV for every chunk: {:?}",
                    f.citations
                )));
            }
            answers.push(f);
        }
        let full = answers.last().map(|f| f.answer.clone()).unwrap_or_default();
        for (t, f) in tally.iter_mut().zip(&answers) {
            let pred = first_line(&f.answer);
            t.f1 += f1(pred, &q.answer);
            t.em += f64::from(u8::from(exact_match(pred, &q.answer)));
            t.ttft += f.timings.first_token_ms;
            t.agree += usize::from(f.answer == full);
        }
        let n = (i + 1) as f64;
        eprintln!(
            "[qa] {}/{} ({:.0} s) gold {:?} | {}",
            i + 1,
            questions.len(),
            t0.elapsed().as_secs_f64(),
            q.answer,
            all.iter()
                .zip(&answers)
                .zip(&tally)
                .map(|((a, f), t)| format!("{a}: {:?} (F1 {:.3})", first_line(&f.answer), t.f1 / n))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    drop(rag);
    crate::engine::close(engine);
    let n = questions.len() as f64;
    let full_f1 = tally.last().map_or(0.0, |t| t.f1 / n);
    Ok(all
        .iter()
        .zip(&tally)
        .map(|(a, t)| QaLine {
            eval: "qa",
            strategy: a.name().into(),
            questions: questions.len(),
            f1: t.f1 / n,
            em: t.em / n,
            ttft_ms_mean: t.ttft / n,
            agreement_with_full: t.agree as f64 / n,
            f1_points_vs_full: (t.f1 / n - full_f1) * 100.0,
            top_k: args.top_k,
            model: model_name.clone(),
            chunk_preamble: args.chunk_preamble.clone(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squad_normalization_and_scores() {
        assert_eq!(
            normalize("The  Eiffel-Tower, in Paris!"),
            "eiffeltower in paris"
        );
        assert_eq!(normalize("An apple a day"), "apple day");
        assert!(exact_match("the Beatles.", "Beatles"));
        assert!(!exact_match("Beatles band", "Beatles"));
        assert_eq!(f1("Paris", "Paris"), 1.0);
        assert_eq!(f1("London", "Paris"), 0.0);
        // 1 shared of 2 predicted and 1 gold: P 0.5, R 1, F1 2/3.
        assert!((f1("in Paris", "Paris") - 2.0 / 3.0).abs() < 1e-12);
        // Repeated tokens count once per gold occurrence.
        assert!((f1("paris paris", "paris") - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(f1("yes", "no"), 0.0);
        assert_eq!(f1("no", "no"), 1.0);
        assert_eq!(f1("yes it is", "yes"), 0.0);
        assert_eq!(f1("", "Paris"), 0.0);
    }

    #[test]
    fn the_first_non_empty_line_is_scored() {
        assert_eq!(first_line("\n  Paris \nThe capital."), "Paris");
        assert_eq!(first_line(""), "");
    }
}
