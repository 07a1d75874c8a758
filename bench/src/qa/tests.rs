//! Unit tests of `ragkv eval qa`'s pure parts.

use super::*;
use std::io::Write;

fn header() -> RunHeader {
    RunHeader {
        model: "m.gguf".into(),
        quantized: false,
        docs: 10,
        top_k: 5,
        chunk_tokens: 512,
        max_tokens: 32,
        chunk_preamble: String::new(),
        recompute_share: 0.15,
        link_tokens: 16,
        strategies: vec!["reposition".into(), "link:2".into()],
        codec: String::new(),
        context: String::new(),
        chunk_order: String::new(),
    }
}

fn logged(q: usize) -> Logged {
    let answer = |strategy: &str, f1: f64| Answer {
        strategy: strategy.into(),
        answer: "Paris".into(),
        f1,
        em: f1 == 1.0,
        ttft_ms: 10.0,
        identical: strategy == "full",
        recomputed: 0,
        forced_tokens: 4,
        forced_agree: if strategy == "full" { 4 } else { 3 },
        kl_sum: 0.2,
        uncompressed: None,
    };
    Logged {
        q,
        id: q as u64,
        gold: "Paris".into(),
        moved: 0,
        answers: vec![
            answer("full", 1.0),
            answer("reposition", 0.5),
            answer("link:2", 1.0),
        ],
    }
}

#[test]
fn the_log_resumes_after_its_last_whole_line() {
    let dir = tempfile::tempdir().unwrap();
    let h = header();
    let mut log = Log::open(Some(dir.path()), &h).unwrap();
    assert!(log.done.is_empty());
    log.append(logged(0)).unwrap();
    log.append(logged(1)).unwrap();
    drop(log);
    // A crash in the middle of the third line.
    let path = dir.path().join("qa-log.jsonl");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(br#"{"q":2,"id":2,"gold":"Par"#).unwrap();
    drop(f);
    let mut log = Log::open(Some(dir.path()), &h).unwrap();
    assert_eq!(log.done.iter().map(|l| l.q).collect::<Vec<_>>(), [0, 1]);
    log.append(logged(2)).unwrap();
    drop(log);
    let log = Log::open(Some(dir.path()), &h).unwrap();
    assert_eq!(log.done.len(), 3);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 4, "{text}");
    // Other settings: refused, the log kept.
    let other = RunHeader {
        top_k: 3,
        ..header()
    };
    assert!(Log::open(Some(dir.path()), &other).is_err());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    // No directory: nothing kept.
    let mut tmp = Log::open(None, &h).unwrap();
    tmp.append(logged(0)).unwrap();
    assert_eq!(tmp.done.len(), 1);
}

#[test]
fn the_summary_pairs_each_strategy_with_full() {
    let done: Vec<Logged> = (0..4).map(logged).collect();
    let lines = summarize(&done, &header());
    let names: Vec<&str> = lines.iter().map(|l| l.strategy.as_str()).collect();
    assert_eq!(names, ["reposition", "link:2", "full"]);
    let r = &lines[0];
    assert_eq!(r.questions, 4);
    assert!((r.f1 - 0.5).abs() < 1e-12 && (r.f1_points_vs_full + 50.0).abs() < 1e-9);
    // Every question loses 0.5: no spread, the interval is the point.
    assert_eq!(r.f1_points_ci95, (-50.0, -50.0));
    assert!((r.agreement_tokens - 0.75).abs() < 1e-12 && r.forced_tokens == 16);
    assert_eq!(r.agreement_tokens_ci95, (0.75, 0.75));
    assert_eq!(lines[2].agreement_tokens_ci95, (1.0, 1.0));
    assert!((r.kl_mean - 0.05).abs() < 1e-12);
    assert_eq!((lines[1].f1, lines[1].em), (1.0, 1.0));
    assert_eq!(lines[2].agreement_answers, 1.0);
}

#[test]
fn every_line_says_how_much_of_naives_gap_it_closes_and_the_default_is_marked() {
    let line = |q: usize| {
        let mut l = logged(q);
        l.answers[1].strategy = "naive".into();
        l.answers[1].forced_agree = 2;
        l
    };
    let done: Vec<Logged> = (0..3).map(line).collect();
    let h = RunHeader {
        strategies: vec!["naive".into(), "link:2".into()],
        ..header()
    };
    let lines = summarize(&done, &h);
    let gap: Vec<(&str, Option<f64>, bool)> = lines
        .iter()
        .map(|l| (l.strategy.as_str(), l.gap_closed, l.default))
        .collect();
    // naive agrees on 2 of 4 tokens, link:2 on 3: half the gap closed.
    assert_eq!(
        gap,
        [
            ("naive", Some(0.0), false),
            ("link:2", Some(0.5), true),
            ("full", Some(1.0), false)
        ]
    );
    let j = serde_json::to_value(&lines[1]).unwrap();
    assert_eq!(
        (j["default"].clone(), j["gap_closed"].clone()),
        (true.into(), 0.5.into())
    );
    assert!(serde_json::to_value(&lines[0])
        .unwrap()
        .get("default")
        .is_none());
    // Named strategies come after naive and the default, each once.
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }
    let args = <Cli as clap::Parser>::parse_from([
        "qa",
        "--strategy",
        "reposition",
        "--strategy",
        "link:2",
    ])
    .args;
    let names: Vec<String> = strategies(&args).iter().map(|a| a.to_string()).collect();
    assert_eq!(names, ["naive", "link:2", "reposition"]);
}

#[test]
fn a_context_run_measures_the_gap_from_naive_on_plain_kv_and_logs_apart() {
    // naive on plain KV agrees on 2 of 4 tokens, naive after neighbours on 3, link:2 on 4.
    let line = |q: usize| {
        let mut l = logged(q);
        l.answers[1].strategy = "naive".into();
        l.answers[2].forced_agree = 4;
        let mut plain = l.answers[1].clone();
        plain.strategy = PLAIN_NAIVE.into();
        plain.forced_agree = 2;
        l.answers.push(plain);
        l
    };
    let done: Vec<Logged> = (0..3).map(line).collect();
    let h = RunHeader {
        strategies: vec!["naive".into(), "link:2".into()],
        context: "neighbours:1".into(),
        ..header()
    };
    let lines = summarize(&done, &h);
    let got: Vec<(&str, &str, Option<f64>)> = lines
        .iter()
        .map(|l| (l.strategy.as_str(), l.context.as_str(), l.gap_closed))
        .collect();
    assert_eq!(
        got,
        [
            (PLAIN_NAIVE, "none", Some(0.0)),
            ("naive", "neighbours:1", Some(0.5)),
            ("link:2", "neighbours:1", Some(1.0)),
            ("full", "neighbours:1", Some(1.0)),
        ]
    );
    // Its log is its own, beside the plain run's.
    let dir = tempfile::tempdir().unwrap();
    Log::open(Some(dir.path()), &h)
        .unwrap()
        .append(line(0))
        .unwrap();
    assert!(dir.path().join("qa-log-neighbours-1.jsonl").exists());
    assert!(Log::open(Some(dir.path()), &header())
        .unwrap()
        .done
        .is_empty());
    // Arranged after neighbours: a log of its own again.
    let chained = RunHeader {
        chunk_order: "neighbours".into(),
        ..h.clone()
    };
    assert!(Log::open(Some(dir.path()), &chained)
        .unwrap()
        .done
        .is_empty());
    assert!(dir
        .path()
        .join("qa-log-neighbours-1-chained.jsonl")
        .exists());
}
